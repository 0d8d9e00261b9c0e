"""HostSyncs: record every point where the host would wait for a CUDA device, on any device.

On CUDA, ``torch.cuda.set_sync_debug_mode`` reports syncs as they happen; on CPU nothing waits, so the
same code paths are found by what they call. Recorded while the context is open (``what`` in quotes):
- host reads of tensor values: ``item``, ``tolist``, ``numpy``, ``cpu`` and ``bool/int/float/index()``
  of a tensor (a device -> host copy the host waits for);
- aten ops that size their output from tensor values, so CUDA syncs to read them: ``nonzero``,
  ``argwhere``, ``masked_select``, ``masked_scatter``, ``unique*``, ``bincount``, ``repeat_interleave``
  without ``output_size``, indexing or index_put with a boolean mask, ``_local_scalar_dense``; and
  ``equal`` ("aten.equal": its CUDA kernel reads the comparison on the host);
- copies to the host: ``_to_copy`` / ``copy_`` from a non-CPU tensor to a CPU one ("copy to host"),
  except a ``non_blocking`` copy into pinned memory (``to("cpu", non_blocking=True)`` pins its output):
  the wait comes where the result is read or the stream synchronized, and that is recorded;
- copies from the host to a device, i.e. to any device type but ``cpu`` (so ``meta`` stands in for CUDA
  on a CPU machine): a blocking ``_to_copy`` / ``copy_`` from a CPU tensor ("copy to device": CUDA
  synchronizes the stream after it); a ``non_blocking`` one from pageable (not pinned) memory ("copy to
  device from pageable memory": CUDA stages it through a pinned buffer and may wait for the stream; the
  fix is ``.pin_memory()`` first); ``torch.tensor`` / ``as_tensor`` / ``asarray`` of Python or NumPy data
  on such a device, including the default device ("tensor(data) to device", a blocking copy); indexing a
  device tensor with CPU index tensors ("index with host indices": copied to the device, blocking);
- waits for the device: ``torch.cuda.synchronize`` ("cuda.synchronize"), ``torch.accelerator.synchronize``
  ("accelerator.synchronize"), ``torch.cuda.Event.synchronize`` ("Event.synchronize") and
  ``torch.cuda.Stream.synchronize`` ("Stream.synchronize", as in ``torch.cuda.current_stream().synchronize()``).

Not recorded: ``Work.wait()`` of a collective (on NCCL the current stream waits, not the host); the
device-generic ``torch.Event`` / ``torch.Stream`` (C types whose methods cannot be wrapped: use
``torch.cuda.Event`` / ``Stream``); copies between two devices. On a CPU-only run the layer's tensors are
on the CPU, so the host -> device kinds show only where a device is named (``meta``) or on a CUDA run.

Reads of tensors that are on the host by construction (a header of host ints, a CPU rank table) are
marked in the source with a ``# host sync: none, <why>`` comment on their line and are not recorded: the
source marker is the declaration, and an unmarked read is recorded as one. Every recorded event names
the moe_comm source line that caused it (or the first caller frame outside torch).

    with HostSyncs() as s:
        layer(x)
    assert s.count == 1, s.report()
"""
from __future__ import annotations

import contextlib
import linecache
import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncs", "SyncEvent", "SYNC_OPS", "HOST_READS", "WAITS"]

SYNC_OPS = ("_local_scalar_dense", "nonzero", "argwhere", "masked_select", "masked_scatter", "unique",
            "_unique", "unique_consecutive", "bincount", "repeat_interleave")
HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")
# (object, attribute, what): the host waits in these until the device is done
WAITS = ((torch.cuda, "synchronize", "cuda.synchronize"),
         (torch.cuda.Event, "synchronize", "Event.synchronize"),
         (torch.cuda.Stream, "synchronize", "Stream.synchronize")) + \
    (((torch.accelerator, "synchronize", "accelerator.synchronize"),) if hasattr(torch, "accelerator") else ())
FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)  # factories that copy host data to their device
NONE_MARKER = "host sync: none"

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)
_state = threading.local()


@dataclass
class SyncEvent:
    what: str  # "tolist", "aten.nonzero", "index[bool]", "copy to host", "copy to device", "cuda.synchronize"
    file: str  # the source file of the first frame outside torch and this module
    line: int
    source: str  # that line, stripped

    def __str__(self) -> str:
        return f"{self.what} at {self.file}:{self.line}: {self.source}"


def _caller() -> Optional[SyncEvent]:
    """The first frame outside torch and this module, as a SyncEvent without ``what``."""
    f = sys._getframe(2)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if path != _THIS_FILE and not path.startswith(_TORCH_DIR) and "contextlib" not in path:
            src = linecache.getline(path, f.f_lineno).strip()
            return SyncEvent("", path, f.f_lineno, src)
        f = f.f_back
    return None


class _Ops(TorchDispatchMode):
    def __init__(self, owner: "HostSyncs"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not getattr(_state, "in_read", 0):
            what = _sync_op(func, args, kwargs)
            if what:
                self.owner._record(what)
        return func(*args, **kwargs)


class _Factories(TorchFunctionMode):
    """``torch.tensor(data, device=...)`` and kin: a host -> device copy that no aten op shows."""

    def __init__(self, owner: "HostSyncs"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FROM_DATA and not getattr(_state, "in_read", 0) and args \
                and not isinstance(args[0], torch.Tensor):  # a tensor's copy is an aten _to_copy, seen there
            dev = kwargs.get("device")
            dev = torch.get_default_device() if dev is None else torch.device(dev)
            if dev.type != "cpu":
                self.owner._record("tensor(data) to device")
        return func(*args, **kwargs)


def _pinned(t: torch.Tensor) -> bool:
    try:
        return t.is_pinned()
    except RuntimeError:  # no accelerator to pin for: nothing is pinned
        return False


def _copy_kind(src: torch.Tensor, dst_type: str, non_blocking: bool, dst: Optional[torch.Tensor] = None) -> str:
    """The sync kind of a copy from ``src`` to a ``dst_type`` device ("" when the host need not wait)."""
    src_type = src.device.type
    if src_type != "cpu" and dst_type == "cpu":
        pinned_out = dst is None or _pinned(dst)  # _to_copy(non_blocking) to the CPU pins its output
        return "" if non_blocking and pinned_out else "copy to host"
    if src_type == "cpu" and dst_type != "cpu":
        if not non_blocking:
            return "copy to device"
        return "" if _pinned(src) else "copy to device from pageable memory"
    return ""


def _sync_op(func, args, kwargs) -> str:
    base = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    if base == "repeat_interleave":
        return "" if kwargs.get("output_size") is not None else "aten.repeat_interleave"
    if any(base == s or base.startswith(s + "_") for s in SYNC_OPS if s != "repeat_interleave") \
            or base.startswith("_unique") or base == "equal":
        return f"aten.{base}"
    if base in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
        indices = [t for t in (args[1] or ()) if isinstance(t, torch.Tensor)]
        if any(t.dtype == torch.bool for t in indices):
            return f"{base}[bool]"
        if args[0].device.type != "cpu" and any(t.device.type == "cpu" and t.dim() > 0 for t in indices):
            return "index with host indices"
    if base == "_to_copy" and args and isinstance(args[0], torch.Tensor):
        dev = kwargs.get("device")
        if dev is not None:
            return _copy_kind(args[0], torch.device(dev).type, bool(kwargs.get("non_blocking", False)))
    if base == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return _copy_kind(args[1], args[0].device.type, non_blocking, dst=args[0])
    return ""


class HostSyncs(contextlib.AbstractContextManager):
    """Context manager recording host syncs (see the module docstring). ``events``: list of SyncEvent;
    ``count``; ``report()``: one line per event. Not re-entrant; one thread at a time."""

    def __init__(self):
        self.events: List[SyncEvent] = []
        self._saved = {}
        self._waits = []  # (object, attribute, its own attribute or None)
        self._modes = []

    @property
    def count(self) -> int:
        return len(self.events)

    def report(self) -> str:
        return "\n".join(str(e) for e in self.events) or "(no host syncs)"

    def _record(self, what: str) -> None:
        ev = _caller()
        if ev is None:
            ev = SyncEvent("", "?", 0, "")
        if NONE_MARKER in ev.source:
            return
        ev.what = what
        self.events.append(ev)

    def _wrap(self, name: str, orig: Callable) -> Callable:
        owner = self

        def read(*a, **k):
            if getattr(_state, "in_read", 0):
                return orig(*a, **k)
            owner._record(name)
            _state.in_read = 1
            try:
                return orig(*a, **k)
            finally:
                _state.in_read = 0
        return read

    def __enter__(self):
        for m in HOST_READS:
            self._saved[m] = getattr(torch.Tensor, m)
            setattr(torch.Tensor, m, self._wrap(m, self._saved[m]))
        for obj, attr, what in WAITS:
            orig = getattr(obj, attr)
            self._waits.append((obj, attr, vars(obj).get(attr)))  # None: inherited, deleted again on exit
            setattr(obj, attr, self._wrap(what, orig))
        self._modes = [_Factories(self), _Ops(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []
        for obj, attr, orig in reversed(self._waits):
            if orig is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, orig)
        self._waits = []
        for m, orig in self._saved.items():
            setattr(torch.Tensor, m, orig)
        self._saved.clear()
        return False
