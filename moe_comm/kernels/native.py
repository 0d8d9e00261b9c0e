"""Loader and launchers of the C++ CPU kernels in ``csrc/permute.cpp`` and ``csrc/quant.cpp``.

Shapes legend: T tokens, K top-k slots, S = T*K slots, N permuted rows, H hidden size, E experts (global),
C chunks, R rows received, B bytes of a packed FP8 row.

Layers: ``csrc/permute.cpp`` holds the kernels; the launchers here validate arguments with
``moe_comm._checks`` (``TypeError`` / ``ValueError`` naming the argument, got vs expected), make inputs
contiguous, cast weights and scales to the accumulation dtype and allocate outputs; the autograd layer is
``moe_comm.ops``.
Semantics are those of ``reference.py`` and ``moe_comm.ops.layout.layout_reference``: permute and
unpermute are bit-identical to the reference (for finite rows), ``make_layout`` and ``make_rank_rows`` are
exactly equal, ``quantize_rows`` / ``dequantize_rows`` (FP8) are bit-identical to the reference (packed bytes,
and the dequantized rows except NaN payload bits in bfloat16 / float16 outputs).

Fresh outputs (no ``out=``, and the staging buffer of a non-contiguous ``out``) come from the extension's
output cache: freed blocks of 1 MiB and more are kept (up to ``set_output_cache_limit``, default 256 MiB idle)
and reused by the next output they fit, so a plain call does not page-fault its output once the previous
output of that size was freed (``output_cache_stats`` counts hits and misses).

The extension is JIT-built on the first ``available()`` call into torch's extensions cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions/py3X_cpu``), in a folder named by a hash of
what the build output depends on: the sources' bytes, the compiler flags, ``CXX``, the torch build and the
Python ABI - never a path. The sources are built from a copy inside that folder, so torch's ``build.ninja``
is the same from every checkout; a finished build leaves ``BUILT_MARK`` there, and any later process (any
checkout, path, or ninja) loads that ``.so`` directly without running ninja or importing
``torch.utils.cpp_extension``. Concurrent builders wait on torch's file lock.
If it cannot be built (no compiler, missing sources) ``available()`` warns once and returns False, and
``moe_comm.kernels.select_backend`` falls back to the torch reference.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Dict, Optional, Tuple

import torch

from moe_comm._checks import check_int, check_out, check_tensor
from moe_comm.kernels.reference import (acc_dtype, check_dequantize_args, check_quantize_args,
                                        check_unpermute_backward_args)

__all__ = ["available", "permute_rows", "unpermute_rows", "unpermute_weight_grad", "unpermute_backward", "make_layout",
           "make_rank_rows", "quantize_rows", "dequantize_rows", "output_cache_stats", "set_output_cache_limit"]

_CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
_SOURCES = ("permute.cpp", "quant.cpp")
# -ffp-contract=off: no FMA, so y*w is rounded before the add exactly as torch does (bitwise unpermute).
# -fopenmp: at::parallel_for is OpenMP in torch's CPU build; without it the kernels run on one thread.
_CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


STALE_LOCK_S = 300  # a build takes ~50 s here; a lock older than this was left by a killed build
BUILT_MARK = "moe_comm_built"  # written into the build folder once its .so is built and loads
_LIB_EXT = ".pyd" if sys.platform == "win32" else ".so"  # what torch's JIT names the module file
_RECIPE = 2  # bump when the way the folder is built changes (2: sources copied into the folder)


def _build_name(sources) -> str:
    """Extension name keyed by everything that changes the build output - the sources' names and bytes, the
    flags, the compiler named by CXX, the torch build and the Python ABI - and by no path: every checkout of
    the same sources shares one cache entry, and different sources or torch builds never share one."""
    h = hashlib.sha256()
    for p in sources:
        h.update(Path(p).name.encode() + b"\0" + Path(p).read_bytes() + b"\0")
    h.update(repr((_RECIPE, _CFLAGS, _LDFLAGS, os.environ.get("CXX", ""), torch.__version__,
                   torch.version.git_version, torch.version.cuda, sys.implementation.cache_tag,
                   importlib.machinery.EXTENSION_SUFFIXES[0])).encode())
    return f"moe_comm_native_{h.hexdigest()[:12]}"


def _build_dir(name: str) -> Path:
    """The build folder for ``name``, where torch's JIT would put it: ``$TORCH_EXTENSIONS_DIR/name``, else
    ``~/.cache/torch_extensions/py3X_cpu/name`` (found without importing ``torch.utils.cpp_extension``)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch import _appdirs
        accel = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
                 f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = Path(os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))) / f"{py}_{accel}"
    return Path(root) / name


def _drop_stale_lock(lock: Path) -> None:
    """torch waits forever on the build lock of a build that was killed; remove one that is clearly stale."""
    try:
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except OSError:  # another process removed it first, or no permission: let torch handle the lock
        pass


def _write_if_changed(path: Path, data: bytes) -> None:
    """Write ``data`` unless ``path`` already holds it (an unchanged file keeps its mtime: ninja skips it);
    atomic, so a concurrent builder never reads half a file."""
    try:
        if path.read_bytes() == data:
            return
    except OSError:
        pass
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _load_built(name: str, build_dir: Path) -> Optional[ModuleType]:
    """The extension built earlier into ``build_dir`` (by any checkout), loaded without ninja; None when
    there is no finished build."""
    so = build_dir / f"{name}{_LIB_EXT}"
    mark = build_dir / BUILT_MARK
    if not (mark.is_file() and so.is_file()):
        return None
    spec = importlib.util.spec_from_file_location(name, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, build_dir: Path, sources) -> ModuleType:
    """Build (or let ninja confirm) the extension from a copy of the sources inside ``build_dir``, so the
    build files name no checkout; then mark the folder as built."""
    from torch.utils import cpp_extension
    src_dir = build_dir / "src"
    src_dir.mkdir(parents=True, exist_ok=True)
    copies = []
    for p in sources:
        copy = src_dir / p.name
        _write_if_changed(copy, p.read_bytes())
        copies.append(str(copy))
    _drop_stale_lock(build_dir / "lock")
    module = cpp_extension.load(name=name, sources=copies, build_directory=str(build_dir),
                                extra_cflags=list(_CFLAGS), extra_ldflags=list(_LDFLAGS), verbose=False)
    _write_if_changed(build_dir / BUILT_MARK, f"{name}\n".encode())
    return module


@functools.lru_cache(maxsize=None)
def _extension() -> Optional[ModuleType]:
    """The built extension module, or None after one warning saying why it could not be built."""
    sources = [_CSRC_DIR / name for name in _SOURCES]
    missing = [str(p) for p in sources if not p.is_file()]
    if missing:
        warnings.warn(f"moe_comm native CPU kernels unavailable: C++ sources not found: {missing}; "
                      "using the torch reference path instead", RuntimeWarning, stacklevel=3)
        return None
    try:
        name = _build_name(sources)
        if name in sys.modules:  # loaded earlier in this process (the cache was cleared)
            return sys.modules[name]
        build_dir = _build_dir(name)
        try:
            module = _load_built(name, build_dir)
        except (ImportError, OSError):  # a damaged build: unmarked (no process loads it meanwhile), built again
            (build_dir / BUILT_MARK).unlink(missing_ok=True)
            # ninja would find the damaged library newer than its objects and do nothing: it goes too
            (build_dir / f"{name}{_LIB_EXT}").unlink(missing_ok=True)
            module = None
        if module is None:
            module = _build(name, build_dir, sources)
        sys.modules[name] = module
        return module
    except Exception as exc:  # any build or import failure means: fall back, say why once
        reason = " ".join(str(exc).split())
        if len(reason) > 600:  # keep the command's start and the compiler's last words, which say why
            reason = f"{reason[:150]} ... {reason[-450:]}"
        warnings.warn(f"moe_comm native CPU kernels could not be built ({type(exc).__name__}: {reason}); "
                      "using the torch reference path instead", RuntimeWarning, stacklevel=3)
        return None


def available() -> bool:
    """True when the C++ kernels are built and loaded (builds them on the first call, then cached)."""
    return _extension() is not None


def _ext() -> ModuleType:
    ext = _extension()
    if ext is None:
        raise RuntimeError("moe_comm native CPU kernels are not available (see the earlier warning); "
                           "check native.available() or use the torch backend")
    return ext


_CPU = torch.device("cpu")


def _index(name: str, t, dim: int) -> torch.Tensor:
    """A checked CPU integer index tensor as the int64 contiguous tensor the kernels read."""
    return check_tensor(name, t, device=_CPU, dim=dim, integer=True).to(torch.int64).contiguous()


def _write(out: Optional[torch.Tensor], shape: Tuple[int, int], like_t: torch.Tensor, like: Optional[str],
           fill) -> torch.Tensor:
    """``fill(dst)`` into ``out`` (checked: ``shape`` and the dtype of ``like_t``, the argument named ``like``,
    None when the dtype is not another argument's) or a new tensor from the output cache; a non-contiguous
    ``out`` gets a contiguous staging buffer (also from the cache) copied in after (the kernels write dense
    rows)."""
    ext = _ext()
    if out is None:
        out = ext.empty_cached(shape, like_t)
    else:
        check_out("out", out, shape, like_t.dtype, _CPU, like=like, contiguous=False)
    dst = out if out.is_contiguous() else ext.empty_cached(shape, like_t)
    fill(dst)
    return out if dst is out else out.copy_(dst)


def output_cache_stats() -> Dict[str, int]:
    """Counters of the output cache the launchers allocate fresh outputs from.

    Returns: ``idle_bytes`` (freed blocks kept for reuse), ``mapped_bytes`` (idle plus in use),
    ``limit_bytes``, ``hits`` (outputs that reused a block: no page faults), ``misses`` (new blocks).
    Only outputs of at least 1 MiB go through the cache; smaller ones come from torch's allocator.
    """
    idle, mapped, limit, hits, misses = _ext().output_cache_stats()
    return {"idle_bytes": idle, "mapped_bytes": mapped, "limit_bytes": limit, "hits": hits, "misses": misses}


def set_output_cache_limit(limit_bytes: int) -> int:
    """Keep at most ``limit_bytes`` of freed output blocks for reuse (default 256 MiB); returns the old limit.

    Lowering it unmaps idle blocks at once (0 empties the cache); blocks in use are never affected.
    The cost of the cache is that resident memory stays up to this much above what tensors hold.
    """
    check_int("limit_bytes", limit_bytes, 0)
    return _ext().set_output_cache_limit(limit_bytes)


def _kernel_config(stream_min_bytes: Optional[int] = None, use_avx2: Optional[bool] = None) -> Tuple[int, bool]:
    """Tuning and test hook: set the output size from which rows are written with streaming stores and
    whether the AVX2 + F16C row loops run (ValueError where the CPU lacks them); returns both as set."""
    got = _ext().kernel_config(-1 if stream_min_bytes is None else stream_min_bytes,
                               -1 if use_avx2 is None else int(use_avx2))
    return got[0], bool(got[1])


def permute_rows(x_TH: torch.Tensor, token_N: torch.Tensor, scale_N: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gather rows: ``out[n] = x_TH[token_N[n]]`` (times ``scale_N[n]`` when given).

    Args:
        x_TH: [T, H] CPU tensor, any dtype (a float dtype when ``scale_N`` is given).
        token_N: [N] integer (int64 preferred), each in [0, T).
        scale_N: optional [N] float; the product is computed in ``acc_dtype(x_TH.dtype)`` and cast back.
        out: optional [N, H] buffer of x's dtype to write into (a persistent workspace).
    Returns: ``out``, or a new [N, H] tensor.
    Example:
        x_TH = [[1, 1], [2, 2]], token_N = [1, 0, 1]
        -> [[2, 2], [1, 1], [2, 2]]
        with scale_N = [0.5, 1, 2] -> [[1, 1], [1, 1], [4, 4]]
    """
    if scale_N is None:
        check_tensor("x_TH", x_TH, device=_CPU, dim=2)
    else:
        check_tensor("x_TH (scaled by scale_N)", x_TH, device=_CPU, dim=2, dtypes=_FLOAT_DTYPES)
    token_N = _index("token_N", token_N, 1)
    N, H = token_N.shape[0], x_TH.shape[1]
    if scale_N is not None:
        check_tensor("scale_N", scale_N, device=_CPU, shape=(N,), shape_from="token_N's length", dtypes=_FLOAT_DTYPES)
        scale_N = scale_N.to(acc_dtype(x_TH.dtype)).contiguous()
    x_TH = x_TH.contiguous()
    return _write(out, (N, H), x_TH, "x_TH", lambda dst: _ext().permute_rows(x_TH, token_N, scale_N, dst))


def unpermute_rows(y_NH: torch.Tensor, row_TK: torch.Tensor, weight_TK: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scatter-reduce rows back to tokens: ``out[t] = sum_k weight_TK[t, k] * y_NH[row_TK[t, k]]``.

    Slots are summed in k = 0..K-1 order in ``acc_dtype(y_NH.dtype)`` and cast to y's dtype.
    Args:
        y_NH: [N, H] float32 / float64 / bfloat16 / float16 CPU tensor.
        row_TK: [T, K] integer (int64 preferred) in [-1, N); -1 means the slot was dropped.
        weight_TK: optional [T, K] float weights (None: plain sum); cast to the accumulation dtype.
        out: optional [T, H] buffer of y's dtype.
    Returns: ``out``, or a new [T, H] tensor.
    Example:
        y_NH = [[1, 1], [2, 2], [3, 3]], row_TK = [[2, 0], [1, -1]], weight_TK = [[.5, 1], [2, 9]]
        -> [[.5*3 + 1, ...], [2*2, ...]] = [[2.5, 2.5], [4, 4]]
        token 1's slot 1 is dropped, so its weight 9 is ignored.
    """
    check_tensor("y_NH", y_NH, device=_CPU, dim=2, dtypes=_FLOAT_DTYPES)
    row_TK = _index("row_TK", row_TK, 2)
    T, H = row_TK.shape[0], y_NH.shape[1]
    if weight_TK is not None:
        check_tensor("weight_TK", weight_TK, device=_CPU, shape=row_TK.shape, shape_from="row_TK's shape",
                     dtypes=_FLOAT_DTYPES)
        weight_TK = weight_TK.to(acc_dtype(y_NH.dtype)).contiguous()
    y_NH = y_NH.contiguous()
    return _write(out, (T, H), y_NH, "y_NH", lambda dst: _ext().unpermute_rows(y_NH, row_TK, weight_TK, dst))


def unpermute_weight_grad(grad_TH: torch.Tensor, y_NH: torch.Tensor, row_TK: torch.Tensor) -> torch.Tensor:
    """Gradient of ``unpermute_rows`` w.r.t. its weights: ``g[t, k] = <grad_TH[t], y_NH[row_TK[t, k]]>``.

    Args:
        grad_TH: [T, H] float gradient of the unpermuted output.
        y_NH: [N, H] float32 / float64 / bfloat16 / float16, the rows that were unpermuted.
        row_TK: [T, K] integer in [-1, N); -1 for dropped slots (their gradient is 0).
    Returns: [T, K] in ``acc_dtype(y_NH.dtype)``; equal to the reference to fp tolerance (different
        summation order).
    Example:
        grad_TH = [[1, 2]], y_NH = [[3, 4], [5, 6]], row_TK = [[1, -1]]
        -> [[1*5 + 2*6, 0]] = [[17, 0]]
    """
    check_tensor("y_NH", y_NH, device=_CPU, dim=2, dtypes=_FLOAT_DTYPES)
    row_TK = _index("row_TK", row_TK, 2)
    check_tensor("grad_TH", grad_TH, device=_CPU, shape=(row_TK.shape[0], y_NH.shape[1]),
                 shape_from="[T, H] from row_TK and y_NH", dtypes=_FLOAT_DTYPES)
    acc = acc_dtype(y_NH.dtype)
    if grad_TH.dtype not in (y_NH.dtype, acc):
        grad_TH = grad_TH.to(acc)
    return _ext().unpermute_weight_grad(grad_TH.contiguous(), y_NH.contiguous(), row_TK)


def unpermute_backward(grad_TH: torch.Tensor, row_TK: torch.Tensor, num_rows: int,
                       weight_TK: Optional[torch.Tensor] = None, y_NH: Optional[torch.Tensor] = None,
                       grad_y: bool = True) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Both gradients of ``unpermute_rows`` in one pass per token (``reference.unpermute_backward``).

    Args:
        grad_TH: [T, H] float32 / float64 / bfloat16 / float16 CPU gradient of the unpermuted output.
        row_TK: [T, K] int64 in [-1, num_rows); -1 = dropped (no row, weight gradient 0).
        num_rows: N. weight_TK: optional [T, K] float32 / float64 (cast to the accumulation dtype).
        y_NH: optional [N, H] rows of the forward in grad's dtype; given: the weights' gradient is computed.
        grad_y: whether to compute y's gradient.
    Returns: (grad_y_NH [N, H] of grad's dtype, bit-identical to the reference on the rows slots point at,
        other rows unwritten; or None), (grad_w_TK [T, K] in the accumulation dtype, the reference's to fp
        tolerance; or None).
    Example:
        grad_TH = [[1, 2]], row_TK = [[1, -1]], weight_TK = [[0.5, 9]], y_NH = [[3, 4], [5, 6]]
        -> grad_y_NH[1] = [0.5, 1], grad_w_TK = [[17, 0]]
    """
    T, K, H = check_unpermute_backward_args(grad_TH, row_TK, num_rows, weight_TK, y_NH, grad_y)
    check_tensor("grad_TH", grad_TH, device=_CPU)
    acc = acc_dtype(grad_TH.dtype)
    gy_NH = _ext().empty_cached((num_rows, H), grad_TH) if grad_y else None
    gw_TK = torch.empty(T, K, dtype=acc) if y_NH is not None else None
    if T == 0 or K == 0 or (gy_NH is None and gw_TK is None):
        return gy_NH, gw_TK
    if num_rows == 0 or H == 0:  # every slot dropped, or empty rows: nothing to write, every dot product 0
        return gy_NH, None if gw_TK is None else gw_TK.zero_()
    _ext().unpermute_backward(grad_TH.contiguous(), row_TK.contiguous(),
                              None if weight_TK is None else weight_TK.to(acc).contiguous(),
                              None if y_NH is None else y_NH.contiguous(), gy_NH, gw_TK)
    return gy_NH, gw_TK


def make_layout(topk_idx_TK: torch.Tensor, num_experts: int, num_chunks: int = 1):
    """Counting-sort layout: ``(dest_row_TK, src_slot_S, counts_CE, num_invalid)``, equal to ``layout_reference``.

    Args:
        topk_idx_TK: [T, K] integer (int64 preferred) global expert ids; -1 means dropped. Values outside
            [-1, E) are counted in ``num_invalid`` and treated as dropped.
        num_experts: E >= 1.
        num_chunks: C >= 1; token t is in chunk min(C-1, (2t(C-1) + T) // 2T) (layout.chunk_of_tokens).
    Returns: dest_row_TK [T, K] int64 (-1 = dropped), src_slot_S [T*K] int64 (routed rows first, then
        the dropped slots ascending), counts_CE [C, E] int64, num_invalid [] int64.
    Example (E=2, C=1): topk_idx_TK = [[1, 0], [0, -1]]
        slots 0..3 have keys [1, 0, 0, drop] -> src_slot_S = [1, 2, 0, 3]
        dest_row_TK = [[2, 0], [1, -1]], counts_CE = [[2, 1]]
    """
    topk_idx_TK = _index("topk_idx_TK", topk_idx_TK, 2)
    check_int("num_experts", num_experts, 1)
    check_int("num_chunks", num_chunks, 1)
    dest_row_TK, src_slot_S, counts_CE, num_invalid = _ext().make_layout(topk_idx_TK, num_experts, num_chunks)
    return dest_row_TK, src_slot_S, counts_CE, num_invalid


def make_rank_rows(topk_idx_TK: torch.Tensor, num_experts: int, num_ranks: int, num_chunks: int = 1):
    """One row per (token, destination rank), equal to ``moe_comm.ops.layout.rank_rows_reference``:
    ``(dest_row_TK, src_slot_S, counts_CW, local_idx_SK, slot_pos_TK, slot_counts_CE, num_invalid)``
    (see ``moe_comm.ops.make_rank_rows``)."""
    topk_idx_TK = _index("topk_idx_TK", topk_idx_TK, 2)
    check_int("num_experts", num_experts, 1)
    check_int("num_ranks", num_ranks, 1)
    check_int("num_chunks", num_chunks, 1)
    if num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by num_ranks, got num_ranks={num_ranks}")
    return tuple(_ext().make_rank_rows(topk_idx_TK, num_experts, num_ranks, num_chunks))


def quantize_rows(x_TH: torch.Tensor, ue8m0: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Quantize each row to float8_e4m3fn in blocks of 128, packed with its block scales (``reference.py``).

    Args:
        x_TH: [T, H] float32 / float64 / bfloat16 / float16 CPU tensor (made contiguous).
        ue8m0: scales as power-of-two exponents (1 byte) instead of float32 (4 bytes).
        out: optional [T, packed_width(H, ue8m0)] uint8 buffer (any strides).
    Returns: q_TB [T, B] uint8, bit-identical to ``reference.quantize_rows``.
    Example (H = 2, float32 scales, B = 8):
        x_TH = [[896.0, -1.0]] -> amax 896, s = 2, q = e4m3([448, -0.5]) = [0x7E, 0xB0]
        -> [[0x7E, 0xB0, 0, 0, 0x00, 0x00, 0x00, 0x40]]   (bytes 4..7: float32 2.0, little endian)
    """
    check_tensor("x_TH", x_TH, device=_CPU)
    T, B = check_quantize_args(x_TH, ue8m0, out)
    x_TH = x_TH.contiguous()
    like = torch.empty(0, dtype=torch.uint8)
    return _write(out, (T, B), like, None, lambda dst: _ext().quantize_rows(x_TH, ue8m0, dst))


def dequantize_rows(q_RB: torch.Tensor, hidden: int, dtype: torch.dtype, ue8m0: bool = False,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows of ``dtype`` back from packed FP8 rows: ``y = float32(q) * s`` per block, cast to ``dtype``.

    Args:
        q_RB: [R, packed_width(hidden, ue8m0)] uint8 CPU tensor of packed rows (made contiguous).
        hidden: H, elements per row. dtype: float32 / float64 / bfloat16 / float16 output dtype.
        ue8m0: how the scales were stored. out: optional [R, hidden] buffer of ``dtype`` (any strides).
    Returns: y_RH [R, hidden], equal to ``reference.dequantize_rows`` bit for bit (NaN payloads of
        bfloat16 / float16 outputs aside: torch's own conversions disagree on those).
    Example (H = 2, float32 scales):
        q_RB = [[0x7E, 0xB0, 0, 0, 0x00, 0x00, 0x00, 0x40]] -> [[896.0, -1.0]]
    """
    check_tensor("q_RB", q_RB, device=_CPU)
    R = check_dequantize_args(q_RB, hidden, dtype, ue8m0, out)
    q_RB = q_RB.contiguous()
    like = torch.empty(0, dtype=dtype)
    return _write(out, (R, hidden), like, None, lambda dst: _ext().dequantize_rows(q_RB, hidden, ue8m0, dst))


def _quant_config(use_avx2: Optional[bool] = None) -> bool:
    """Test hook: whether the FP8 row loops run their AVX2 copy (set it when given; ValueError where the
    CPU lacks AVX2); returns the setting."""
    return bool(_ext().quant_config(-1 if use_avx2 is None else int(use_avx2)))


def _e4m3_from_f32(f: torch.Tensor) -> torch.Tensor:
    """Test hook: the kernels' float32 -> float8_e4m3fn conversion alone, as uint8 bits."""
    return _ext().e4m3_from_f32(f)


def _e4m3_to_f32(q: torch.Tensor) -> torch.Tensor:
    """Test hook: the kernels' float8_e4m3fn (uint8 bits) -> float32 conversion alone."""
    return _ext().e4m3_to_f32(q)
