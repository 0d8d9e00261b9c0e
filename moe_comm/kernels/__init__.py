"""Row kernels behind ``moe_comm.ops``: permutation and FP8 row quantization.

Every backend implements the same launchers with the same semantics (see ``reference.py``):
``permute_rows``, ``unpermute_rows``, ``unpermute_weight_grad``, ``unpermute_backward`` (both gradients of
``unpermute_rows`` in one pass per token), ``quantize_rows`` and ``dequantize_rows``
(the FP8 packed-row layout and ``packed_width`` live in ``reference.py`` only, shared by all).
  reference.py   pure torch; the test oracle and the fallback
  native.py      loader of the C++ CPU kernels in csrc/ (JIT-built, cached)
  triton_ops.py  @triton.jit kernels + launchers (CUDA; CPU only under TRITON_INTERPRET=1)
"""
from __future__ import annotations

import os
from types import ModuleType

import torch

from moe_comm._checks import check_choice
from moe_comm.kernels import reference

__all__ = ["select_backend", "BACKENDS"]

BACKENDS = ("auto", "triton", "native", "torch")


def _triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_SELECTED = {}  # (backend, device type, TRITON_INTERPRET for "triton") -> module: every call's kernels, chosen once


def select_backend(backend: str, device: torch.device) -> ModuleType:
    """The kernel module for ``backend`` on ``device``.

    "auto": CUDA -> triton, CPU -> native (C++; one warning and torch if it cannot be built).
    "triton" on CPU tensors only works under TRITON_INTERPRET=1 (set before triton is imported).
    """
    # TRITON_INTERPRET changes only what "triton" picks (and reading the environment costs more than the rest)
    key = (backend, getattr(device, "type", device), backend == "triton" and _triton_interpreting())
    module = _SELECTED.get(key)
    if module is None:
        module = _SELECTED[key] = _select(backend, torch.device(device))
    return module


def _select(backend: str, device: torch.device) -> ModuleType:
    check_choice("backend", backend, BACKENDS)
    if backend == "torch":
        return reference
    if backend == "auto":
        if device.type == "cuda":
            from moe_comm.kernels import triton_ops
            return triton_ops if triton_ops.available() else reference
        if device.type == "cpu":
            from moe_comm.kernels import native
            return native if native.available() else reference
        return reference
    if backend == "native":
        if device.type != "cpu":
            raise ValueError(f"backend='native' runs on CPU tensors, got a tensor on {device}")
        from moe_comm.kernels import native
        return native if native.available() else reference
    # triton
    if device.type == "cpu" and not _triton_interpreting():
        raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
                         f"imported for CPU tensors; got a tensor on {device}")
    from moe_comm.kernels import triton_ops
    if not triton_ops.available():
        raise RuntimeError("backend='triton' requested but triton cannot be imported")
    return triton_ops
