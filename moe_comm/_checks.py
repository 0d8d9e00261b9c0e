"""The one place argument checks live. Each public argument is checked once, at the public boundary.

Every check raises ``TypeError`` (wrong kind) or ``ValueError`` (wrong value) whose message names the
argument (``owner: name``) and says what was expected and what was got. Each returns the checked value,
so a call site reads ``self.window = check_int("LoadMonitor: window", window, 1, high=1 << 20)``.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch

__all__ = ["check_int", "check_float", "check_choice", "check_tensor", "check_out", "check_int_list", "describe"]


def describe(value) -> str:
    """Short 'got ...' text: a tensor's shape/dtype/device, otherwise repr (cut at 80 characters)."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}, {str(value.dtype).replace('torch.', '')} on {value.device}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_int(name: str, value, low: Optional[int] = None, *, high: Optional[int] = None) -> int:
    """An int (not a bool) in [low, high]; returns it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {describe(value)}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value


def check_int_list(name: str, values, low: Optional[int] = None, *, high: Optional[int] = None) -> list:
    """A sequence (or 1-D integer tensor) of ints, each in [low, high]; returns a list of ints.
    A float tensor or float entries raise (never truncated)."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
            raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got {describe(values)}")
        values = values.tolist()  # host sync: none, validation of a host-side table (CPU or once per call)
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list of ints, got {describe(values)}")
    return [check_int(f"{name}[{i}]", v, low, high=high) for i, v in enumerate(values)]


def check_float(name: str, value, low: Optional[float] = None, *, high: Optional[float] = None,
                low_open: bool = False) -> float:
    """A finite real number (int or float, not bool) in [low, high] (or (low, high] with low_open)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {describe(value)}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return float(value)


def check_choice(name: str, value, choices: Iterable):
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {describe(value)}")
    return value


def check_tensor(name: str, t, *, dim: Optional[int] = None, dtypes: Optional[Sequence[torch.dtype]] = None,
                 floating: bool = False, integer: bool = False, device: Optional[torch.device] = None,
                 shape: Optional[Sequence[Optional[int]]] = None) -> torch.Tensor:
    """A tensor with the given rank, dtype family or set, device and shape (None entries: any size)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if shape is not None and (t.dim() != len(shape) or any(s is not None and s != g for s, g in zip(shape, t.shape))):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if integer and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} must be on {device}, got a tensor on {t.device}")
    return t


def check_out(name: str, out, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
    """An optional ``out=`` buffer: None, or a contiguous tensor of exactly this shape, dtype and device."""
    if out is None:
        return None
    check_tensor(name, out, shape=list(shape), dtypes=(dtype,), device=device)
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return out
