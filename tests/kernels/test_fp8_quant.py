"""Tier 1: pure logic, no processes. FP8 (float8_e4m3fn) block quantization of rows on every backend.

``quantize_rows`` / ``dequantize_rows`` of ``moe_comm.kernels.native`` (C++) and ``triton_ops`` (under
TRITON_INTERPRET=1 on CPU) against the pure-torch oracle ``moe_comm.kernels.reference``: the packed bytes
and the dequantized rows bit for bit (NaN included: every backend writes the dtype's canonical NaN), for
float32 / bfloat16 / float16 / float64 rows, H in {1, 7, 128, 130, 512}, T in {0, 1, 5, 33}, float32 and
ue8m0 scales, with NaN / Inf blocks, all-zero blocks, subnormal-range values, values on e4m3 rounding
ties and outliers. The element conversions alone are checked against torch over a strided sweep of all
float32 bit patterns, every e4m3 rounding boundary and random bits. Also: the documented error bound, the
packed widths, ``out=`` buffers, each C++ loop copy (AVX2 / generic), Triton programs that split or span
rows, packed rows moved by the byte row permute, and the argument errors of ``moe_comm.ops``.
T*B > 2^31 (int64 offsets) needs more memory than this tier has; the kernels use int64 offsets throughout.

Shapes legend: T tokens, H hidden size, R rows, B = packed_width(H, ue8m0) bytes of a packed row,
n = ceil(H / 128) blocks.

If the native extension cannot be built while a C++ compiler exists, its tests fail (not skip).
"""
import os
import shutil

import torch

# Before anything imports triton (tests/conftest.py decides first, at pytest_configure; this covers running
# the module without it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moe_comm import ops  # noqa: E402
from moe_comm.kernels import native, reference, triton_ops  # noqa: E402
from moe_comm.kernels.reference import FP8_BLOCK, packed_width  # noqa: E402

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
HS = [1, 7, 128, 130, 512]
TS = [0, 1, 5, 33]
E4M3 = torch.float8_e4m3fn
BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
        torch.float16: torch.int16, torch.uint8: torch.uint8}

if triton_ops.available() and triton_ops._interpreting():
    TRITON_DEVICE = torch.device("cpu")
elif triton_ops.available() and torch.cuda.is_available():
    TRITON_DEVICE = torch.device("cuda")
else:
    TRITON_DEVICE = None


def _native_or_skip():
    if not native.available():
        if shutil.which("c++"):
            pytest.fail("a C++ compiler exists but moe_comm's native kernels did not build; see the warning")
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    return native, torch.device("cpu")


def _triton_or_skip():
    if TRITON_DEVICE is None:
        pytest.skip("triton is not importable, or was imported before TRITON_INTERPRET=1 without CUDA")
    return triton_ops, TRITON_DEVICE


@pytest.fixture(params=["native", "triton"])
def backend(request):
    """(kernel module, the device its tensors live on)."""
    return _native_or_skip() if request.param == "native" else _triton_or_skip()


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
def e4m3_values() -> torch.Tensor:
    """The 127 non-negative finite e4m3fn values, ascending, as float32 (0, 2^-9, ..., 448)."""
    return torch.arange(0x7F, dtype=torch.uint8).view(E4M3).to(torch.float32)


def tie_values(n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` random midpoints between neighbouring e4m3 values (exact ties for round-to-nearest-even), signed."""
    v = e4m3_values()
    mid = (v[:-1] + v[1:]) / 2  # exact in float32 (5 significant bits)
    pick = mid[torch.randint(0, len(mid), (n,), generator=g)]
    return torch.where(torch.rand(n, generator=g) < 0.5, -pick, pick)


def special_rows(T: int, H: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[T, H] rows, row t of kind t % 8: plain, NaN, +-Inf, zeros (and -0), subnormal-range, tiny amax
    (subnormal float32 scale), rounding ties with amax 448 (scale 1), outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64) * 3
    last = H - 1
    for t in range(T):
        kind = t % 8
        if kind == 1:
            x[t, H // 3] = float("nan")
            x[t, last] = -float("nan")
        elif kind == 2:
            x[t, (2 * H) // 3] = float("inf")
            x[t, 0] = -float("inf")
        elif kind == 3:
            x[t] = 0.0
            x[t, last] = -0.0
        elif kind == 4:
            x[t] *= 1e-39  # float32 subnormals
        elif kind == 5:
            x[t] *= 3e-37  # amax / 448 is a float32 subnormal
        elif kind == 6:
            x[t] = tie_values(H, g).double()
            x[t, ::FP8_BLOCK] = 448.0  # every block: amax 448, scale exactly 1 (both scale kinds)
        elif kind == 7:
            x[t, torch.randint(0, H, (3,), generator=g)] = 1e3
            x[t, 0] = -6e4
    return x.to(dtype)


def assert_bits(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Equal bit patterns (so NaN payloads and -0.0 count), same dtype and shape."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    g, w = got.cpu().view(BITS[got.dtype]), want.cpu().view(BITS[want.dtype])
    if not torch.equal(g, w):
        bad = (g != w).nonzero()
        raise AssertionError(f"{what}: {len(bad)} elements differ, first at {bad[0].tolist()}: "
                             f"{got.cpu()[tuple(bad[0])]} vs {want.cpu()[tuple(bad[0])]}")


def _layout(H, ue8m0):
    return reference.packed_layout(H, ue8m0)


# ---------------------------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("H,ue8m0,want", [
    (512, False, 528), (512, True, 516), (7168, False, 7392), (7168, True, 7224), (1, False, 8), (1, True, 8),
    (7, False, 12), (7, True, 12), (128, False, 132), (130, False, 140), (130, True, 136), (5120, False, 5280),
    (0, False, 0), (0, True, 0)])
def test_packed_width(H, ue8m0, want):
    assert packed_width(H, ue8m0) == want == ops.packed_width(H, ue8m0=ue8m0)
    s0, n, sb, B = reference.packed_layout(H, ue8m0)
    assert B == want and s0 == -(-H // 4) * 4 and n == -(-H // 128) and sb == (1 if ue8m0 else 4) and B % 4 == 0


def test_worked_example():
    """The docstring example: x = [[896, -1]] -> s = 2, payload [0x7E, 0xB0], scale bytes of float32 2.0."""
    q = reference.quantize_rows(torch.tensor([[896.0, -1.0]]))
    assert q.tolist() == [[0x7E, 0xB0, 0, 0, 0x00, 0x00, 0x00, 0x40]]
    assert reference.dequantize_rows(q, 2, torch.float32).tolist() == [[896.0, -1.0]]
    q8 = reference.quantize_rows(torch.tensor([[896.0, -1.0]]), ue8m0=True)
    assert q8.tolist() == [[0x7E, 0xB0, 0, 0, 128, 0, 0, 0]]  # b = 128: s = 2^1


# ---------------------------------------------------------------------------------------------------
# bit-identical to the reference
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32_scales", "ue8m0"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_matches_reference(backend, dtype, ue8m0):
    impl, device = backend
    for H in HS:
        for T in TS:
            x_TH = special_rows(T, H, dtype, seed=H + T).to(device)
            want_TB = reference.quantize_rows(x_TH, ue8m0)
            got_TB = impl.quantize_rows(x_TH, ue8m0)
            assert_bits(got_TB, want_TB, f"packed bytes T={T} H={H}")
            # dequantize depends on the bytes and the output dtype only: each dtype is the output once
            assert_bits(impl.dequantize_rows(want_TB, H, dtype, ue8m0),
                        reference.dequantize_rows(want_TB, H, dtype, ue8m0), f"rows T={T} H={H}")


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32_scales", "ue8m0"])
def test_special_blocks(ue8m0):
    """What the reference (and so every backend) does with NaN / Inf / zero / tie blocks."""
    H = 300  # blocks of 128, 128, 44
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(1))
    x[0, 130] = float("nan")              # block 1 of row 0
    x[1, 5], x[1, 290] = float("inf"), -float("inf")  # blocks 0 and 2 of row 1
    x[2, :128] = 0.0                      # block 0 of row 2 all zero
    x[3, :128] = 0.0
    x[3, 0] = -0.0
    ties = torch.tensor([1.0625, 1.1875, -1.0625, 2 ** -10, 3 * 2 ** -10, 2 ** -10 + 2 ** -20, 232.0])
    x[4, :128] = 448.0                    # amax 448: scale exactly 1 (both kinds), the ties round on their own
    x[4, :7] = ties
    q = reference.quantize_rows(x, ue8m0)
    y = reference.dequantize_rows(q, H, torch.float32, ue8m0)
    nan = y.isnan()
    assert nan[0, 128:256].all() and not nan[0, :128].any() and not nan[0, 256:].any()
    assert nan[1, :128].all() and nan[1, 256:].all() and not nan[1, 128:256].any()
    assert not nan[2:].any()
    # a non-finite block leaves the other blocks as if it were not there
    clean = x[:2].clone()
    clean[0, 128:256], clean[1, :128], clean[1, 256:] = 0.0, 0.0, 0.0
    y_clean = reference.dequantize_rows(reference.quantize_rows(clean, ue8m0), H, torch.float32, ue8m0)
    assert torch.equal(y[0, :128], y_clean[0, :128]) and torch.equal(y[1, 128:256], y_clean[1, 128:256])
    # zero blocks: scale 1 (float32 1.0 or exponent 127), payload +0 / -0, decode to zeros
    s0, n, sb, _ = _layout(H, ue8m0)
    one = [127] if ue8m0 else [0x00, 0x00, 0x80, 0x3F]
    assert q[2, s0:s0 + sb].tolist() == one and q[3, s0:s0 + sb].tolist() == one
    assert (q[2, :128] == 0).all() and q[3, 0] == 0x80 and (y[2:4, :128] == 0).all()
    # ties to even; 2^-10 + 2^-20 is past the tie and rounds up; 232 is half-way between 224 and 240
    assert y[4, :7].tolist() == [1.0, 1.25, -1.0, 0.0, 2 ** -8, 2 ** -9, 224.0]


def test_nan_and_inf_scale_bytes():
    x = torch.ones(2, 130)
    x[0, 3] = float("nan")
    x[1, 3] = -float("inf")
    q32, q8 = reference.quantize_rows(x), reference.quantize_rows(x, ue8m0=True)
    s32 = q32[:, 132:140].contiguous().view(torch.int32)  # [2, 2] float32 scale bits
    assert s32[0, 0] == 0x7FC00000 and s32[1, 0] == 0x7F800000  # canonical NaN; inf / 448 = inf
    assert q8[:, 132].tolist() == [255, 255] and q8[:, 133].tolist() == [127 - 8, 127 - 8]  # 1/448 -> 2^-8


def test_nonfinite_decodes_to_canonical_nan(backend):
    impl, device = backend
    x = torch.randn(4, 200)
    x[0, 1], x[1, 150], x[2, 7], x[3, 199] = float("nan"), -float("nan"), float("inf"), -float("inf")
    for ue8m0 in (False, True):
        q = impl.quantize_rows(x.to(device), ue8m0)
        for dtype in FLOATS:
            y = impl.dequantize_rows(q, 200, dtype, ue8m0).cpu()
            canonical = torch.full((), float("nan"), dtype=dtype).view(BITS[dtype])
            assert (y.view(BITS[dtype])[y.isnan()] == canonical).all()
            assert int(y.isnan().sum()) == 128 + 72 + 128 + 72


# ---------------------------------------------------------------------------------------------------
# the element conversions, exhaustively
# ---------------------------------------------------------------------------------------------------
def _float32_of_bits(bits_i64: torch.Tensor) -> torch.Tensor:
    return torch.where(bits_i64 >= 2 ** 31, bits_i64 - 2 ** 32, bits_i64).to(torch.int32).view(torch.float32)


def conversion_inputs() -> torch.Tensor:
    """float32 values: every 4093rd bit pattern over all 2^32, +-(each e4m3 value and each midpoint between
    neighbours) +- up to 4 float32 ulps, the saturation edges 448 / 464 / 480 likewise, specials, random bits."""
    sweep = _float32_of_bits(torch.arange(0, 2 ** 32, 4093, dtype=torch.int64))
    v = e4m3_values()
    points = torch.cat([v, (v[:-1] + v[1:]) / 2, torch.tensor([464.0, 480.0, 2.0 ** -10, 2.0 ** -6])])
    near = (points.view(torch.int32).to(torch.int64)[:, None] + torch.arange(-4, 5)[None, :]).clamp(min=0)
    near = _float32_of_bits(near.flatten())
    rand = torch.randint(-2 ** 31, 2 ** 31, (1 << 20,), generator=torch.Generator().manual_seed(0),
                         dtype=torch.int64).to(torch.int32).view(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 1e-45, -1e-45,
                            3.4e38, -3.4e38])
    nan_payloads = torch.tensor([0x7F800001, 0x7FFFFFFF, -1, -0x7FFFFF], dtype=torch.int32).view(torch.float32)
    return torch.cat([sweep, near, -near, rand, special, nan_payloads])


def _torch_saturates() -> bool:
    """torch >= some 2.x converts finite overflow and inf to +-448 (older versions gave NaN)."""
    return torch.tensor([1e6, float("inf")]).to(E4M3).view(torch.uint8).tolist() == [0x7E, 0x7E]


@pytest.mark.parametrize("which", ["native", "triton"])
def test_e4m3_conversion_exhaustive(which):
    impl, device = _native_or_skip() if which == "native" else _triton_or_skip()
    f = conversion_inputs()
    if which == "native":
        got = impl._e4m3_from_f32(f)
    else:
        got = impl._e4m3_convert(f.to(device), to_f32=False).cpu()
    want = f.to(E4M3).view(torch.uint8)
    sat = (f.abs() > 448) & ~f.isnan()
    # the kernels saturate: +-448 for every non-NaN beyond 448 (the quantizer clamps to +-448 first anyway)
    assert torch.equal(got[sat], torch.where(f[sat] < 0, 0xFE, 0x7E).to(torch.uint8))
    keep = torch.ones_like(sat) if _torch_saturates() else ~sat
    bad = (got != want) & keep
    assert not bad.any(), f"{int(bad.sum())} differ: f={f[bad][:4].tolist()} got {got[bad][:4]} want {want[bad][:4]}"
    # and back: all 256 codes give torch's float32 bits (NaN 0x7F -> 0x7FF00000 with the sign)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    back = impl._e4m3_to_f32(codes) if which == "native" else impl._e4m3_convert(codes.to(device), to_f32=True)
    assert_bits(back.cpu(), codes.view(E4M3).to(torch.float32), "e4m3 -> float32")


# ---------------------------------------------------------------------------------------------------
# error bound
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32_scales", "ue8m0"])
@pytest.mark.parametrize("kind", ["randn", "outliers"])
def test_error_bound(kind, ue8m0):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 520, generator=g)
    if kind == "outliers":  # a few large values per row: most of their block lands in e4m3's subnormals
        for t in range(64):
            x[t, torch.randint(0, 520, (4,), generator=g)] = 1e3 * torch.randn(4, generator=g)
    y = ops.dequantize_rows(ops.quantize_rows(x, ue8m0=ue8m0, backend="torch"), 520, torch.float32,
                            ue8m0=ue8m0, backend="torch")
    err = (y.double() - x.double()).abs()
    bound = ops.fp8_error_bound(x, ue8m0=ue8m0)
    assert (err <= bound).all()
    s = reference.block_scales(x, ue8m0).double().repeat_interleave(FP8_BLOCK, dim=1)[:, :520]
    normal = (x.double() / s).abs() >= 2 ** -6
    assert (err[normal] <= 2 ** -4 * x.double().abs()[normal]).all()
    assert (err[~normal] <= 2 ** -10 * s[~normal] * (1 + 2 ** -20)).all()
    assert (err / bound).max() > 0.5  # the bound is not vacuous
    if kind == "outliers":
        assert (~normal).sum() > 100  # the absolute floor was exercised


def test_error_bound_marks_nonfinite_blocks():
    x = torch.ones(1, 256)
    x[0, 200] = float("inf")
    b = ops.fp8_error_bound(x)
    assert b[0, :128].isfinite().all() and b[0, 128:].isnan().all()


def extreme_amaxes(dtype: torch.dtype, stride: int = 1) -> torch.Tensor:
    """Positive finite block amaxes of ``dtype`` at the edges: bfloat16 / float16: the top 2048 finite values
    and every ``stride``-th below (stride 1: all of them, 32639 / 31743); for
    float32 the top 4096 values, +-8 ulps around 248 * 2^120 (rounds to 256 * 2^120 = inf without the top
    clamp) and 448 * 2^119 (the top scale's threshold), 3.3e38, 2000 log-uniform values over the whole
    range, and tiny ones (subnormals, amax / 448 subnormal or underflowing to 0)."""
    if dtype != torch.float32:
        end = 0x7C00 if dtype == torch.float16 else 0x7F80
        bits = torch.cat([torch.arange(1, end - 2048, stride), torch.arange(end - 2048, end)])
        return bits.to(torch.int16).view(dtype)
    top = torch.arange(0x7F7FFFFF - 4095, 0x7F7FFFFF + 1, dtype=torch.int32)
    near = [torch.tensor([248 * 2.0 ** 120, 448 * 2.0 ** 119]).view(torch.int32)[i] + torch.arange(-8, 9)
            for i in range(2)]
    g = torch.Generator().manual_seed(5)
    sweep = torch.exp2(torch.rand(2000, generator=g, dtype=torch.float64) * 277 - 149).float().view(torch.int32)
    tiny = torch.tensor([1e-45, 3e-45, 1e-40, 1.17e-38, 448 * 2.0 ** -126, 3.3e38]).view(torch.int32)
    return torch.cat([top, *near, sweep, tiny]).view(torch.float32).clamp_min(1e-45)


def extreme_rows(dtype: torch.dtype, stride: int = 1) -> torch.Tensor:
    """[T, 130] rows, two blocks each: block 0 has amax a (both signs, one per row of extreme_amaxes)
    mixed with a times uniform(-1, 1) (so with subnormal-range q), zeros and -0; block 1 is small;
    plus all-zero rows and a row of float32 / float16 subnormals."""
    a = extreme_amaxes(dtype, stride)
    T = len(a)
    g = torch.Generator().manual_seed(6)
    x = torch.rand(T, 130, generator=g, dtype=torch.float64) * 2 - 1
    x[:, 0] = 1.0
    x[1::2, 0] = -1.0
    x[:, 1:3] = 2.0 ** -30  # far below amax: e4m3 subnormals or 0 after scaling
    x[:, 3], x[:, 4] = 0.0, -0.0
    x = (x[:, :128] * a.double()[:, None]).to(dtype)  # products rounded to the dtype: |x| <= a still
    tail = (torch.rand(T, 2, generator=g) * 2 - 1).to(dtype)
    x = torch.cat([x, tail], dim=1)
    extra = torch.zeros(3, 130, dtype=dtype)
    extra[1] = torch.finfo(dtype).tiny * torch.linspace(-1, 1, 130).to(dtype)  # subnormal range
    extra[2, ::2] = torch.finfo(dtype).max  # max and -max in every block with zeros
    extra[2, 1::4] = -torch.finfo(dtype).max
    return torch.cat([x, extra])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("which", ["torch", "native", "triton"])
def test_ue8m0_extremes_stay_finite_and_within_the_bound(which, dtype):
    """#27.8: with ue8m0 scales every finite row comes back finite (in float32 and in its own dtype) and
    within fp8_error_bound, up to the dtype's max: at the top scale (2^120; float16: 2^8) x / s in
    [248, 256) used to round to 256 and 256 * s overflow to inf. Every backend writes the reference's bytes."""
    impl, device = (reference, torch.device("cpu")) if which == "torch" else \
        (_native_or_skip() if which == "native" else _triton_or_skip())
    x = extreme_rows(dtype, stride=16 if which == "triton" else 1)  # the interpreter: ~1 ms per row
    H = x.shape[1]
    q = impl.quantize_rows(x.to(device), True).cpu()
    if which != "torch":
        assert_bits(q, reference.quantize_rows(x, True), f"packed bytes ({which})")
    y32 = impl.dequantize_rows(q.to(device), H, torch.float32, True).cpu()
    assert y32.isfinite().all(), x[~y32.isfinite()][:4]
    err = (y32.double() - x.double()).abs()
    bound = ops.fp8_error_bound(x, ue8m0=True)
    assert (err <= bound).all(), (x[err > bound][:4], y32[err > bound][:4])
    assert (err / bound).max() > 0.9  # the extremes press on the bound: 240 * s for x -> 256 * s is 2^-4 off
    y = impl.dequantize_rows(q.to(device), H, dtype, True).cpu()
    assert y.isfinite().all(), x[~y.isfinite()][:4]
    assert_bits(y, y32.to(dtype), f"rows in {dtype} ({which})")
    amax_max = x[-1].abs().max()
    assert y[-1].abs().max() <= amax_max and y[-1, 0] == -y[-1, 1]  # max and -max: finite, symmetric


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_float32_scales_at_the_extremes_stay_finite(dtype):
    """float32 scales never overflowed (q <= 448 and 448 * (amax / 448) rounds to amax); kept that way."""
    x = extreme_rows(dtype)
    y = reference.dequantize_rows(reference.quantize_rows(x), x.shape[1], dtype)
    assert y.isfinite().all()


# ---------------------------------------------------------------------------------------------------
# out= buffers, launch variants, integration
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32_scales", "ue8m0"])
def test_out_buffers(backend, ue8m0):
    impl, device = backend
    T, H = 5, 300
    B = packed_width(H, ue8m0)
    x = special_rows(T, H, torch.bfloat16, seed=3).to(device)
    want = reference.quantize_rows(x, ue8m0)
    out = torch.full((T, B), 0xAB, dtype=torch.uint8, device=device)  # every byte must be written
    assert impl.quantize_rows(x, ue8m0, out=out) is out
    assert_bits(out, want, "contiguous out")
    wide = torch.full((T, B + 8), 0xAB, dtype=torch.uint8, device=device)
    res = impl.quantize_rows(x, ue8m0, out=wide[:, 4:4 + B])
    assert_bits(res, want, "strided out")
    assert (wide[:, :4] == 0xAB).all() and (wide[:, 4 + B:] == 0xAB).all()
    want_y = reference.dequantize_rows(want, H, torch.float16, ue8m0)
    out_y = torch.empty(T, H, dtype=torch.float16, device=device)
    assert impl.dequantize_rows(want, H, torch.float16, ue8m0, out=out_y) is out_y
    assert_bits(out_y, want_y, "dequantize out")
    out_yt = torch.zeros(H, T, dtype=torch.float16, device=device).t()  # column-major
    assert_bits(impl.dequantize_rows(want, H, torch.float16, ue8m0, out=out_yt), want_y, "non-contiguous out")
    # strided inputs: rows of a wider buffer
    x_wide = torch.zeros(T, H + 3, dtype=torch.bfloat16, device=device)
    x_wide[:, :H] = x
    assert_bits(impl.quantize_rows(x_wide[:, :H], ue8m0), want, "strided x_TH")
    assert_bits(impl.dequantize_rows(wide[:, 4:4 + B], H, torch.float16, ue8m0), want_y, "strided q_RB")


@pytest.mark.parametrize("use_avx2", [False, True], ids=["generic", "avx2"])
def test_native_loop_copies(use_avx2):
    _native_or_skip()
    before = native._quant_config()
    try:
        try:
            native._quant_config(use_avx2)
        except ValueError:
            pytest.skip("this CPU or build has no AVX2 path")
        for dtype in FLOATS:
            for ue8m0 in (False, True):
                x = special_rows(33, 300, dtype, seed=11)
                q = native.quantize_rows(x, ue8m0)
                assert_bits(q, reference.quantize_rows(x, ue8m0), f"{dtype} ue8m0={ue8m0}")
                assert_bits(native.dequantize_rows(q, 300, dtype, ue8m0),
                            reference.dequantize_rows(q, 300, dtype, ue8m0), f"{dtype} ue8m0={ue8m0}")
    finally:
        native._quant_config(before)


@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_triton_programs_split_and_span_rows(blocks):
    """BLOCKS (row, block) pairs per program: 1 and 2 split a row of 3 blocks over programs, 4 spans rows."""
    impl, device = _triton_or_skip()
    T, H = 3, 300
    x = special_rows(T, H, torch.float32, seed=5).to(device)
    for ue8m0 in (False, True):
        want = reference.quantize_rows(x, ue8m0)
        out = torch.full_like(want, 0xAB)
        impl._launch_quantize(x, ue8m0, out, blocks=blocks)
        assert_bits(out, want, f"blocks={blocks}")
        y = torch.empty(T, H, device=device)
        impl._launch_dequantize(want, H, ue8m0, y, blocks=blocks)
        assert_bits(y, reference.dequantize_rows(want, H, torch.float32, ue8m0), f"blocks={blocks}")


def test_packed_rows_survive_the_byte_permute(backend):
    """Quantize once, move the packed rows with the uint8 row permute, dequantize: the same rows as
    dequantizing first and permuting the result."""
    impl, device = backend
    x = special_rows(9, 260, torch.bfloat16, seed=9).to(device)
    token_N = torch.tensor([8, 0, 3, 3, 7, 1, 0], device=device)
    for ue8m0 in (False, True):
        q = impl.quantize_rows(x, ue8m0)
        moved = impl.permute_rows(q, token_N)
        assert_bits(impl.dequantize_rows(moved, 260, torch.bfloat16, ue8m0),
                    reference.dequantize_rows(q, 260, torch.bfloat16, ue8m0).index_select(0, token_N), "moved")


def test_roundtrip_exact_for_representable_rows():
    """Rows that are e4m3 values times a power-of-two scale come back exactly (any scale kind)."""
    v = e4m3_values()
    g = torch.Generator().manual_seed(2)
    q = v[torch.randint(0, len(v), (4, 256), generator=g)] * torch.where(torch.rand(4, 256, generator=g) < .5, -1, 1)
    q[:, ::128] = 448.0  # amax 448 in every block: s = 2^3 exactly after the 8x below
    x = q * 8
    for ue8m0 in (False, True):
        for name in ("torch", "native", "triton") if TRITON_DEVICE is not None else ("torch", "native"):
            xd = x.to(TRITON_DEVICE) if name == "triton" else x
            y = ops.dequantize_rows(ops.quantize_rows(xd, ue8m0=ue8m0, backend=name), 256, torch.float32,
                                    ue8m0=ue8m0, backend=name)
            assert torch.equal(y.cpu(), x), name


# ---------------------------------------------------------------------------------------------------
# the public wrappers
# ---------------------------------------------------------------------------------------------------
def test_ops_backends_agree():
    x = special_rows(17, 200, torch.float16, seed=4)
    want = reference.quantize_rows(x, True)
    for name in ("auto", "torch", "native"):
        assert_bits(ops.quantize_rows(x, ue8m0=True, backend=name), want, name)
        assert_bits(ops.dequantize_rows(want, 200, torch.float16, ue8m0=True, backend=name),
                    reference.dequantize_rows(want, 200, torch.float16, True), name)
    xg = x.clone().requires_grad_(True).float()
    q = ops.quantize_rows(xg)  # no autograd: nothing to record
    assert not q.requires_grad and not ops.dequantize_rows(q, 200, torch.float32).requires_grad


QUANT_ERRORS = [
    ("x_TH int", dict(x_TH=torch.zeros(2, 4, dtype=torch.int32)), TypeError, r"x_TH must have dtype in"),
    ("x_TH 1-D", dict(x_TH=torch.zeros(4)), ValueError, r"x_TH must be 2-D, got shape \(4,\)"),
    ("ue8m0 int", dict(ue8m0=1), TypeError, r"ue8m0 must be a bool, got 1"),
    ("out dtype", dict(out=torch.zeros(2, 12, dtype=torch.int8)), TypeError, r"out must have dtype uint8"),
    ("out shape", dict(out=torch.zeros(2, 11, dtype=torch.uint8)), ValueError, r"out must have shape \[2, 12\]"),
    ("backend", dict(backend="gpu"), ValueError, r"backend must be one of"),
]


@pytest.mark.parametrize("case", QUANT_ERRORS, ids=[c[0] for c in QUANT_ERRORS])
def test_quantize_errors_name_the_argument(case):
    _, kwargs, exc, match = case
    args = dict(x_TH=torch.zeros(2, 7))
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        ops.quantize_rows(args.pop("x_TH"), **args)


DEQUANT_ERRORS = [
    ("q_RB float", dict(q_RB=torch.zeros(3, 528)), TypeError, r"q_RB must have dtype in \(uint8\), got torch.float32"),
    ("q_RB fp8", dict(q_RB=torch.zeros(3, 528, dtype=torch.uint8).view(E4M3)), TypeError, r"q_RB must have dtype"),
    ("q_RB width", dict(q_RB=torch.zeros(3, 516, dtype=torch.uint8)), ValueError,
     r"q_RB must have shape \[\*, 528\] \(packed_width\(hidden=512, ue8m0=False\)\), got \(3, 516\)"),
    ("q_RB ue8m0 width", dict(q_RB=torch.zeros(3, 528, dtype=torch.uint8), ue8m0=True), ValueError,
     r"q_RB must have shape \[\*, 516\] \(packed_width\(hidden=512, ue8m0=True\)\)"),
    ("q_RB 1-D", dict(q_RB=torch.zeros(528, dtype=torch.uint8)), ValueError, r"q_RB must be 2-D"),
    ("hidden negative", dict(hidden=-1), ValueError, r"hidden must be >= 0, got -1"),
    ("hidden float", dict(hidden=512.0), TypeError, r"hidden must be an int"),
    ("dtype int", dict(dtype=torch.int32), TypeError, r"dtype must be one of \(float32, float64, bfloat16, float16\)"),
    ("dtype str", dict(dtype="float32"), TypeError, r"dtype must be one of"),
    ("out dtype", dict(out=torch.zeros(3, 512, dtype=torch.float16)), TypeError, r"out must have dtype float32"),
    ("out shape", dict(out=torch.zeros(3, 511)), ValueError, r"out must have shape \[3, 512\]"),
]


@pytest.mark.parametrize("case", DEQUANT_ERRORS, ids=[c[0] for c in DEQUANT_ERRORS])
def test_dequantize_errors_name_the_argument(case):
    _, kwargs, exc, match = case
    args = dict(q_RB=torch.zeros(3, 528, dtype=torch.uint8), hidden=512, dtype=torch.float32)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        ops.dequantize_rows(args.pop("q_RB"), args.pop("hidden"), args.pop("dtype"), **args)


def test_backend_launchers_check_too(backend):
    impl, device = backend
    with pytest.raises(ValueError, match=r"q_RB must have shape \[\*, 12\]"):
        impl.dequantize_rows(torch.zeros(2, 8, dtype=torch.uint8, device=device), 7, torch.float32)
    with pytest.raises(TypeError, match=r"q_RB must have dtype in \(uint8\)"):
        impl.dequantize_rows(torch.zeros(2, 12, dtype=torch.int32, device=device), 7, torch.float32)
    with pytest.raises(TypeError, match=r"x_TH must have dtype in"):
        impl.quantize_rows(torch.zeros(2, 7, dtype=torch.int64, device=device))
