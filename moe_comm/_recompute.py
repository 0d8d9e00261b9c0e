"""Activation checkpointing seen from a call: is this forward the first pass of a checkpoint, or its
recompute inside backward? And which input is which across the two (so MoELayer's recompute routes with the
bias the first pass used and records no load twice, and a Dispatcher's recompute lays its rows out as the
first pass did: ``dispatch.send_rows.pieces``)."""
from __future__ import annotations

import inspect
import sys
from typing import Optional

import torch
import torch.utils.checkpoint as torch_checkpoint

__all__ = ["checkpoint_mode", "forget_bias", "in_backward", "input_key"]

# torch.utils.checkpoint's frames, to tell how a forward runs (see ``checkpoint_mode``).
_REENTRANT_CODE = getattr(getattr(getattr(torch_checkpoint, "CheckpointFunction", None), "forward", None),
                          "__code__", None)
_CHECKPOINT_CODE = getattr(inspect.unwrap(torch_checkpoint.checkpoint), "__code__", None)


def checkpoint_mode() -> Optional[str]:
    """"reentrant" inside the first (no-grad) forward of ``torch.utils.checkpoint.checkpoint(...,
    use_reentrant=True)``, "non_reentrant" inside the first forward of ``use_reentrant=False``, else None.
    Found by walking the Python stack for torch's checkpoint frames (innermost wins); the recompute runs
    from the autograd engine, outside them (``in_backward`` tells it)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _REENTRANT_CODE:
            return "reentrant"
        if frame.f_code is _CHECKPOINT_CODE:
            return "non_reentrant"
        frame = frame.f_back
    return None


def forget_bias(table: dict, key: tuple, snapshot: torch.Tensor) -> None:
    """Finalizer of a checkpointed input: its recompute is over (or will never come)."""
    if table.get(key) is snapshot:
        del table[key]


def in_backward() -> bool:
    """True while autograd runs a backward pass on this thread: a forward called then is activation
    checkpointing's recompute."""
    return torch._C._current_graph_task_id() != -1


def input_key(x: torch.Tensor) -> tuple:
    """Identifies x's data across a checkpoint and its recompute (reentrant recomputes from a detached
    alias of x: the same storage, offset, shape and strides)."""
    return (x.device, x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), tuple(x.stride()))
