"""Deferred weight gradients: an expert chunk's backward gives its input gradient first and its weight
gradients later.

The pipeline's backward sends each chunk's input gradient back to the tokens' ranks as soon as it exists;
the weight-gradient GEMMs (two thirds of a SwiGLU backward) then run while that transfer is in flight.
An expert autograd Function that supports it checks ``active()`` in its backward: when a collector is
active it returns the input gradient only (None for the weights) and queues a closure that computes the
weight gradients; ``WeightGrads.run()`` computes them and hands them to autograd, so they reach ``.grad``
through whatever produced the Function's weight inputs (a Parameter, an autocast cast) with its hooks.

    with deferring() as wgrads:
        torch.autograd.backward([out], [grad])   # input gradient only
    ... start sending the input gradient ...
    wgrads.run()                                 # weight gradients, accumulated into .grad
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Sequence, Tuple

import torch

__all__ = ["WeightGrads", "deferring", "active"]

_active: List["WeightGrads"] = []  # a stack: the innermost collector is the active one (one thread at a time)


class WeightGrads:
    """Queued weight-gradient work of one backward: (closure -> grads, the tensors they are gradients of)."""

    def __init__(self):
        self.todo: List[Tuple[Callable[[], Sequence[Optional[torch.Tensor]]], Sequence[torch.Tensor]]] = []

    def add(self, compute: Callable[[], Sequence[Optional[torch.Tensor]]], inputs: Sequence[torch.Tensor]) -> None:
        self.todo.append((compute, tuple(inputs)))

    def run(self) -> None:
        """Compute every queued gradient and backpropagate it into its input (accumulating into ``.grad``)."""
        todo, self.todo = self.todo, []
        for compute, inputs in todo:
            with torch.no_grad():  # as inside the backward that queued it
                grads = compute()
            pairs = [(t, g) for t, g in zip(inputs, grads) if g is not None and t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


@contextlib.contextmanager
def deferring():
    """Collect the weight-gradient work of the backward run inside the block (see the module docstring)."""
    collector = WeightGrads()
    _active.append(collector)
    try:
        yield collector
    finally:
        _active.remove(collector)


def active() -> Optional[WeightGrads]:
    """The collector a supporting backward queues its weight gradients on, or None (compute them now)."""
    return _active[-1] if _active else None
