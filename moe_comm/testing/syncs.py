"""HostSyncs: record every point where the host would wait for a CUDA device, on any device.

On CUDA, ``torch.cuda.set_sync_debug_mode`` reports syncs as they happen; on CPU nothing waits, so the
same code paths are found by what they call. Recorded while the context is open:
- host reads of tensor values: ``item``, ``tolist``, ``numpy``, ``cpu`` and ``bool/int/float/index()``
  of a tensor (a device -> host copy the host waits for);
- aten ops that size their output from tensor values, so CUDA syncs to read them: ``nonzero``,
  ``argwhere``, ``masked_select``, ``masked_scatter``, ``unique*``, ``bincount``, ``repeat_interleave``
  without ``output_size``, indexing or index_put with a boolean mask, ``_local_scalar_dense``;
- copies between devices to the host (``_to_copy`` / ``copy_`` from a non-CPU tensor to a CPU one);
- ``torch.cuda.synchronize``.

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
from typing import List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncs", "SyncEvent", "SYNC_OPS", "HOST_READS"]

SYNC_OPS = ("_local_scalar_dense", "nonzero", "argwhere", "masked_select", "masked_scatter", "unique",
            "_unique", "unique_consecutive", "bincount", "repeat_interleave")
HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")
NONE_MARKER = "host sync: none"

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)
_state = threading.local()


@dataclass
class SyncEvent:
    what: str  # "tolist", "aten.nonzero", "index[bool]", "copy to host", "cuda.synchronize"
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


def _sync_op(func, args, kwargs) -> str:
    base = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    if base == "repeat_interleave":
        return "" if kwargs.get("output_size") is not None else "aten.repeat_interleave"
    if any(base == s or base.startswith(s + "_") for s in SYNC_OPS if s != "repeat_interleave") \
            or base.startswith("_unique"):
        return f"aten.{base}"
    if base in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (args[1] or ())):
            return f"{base}[bool]"
    if base == "_to_copy" and args and isinstance(args[0], torch.Tensor):
        dev = kwargs.get("device")
        if args[0].device.type != "cpu" and dev is not None and torch.device(dev).type == "cpu":
            return "copy to host"
    if base == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
        if args[1].device.type != "cpu" and args[0].device.type == "cpu":
            return "copy to host"
    return ""


class HostSyncs(contextlib.AbstractContextManager):
    """Context manager recording host syncs (see the module docstring). ``events``: list of SyncEvent;
    ``count``; ``report()``: one line per event. Not re-entrant; one thread at a time."""

    def __init__(self):
        self.events: List[SyncEvent] = []
        self._saved = {}
        self._mode: Optional[_Ops] = None

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

    def _wrap(self, name, orig):
        owner = self

        def read(t, *a, **k):
            if getattr(_state, "in_read", 0):
                return orig(t, *a, **k)
            owner._record(name)
            _state.in_read = 1
            try:
                return orig(t, *a, **k)
            finally:
                _state.in_read = 0
        return read

    def __enter__(self):
        for m in HOST_READS:
            self._saved[m] = getattr(torch.Tensor, m)
            setattr(torch.Tensor, m, self._wrap(m, self._saved[m]))
        self._saved["cuda.synchronize"] = torch.cuda.synchronize

        def synchronize(*a, **k):
            self._record("cuda.synchronize")
            return self._saved["cuda.synchronize"](*a, **k)
        torch.cuda.synchronize = synchronize
        self._mode = _Ops(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        torch.cuda.synchronize = self._saved.pop("cuda.synchronize")
        for m, orig in self._saved.items():
            setattr(torch.Tensor, m, orig)
        self._saved.clear()
        return False
