"""FP8 (float8_e4m3fn) block quantization of rows for FP8 dispatch, over the kernel backends.

Shapes legend: T tokens, H hidden size, R rows received, B = packed_width(H, ue8m0) bytes of a packed row,
n = ceil(H / 128) scale blocks of a row.

Each token row is quantized once into a packed uint8 row (e4m3fn payload, one scale per block of 128
elements, zero padding; the layout and the math are in ``moe_comm/kernels/reference.py``). The packed rows
move through the byte-agnostic row permute and all-to-all like any uint8 rows, and the receiver
dequantizes. Every backend ("triton" | "native" | "torch") writes the same bytes and the same rows.
No autograd: the result is not differentiable, the caller handles gradients.

Error bound (``fp8_error_bound``). For an element x of a block with scale s (x cast to float32) and
y = dequantize_rows(quantize_rows(x)) in float32:
  |y - x| <= 2^-4 * |x|   when |x / s| is in e4m3's normal range [2^-6, 448]: 3 mantissa bits rounded to
                          nearest even, so half an ulp is at most 2^-4 of the value;
  |y - x| <= s * 2^-10    when |x / s| < 2^-6 (subnormal range): half the smallest subnormal step 2^-9.
``fp8_error_bound`` returns their sum, 2^-4 * |x| + 2^-10 * s, which holds for every element (it also
covers the float32 roundings of x / s and q * s, each 2^-24 relative).
ue8m0 scales: the same bounds hold; s is the power of two >= amax / 448, larger than the float32 scale by
less than 2x, so the absolute floor s * 2^-10 at most doubles. At the top scale of the row dtype (s = 2^120
for float32 / bfloat16, amax > 448 * 2^119 ~ 3.0e38; s = 2^8 for float16, amax > 57344) 448 * s would
overflow the dtype, so x / s is clamped to +-240 there (x / s < 256 as |x| <= the dtype's max; the clamp
costs at most 16 / 256 = 2^-4 of |x|): every finite row dequantizes to finite values in float32 and in its
own dtype, up to the dtype's max (tested at every finite bfloat16 / float16 value and float32's top).
Conditions: the block is finite (a NaN or Inf makes the whole block decode to NaN; other blocks of the row
are unaffected); with float32 scales, amax >= 448 * 2^-126 ~ 5.3e-36 (below that amax / 448 is a subnormal
rounded to few bits, so the block's largest elements may clip at 448; ue8m0 scales have no such limit).
A bfloat16 / float16 output adds its own rounding (2^-8 / 2^-11 relative) on top; float64 rows are first
rounded to float32 (2^-24 relative).
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_comm.kernels import select_backend
from moe_comm.kernels.reference import (FP8_BLOCK, FP8_MAX, block_scales, check_dequantize_args,
                                        check_quantize_args, packed_width)

__all__ = ["quantize_rows", "dequantize_rows", "packed_width", "fp8_error_bound", "FP8_BLOCK", "FP8_MAX"]


def quantize_rows(x_TH: torch.Tensor, *, ue8m0: bool = False, backend: str = "auto",
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Quantize each row to float8_e4m3fn in blocks of 128 elements, packed with the block scales.

    Args:
        x_TH: [T, H] float32 / float64 / bfloat16 / float16 rows (any H >= 0, T >= 0).
        ue8m0: store each scale as a power-of-two exponent byte (scale 2^(b - 127), 255 = NaN) instead of
            a float32 (4 bytes).
        backend: "auto" | "triton" | "native" | "torch"; all write the same bytes.
        out: optional [T, packed_width(H, ue8m0)] uint8 buffer to write into.
    Returns: q_TB [T, B] uint8 (``out`` when given); not differentiable.
    Example (H = 2, float32 scales, B = 8):
        x_TH = [[896.0, -1.0]] -> amax 896, s = 896 / 448 = 2, payload e4m3([448, -0.5]) = [0x7E, 0xB0]
        -> [[0x7E, 0xB0, 0, 0, 0x00, 0x00, 0x00, 0x40]]   (bytes 4..7: float32 2.0, little endian)
    """
    check_quantize_args(x_TH, ue8m0, out)
    with torch.no_grad():
        return select_backend(backend, x_TH.device).quantize_rows(x_TH, ue8m0, out=out)


def dequantize_rows(q_RB: torch.Tensor, hidden: int, dtype: torch.dtype, *, ue8m0: bool = False,
                    backend: str = "auto", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows back from packed FP8 rows: ``y = float32(q) * s`` per block, cast to ``dtype`` (nearest even).

    Args:
        q_RB: [R, packed_width(hidden, ue8m0)] uint8 packed rows (from ``quantize_rows``, possibly
            permuted or exchanged since).
        hidden: H, the elements of a row (fixes the layout together with ``ue8m0``).
        dtype: float32 / float64 / bfloat16 / float16.
        ue8m0: how the scales were stored; must match the quantization.
        backend: as in ``quantize_rows``. out: optional [R, hidden] buffer of ``dtype``.
    Returns: y_RH [R, hidden] of ``dtype`` (``out`` when given); a block with a NaN or Inf decodes to
        NaN (the dtype's canonical NaN). Not differentiable.
    Example (H = 2, float32 scales):
        q_RB = [[0x7E, 0xB0, 0, 0, 0x00, 0x00, 0x00, 0x40]] -> [[448 * 2, -0.5 * 2]] = [[896.0, -1.0]]
    """
    check_dequantize_args(q_RB, hidden, dtype, ue8m0, out)
    with torch.no_grad():
        return select_backend(backend, q_RB.device).dequantize_rows(q_RB, hidden, dtype, ue8m0, out=out)


def fp8_error_bound(x_TH: torch.Tensor, *, ue8m0: bool = False) -> torch.Tensor:
    """Per-element bound on ``|dequantize(quantize(x)) - x|`` (float32 output): 2^-4 |x| + 2^-10 s.

    See the module docstring for where it comes from and when it holds (finite blocks; float32 scales
    need amax >= 448 * 2^-126). Computed in float64 from x cast to float32 and the block scales s.
    Args:
        x_TH: [T, H] float32 / float64 / bfloat16 / float16 rows.
        ue8m0: the scale kind the rows are quantized with.
    Returns: [T, H] float64; NaN for the elements of a block holding a NaN or Inf (no bound: it decodes
        to NaN).
    Example: x_TH = [[896.0, 1.0]] -> s = 2 -> [[896 / 16 + 2 / 1024, 1 / 16 + 2 / 1024]] = [[56.00195, 0.06445]]
    """
    s_Tn = block_scales(x_TH, ue8m0).to(torch.float64)
    T, H = x_TH.shape
    s_TH = s_Tn.repeat_interleave(FP8_BLOCK, dim=1)[:, :H]
    bound_TH = x_TH.to(torch.float32).to(torch.float64).abs() * 2.0 ** -4 + s_TH * 2.0 ** -10
    return torch.where(s_TH.isfinite(), bound_TH, torch.full_like(bound_TH, float("nan")))
