"""The one place argument checks live. Each public argument is checked once, at the public boundary.

Every check raises ``TypeError`` (wrong kind) or ``ValueError`` (wrong value) whose message names the
argument (``owner: name``) and says what was expected and what was got. Each returns the checked value,
so a call site reads ``self.window = check_int("LoadMonitor: window", window, 1, high=1 << 20)``.
"""
from __future__ import annotations

import math
import sys
from typing import Callable, Iterable, List, Optional, Sequence

import torch

__all__ = ["check_int", "check_int_list", "check_float", "check_fraction", "check_bool", "check_choice",
           "check_tensor", "check_same_device", "check_out", "describe", "graph_break"]


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


def check_fraction(name: str, value) -> float:
    """A finite number in [0, 1] (a share, a probability); returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a fraction in [0, 1], got {describe(value)}")
    if not 0.0 <= value <= 1.0:  # also rejects nan
        raise ValueError(f"{name} must be a fraction in [0, 1], got {value}")
    return float(value)


def check_bool(name: str, value) -> bool:
    """A bool (not an int standing for one); returns it."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {describe(value)}")
    return value


def check_choice(name: str, value, choices: Iterable):
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {describe(value)}")
    return value


def check_tensor(name: str, t, *, dim: Optional[int] = None, dtypes: Optional[Sequence[torch.dtype]] = None,
                 floating: bool = False, integer: bool = False, device: Optional[torch.device] = None,
                 shape: Optional[Sequence[Optional[int]]] = None, shape_from: Optional[str] = None) -> torch.Tensor:
    """A tensor with the given rank, dtype family or set, device and shape (None entries: any size).

    ``shape_from`` says where the expected shape comes from, for the message:
    ``check_tensor("x_TH", x, shape=(3, None), shape_from="T from the layout")`` raises
    "x_TH must have shape [3, *] (T from the layout), got (4, 2)".
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if shape is not None and _shape_differs(shape, t.shape):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        why = f" ({shape_from})" if shape_from else ""
        raise ValueError(f"{name} must have shape {want}{why}, got {tuple(t.shape)}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if integer and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")
    if device is not None and t.device != (device if isinstance(device, torch.device) else torch.device(device)):
        raise ValueError(f"{name} must be on {device}, got a tensor on {t.device}")
    return t


def _shape_differs(shape: Sequence[Optional[int]], got: torch.Size) -> bool:
    if len(got) != len(shape):
        return True
    for s, g in zip(shape, got):  # a loop, not any(<generator>): checked ~35 times per layer call
        if s is not None and s != g:
            return True
    return False


def check_same_device(ref_name: str, ref: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    """Every tensor of ``others`` (None entries skipped) is on ``ref``'s device.
    Example: ``check_same_device("x_TH", x, token_N=idx)`` -> "token_N must be on x_TH's device cpu, got meta"."""
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {t.device}")


def check_out(name: str, out, shape: Sequence[int], dtype: torch.dtype, device: torch.device, *,
              like: Optional[str] = None, contiguous: bool = True) -> Optional[torch.Tensor]:
    """An optional ``out=`` buffer: None, or a tensor of exactly this shape, dtype and device (and contiguous
    unless ``contiguous=False``, for writers that stage into a dense buffer). ``like`` names the argument
    whose dtype and device ``out`` must share: "out must have x_TH's dtype float32, got torch.float64"."""
    if out is None:
        return None
    check_tensor(name, out, shape=list(shape))
    whose = f"{like}'s " if like else ""
    if out.dtype != dtype:
        raise TypeError(f"{name} must have {whose}dtype {str(dtype).replace('torch.', '')}, got {out.dtype}")
    if out.device != torch.device(device):
        raise ValueError(f"{name} must be on {whose}device {device}, got a tensor on {out.device}")
    if contiguous and not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {out.stride()}")
    return out


# ---- torch.compile graph breaks without importing torch._dynamo (about 1 s) at import ----

_PENDING_BREAKS: List[Callable] = []  # functions awaiting torch.compiler.disable until torch._dynamo is imported


def graph_break(fn: Callable) -> Callable:
    """Decorator, the same as ``torch.compiler.disable`` (under torch.compile the graph breaks at a call of
    ``fn``, which runs eagerly), but ``import moe_comm`` does not import ``torch._dynamo``.

    Nothing can compile before ``torch._dynamo`` is imported, so until then ``fn`` stays the plain function
    (which also saves the disable wrapper's per-call cost in eager-only processes). The import of
    ``torch._dynamo`` (by ``torch.compile`` or anything else) replaces it, where it is defined (its class or
    module, found by ``__qualname__``), by ``torch.compiler.disable(fn)`` before any frame is traced.
    Applied at once when ``torch._dynamo`` is already imported, or ``fn`` is local to a function."""
    if "torch._dynamo" in sys.modules or "<locals>" in fn.__qualname__:
        _apply_pending_breaks()
        return torch.compiler.disable(fn)
    _PENDING_BREAKS.append(fn)
    if _DynamoImportHook not in sys.meta_path:
        sys.meta_path.insert(0, _DynamoImportHook)
    return fn


def _apply_pending_breaks() -> None:
    """Replace every pending function on its class or module by ``torch.compiler.disable(fn)``."""
    for fn in list(_PENDING_BREAKS):
        owner = sys.modules.get(fn.__module__)
        *path, name = fn.__qualname__.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is None or vars(owner).get(name) is not fn:
            continue  # not (yet) bound where it was defined: tried again by the next graph_break
        setattr(owner, name, torch.compiler.disable(fn))
        _PENDING_BREAKS.remove(fn)


def graph_breaks_applied() -> None:
    """Backstop, called where a Dispatcher is built: once ``torch._dynamo`` is imported (by any route, even one that
    passed the import hook by), every pending graph break is applied; one that cannot be is said, once, since
    torch.compile would then trace the protocol's host reads and collectives."""
    if "torch._dynamo" not in sys.modules or not _PENDING_BREAKS:
        return
    _apply_pending_breaks()
    if _PENDING_BREAKS:
        import warnings

        names = ", ".join(f"{fn.__module__}.{fn.__qualname__}" for fn in _PENDING_BREAKS)
        warnings.warn(f"moe_comm: could not mark {names} as torch.compile graph breaks (not found where they are "
                      "defined)", RuntimeWarning, stacklevel=3)
        _PENDING_BREAKS.clear()


class _DynamoImportHook:
    """``sys.meta_path`` finder that only watches ``torch._dynamo``: its module executes as usual (found by the
    other finders), then the pending graph breaks are applied."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname != "torch._dynamo":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if finder is _DynamoImportHook or find is None else find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader_exec = getattr(spec.loader, "exec_module", None)
        if loader_exec is None:
            return spec

        def exec_module(module):
            loader_exec(module)
            if _DynamoImportHook in sys.meta_path:
                sys.meta_path.remove(_DynamoImportHook)
            _apply_pending_breaks()

        spec.loader.exec_module = exec_module  # this spec's own loader instance
        return spec
