"""Pure-torch reference of the row kernels: the oracle every backend is tested against.

Shapes legend: T tokens, K top-k slots, N permuted rows, H hidden size, R rows received, B bytes of a
packed FP8 row, n = ceil(H / FP8_BLOCK) scale blocks of a row.
Accumulation: float64 inputs accumulate in float64, everything else in float32, slots summed in
k = 0..K-1 order (fixed order => deterministic), then cast to the input dtype.

FP8 rows (``quantize_rows`` / ``dequantize_rows``): each row is cut into blocks of FP8_BLOCK = 128
elements (the last may be shorter); each block gets one scale and its elements become float8_e4m3fn.
A packed row is ``packed_width(H, ue8m0)`` uint8 bytes, little endian, the same on every backend:
  [0, H)            e4m3fn payload, element i at byte i
  [S0, S0 + n*sb)   the n block scales, S0 = round_up(H, 4): float32 (sb = 4) or ue8m0 (sb = 1: a biased
                    exponent b, scale 2^(b - 127); b = 255 means NaN)
  the rest          0 (padding up to a multiple of 4 bytes)
Math per block, in float32 (x cast to float32 first, float64 rounding to nearest even):
  amax = max |x|, NaN when any element is NaN (canonical NaN 0x7FC00000)
  r = amax / 448 (one IEEE division)
  float32 scale s: r, except s = 1 when r == 0 (all-zero block, or amax < 448 * 2^-150 so r underflows);
      a subnormal r (amax < 448 * 2^-126) is kept, so such a block's largest elements may clip at 448.
      amax inf -> s = inf, amax NaN -> s = NaN (0x7FC00000).
  ue8m0 scale s = 2^(b - 127): the smallest power of two >= r, from the bits of r, b clamped to
      [1, 254]; r == 0 -> b = 127 (s = 1); r inf or NaN -> b = 255 (NaN).
  q = float8_e4m3fn(clamp(x / s, -lim, lim)), torch's conversion: round to nearest even, subnormals
      down to 2^-9, -0.0 kept, NaN -> 0x7F with the NaN's sign. lim = 448, except for a ue8m0 block
      whose b is at least ue8m0_top_code(x's dtype) (b = 247 for float32 / bfloat16 / float64 rows, amax
      > 448 * 2^119 ~ 3.0e38; b = 135 for float16, amax > 448 * 2^7 = 57344): there 448 * s overflows the
      dtype and x / s in [248, 256) would round up to 256, 256 * s = 2^128 (2^16) = inf, so lim = 240, the
      largest e4m3 below 256 (error <= 16 / 256 = 2^-4 of |x|, inside the bound of ops/quant.py).
  dequantize: y = float32(q) * s (one IEEE multiply), then cast to the output dtype (nearest even);
      a NaN result is the dtype's canonical quiet NaN (bits 0x7FC00000, 0x7FC0, 0x7E00, 0x7FF8...).
Non-finite input: a NaN or Inf makes its whole 128-block decode to NaN (s NaN, or s = inf with
inf/inf = NaN and 0 * inf = NaN); the other blocks of the row are unaffected. The sign bit of a NaN
payload byte follows the device's division NaN rules (x86: inf/inf is -NaN, a NaN operand passes
through; CUDA: +NaN): every backend agrees on one device, and it decodes to NaN anyway.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from moe_comm._checks import check_bool, check_int, check_out, check_same_device, check_tensor

__all__ = ["permute_rows", "unpermute_rows", "unpermute_weight_grad", "acc_dtype", "FP8_BLOCK", "FP8_MAX",
           "FP8_TOP_LIMIT", "ue8m0_top_code", "unpermute_backward", "check_unpermute_backward_args",
           "FP8_DTYPES", "packed_width", "packed_layout", "quantize_rows", "dequantize_rows", "block_scales",
           "check_quantize_args", "check_dequantize_args"]

FP8_BLOCK = 128  # elements per scale
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_TOP_LIMIT = 240.0  # largest float8_e4m3fn below 256: the payload limit at the top ue8m0 scale
FP8_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # row dtypes quantize / dequantize


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for rows of ``dtype``: float64 stays float64, the rest use float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def permute_rows(x_TH: torch.Tensor, token_N: torch.Tensor, scale_N: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gather rows: ``out[n] = x_TH[token_N[n]]`` (times ``scale_N[n]`` when given).

    Args:
        x_TH: [T, H] any dtype, contiguous rows.
        token_N: [N] int64, each in [0, T).
        scale_N: optional [N] float32 or float64; the product is computed in ``acc_dtype`` and cast back.
        out: optional [N, H] buffer of x's dtype to write into.
    Example:
        x_TH = [[1, 1], [2, 2]], token_N = [1, 0, 1]
        -> [[2, 2], [1, 1], [2, 2]]
        with scale_N = [0.5, 1, 2] -> [[1, 1], [1, 1], [4, 4]]
    """
    if scale_N is None:
        if out is None:
            return x_TH.index_select(0, token_N)
        return torch.index_select(x_TH, 0, token_N, out=out)
    acc = acc_dtype(x_TH.dtype)
    res = (x_TH.index_select(0, token_N).to(acc) * scale_N.to(acc)[:, None]).to(x_TH.dtype)
    if out is None:
        return res
    return out.copy_(res)


def unpermute_rows(y_NH: torch.Tensor, row_TK: torch.Tensor, weight_TK: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scatter-reduce rows back to tokens: ``out[t] = sum_k weight_TK[t, k] * y_NH[row_TK[t, k]]``.

    Args:
        y_NH: [N, H] any float dtype.
        row_TK: [T, K] int64; -1 means the slot was dropped and contributes nothing.
        weight_TK: optional [T, K] float32 or float64 (None: plain sum).
        out: optional [T, H] buffer of y's dtype.
    Example:
        y_NH = [[1, 1], [2, 2], [3, 3]], row_TK = [[2, 0], [1, -1]], weight_TK = [[.5, 1], [2, 9]]
        -> [[.5*3 + 1, ...], [2*2, ...]] = [[2.5, 2.5], [4, 4]]
        token 1's slot 1 is dropped, so its weight 9 is ignored.
    """
    T, K = row_TK.shape
    acc = acc_dtype(y_NH.dtype)
    total = torch.zeros(T, y_NH.shape[1], dtype=acc, device=y_NH.device)
    if y_NH.shape[0] > 0:
        zero = torch.zeros((), dtype=acc, device=y_NH.device)
        for k in range(K):  # fixed slot order: deterministic sum; dropped slots read nothing
            valid = (row_TK[:, k] >= 0)[:, None]
            rows = y_NH.index_select(0, row_TK[:, k].clamp(min=0)).to(acc)
            if weight_TK is not None:
                rows = rows * weight_TK[:, k].to(acc)[:, None]
            total += torch.where(valid, rows, zero)
    if out is None:
        return total.to(y_NH.dtype)
    return out.copy_(total)


def unpermute_weight_grad(grad_TH: torch.Tensor, y_NH: torch.Tensor, row_TK: torch.Tensor) -> torch.Tensor:
    """Gradient of ``unpermute_rows`` w.r.t. its weights: ``g[t, k] = <grad_TH[t], y_NH[row_TK[t, k]]>``.

    Args:
        grad_TH: [T, H] gradient of the unpermuted output.
        y_NH: [N, H] the rows that were unpermuted.
        row_TK: [T, K] int64, -1 for dropped slots (their gradient is 0).
    Returns: [T, K] in ``acc_dtype(y_NH.dtype)`` (float32, or float64 for float64 rows).
    Example:
        grad_TH = [[1, 2]], y_NH = [[3, 4], [5, 6]], row_TK = [[1, -1]]
        -> [[1*5 + 2*6, 0]] = [[17, 0]]
    """
    T, K = row_TK.shape
    acc = acc_dtype(y_NH.dtype)
    g = grad_TH.to(acc)
    out = torch.zeros(T, K, dtype=acc, device=y_NH.device)
    if y_NH.shape[0] == 0:
        return out
    for k in range(K):
        rows = y_NH.index_select(0, row_TK[:, k].clamp(min=0)).to(acc)
        dots = (rows * g).sum(dim=1)
        out[:, k] = torch.where(row_TK[:, k] >= 0, dots, torch.zeros_like(dots))
    return out


_GRAD_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_unpermute_backward_args(grad_TH, row_TK, num_rows, weight_TK, y_NH, grad_y) -> Tuple[int, int, int]:
    """Checks of ``unpermute_backward``'s arguments (shared by every backend); returns (T, K, H)."""
    check_tensor("grad_TH", grad_TH, dim=2, dtypes=_GRAD_DTYPES)
    T, H = grad_TH.shape
    check_tensor("row_TK", row_TK, dim=2, shape=(T, None), shape_from="[T, K], T from grad_TH", dtypes=(torch.int64,))
    K = row_TK.shape[1]
    check_int("num_rows", num_rows, 0)
    check_bool("grad_y", grad_y)
    if weight_TK is not None:
        check_tensor("weight_TK", weight_TK, shape=(T, K), shape_from="row_TK's shape",
                     dtypes=(torch.float32, torch.float64))
    if y_NH is not None:
        check_tensor("y_NH", y_NH, shape=(num_rows, H), shape_from="[num_rows, H], H from grad_TH",
                     dtypes=(grad_TH.dtype,))
    check_same_device("grad_TH", grad_TH, row_TK=row_TK, weight_TK=weight_TK, y_NH=y_NH)
    return T, K, H


def unpermute_backward(grad_TH: torch.Tensor, row_TK: torch.Tensor, num_rows: int,
                       weight_TK: Optional[torch.Tensor] = None, y_NH: Optional[torch.Tensor] = None,
                       grad_y: bool = True) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Both gradients of ``unpermute_rows`` from one read of ``grad_TH`` (the kernels do one pass per token).

    Args:
        grad_TH: [T, H] float gradient of the unpermuted output.
        row_TK: [T, K] int64, the permuted row of slot (t, k), in [0, num_rows); -1 = dropped (no row
            written, weight gradient 0).
        num_rows: N, the rows of y.
        weight_TK: optional [T, K] float32 / float64 weights of the forward (None: a plain sum).
        y_NH: optional [N, H] rows of the forward, grad's dtype; given: the weights' gradient is computed.
        grad_y: whether to compute y's gradient.
    Returns: (grad_y_NH, grad_w_TK).
        grad_y_NH: [N, H] of grad's dtype, row row_TK[t, k] = grad_TH[t] * weight_TK[t, k] in
            ``acc_dtype`` cast back (``permute_rows`` with scales: bit-identical on every backend); rows
            no slot points at (padding of a padded layout) are 0 here and unwritten by the kernels. None
            when not ``grad_y``.
        grad_w_TK: [T, K] in ``acc_dtype(y's dtype)``, <grad_TH[t], y_NH[row_TK[t, k]]> (the kernels sum
            in their own order: fp tolerance), 0 for dropped slots. None without ``y_NH``.
    Example:
        grad_TH = [[1, 2]], row_TK = [[1, -1]], weight_TK = [[0.5, 9]], y_NH = [[3, 4], [5, 6]]
        -> grad_y_NH = [[0, 0], [0.5, 1]], grad_w_TK = [[1*5 + 2*6, 0]] = [[17, 0]]
    """
    T, K, H = check_unpermute_backward_args(grad_TH, row_TK, num_rows, weight_TK, y_NH, grad_y)
    gy_NH = gw_TK = None
    if grad_y:
        acc = acc_dtype(grad_TH.dtype)
        valid_S = row_TK.reshape(-1) >= 0
        dest_S = torch.where(valid_S, row_TK.reshape(-1), num_rows)  # dropped slots: a spare row, cut off
        rows_SH = grad_TH.repeat_interleave(K, dim=0) if K else grad_TH[:0]
        if weight_TK is not None:
            rows_SH = (rows_SH.to(acc) * weight_TK.reshape(-1).to(acc)[:, None]).to(grad_TH.dtype)
        gy_NH = torch.zeros(num_rows + 1, H, dtype=grad_TH.dtype, device=grad_TH.device)
        gy_NH = gy_NH.index_copy_(0, dest_S, rows_SH)[:num_rows]
    if y_NH is not None:
        gw_TK = unpermute_weight_grad(grad_TH, y_NH, row_TK)
    return gy_NH, gw_TK


# ---------------------------------------------------------------------------------------------------
# FP8 (float8_e4m3fn) block quantization of rows
# ---------------------------------------------------------------------------------------------------
def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def packed_layout(hidden: int, ue8m0: bool = False) -> Tuple[int, int, int, int]:
    """``(S0, n, sb, B)`` of a packed row: scales start at byte S0, n block scales of sb bytes, B bytes in all.

    Example: packed_layout(130) -> (132, 2, 4, 140); packed_layout(130, ue8m0=True) -> (132, 2, 1, 136)
    """
    check_int("hidden", hidden, 0)
    check_bool("ue8m0", ue8m0)
    s0, n, sb = _round_up(hidden, 4), -(-hidden // FP8_BLOCK), 1 if ue8m0 else 4
    return s0, n, sb, _round_up(s0 + n * sb, 4)


def packed_width(hidden: int, ue8m0: bool = False) -> int:
    """Bytes of one packed FP8 row of ``hidden`` elements: payload, block scales, zero padding to 4 bytes.

    Example: packed_width(512) -> 512 + 4 * 4 = 528; packed_width(512, ue8m0=True) -> 516;
             packed_width(7168) -> 7168 + 56 * 4 = 7392; packed_width(7) -> 8 + 4 = 12.
    """
    return packed_layout(hidden, ue8m0)[3]


def check_quantize_args(x_TH, ue8m0, out) -> Tuple[int, int]:
    """Checks of ``quantize_rows``' arguments (shared by every backend); returns (T, B)."""
    check_tensor("x_TH", x_TH, dim=2, dtypes=FP8_DTYPES)
    check_bool("ue8m0", ue8m0)
    T, H = x_TH.shape
    B = packed_width(H, ue8m0)
    check_out("out", out, (T, B), torch.uint8, x_TH.device, contiguous=False)
    return T, B


def check_dequantize_args(q_RB, hidden, dtype, ue8m0, out) -> int:
    """Checks of ``dequantize_rows``' arguments (shared by every backend); returns R."""
    check_int("hidden", hidden, 0)
    check_bool("ue8m0", ue8m0)
    if not isinstance(dtype, torch.dtype) or dtype not in FP8_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in FP8_DTYPES)
        raise TypeError(f"dtype must be one of ({names}), got {dtype!r}")
    B = packed_width(hidden, ue8m0)
    check_tensor("q_RB", q_RB, dim=2, dtypes=(torch.uint8,))
    if q_RB.shape[1] != B:
        raise ValueError(f"q_RB must have shape [*, {B}] (packed_width(hidden={hidden}, ue8m0={ue8m0})), "
                         f"got {tuple(q_RB.shape)}")
    R = q_RB.shape[0]
    check_out("out", out, (R, hidden), dtype, q_RB.device, contiguous=False)
    return R


def _blocks(x_TH: torch.Tensor) -> torch.Tensor:
    """[T, n, FP8_BLOCK] float32 copy of ``x_TH``, the last block zero-padded (|0| changes no amax)."""
    T, H = x_TH.shape
    n = -(-H // FP8_BLOCK)
    x_TnC = torch.zeros(T, n * FP8_BLOCK, dtype=torch.float32, device=x_TH.device)
    x_TnC[:, :H] = x_TH  # float64 -> float32 rounds to nearest even
    return x_TnC.view(T, n, FP8_BLOCK)


def _scales_of_blocks(x_TnC: torch.Tensor, ue8m0: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(s_Tn float32 scales, their packed bytes: [T, n, 4] little-endian float32 bytes or [T, n] exponents)."""
    nan = torch.full((), float("nan"), dtype=torch.float32, device=x_TnC.device)  # bits 0x7FC00000
    amax_Tn = x_TnC.abs().amax(dim=2)
    amax_Tn = torch.where(x_TnC.isnan().any(dim=2), nan, amax_Tn)  # canonical NaN, whichever NaN amax kept
    # divide by a tensor, not a Python scalar: CUDA multiplies by the reciprocal of a scalar divisor
    r_Tn = amax_Tn / torch.full_like(amax_Tn, FP8_MAX)
    if not ue8m0:
        s_Tn = torch.where(r_Tn == 0, torch.ones_like(r_Tn), r_Tn)
        s_Tn = torch.where(amax_Tn.isnan(), nan, s_Tn).contiguous()
        shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=s_Tn.device)
        return s_Tn, ((s_Tn.view(torch.int32)[:, :, None] >> shifts) & 0xFF).to(torch.uint8)  # little endian
    bits_Tn = r_Tn.view(torch.int32)  # r >= 0 or +NaN: no sign bit
    exp_Tn = (bits_Tn >> 23) & 0xFF
    b_Tn = (exp_Tn + ((bits_Tn & 0x7FFFFF) != 0).to(torch.int32)).clamp(1, 254)  # ceil to a power of two
    b_Tn = torch.where(r_Tn == 0, torch.full_like(b_Tn, 127), b_Tn)
    b_Tn = torch.where(exp_Tn == 255, torch.full_like(b_Tn, 255), b_Tn)  # r inf or NaN
    return _ue8m0_scale(b_Tn), b_Tn.to(torch.uint8)


def ue8m0_top_code(dtype: torch.dtype) -> int:
    """The ue8m0 code b from which the payload is clamped to +-FP8_TOP_LIMIT for rows of ``dtype``: the
    scale 2^(b - 127) = 2^(emax + 1) / 256, at which 448 * s overflows the dtype while 240 * s does not.
    float64 rows are rounded to float32 first, so they share float32's code.
    Example: float32 / bfloat16 / float64 -> 127 + 128 - 8 = 247 (s = 2^120); float16 -> 127 + 16 - 8 = 135 (s = 256)
    """
    return 127 + (16 if dtype == torch.float16 else 128) - 8


def _ue8m0_scale(b: torch.Tensor) -> torch.Tensor:
    """float32 2^(b - 127) built from the bits (exact); b = 255 -> NaN (0x7FC00000), b = 0 -> 0."""
    b = b.to(torch.int32)
    return ((b << 23) | torch.where(b == 255, 0x400000, 0).to(torch.int32)).view(torch.float32)


def block_scales(x_TH: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """The float32 scale of each FP8 block of ``x_TH`` [T, H] (what ``quantize_rows`` stores), as [T, n].

    Example: x_TH = [[896.0] + [1.0] * 129] -> [[2.0, 1 / 448]]; with ue8m0 -> [[2.0, 2^-8]]
    """
    check_tensor("x_TH", x_TH, dim=2, dtypes=FP8_DTYPES)
    return _scales_of_blocks(_blocks(x_TH), ue8m0)[0]


def quantize_rows(x_TH: torch.Tensor, ue8m0: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Quantize each row to float8_e4m3fn in blocks of 128, packed with its block scales (module docstring).

    Args:
        x_TH: [T, H] float32 / float64 / bfloat16 / float16.
        ue8m0: scales as power-of-two exponents (1 byte) instead of float32 (4 bytes).
        out: optional [T, packed_width(H, ue8m0)] uint8 buffer.
    Returns: q_TB [T, B] uint8, B = packed_width(H, ue8m0).
    Example (H = 2, float32 scales, B = 8):
        x_TH = [[896.0, -1.0]] -> amax 896, s = 2, q = e4m3([448, -0.5]) = [0x7E, 0xB0]
        -> [[0x7E, 0xB0, 0, 0, 0x00, 0x00, 0x00, 0x40]]   (bytes 4..7: float32 2.0, little endian)
    """
    T, B = check_quantize_args(x_TH, ue8m0, out)
    H = x_TH.shape[1]
    s0, n, sb, _ = packed_layout(H, ue8m0)
    x_TnC = _blocks(x_TH)
    s_Tn, code_Tn = _scales_of_blocks(x_TnC, ue8m0)
    # one IEEE division by a tensor; clamp keeps NaN; torch's conversion rounds to nearest even
    v_TnC = x_TnC / s_Tn[:, :, None]
    q_TnC = v_TnC.clamp(-FP8_MAX, FP8_MAX)
    if ue8m0:  # the top scale: clamp to 240 so that q * s stays finite in x's dtype (module docstring)
        top_Tn1 = (code_Tn.to(torch.int32) >= ue8m0_top_code(x_TH.dtype))[:, :, None]
        q_TnC = torch.where(top_Tn1, v_TnC.clamp(-FP8_TOP_LIMIT, FP8_TOP_LIMIT), q_TnC)
    q_TnC = q_TnC.to(torch.float8_e4m3fn)
    q_TB = torch.zeros(T, B, dtype=torch.uint8, device=x_TH.device)
    q_TB[:, :H] = q_TnC.view(torch.uint8).view(T, n * FP8_BLOCK)[:, :H]
    q_TB[:, s0:s0 + n * sb] = code_Tn.reshape(T, n * sb)
    return q_TB if out is None else out.copy_(q_TB)


def dequantize_rows(q_RB: torch.Tensor, hidden: int, dtype: torch.dtype, ue8m0: bool = False,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows of ``dtype`` back from packed FP8 rows: ``y = float32(q) * s`` per block, cast to ``dtype``.

    Args:
        q_RB: [R, packed_width(hidden, ue8m0)] uint8 packed rows (from ``quantize_rows``).
        hidden: H, elements per row.
        dtype: float32 / float64 / bfloat16 / float16 output dtype.
        ue8m0: how the scales were stored (must match the quantization).
        out: optional [R, hidden] buffer of ``dtype``.
    Returns: y_RH [R, hidden] of ``dtype``; a block whose scale is NaN or inf decodes to NaN (the dtype's
        canonical quiet NaN, positive).
    Example (H = 2, float32 scales):
        q_RB = [[0x7E, 0xB0, 0, 0, 0x00, 0x00, 0x00, 0x40]] -> [[448 * 2, -0.5 * 2]] = [[896.0, -1.0]]
    """
    R = check_dequantize_args(q_RB, hidden, dtype, ue8m0, out)
    s0, n, sb, _ = packed_layout(hidden, ue8m0)
    q_RnC = torch.zeros(R, n * FP8_BLOCK, dtype=torch.uint8, device=q_RB.device)
    q_RnC[:, :hidden] = q_RB[:, :hidden]
    code_RnS = q_RB[:, s0:s0 + n * sb].reshape(R, n, sb).to(torch.int32)
    if ue8m0:
        s_Rn = _ue8m0_scale(code_RnS[:, :, 0])
    else:  # 4 little-endian bytes per scale
        shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=q_RB.device)
        s_Rn = (code_RnS << shifts).sum(dim=2, dtype=torch.int32).view(torch.float32)
    y_RnC = q_RnC.view(torch.float8_e4m3fn).to(torch.float32).view(R, n, FP8_BLOCK) * s_Rn.view(R, n, 1)
    y_RH = y_RnC.view(R, n * FP8_BLOCK)[:, :hidden].to(dtype)
    # NaN as the dtype's canonical quiet NaN: a product of two NaNs may return either one's payload, and
    # torch's own float32 -> bfloat16 / float16 conversions give NaN different bits in different paths
    y_RH = torch.where(y_RH.isnan(), torch.full((), float("nan"), dtype=dtype, device=q_RB.device), y_RH)
    return y_RH if out is None else out.copy_(y_RH)
