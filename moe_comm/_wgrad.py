"""Deferred weight gradients: an expert chunk's backward gives its input gradient first and its weight
gradients later.

The pipeline's backward sends each chunk's input gradient back to the tokens' ranks as soon as it exists;
the weight-gradient GEMMs (two thirds of a SwiGLU backward) then run while that transfer is in flight.
An expert autograd Function that supports it checks ``active()`` in its backward: when a collector is
active it returns the input gradient only (None for the weights) and queues a closure that computes the
weight gradients; ``WeightGrads.run()`` computes them and hands them to autograd, so they reach ``.grad``
through whatever produced the Function's weight inputs (a Parameter, or a cast an ``expert_fn`` made) with its
hooks. GroupedExperts' Functions take the Parameters themselves, under autocast too (they cast inside and return
the gradients in the Parameters' dtype), so every chunk's weight gradients go to the same inputs.

    with deferring() as wgrads:
        torch.autograd.backward([out], [grad])   # input gradient only
    ... start sending the input gradient ...
    wgrads.run()                                 # weight gradients, accumulated into .grad

A pipelined backward runs one collector per chunk; ``run(sums)`` with a shared ``GradSums`` adds every chunk's
weight gradients into one buffer per weight and ``sums.flush()`` hands them to autograd once.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["WeightGrads", "GradSums", "deferring", "holding", "active"]

_active: List["WeightGrads"] = []  # a stack: the innermost collector is the active one (one thread at a time)


class WeightGrads:
    """Queued weight-gradient work of one backward: (closure -> grads, the tensors they are gradients of)."""

    def __init__(self):
        self.todo: List[Tuple[Callable[[], Sequence[Optional[torch.Tensor]]], Sequence[torch.Tensor]]] = []

    def add(self, compute: Callable[[], Sequence[Optional[torch.Tensor]]], inputs: Sequence[torch.Tensor]) -> None:
        self.todo.append((compute, tuple(inputs)))

    def run(self, sums: Optional["GradSums"] = None) -> None:
        """Compute every queued gradient and backpropagate it into its input (accumulating into ``.grad``);
        with ``sums``, add it there instead (``sums.flush()`` backpropagates the totals)."""
        todo, self.todo = self.todo, []
        for compute, inputs in todo:
            if sums is not None:
                with torch.no_grad():
                    sums.add(compute, inputs)
                continue
            with torch.no_grad():  # as inside the backward that queued it
                grads = compute()
            pairs = [(t, g) for t, g in zip(inputs, grads) if g is not None and t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


class GradSums:
    """The weight gradients of the chunks of one backward, summed before autograd sees them.

    The first chunk's gradients become the sums; a later chunk's closure with ``accumulates = True`` is called
    with ``into=sums`` and adds with its GEMMs (addmm_), any other closure's result is added (under autocast
    GroupedExperts' gradients come in the Parameters' dtype, fp32: the chunks are summed in fp32, in chunk
    order, as autograd's accumulation into ``.grad`` would). A chunk whose inputs differ from the last one's (an
    ``expert_fn`` that casts the weights itself, anew every chunk) flushes first. Per
    chunk after the first this saves the zero-filled gradient buffers and autograd's accumulation into
    ``.grad`` (here, e = 4, H = F = 512 fp32: 12 MiB each, ~3 passes of memory traffic per chunk). The totals
    round like any other summation order: equal to chunk-by-chunk accumulation to float rounding.
    """

    def __init__(self):
        # key: the ids of the inputs (kept alive by the entry) -> (inputs, summed gradients)
        self.entries: Dict[Tuple[int, ...], Tuple[Sequence[torch.Tensor], List[Optional[torch.Tensor]]]] = {}

    def add(self, compute: Callable[..., Sequence[Optional[torch.Tensor]]], inputs: Sequence[torch.Tensor]) -> None:
        key = tuple(id(t) for t in inputs)
        entry = self.entries.get(key)
        if entry is None:
            # other inputs than the last chunk's (an expert_fn casting the weights anew every chunk): hand the earlier
            # sums to autograd now, so at most one chunk's gradients are held
            self.flush()
            self.entries[key] = (tuple(inputs), list(compute()))
            return
        sums = entry[1]
        if getattr(compute, "accumulates", False) and all(g is not None for g in sums):
            compute(into=sums)
            return
        _add_into(sums, compute())

    def flush(self) -> None:
        """Backpropagate the sums into their inputs (accumulating into ``.grad``), once per input; inside
        ``holding()`` hand them to the holder instead."""
        entries, self.entries = self.entries, {}
        if _held and _held[-1] is not self:  # into the holder's sums: one buffer per weight, whatever the chunks
            held = _held[-1].entries
            for key, (inputs, sums) in entries.items():
                if key in held:
                    _add_into(held[key][1], sums)
                else:
                    held[key] = (inputs, sums)
            return
        for inputs, sums in entries.values():
            pairs = [(t, g) for t, g in zip(inputs, sums) if g is not None and t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def _add_into(sums: List[Optional[torch.Tensor]], grads: Sequence[Optional[torch.Tensor]]) -> None:
    """sums[j] += grads[j] in place (a None sum takes the gradient itself; a None gradient adds nothing)."""
    for j, g in enumerate(grads):
        if g is not None:
            sums[j] = g if sums[j] is None else sums[j].add_(g)


@contextlib.contextmanager
def deferring():
    """Collect the weight-gradient work of the backward run inside the block (see the module docstring)."""
    collector = WeightGrads()
    _active.append(collector)
    try:
        yield collector
    finally:
        _active.remove(collector)


_held: List[GradSums] = []  # holders of flushed sums (``holding``), innermost last


@contextlib.contextmanager
def holding():
    """Every ``GradSums.flush()`` inside the block hands its sums to the yielded holder instead of ``.grad``: a
    nested backward's weight gradients wait for the outer phase's closing exchange (``holder.flush()`` then;
    leaving without it drops them: no partial gradients)."""
    holder = GradSums()
    _held.append(holder)
    try:
        yield holder
    finally:
        _held.remove(holder)


def active() -> Optional[WeightGrads]:
    """The collector a supporting backward queues its weight gradients on, or None (compute them now)."""
    return _active[-1] if _active else None
