"""Triton row-permutation kernels: permute (gather), unpermute (weighted scatter-reduce), weight grad.

Shapes legend: T tokens, K top-k slots, N permuted rows, H hidden size.
Semantics are those of ``reference.py`` (the oracle): permute is bit-exact; unpermute sums the slots in
k = 0..K-1 order in float32 (float64 for float64 rows) and casts once at the end.

Layers (shared/STYLE.md): ``_*_kernel`` are pure ``@triton.jit`` kernels; ``permute_rows``,
``unpermute_rows`` and ``unpermute_weight_grad`` are launchers (validate with ``moe_comm._checks``,
allocate, build the grid); the autograd layer lives in ``moe_comm.ops``.

Kernels run on CUDA tensors, and on CPU tensors only when TRITON_INTERPRET=1 was set before triton was
imported (this module decorates its kernels at import time, so the flag must be set before importing it).
The module imports without triton installed; ``available()`` then returns False.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from moe_comm._checks import check_out, check_same_device, check_tensor
from moe_comm.kernels.reference import acc_dtype

try:  # optional dependency: the module must import without triton (available() -> False)
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a broken install that fails while importing
    triton = None
    tl = None

__all__ = ["available", "permute_rows", "unpermute_rows", "unpermute_weight_grad"]

# Payload dtypes the kernels move. Integer payloads (e.g. fp8 viewed as uint8) are permuted as raw bits;
# scaling and the reductions need floating rows.
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_WEIGHT_DTYPES = (torch.float32, torch.float64)

# Bytes of one row block handled by one program. 4 KiB = 4 warps x 32 threads x two 16-byte vectors.
# Not yet tuned on a GPU: benchmarks/gpu_check.py sweeps this and prints the bandwidth of each choice.
_BLOCK_BYTES = 4096


def available() -> bool:
    """True when triton can be imported (kernels then run on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    try:
        import triton as _triton  # noqa: F401  (lazy: only probing)
        import triton.language as _tl  # noqa: F401
    except Exception:
        return False
    return triton is not None


# ---------------------------------------------------------------------------------------------------
# Kernels (pure @triton.jit)
# ---------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _cast_rtne(v, OUT: tl.constexpr):
        """``v.to(OUT)`` rounding to nearest even, bit-identical to torch's ``.to(OUT)``.

        bfloat16 is rounded by hand: the interpreter truncates float32 -> bfloat16 (triton 3.9), and the
        few integer ops are free in these memory-bound kernels. NaN stays NaN (payload 0x7FC0).
        Example: v = 1 + 2**-8 (float32, exactly half-way between two bfloat16s)
            bits 0x3F808000 + 0x7FFF + lsb 0 = 0x3F80FFFF -> >> 16 = 0x3F80 = 1.0 (tie to even)
            whereas 1 + 3 * 2**-8 rounds up to 0x3F82 = 1 + 2**-6.
        """
        if OUT == tl.bfloat16:
            bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            nan = tl.full(v.shape, 0x7FC0, tl.uint16).to(tl.bfloat16, bitcast=True)
            return tl.where(v != v, nan, rounded)
        else:
            return v.to(OUT)

    @triton.jit
    def _permute_rows_kernel(x_ptr, token_ptr, scale_ptr, out_ptr, H, stride_x, stride_out,
                             HAS_SCALE: tl.constexpr, ACC: tl.constexpr, BLOCK_H: tl.constexpr):
        """One program copies columns [h0, h0 + BLOCK_H) of permuted row n: out[n] = x[token[n]] (* scale[n]).

        Example (H=2, BLOCK_H=2, grid (3, 1)):
            x = [[1, 1], [2, 2]], token = [1, 0, 1], scale = [0.5, 1, 2]
            -> program (0, 0) writes out[0] = 0.5 * x[1] = [1, 1]; out = [[1, 1], [1, 1], [4, 4]]
        """
        n = tl.program_id(0).to(tl.int64)  # int64 before any stride product: N*H may exceed 2^31
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < H
        token = tl.load(token_ptr + n).to(tl.int64)
        row = tl.load(x_ptr + token * stride_x + cols, mask=mask)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + n).to(ACC)
            row = _cast_rtne(row.to(ACC) * scale, out_ptr.dtype.element_ty)
        tl.store(out_ptr + n * stride_out + cols, row, mask=mask)

    @triton.jit
    def _unpermute_rows_kernel(y_ptr, row_ptr, weight_ptr, out_ptr, H, K, stride_y, stride_out,
                               HAS_WEIGHT: tl.constexpr, ACC: tl.constexpr, BLOCK_H: tl.constexpr):
        """One program reduces columns [h0, h0 + BLOCK_H) of token t: out[t] = sum_k w[t, k] * y[row[t, k]].

        Example (H=2, K=2, grid (2, 1)):
            y = [[1, 1], [2, 2], [3, 3]], row = [[2, 0], [1, -1]], w = [[.5, 1], [2, 9]]
            -> program (1, 0): slot 0 adds 2 * y[1], slot 1 is dropped (-1) and skipped; out = [[2.5, 2.5], [4, 4]]
        """
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < H
        acc = tl.zeros([BLOCK_H], dtype=ACC)
        for k in range(K):  # slots in k order: the same rounding sequence as the reference
            row = tl.load(row_ptr + t * K + k)
            # compare after broadcasting: the interpreter mis-types a splatted scalar int1 (triton 3.9)
            valid_H = tl.broadcast_to(row, [BLOCK_H]) >= 0
            # a dropped slot loads no y row and adds exactly 0, whatever its weight (even inf/nan)
            y = tl.load(y_ptr + row * stride_y + cols, mask=mask & valid_H, other=0.0).to(ACC)
            if HAS_WEIGHT:
                w = tl.load(weight_ptr + t * K + k).to(ACC)
                w = tl.where(row >= 0, w, 0.0)
                acc += y * w
            else:
                acc += y
        tl.store(out_ptr + t * stride_out + cols, _cast_rtne(acc, out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _unpermute_weight_grad_kernel(grad_ptr, y_ptr, row_ptr, out_ptr, H, K, stride_grad, stride_y,
                                      ACC: tl.constexpr, BLOCK_H: tl.constexpr):
        """One program computes the dot product of slot (t, k): out[t, k] = <grad[t], y[row[t, k]]>, 0 if dropped.

        Example (H=2, K=2, grid (1, 2)):
            grad = [[1, 2]], y = [[3, 4], [5, 6]], row = [[1, -1]]
            -> program (0, 0) writes 1*5 + 2*6 = 17, program (0, 1) writes 0; out = [[17, 0]]
        """
        t = tl.program_id(0).to(tl.int64)
        k = tl.program_id(1).to(tl.int64)
        row = tl.load(row_ptr + t * K + k)
        valid_H = tl.broadcast_to(row, [BLOCK_H]) >= 0  # dropped slot: nothing loaded, dot product 0
        acc = tl.zeros([BLOCK_H], dtype=ACC)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            mask = (cols < H) & valid_H
            g = tl.load(grad_ptr + t * stride_grad + cols, mask=mask, other=0.0).to(ACC)
            y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(ACC)
            acc += g * y
        tl.store(out_ptr + t * K + k, tl.sum(acc, axis=0))


# ---------------------------------------------------------------------------------------------------
# Launchers: validate, allocate, build the grid
# ---------------------------------------------------------------------------------------------------
def _next_pow2(v: int) -> int:
    return 1 << max(int(v) - 1, 0).bit_length()


def _block_config(H: int, elem_bytes: int, block_bytes: int = _BLOCK_BYTES):
    """(BLOCK_H, num_warps): a power-of-two column block of at most ``block_bytes`` (at least 16 columns)."""
    block_h = max(16, min(_next_pow2(H), max(16, block_bytes // elem_bytes)))
    num_warps = max(1, min(8, block_h * elem_bytes // 1024))  # ~32 bytes per thread
    return block_h, num_warps


def _tl_acc(dtype: torch.dtype):
    return tl.float64 if acc_dtype(dtype) == torch.float64 else tl.float32


def _check_runs_here(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not _interpreting():
        raise ValueError(f"{name} is on {t.device}: the Triton kernels need CUDA tensors, or "
                         "TRITON_INTERPRET=1 set before triton (and this module) is imported for CPU tensors")


def _interpreting() -> bool:
    """True when the kernels were decorated in interpreter mode (TRITON_INTERPRET=1 at import)."""
    return triton is not None and type(_permute_rows_kernel).__name__ == "InterpretedFunction"


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("moe_comm.kernels.triton_ops needs triton, which cannot be imported")


def _rows_last_dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its columns are dense (any row stride is passed to the kernel), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _staged(out: Optional[torch.Tensor], shape, ref: torch.Tensor, launch) -> torch.Tensor:
    """``launch(dst)`` into ``out`` or a new tensor like ``ref``; an ``out`` whose rows are not dense
    gets a staging buffer copied in after (the kernels write rows with unit stride)."""
    dst = out if out is not None and out.stride(-1) == 1 else torch.empty(shape, dtype=ref.dtype, device=ref.device)
    launch(dst)
    if out is not None and dst is not out:
        out.copy_(dst)
        return out
    return dst


def permute_rows(x_TH: torch.Tensor, token_N: torch.Tensor, scale_N: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gather rows: ``out[n] = x_TH[token_N[n]]`` (times ``scale_N[n]`` when given); bit-exact vs reference.

    Args:
        x_TH: [T, H] float16/bfloat16/float32/float64 (or an integer dtype, without ``scale_N``).
            Any row stride; columns are copied to dense if not already.
        token_N: [N] int64, each in [0, T) (not checked: that would need a host sync).
        scale_N: optional [N] float32 or float64; the product is computed in float32 (float64 for
            float64 rows) and cast back to x's dtype.
        out: optional [N, H] buffer of x's dtype to write into (any strides).
    Returns: [N, H] of x's dtype (``out`` when given).
    Example:
        x_TH = [[1, 1], [2, 2]], token_N = [1, 0, 1]
        -> [[2, 2], [1, 1], [2, 2]]; with scale_N = [0.5, 1, 2] -> [[1, 1], [1, 1], [4, 4]]
    """
    _require_triton()
    if scale_N is None:
        check_tensor("x_TH", x_TH, dim=2, dtypes=_FLOAT_DTYPES + _INT_DTYPES)
    else:
        check_tensor("x_TH (scaled by scale_N)", x_TH, dim=2, dtypes=_FLOAT_DTYPES)
    check_tensor("token_N", token_N, dim=1, dtypes=(torch.int64,))
    N = token_N.shape[0]
    if scale_N is not None:
        check_tensor("scale_N", scale_N, shape=(N,), shape_from="token_N's length", dtypes=_WEIGHT_DTYPES)
    check_same_device("x_TH", x_TH, token_N=token_N, scale_N=scale_N)
    _check_runs_here("x_TH", x_TH)
    T, H = x_TH.shape
    if T == 0 and N > 0:
        raise ValueError(f"token_N has {N} rows but x_TH has no tokens (T=0): every index is out of range")
    check_out("out", out, (N, H), x_TH.dtype, x_TH.device, like="x_TH", contiguous=False)
    def launch(dst):
        if N > 0 and H > 0:
            _launch_permute(_rows_last_dense(x_TH), token_N.contiguous(),
                            scale_N.contiguous() if scale_N is not None else None, dst)
    return _staged(out, (N, H), x_TH, launch)


def unpermute_rows(y_NH: torch.Tensor, row_TK: torch.Tensor, weight_TK: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scatter-reduce rows back to tokens: ``out[t] = sum_k weight_TK[t, k] * y_NH[row_TK[t, k]]``.

    Args:
        y_NH: [N, H] float16/bfloat16/float32/float64, any row stride.
        row_TK: [T, K] int64, each in [0, N) or -1 = dropped (contributes nothing; its weight is not read).
        weight_TK: optional [T, K] float32 or float64 (None: plain sum of the routed slots).
        out: optional [T, H] buffer of y's dtype (any strides).
    Returns: [T, H] of y's dtype; slots summed in k order in float32 (float64 for float64 rows).
    Example:
        y_NH = [[1, 1], [2, 2], [3, 3]], row_TK = [[2, 0], [1, -1]], weight_TK = [[.5, 1], [2, 9]]
        -> [[.5*3 + 1, ...], [2*2, ...]] = [[2.5, 2.5], [4, 4]]
    """
    _require_triton()
    check_tensor("y_NH", y_NH, dim=2, dtypes=_FLOAT_DTYPES)
    check_tensor("row_TK", row_TK, dim=2, dtypes=(torch.int64,))
    if weight_TK is not None:
        check_tensor("weight_TK", weight_TK, shape=row_TK.shape, shape_from="row_TK's shape", dtypes=_WEIGHT_DTYPES)
    check_same_device("y_NH", y_NH, row_TK=row_TK, weight_TK=weight_TK)
    _check_runs_here("y_NH", y_NH)
    N, H = y_NH.shape
    T, K = row_TK.shape
    check_out("out", out, (T, H), y_NH.dtype, y_NH.device, like="y_NH", contiguous=False)
    if T == 0 or H == 0:
        return out if out is not None else torch.empty(T, H, dtype=y_NH.dtype, device=y_NH.device)
    if N == 0 or K == 0:  # nothing routed: every slot must be dropped
        if out is not None:
            return out.zero_()
        return torch.zeros(T, H, dtype=y_NH.dtype, device=y_NH.device)
    return _staged(out, (T, H), y_NH, lambda dst: _launch_unpermute(
        _rows_last_dense(y_NH), row_TK.contiguous(), weight_TK.contiguous() if weight_TK is not None else None, dst))


def unpermute_weight_grad(grad_TH: torch.Tensor, y_NH: torch.Tensor, row_TK: torch.Tensor) -> torch.Tensor:
    """Gradient of ``unpermute_rows`` w.r.t. its weights: ``g[t, k] = <grad_TH[t], y_NH[row_TK[t, k]]>``.

    Args:
        grad_TH: [T, H] float16/bfloat16/float32/float64 gradient of the unpermuted output.
        y_NH: [N, H] float16/bfloat16/float32/float64, the rows that were unpermuted.
        row_TK: [T, K] int64, each in [0, N) or -1 = dropped (gradient 0).
    Returns: [T, K] float32 (float64 when y_NH is float64), products summed in that dtype.
    Example:
        grad_TH = [[1, 2]], y_NH = [[3, 4], [5, 6]], row_TK = [[1, -1]]
        -> [[1*5 + 2*6, 0]] = [[17, 0]]
    """
    _require_triton()
    check_tensor("y_NH", y_NH, dim=2, dtypes=_FLOAT_DTYPES)
    check_tensor("row_TK", row_TK, dim=2, dtypes=(torch.int64,))
    N, H = y_NH.shape
    T, K = row_TK.shape
    check_tensor("grad_TH", grad_TH, shape=(T, H), shape_from="[T, H] from row_TK and y_NH", dtypes=_FLOAT_DTYPES)
    check_same_device("y_NH", y_NH, grad_TH=grad_TH, row_TK=row_TK)
    _check_runs_here("y_NH", y_NH)
    acc = acc_dtype(y_NH.dtype)
    if T == 0 or K == 0:
        return torch.empty(T, K, dtype=acc, device=y_NH.device)
    if N == 0 or H == 0:  # nothing routed, or empty rows: every dot product is 0
        return torch.zeros(T, K, dtype=acc, device=y_NH.device)
    out = torch.empty(T, K, dtype=acc, device=y_NH.device)
    _launch_weight_grad(_rows_last_dense(grad_TH), _rows_last_dense(y_NH), row_TK.contiguous(), out)
    return out


# Grid builders. They take validated inputs (dense columns, contiguous index/weight vectors, N, T, H > 0);
# ``block_bytes`` is exposed so benchmarks/gpu_check.py can sweep the column block.
def _on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensors' device for the launch."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _launch_permute(x_TH, token_N, scale_N, out_NH, block_bytes: int = _BLOCK_BYTES) -> None:
    N, H = out_NH.shape
    block_h, num_warps = _block_config(H, x_TH.element_size(), block_bytes)
    grid = (N, triton.cdiv(H, block_h))  # rows on axis 0 (up to 2^31 - 1), column blocks on axis 1
    with _on_device(x_TH):
        _permute_rows_kernel[grid](
            x_TH, token_N, scale_N if scale_N is not None else token_N, out_NH, H, x_TH.stride(0), out_NH.stride(0),
            HAS_SCALE=scale_N is not None, ACC=_tl_acc(x_TH.dtype), BLOCK_H=block_h, num_warps=num_warps)


def _launch_unpermute(y_NH, row_TK, weight_TK, out_TH, block_bytes: int = _BLOCK_BYTES) -> None:
    T, H = out_TH.shape
    K = row_TK.shape[1]
    block_h, num_warps = _block_config(H, y_NH.element_size(), block_bytes)
    grid = (T, triton.cdiv(H, block_h))
    with _on_device(y_NH):
        _unpermute_rows_kernel[grid](
            y_NH, row_TK, weight_TK if weight_TK is not None else row_TK, out_TH, H, K, y_NH.stride(0),
            out_TH.stride(0), HAS_WEIGHT=weight_TK is not None, ACC=_tl_acc(y_NH.dtype), BLOCK_H=block_h,
            num_warps=num_warps)


def _launch_weight_grad(grad_TH, y_NH, row_TK, out_TK, block_bytes: int = _BLOCK_BYTES) -> None:
    T, K = out_TK.shape
    H = y_NH.shape[1]
    block_h, num_warps = _block_config(H, max(grad_TH.element_size(), y_NH.element_size()), block_bytes)
    grid = (T, K)  # one program per slot; it walks H in BLOCK_H steps
    with _on_device(y_NH):
        _unpermute_weight_grad_kernel[grid](
            grad_TH, y_NH, row_TK, out_TK, H, K, grad_TH.stride(0), y_NH.stride(0),
            ACC=_tl_acc(y_NH.dtype), BLOCK_H=block_h, num_warps=num_warps)
