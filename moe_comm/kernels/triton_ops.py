"""Triton row kernels: permute (gather), unpermute (weighted scatter-reduce), weight grad, FP8 row quantization.

Shapes legend: T tokens, K top-k slots, N permuted rows, H hidden size, R rows received, B bytes of a
packed FP8 row, n = ceil(H / 128) FP8 blocks of a row.
Semantics are those of ``reference.py`` (the oracle): permute is bit-exact; unpermute sums the slots in
k = 0..K-1 order in float32 (float64 for float64 rows) and casts once at the end; ``quantize_rows`` /
``dequantize_rows`` are bit-exact (the float32 divisions use ``tl.math.div_rn``, IEEE round to nearest, as
a plain ``/`` may be approximate on a GPU; the float8 conversions are integer bit manipulation, not
``tl.float8e4nv`` casts).

Layers (shared/STYLE.md): ``_*_kernel`` are pure ``@triton.jit`` kernels; ``permute_rows``,
``unpermute_rows``, ``unpermute_weight_grad``, ``quantize_rows`` and ``dequantize_rows`` are launchers
(validate with ``moe_comm._checks``, allocate, build the grid); the autograd layer lives in ``moe_comm.ops``.

Kernels run on CUDA tensors, and on CPU tensors only when TRITON_INTERPRET=1 was set before triton was
imported (this module decorates its kernels at import time, so the flag must be set before importing it).
The module imports without triton installed; ``available()`` then returns False.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch

from moe_comm._checks import check_out, check_same_device, check_tensor
from moe_comm.kernels.reference import (FP8_BLOCK, acc_dtype, check_dequantize_args, check_quantize_args,
                                        check_unpermute_backward_args, packed_layout, ue8m0_top_code)

try:  # optional dependency: the module must import without triton (available() -> False)
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a broken install that fails while importing
    triton = None
    tl = None

__all__ = ["available", "permute_rows", "unpermute_rows", "unpermute_weight_grad", "unpermute_backward",
           "quantize_rows", "dequantize_rows"]

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

    @triton.jit
    def _unpermute_backward_kernel(grad_ptr, row_ptr, weight_ptr, y_ptr, grad_y_ptr, grad_w_ptr, H, K,
                                   stride_grad, stride_y, stride_gy, HAS_WEIGHT: tl.constexpr,
                                   GRAD_Y: tl.constexpr, GRAD_W: tl.constexpr, ACC: tl.constexpr,
                                   BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
        """One program per token t walks grad[t] once in BLOCK_H columns; for each valid slot k (row
        r = row[t, k]) it writes grad_y[r] = grad[t] * w[t, k] (cast back; without weights a copy) and
        accumulates <grad[t], y[r]> into grad_w[t, k] (0 for a dropped slot). The K slots are the rows of
        a [BLOCK_K, BLOCK_H] tile, so grad[t] is read once, not 2K times as by permute + weight-grad.

        Example (H=2, K=2, grid (1,)):
            grad = [[1, 2]], row = [[1, -1]], w = [[.5, 9]], y = [[3, 4], [5, 6]]
            -> grad_y[1] = [.5, 1] (row 0 untouched), grad_w = [[1*5 + 2*6, 0]] = [[17, 0]]
        """
        t = tl.program_id(0).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        in_k = ks < K
        rows = tl.load(row_ptr + t * K + ks, mask=in_k, other=-1)
        valid = rows >= 0  # dropped slots load and store nothing
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + t * K + ks, mask=in_k & valid, other=0.0).to(ACC)
        else:
            w = tl.full([BLOCK_K], 1.0, ACC)  # unused: the rows are copied
        dots = tl.zeros([BLOCK_K, BLOCK_H], dtype=ACC)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            in_h = cols < H
            g_raw = tl.load(grad_ptr + t * stride_grad + cols, mask=in_h, other=0.0)
            m = valid[:, None] & in_h[None, :]
            if GRAD_Y:
                if HAS_WEIGHT:
                    v = _cast_rtne(g_raw.to(ACC)[None, :] * w[:, None], grad_y_ptr.dtype.element_ty)
                else:
                    v = tl.broadcast_to(g_raw[None, :], [BLOCK_K, BLOCK_H])  # a copy, bit for bit
                tl.store(grad_y_ptr + rows[:, None] * stride_gy + cols[None, :], v, mask=m)
            if GRAD_W:
                y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=m, other=0.0).to(ACC)
                dots += g_raw.to(ACC)[None, :] * y
        if GRAD_W:
            tl.store(grad_w_ptr + t * K + ks, tl.sum(dots, axis=1), mask=in_k)


    # -----------------------------------------------------------------------------------------------
    # FP8 (float8_e4m3fn) rows; layout and math in reference.py. One program: BLOCKS blocks of one row.
    # -----------------------------------------------------------------------------------------------
    @triton.jit
    def _e4m3_from_f32(y):
        """float32 -> float8_e4m3fn bits (uint8), torch's conversion in integer ops (as csrc/quant.cpp).

        NaN -> 0x7F with its sign; |y| >= 448 after rounding (inf too) -> 0x7E (torch saturates);
        below 2^-6: |y| / 2^-9 rounded to nearest even; else the exponent rebiased (127 -> 7) and the
        mantissa rounded to 3 bits, nearest even.
        Example: 1.0625 (half-way between 1 and 1.125) -> 0x38 = 1.0; 2^-10 -> 0x00; -3e-3 -> 0x82.
        """
        bits = y.to(tl.uint32, bitcast=True)
        sign = bits & 0x80000000
        a = bits ^ sign
        e = a >> 23
        normal = (a + 0xC4000000 + 0x7FFFF + ((a >> 20) & 1)) >> 20  # 0xC4000000 = (7 - 127) << 23 mod 2^32
        normal = tl.where(normal == 0x7F, 0x7E, normal)  # rounded past 448
        # below 2^-6: value m * 2^(max(e, 1) - 150) is m >> sh in units of 2^-9 (sh >= 21; capped at 31
        # so no lane shifts by 32 or more, whatever the unselected branch holds)
        m = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0).to(tl.uint32)
        sh = tl.minimum(tl.where(e > 0, 141 - e, 140).to(tl.uint32), 31)
        one = tl.full(y.shape, 1, tl.uint32)
        half = one << (sh - 1)
        rem = m & ((one << sh) - 1)
        sub = m >> sh
        sub = sub + ((rem > half) | ((rem == half) & ((sub & 1) == 1))).to(tl.uint32)
        r = tl.where(a < 0x3C800000, sub, normal)  # 0x3C800000 = 2^-6
        r = tl.where(a >= 0x43F00000, 0x7E, r)  # >= 480 (inf included)
        r = tl.where(a > 0x7F800000, 0x7F, r)  # NaN
        return (r | (sign >> 24)).to(tl.uint8)

    @triton.jit
    def _e4m3_to_f32(q):
        """float8_e4m3fn bits (uint8) -> float32, the bits torch gives (NaN 0x7F -> 0x7FF00000, sign kept).

        Example: 0x38 -> 1.0; 0x01 -> 2^-9; 0x80 -> -0.0; 0xFF -> NaN with the sign bit set.
        """
        v = q.to(tl.uint32)
        sign = (v & 0x80) << 24
        e = (v >> 3) & 0xF
        m = v & 7
        normal = ((e + 120) << 23) | (m << 20)
        sub = (m.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)  # m * 2^-9, exact
        bits = tl.where(e == 0, sub, normal)
        bits = tl.where((v & 0x7F) == 0x7F, 0x7FF00000, bits)
        return (bits | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _canonical_nan_like(x):
        """A tensor like ``x`` (shape and dtype) of the dtype's canonical quiet NaN, what torch writes for
        float("nan"): 0x7FC0 (bfloat16), 0x7E00 (float16), 0x7FC00000 (float32), 0x7FF8... (float64)."""
        if x.dtype == tl.bfloat16:
            return tl.full(x.shape, 0x7FC0, tl.uint16).to(tl.bfloat16, bitcast=True)
        elif x.dtype == tl.float16:
            return tl.full(x.shape, 0x7E00, tl.uint16).to(tl.float16, bitcast=True)
        elif x.dtype == tl.float64:
            return tl.full(x.shape, 0x7FF8000000000000, tl.uint64).to(tl.float64, bitcast=True)
        else:
            return tl.full(x.shape, 0x7FC00000, tl.uint32).to(tl.float32, bitcast=True)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, out_ptr, H, S0, NB, END, B, num_blocks, stride_x, stride_out,
                              UE8M0: tl.constexpr, TOP_CODE: tl.constexpr, BLOCKS: tl.constexpr,
                              GROUP: tl.constexpr):
        """One program packs BLOCKS consecutive blocks of the flat list of all (row, block) pairs,
        g = t * NB + j (a program may span rows): payload bytes and block scales; the lane of block
        j = 0 of a row also zeroes its padding bytes [H, S0) and [END, B), END = S0 + NB * scale bytes.
        TOP_CODE: reference.ue8m0_top_code(x's dtype); ue8m0 blocks with b >= TOP_CODE clamp to +-240.

        Example (H = 2, float32 scales, B = 8, one block, grid (1,)):
            x = [[896.0, -1.0]] -> amax 896, s = 896 / 448 = 2, payload e4m3([448, -0.5]) = [0x7E, 0xB0]
            -> out = [[0x7E, 0xB0, 0, 0, 0x00, 0x00, 0x00, 0x40]]  (bytes 4..7: float32 2.0)
        """
        g = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)  # int64: T*B may exceed 2^31
        valid = g < num_blocks
        t = g // NB
        j = g - t * NB
        cols = j[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        mask = (cols < H) & valid[:, None]
        row = out_ptr + t * stride_out  # [BLOCKS] row pointers
        x = tl.load(x_ptr + (t * stride_x)[:, None] + cols, mask=mask, other=0.0)
        if x.dtype == tl.bfloat16:  # exact widening by the bits: the interpreter mangles bf16 subnormals
            x = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            x = x.to(tl.float32)  # float64: round to nearest even
        # max of |x| bits: orders like the values, and any NaN (bits above inf) wins, unlike a float max
        amax_bits = tl.max(x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF, axis=1)
        amax_bits = tl.where(amax_bits > 0x7F800000, 0x7FC00000, amax_bits)  # canonical NaN
        r = tl.math.div_rn(amax_bits.to(tl.float32, bitcast=True), tl.full([BLOCKS], 448.0, tl.float32))
        rb = r.to(tl.uint32, bitcast=True)
        if UE8M0:
            e = (rb >> 23) & 0xFF
            b = tl.minimum(tl.maximum(e + ((rb & 0x7FFFFF) != 0).to(tl.uint32), 1), 254)  # ceil to 2^k
            b = tl.where(rb == 0, 127, b)
            b = tl.where(e == 255, 255, b)  # r inf or NaN
            s_bits = (b << 23) | tl.where(b == 255, 0x400000, 0).to(tl.uint32)
            tl.store(row + S0 + j, b.to(tl.uint8), mask=valid)
            # the top scale: 240 keeps q * s finite in x's dtype (reference.py)
            lim = tl.broadcast_to(tl.where(b >= TOP_CODE, 240.0, 448.0)[:, None], [BLOCKS, GROUP])
        else:
            lim = tl.full([BLOCKS, GROUP], 448.0, tl.float32)
            s_bits = tl.where(rb == 0, 0x3F800000, rb)  # r == 0 -> s = 1.0
            s_bits = tl.where(amax_bits == 0x7FC00000, 0x7FC00000, s_bits)
            k = tl.arange(0, 4)
            s_bytes = ((s_bits[:, None] >> (k[None, :] * 8)) & 0xFF).to(tl.uint8)  # little endian
            tl.store(row[:, None] + S0 + j[:, None] * 4 + k[None, :], s_bytes, mask=valid[:, None] & (k[None, :] < 4))
        s = tl.broadcast_to(s_bits.to(tl.float32, bitcast=True)[:, None], [BLOCKS, GROUP])
        y = tl.math.div_rn(x, s)
        y = tl.where(y > lim, lim, tl.where(y < -lim, -lim, y))  # comparisons keep NaN
        tl.store(row[:, None] + cols, _e4m3_from_f32(y), mask=mask)
        p = tl.arange(0, 4)[None, :]
        first = valid[:, None] & (j[:, None] == 0)
        zero = tl.zeros([BLOCKS, 4], dtype=tl.uint8)
        tl.store(row[:, None] + H + p, zero, mask=first & (H + p < S0))
        tl.store(row[:, None] + END + p, zero, mask=first & (END + p < B))

    @triton.jit
    def _dequantize_rows_kernel(q_ptr, out_ptr, H, S0, NB, num_blocks, stride_q, stride_out,
                                UE8M0: tl.constexpr, BLOCKS: tl.constexpr, GROUP: tl.constexpr):
        """One program decodes BLOCKS consecutive (row, block) pairs g = r * NB + j: out = float32(q) * s, cast.

        Example (H = 2, float32 scales, one block, grid (1,)):
            q = [[0x7E, 0xB0, 0, 0, 0x00, 0x00, 0x00, 0x40]] -> s = 2.0, [448, -0.5] * 2
            -> out = [[896.0, -1.0]]
        """
        g = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        valid = g < num_blocks
        r = g // NB
        j = g - r * NB
        cols = j[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        mask = (cols < H) & valid[:, None]
        row = q_ptr + r * stride_q
        q = tl.load(row[:, None] + cols, mask=mask, other=0)
        if UE8M0:
            b = tl.load(row + S0 + j, mask=valid, other=127).to(tl.uint32)
            s_bits = (b << 23) | tl.where(b == 255, 0x400000, 0).to(tl.uint32)
        else:
            k = tl.arange(0, 4)
            s_bytes = tl.load(row[:, None] + S0 + j[:, None] * 4 + k[None, :], mask=valid[:, None] & (k[None, :] < 4),
                              other=0).to(tl.uint32)
            s_bits = tl.sum(s_bytes << (k[None, :] * 8), axis=1)  # disjoint bytes: the sum is the OR
        y = _e4m3_to_f32(q) * s_bits.to(tl.float32, bitcast=True)[:, None]  # one IEEE multiply
        if out_ptr.dtype.element_ty == tl.float64:
            out = y.to(tl.float64)
        else:
            out = _cast_rtne(y, out_ptr.dtype.element_ty)
        out = tl.where(y != y, _canonical_nan_like(out), out)  # one NaN pattern, as the reference
        tl.store(out_ptr + (r * stride_out)[:, None] + cols, out, mask=mask)

    @triton.jit
    def _e4m3_convert_kernel(src_ptr, dst_ptr, n, TO_F32: tl.constexpr, BLOCK: tl.constexpr):
        """Test hook: one of the element conversions alone over a flat array (float32 <-> e4m3 bits).

        Example (TO_F32 False): src = [1.0625, -3e-3] -> dst = [0x38, 0x82]
        """
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(src_ptr + offs, mask=mask)
        if TO_F32:
            tl.store(dst_ptr + offs, _e4m3_to_f32(v), mask=mask)
        else:
            tl.store(dst_ptr + offs, _e4m3_from_f32(v), mask=mask)


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


def unpermute_backward(grad_TH: torch.Tensor, row_TK: torch.Tensor, num_rows: int,
                       weight_TK: Optional[torch.Tensor] = None, y_NH: Optional[torch.Tensor] = None,
                       grad_y: bool = True) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Both gradients of ``unpermute_rows`` from one kernel, one program per token (``reference.unpermute_backward``).

    Args:
        grad_TH: [T, H] float16/bfloat16/float32/float64 gradient of the unpermuted output, any row stride.
        row_TK: [T, K] int64 in [-1, num_rows) (not checked: a host sync); -1 = dropped (no row, gradient 0).
        num_rows: N. weight_TK: optional [T, K] float32 / float64 weights (None: a plain sum).
        y_NH: optional [N, H] rows of the forward in grad's dtype; given: the weights' gradient is computed.
        grad_y: whether to compute y's gradient.
    Returns: (grad_y_NH [N, H] of grad's dtype, bit-identical to the reference on the rows slots point at,
        other rows unwritten; or None), (grad_w_TK [T, K] float32 (float64 for float64 rows), the reference's
        to fp tolerance; or None).
    Example:
        grad_TH = [[1, 2]], row_TK = [[1, -1]], weight_TK = [[0.5, 9]], y_NH = [[3, 4], [5, 6]]
        -> grad_y_NH[1] = [0.5, 1], grad_w_TK = [[17, 0]]
    """
    _require_triton()
    T, K, H = check_unpermute_backward_args(grad_TH, row_TK, num_rows, weight_TK, y_NH, grad_y)
    _check_runs_here("grad_TH", grad_TH)
    dev = grad_TH.device
    gy_NH = torch.empty(num_rows, H, dtype=grad_TH.dtype, device=dev) if grad_y else None
    gw_TK = torch.empty(T, K, dtype=acc_dtype(grad_TH.dtype), device=dev) if y_NH is not None else None
    if T == 0 or K == 0 or (gy_NH is None and gw_TK is None):
        return gy_NH, gw_TK
    if num_rows == 0 or H == 0:  # every slot dropped, or empty rows: nothing to write, every dot product 0
        return gy_NH, None if gw_TK is None else gw_TK.zero_()
    _launch_unpermute_backward(_rows_last_dense(grad_TH), row_TK.contiguous(),
                               None if weight_TK is None else weight_TK.contiguous(),
                               None if y_NH is None else _rows_last_dense(y_NH), gy_NH, gw_TK)
    return gy_NH, gw_TK


def quantize_rows(x_TH: torch.Tensor, ue8m0: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Quantize each row to float8_e4m3fn in blocks of 128, packed with its block scales (``reference.py``).

    Args:
        x_TH: [T, H] float16/bfloat16/float32/float64, any row stride.
        ue8m0: scales as power-of-two exponents (1 byte) instead of float32 (4 bytes).
        out: optional [T, packed_width(H, ue8m0)] uint8 buffer (any strides).
    Returns: q_TB [T, B] uint8, bit-identical to ``reference.quantize_rows`` on the same device.
    Example (H = 2, float32 scales, B = 8):
        x_TH = [[896.0, -1.0]] -> amax 896, s = 2, q = e4m3([448, -0.5]) = [0x7E, 0xB0]
        -> [[0x7E, 0xB0, 0, 0, 0x00, 0x00, 0x00, 0x40]]   (bytes 4..7: float32 2.0, little endian)
    """
    _require_triton()
    T, B = check_quantize_args(x_TH, ue8m0, out)
    _check_runs_here("x_TH", x_TH)
    def launch(dst):
        if T > 0 and B > 0:
            _launch_quantize(_rows_last_dense(x_TH), ue8m0, dst)
    return _staged(out, (T, B), torch.empty(0, dtype=torch.uint8, device=x_TH.device), launch)


def dequantize_rows(q_RB: torch.Tensor, hidden: int, dtype: torch.dtype, ue8m0: bool = False,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows of ``dtype`` back from packed FP8 rows: ``y = float32(q) * s`` per block, cast to ``dtype``.

    Args:
        q_RB: [R, packed_width(hidden, ue8m0)] uint8 packed rows, any row stride.
        hidden: H, elements per row. dtype: float16/bfloat16/float32/float64 output dtype.
        ue8m0: how the scales were stored. out: optional [R, hidden] buffer of ``dtype`` (any strides).
    Returns: y_RH [R, hidden], bit-identical to ``reference.dequantize_rows`` (NaN: the dtype's canonical NaN).
    Example (H = 2, float32 scales):
        q_RB = [[0x7E, 0xB0, 0, 0, 0x00, 0x00, 0x00, 0x40]] -> [[896.0, -1.0]]
    """
    _require_triton()
    R = check_dequantize_args(q_RB, hidden, dtype, ue8m0, out)
    _check_runs_here("q_RB", q_RB)
    def launch(dst):
        if R > 0 and hidden > 0:
            _launch_dequantize(_rows_last_dense(q_RB), hidden, ue8m0, dst)
    return _staged(out, (R, hidden), torch.empty(0, dtype=dtype, device=q_RB.device), launch)

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


def _launch_unpermute_backward(grad_TH, row_TK, weight_TK, y_NH, grad_y_NH, grad_w_TK,
                               block_bytes: int = _BLOCK_BYTES) -> None:
    T, H = grad_TH.shape
    K = row_TK.shape[1]
    block_k = _next_pow2(K)
    # the [BLOCK_K, BLOCK_H] tile of y rows / grad_y rows holds about block_bytes, as the other kernels' blocks
    block_h, num_warps = _block_config(H, grad_TH.element_size() * block_k, block_bytes)
    some = grad_TH  # any tensor stands in for an absent pointer (its kernel branch is compiled out)
    with _on_device(grad_TH):
        _unpermute_backward_kernel[(T,)](
            grad_TH, row_TK, some if weight_TK is None else weight_TK, some if y_NH is None else y_NH,
            some if grad_y_NH is None else grad_y_NH, some if grad_w_TK is None else grad_w_TK, H, K,
            grad_TH.stride(0), 0 if y_NH is None else y_NH.stride(0),
            0 if grad_y_NH is None else grad_y_NH.stride(0), HAS_WEIGHT=weight_TK is not None,
            GRAD_Y=grad_y_NH is not None, GRAD_W=grad_w_TK is not None, ACC=_tl_acc(grad_TH.dtype),
            BLOCK_K=block_k, BLOCK_H=block_h, num_warps=num_warps)


def _fp8_config(blocks: Optional[int]):
    """(BLOCKS, num_warps): (row, block) pairs per program, a power of two, and warps.
    8 blocks (1024 elements) on a GPU, not tuned yet; 64 under the interpreter, where each program costs
    ~25 ms of Python whatever its size. ``blocks`` forces BLOCKS (tests split rows over programs with it)."""
    if blocks is None:
        blocks = 64 if _interpreting() else 8
    return blocks, max(1, min(4, blocks))


def _launch_quantize(x_TH, ue8m0: bool, out_TB, blocks: Optional[int] = None) -> None:
    T, H = x_TH.shape
    s0, n, sb, B = packed_layout(H, ue8m0)
    blocks, num_warps = _fp8_config(blocks)
    grid = (triton.cdiv(T * n, blocks),)
    with _on_device(x_TH), _quiet_interpreter():
        _quantize_rows_kernel[grid](
            x_TH, out_TB, H, s0, n, s0 + n * sb, B, T * n, x_TH.stride(0), out_TB.stride(0),
            UE8M0=ue8m0, TOP_CODE=ue8m0_top_code(x_TH.dtype), BLOCKS=blocks, GROUP=FP8_BLOCK,
            num_warps=num_warps)


def _launch_dequantize(q_RB, hidden: int, ue8m0: bool, out_RH, blocks: Optional[int] = None) -> None:
    R = q_RB.shape[0]
    s0, n, _, _ = packed_layout(hidden, ue8m0)
    blocks, num_warps = _fp8_config(blocks)
    grid = (triton.cdiv(R * n, blocks),)
    with _on_device(q_RB), _quiet_interpreter():
        _dequantize_rows_kernel[grid](
            q_RB, out_RH, hidden, s0, n, R * n, q_RB.stride(0), out_RH.stride(0),
            UE8M0=ue8m0, BLOCKS=blocks, GROUP=FP8_BLOCK, num_warps=num_warps)


def _quiet_interpreter():
    """Under the interpreter, numpy's warnings for inf / inf, 0 * inf and casts of out-of-range values off:
    those are the defined NaN / inf cases here (a compiled kernel never warns)."""
    if not _interpreting():
        return contextlib.nullcontext()
    import numpy as np  # the interpreter's own dependency
    return np.errstate(invalid="ignore", over="ignore", divide="ignore")


def _e4m3_convert(src: torch.Tensor, to_f32: bool, block: int = 1 << 16) -> torch.Tensor:
    """Test hook: the kernels' float32 -> e4m3 bits (uint8) conversion, or back with ``to_f32``."""
    src = src.contiguous()
    dst = torch.empty(src.shape, dtype=torch.float32 if to_f32 else torch.uint8, device=src.device)
    if src.numel():
        with _on_device(src), _quiet_interpreter():
            _e4m3_convert_kernel[(triton.cdiv(src.numel(), block),)](src, dst, src.numel(), TO_F32=to_f32,
                                                                     BLOCK=block)
    return dst
