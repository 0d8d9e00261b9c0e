"""Tier 1: pure logic; Triton kernels under TRITON_INTERPRET=1 on CPU.

Every kernel in ``moe_comm.kernels.triton_ops`` is checked against the pure-torch oracle
``moe_comm.kernels.reference``: permute bit-exact, unpermute and its weight gradient close (float32
rtol 1e-6). Shapes stay small (T <= 64, H <= 96, plus a few rows wide enough for several column
blocks) because the interpreter runs each program in Python.

Shapes legend: T tokens, K top-k slots, N routed rows, H hidden size, E experts.

The default session (``-m "not gpu"``) runs the kernels on CPU tensors in the interpreter, on CPU and
CUDA machines alike (tests/conftest.py sets TRITON_INTERPRET=1 unless only ``gpu`` tests are selected).
With TRITON_INTERPRET=0 on a CUDA machine the same small checks run compiled on CUDA tensors; ``TestGpu``
(marker ``gpu``, tier 3: ``pytest -m gpu``) adds large shapes, including N*H > 2^31 for the int64 offsets.
"""
import os

import torch

# Must happen before anything imports triton (tests/conftest.py decides first, at pytest_configure; this
# covers running the module without it). On a CUDA machine the choice is conftest's.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not importable")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from moe_comm.kernels import reference, triton_ops  # noqa: E402
from moe_comm.ops.layout import make_layout  # noqa: E402

if triton_ops._interpreting():
    DEVICE = torch.device("cpu")
elif torch.cuda.is_available():
    DEVICE = torch.device("cuda")
else:
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set and there is no CUDA device",
                allow_module_level=True)

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# (rtol, atol) for unpermute outputs, compared in float64. The interpreter matches the reference bit
# for bit; the slack covers a GPU fusing multiply-add (and then 1 ulp of a half-precision result).
TOL = {torch.float32: (1e-6, 1e-6), torch.float64: (1e-12, 1e-12),
       torch.bfloat16: (2 ** -7, 1e-6), torch.float16: (2 ** -10, 1e-6)}


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
def routing(T, K, E, *, drop=0.0, used_experts=None, seed=0, device=DEVICE):
    """(token_N, row_TK, N) from make_layout on random top-k; ``used_experts`` limits routing to the
    first few experts so the others get zero tokens (their rows are simply absent)."""
    g = torch.Generator().manual_seed(seed)
    used = E if used_experts is None else used_experts
    scores_TE = torch.rand(T, E, generator=g)
    scores_TE[:, used:] = -1.0
    topk_idx_TK = scores_TE.topk(K, dim=1).indices if K <= E else torch.randint(0, used, (T, K), generator=g)
    if drop:
        topk_idx_TK[torch.rand(T, K, generator=g) < drop] = -1
    layout = make_layout(topk_idx_TK, num_experts=E, backend="torch")
    N = layout.num_rows
    return layout.token_N.to(device), layout.dest_row_TK.to(device), N


def randn(*shape, dtype=torch.float32, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(device)


def weights(row_TK, dtype=torch.float32, seed=1):
    """Random weights; dropped slots get NaN, so a kernel that reads them shows it."""
    w_TK = torch.rand(row_TK.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    w_TK = w_TK.to(dtype).to(row_TK.device)
    return torch.where(row_TK >= 0, w_TK, torch.full_like(w_TK, float("nan")))


def assert_bitwise(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    if not torch.equal(got, want):
        bad = (got != want).any(dim=1).nonzero().flatten().tolist()
        raise AssertionError(f"rows {bad[:10]} differ (of {got.shape[0]}); first: {got[bad[0]][:8]} vs {want[bad[0]][:8]}")


def assert_close(got, want, dtype=None):
    rtol, atol = TOL[dtype or want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol, equal_nan=False)


def grad_tol(dtype, H):
    """Weight-grad tolerance: float32 dot products of length H summed in another order than torch's."""
    return (1e-12, 1e-12) if dtype == torch.float64 else (1e-5, 1e-6 * H)


# ---------------------------------------------------------------------------------------------------
# permute_rows
# ---------------------------------------------------------------------------------------------------
class TestPermute:
    @pytest.mark.parametrize("dtype", FLOATS, ids=str)
    @pytest.mark.parametrize("scale_dtype", [None, torch.float32, torch.float64], ids=str)
    def test_bitwise_vs_reference(self, dtype, scale_dtype):
        T, K, E, H = 24, 2, 6, 96
        token_N, _, N = routing(T, K, E, drop=0.2)
        x_TH = randn(T, H, dtype=dtype)
        scale_N = None if scale_dtype is None else (randn(N, dtype=scale_dtype, seed=3) * 3)
        assert_bitwise(triton_ops.permute_rows(x_TH, token_N, scale_N), reference.permute_rows(x_TH, token_N, scale_N))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
    def test_payload_names_its_token(self, dtype):
        T, K, E, H = 40, 3, 8, 72
        token_N, _, N = routing(T, K, E, drop=0.1, seed=5)
        # x[t, h] = 256 t + h: every value says which token and column it came from (exact in fp32)
        x_TH = (torch.arange(T, dtype=dtype)[:, None] * 256 + torch.arange(H, dtype=dtype)).to(DEVICE)
        x_NH = triton_ops.permute_rows(x_TH, token_N)
        assert torch.equal((x_NH[:, 0] // 256).long(), token_N)
        assert torch.equal(x_NH % 256, torch.arange(H, dtype=dtype, device=DEVICE).expand(N, H))

    @pytest.mark.parametrize("dtype,H", [(torch.float32, 2100), (torch.bfloat16, 4100)], ids=str)
    def test_several_column_blocks(self, dtype, H):
        # BLOCK_H is 1024 (fp32) / 2048 (bf16): three column blocks, the last one partly masked
        token_N = torch.tensor([3, 0, 2, 3, 1, 0], device=DEVICE)
        x_TH = randn(4, H, dtype=dtype)
        scale_N = randn(6, seed=2)
        assert_bitwise(triton_ops.permute_rows(x_TH, token_N, scale_N), reference.permute_rows(x_TH, token_N, scale_N))

    def test_bf16_rounds_to_nearest_even(self):
        # products at and around bf16 half-way points, plus inf/zero/subnormal: same bits as torch
        v_N = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -8 + 2 ** -20, 2 - 2 ** -9,
                            3.4e38, -3.4e38, 0.0, -0.0, 1e-40, 1.5e-39, float("inf")], device=DEVICE)
        x_TH = torch.ones(1, 16, dtype=torch.bfloat16, device=DEVICE)
        token_N = torch.zeros(len(v_N), dtype=torch.int64, device=DEVICE)
        assert_bitwise(triton_ops.permute_rows(x_TH, token_N, v_N), reference.permute_rows(x_TH, token_N, v_N))

    def test_out_buffers(self):
        T, H = 10, 48
        token_N = torch.tensor([9, 0, 4, 4, 7], device=DEVICE)
        x_TH = randn(T, H)
        want = reference.permute_rows(x_TH, token_N)
        out = torch.empty(5, H, device=DEVICE)
        assert triton_ops.permute_rows(x_TH, token_N, out=out) is out
        assert_bitwise(out, want)
        wide = torch.full((5, H + 16), -7.0, device=DEVICE)  # rows strided, columns dense
        assert triton_ops.permute_rows(x_TH, token_N, out=wide[:, 8:H + 8]) is not None
        assert_bitwise(wide[:, 8:H + 8], want)
        assert (wide[:, :8] == -7).all() and (wide[:, H + 8:] == -7).all()
        out_t = torch.empty(H, 5, device=DEVICE).t()  # columns strided: written through a copy
        assert triton_ops.permute_rows(x_TH, token_N, out=out_t) is out_t
        assert_bitwise(out_t, want)

    def test_noncontiguous_inputs(self):
        T, H = 12, 40
        x_HT = randn(H, T)
        x_TH = x_HT.t()  # columns strided
        x_wide = randn(T, 2 * H)[:, 5:H + 5]  # rows strided, columns dense (no copy)
        token_N = torch.tensor([11, 0, 3, 3, 5, 2, 7, 0], device=DEVICE)[::2]
        scale_N = randn(8, seed=4)[1::2]
        for x in (x_TH, x_wide):
            assert_bitwise(triton_ops.permute_rows(x, token_N, scale_N), reference.permute_rows(x, token_N, scale_N))
            assert_bitwise(triton_ops.permute_rows(x, token_N), reference.permute_rows(x, token_N))

    @pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.int64], ids=str)
    def test_integer_payload(self, dtype):
        x_TH = torch.randint(0, 100, (6, 20), dtype=dtype, device=DEVICE)
        token_N = torch.tensor([5, 1, 1, 0], device=DEVICE)
        assert_bitwise(triton_ops.permute_rows(x_TH, token_N), reference.permute_rows(x_TH, token_N))
        with pytest.raises(TypeError, match="x_TH"):
            triton_ops.permute_rows(x_TH, token_N, torch.ones(4, device=DEVICE))

    def test_empty(self):
        x_TH = randn(5, 8)
        assert triton_ops.permute_rows(x_TH, torch.empty(0, dtype=torch.int64, device=DEVICE)).shape == (0, 8)
        assert triton_ops.permute_rows(randn(5, 0), torch.tensor([1, 2], device=DEVICE)).shape == (2, 0)
        assert triton_ops.permute_rows(randn(0, 8), torch.empty(0, dtype=torch.int64, device=DEVICE)).shape == (0, 8)
        with pytest.raises(ValueError, match="T=0"):
            triton_ops.permute_rows(randn(0, 8), torch.tensor([0], device=DEVICE))

    def test_docstring_example(self):
        x_TH = torch.tensor([[1.0, 1.0], [2.0, 2.0]], device=DEVICE)
        token_N = torch.tensor([1, 0, 1], device=DEVICE)
        assert triton_ops.permute_rows(x_TH, token_N).tolist() == [[2, 2], [1, 1], [2, 2]]
        got = triton_ops.permute_rows(x_TH, token_N, torch.tensor([0.5, 1.0, 2.0], device=DEVICE))
        assert got.tolist() == [[1, 1], [1, 1], [4, 4]]


# ---------------------------------------------------------------------------------------------------
# unpermute_rows
# ---------------------------------------------------------------------------------------------------
class TestUnpermute:
    @pytest.mark.parametrize("dtype", FLOATS, ids=str)
    @pytest.mark.parametrize("weight_dtype", [None, torch.float32, torch.float64], ids=str)
    def test_close_to_reference(self, dtype, weight_dtype):
        T, K, E, H = 24, 2, 6, 96
        _, row_TK, N = routing(T, K, E, drop=0.25, seed=7)
        assert (row_TK < 0).any()
        y_NH = randn(N, H, dtype=dtype)
        weight_TK = None if weight_dtype is None else weights(row_TK, weight_dtype)
        assert_close(triton_ops.unpermute_rows(y_NH, row_TK, weight_TK), reference.unpermute_rows(y_NH, row_TK, weight_TK))

    @pytest.mark.parametrize("K", [1, 2, 3])
    def test_topk_and_empty_experts(self, K):
        T, E, H = 17, 8, 33
        _, row_TK, N = routing(T, K, E, used_experts=3, drop=0.1, seed=K)  # experts 3..7 get no rows
        y_NH = randn(N, H, seed=K)
        weight_TK = weights(row_TK)
        assert_close(triton_ops.unpermute_rows(y_NH, row_TK, weight_TK), reference.unpermute_rows(y_NH, row_TK, weight_TK))
        assert_close(triton_ops.unpermute_rows(y_NH, row_TK), reference.unpermute_rows(y_NH, row_TK))

    def test_round_trip_sums_the_slots(self):
        # permute then unpermute with unit weights: token t comes back times its routed slot count
        T, K, E, H = 20, 3, 5, 24
        token_N, row_TK, _ = routing(T, K, E, drop=0.3, seed=11)
        x_TH = (torch.arange(T, dtype=torch.float32)[:, None] * 256 + torch.arange(H)).to(DEVICE)
        back_TH = triton_ops.unpermute_rows(triton_ops.permute_rows(x_TH, token_N), row_TK)
        assert torch.equal(back_TH, x_TH * (row_TK >= 0).sum(1, keepdim=True).float())

    def test_nothing_routed_and_empty(self):
        H = 16
        row_TK = torch.full((4, 2), -1, dtype=torch.int64, device=DEVICE)
        out = torch.full((4, H), 3.0, device=DEVICE)
        assert triton_ops.unpermute_rows(randn(0, H), row_TK, weights(row_TK), out=out) is out
        assert (out == 0).all()
        assert (triton_ops.unpermute_rows(randn(0, H), row_TK) == 0).all()
        assert (triton_ops.unpermute_rows(randn(3, H), torch.empty(4, 0, dtype=torch.int64, device=DEVICE)) == 0).all()
        assert triton_ops.unpermute_rows(randn(3, H), torch.empty(0, 2, dtype=torch.int64, device=DEVICE)).shape == (0, H)
        # all slots dropped but rows exist (N > 0): zeros through the kernel
        assert (triton_ops.unpermute_rows(randn(3, H), row_TK, weights(row_TK)) == 0).all()

    def test_several_column_blocks(self):
        H = 2100
        row_TK = torch.tensor([[2, -1], [0, 1], [-1, -1]], device=DEVICE)
        y_NH = randn(3, H, dtype=torch.bfloat16)
        weight_TK = weights(row_TK)
        assert_close(triton_ops.unpermute_rows(y_NH, row_TK, weight_TK), reference.unpermute_rows(y_NH, row_TK, weight_TK))

    def test_noncontiguous_inputs_and_out(self):
        T, K, E, H = 16, 3, 6, 40
        _, row_TK, N = routing(T, K, E, drop=0.2, seed=13)
        y_wide = randn(N, H + 24)[:, 24:]  # rows strided
        y_t = randn(H, N).t()  # columns strided
        row_KT = row_TK.t().contiguous().t()  # same values, transposed strides
        weight_TK = weights(row_TK).t().contiguous().t()
        for y_NH in (y_wide, y_t):
            want = reference.unpermute_rows(y_NH, row_TK, weight_TK)
            assert_close(triton_ops.unpermute_rows(y_NH, row_KT, weight_TK), want)
            out_t = torch.empty(H, T, device=DEVICE).t()
            assert triton_ops.unpermute_rows(y_NH, row_KT, weight_TK, out=out_t) is out_t
            assert_close(out_t, want)

    def test_docstring_example(self):
        y_NH = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]], device=DEVICE)
        row_TK = torch.tensor([[2, 0], [1, -1]], device=DEVICE)
        weight_TK = torch.tensor([[0.5, 1.0], [2.0, 9.0]], device=DEVICE)
        assert triton_ops.unpermute_rows(y_NH, row_TK, weight_TK).tolist() == [[2.5, 2.5], [4, 4]]


# ---------------------------------------------------------------------------------------------------
# unpermute_weight_grad
# ---------------------------------------------------------------------------------------------------
class TestWeightGrad:
    @pytest.mark.parametrize("dtype", FLOATS, ids=str)
    def test_close_to_reference(self, dtype):
        T, K, E, H = 16, 3, 6, 96
        _, row_TK, N = routing(T, K, E, drop=0.2, seed=17)
        grad_TH, y_NH = randn(T, H, dtype=dtype, seed=1), randn(N, H, dtype=dtype, seed=2)
        got = triton_ops.unpermute_weight_grad(grad_TH, y_NH, row_TK)
        want = reference.unpermute_weight_grad(grad_TH, y_NH, row_TK)
        assert got.dtype == reference.acc_dtype(dtype)
        assert (got[row_TK < 0] == 0).all()
        rtol, atol = grad_tol(dtype, H)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)

    def test_several_column_blocks_and_noncontiguous(self):
        H = 2100  # fp32: BLOCK_H 1024, the kernel walks three blocks
        row_TK = torch.tensor([[2, -1], [0, 1], [-1, -1]], device=DEVICE)
        grad_TH = randn(H, 3, seed=1).t()
        y_NH = randn(3, H + 10, seed=2)[:, 10:]
        got = triton_ops.unpermute_weight_grad(grad_TH, y_NH, row_TK.t().contiguous().t())
        rtol, atol = grad_tol(torch.float32, H)
        torch.testing.assert_close(got, reference.unpermute_weight_grad(grad_TH, y_NH, row_TK), rtol=rtol, atol=atol)

    def test_empty(self):
        H = 8
        row_TK = torch.full((3, 2), -1, dtype=torch.int64, device=DEVICE)
        assert (triton_ops.unpermute_weight_grad(randn(3, H), randn(0, H), row_TK) == 0).all()
        empty_T = torch.empty(0, 2, dtype=torch.int64, device=DEVICE)
        assert triton_ops.unpermute_weight_grad(randn(0, H), randn(4, H), empty_T).shape == (0, 2)
        got = triton_ops.unpermute_weight_grad(randn(3, H, dtype=torch.float64), randn(2, H, dtype=torch.float64), row_TK)
        assert got.dtype == torch.float64 and (got == 0).all()

    def test_docstring_example(self):
        got = triton_ops.unpermute_weight_grad(torch.tensor([[1.0, 2.0]], device=DEVICE),
                                               torch.tensor([[3.0, 4.0], [5.0, 6.0]], device=DEVICE),
                                               torch.tensor([[1, -1]], device=DEVICE))
        assert got.tolist() == [[17.0, 0.0]]


# ---------------------------------------------------------------------------------------------------
# all three against the reference on random routings
# ---------------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(0, 12), K=st.integers(1, 3), E=st.integers(1, 6), H=st.integers(1, 40),
       drop=st.sampled_from([0.0, 0.3, 1.0]), dtype=st.sampled_from(FLOATS), seed=st.integers(0, 2 ** 16))
def test_random_routings_match_reference(T, K, E, H, drop, dtype, seed):
    token_N, row_TK, N = routing(T, K, E, drop=drop, seed=seed)
    x_TH = randn(T, H, dtype=dtype, seed=seed)
    scale_N = randn(N, seed=seed + 1)
    x_NH = triton_ops.permute_rows(x_TH, token_N, scale_N)
    assert_bitwise(x_NH, reference.permute_rows(x_TH, token_N, scale_N))
    weight_TK = weights(row_TK, seed=seed)
    grad_TH = randn(T, H, dtype=dtype, seed=seed + 2)
    if N == 0:  # the reference cannot index an empty y_NH; nothing routed means zeros
        want_TH = torch.zeros(T, H, dtype=dtype, device=DEVICE)
        want_TK = torch.zeros(T, K, dtype=reference.acc_dtype(dtype), device=DEVICE)
    else:
        want_TH = reference.unpermute_rows(x_NH, row_TK, weight_TK)
        want_TK = reference.unpermute_weight_grad(grad_TH, x_NH, row_TK)
    assert_close(triton_ops.unpermute_rows(x_NH, row_TK, weight_TK), want_TH, dtype)
    rtol, atol = grad_tol(dtype, H)
    torch.testing.assert_close(triton_ops.unpermute_weight_grad(grad_TH, x_NH, row_TK), want_TK, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------------
# validation: errors name the argument and say got vs expected; nothing is launched
# ---------------------------------------------------------------------------------------------------
def _t(*shape, dtype=torch.float32, device=DEVICE):
    return torch.zeros(*shape, dtype=dtype, device=device)


IDX = torch.int64
BAD_CALLS = [
    ("permute x 1-D", lambda: triton_ops.permute_rows(_t(4), _t(2, dtype=IDX)), ValueError, "x_TH must be 2-D"),
    ("permute x list", lambda: triton_ops.permute_rows([[1.0]], _t(2, dtype=IDX)), TypeError, "x_TH must be a torch.Tensor"),
    ("permute token int32", lambda: triton_ops.permute_rows(_t(4, 8), _t(2, dtype=torch.int32)), TypeError, "token_N.*int32"),
    ("permute token 2-D", lambda: triton_ops.permute_rows(_t(4, 8), _t(2, 1, dtype=IDX)), ValueError, "token_N must be 1-D"),
    ("permute bool x", lambda: triton_ops.permute_rows(_t(4, 8, dtype=torch.bool), _t(2, dtype=IDX)), TypeError, "x_TH.*bool"),
    ("permute scale len", lambda: triton_ops.permute_rows(_t(4, 8), _t(2, dtype=IDX), _t(3)), ValueError, r"scale_N must have shape \[2\] \(token_N's length\), got \(3,\)"),
    ("permute scale fp16", lambda: triton_ops.permute_rows(_t(4, 8), _t(2, dtype=IDX), _t(2, dtype=torch.float16)), TypeError, "scale_N.*float16"),
    ("permute out shape", lambda: triton_ops.permute_rows(_t(4, 8), _t(2, dtype=IDX), out=_t(3, 8)), ValueError, r"out must have shape \[2, 8\], got \(3, 8\)"),
    ("permute out dtype", lambda: triton_ops.permute_rows(_t(4, 8), _t(2, dtype=IDX), out=_t(2, 8, dtype=torch.float64)), TypeError, "out must have x_TH's dtype"),
    ("permute token device", lambda: triton_ops.permute_rows(_t(4, 8), _t(2, dtype=IDX, device="meta")), ValueError, "token_N must be on x_TH's device"),
    ("unpermute y int", lambda: triton_ops.unpermute_rows(_t(4, 8, dtype=torch.int32), _t(2, 2, dtype=IDX)), TypeError, "y_NH.*int32"),
    ("unpermute row 1-D", lambda: triton_ops.unpermute_rows(_t(4, 8), _t(2, dtype=IDX)), ValueError, "row_TK must be 2-D"),
    ("unpermute weight shape", lambda: triton_ops.unpermute_rows(_t(4, 8), _t(2, 2, dtype=IDX), _t(2, 3)), ValueError, r"weight_TK must have shape \[2, 2\] \(row_TK's shape\), got \(2, 3\)"),
    ("unpermute weight bf16", lambda: triton_ops.unpermute_rows(_t(4, 8), _t(2, 2, dtype=IDX), _t(2, 2, dtype=torch.bfloat16)), TypeError, "weight_TK.*bfloat16"),
    ("unpermute out shape", lambda: triton_ops.unpermute_rows(_t(4, 8), _t(2, 2, dtype=IDX), out=_t(4, 8)), ValueError, r"out must have shape \[2, 8\], got \(4, 8\)"),
    ("unpermute weight device", lambda: triton_ops.unpermute_rows(_t(4, 8), _t(2, 2, dtype=IDX), _t(2, 2, device="meta")), ValueError, "weight_TK must be on y_NH's device"),
    ("grad shape", lambda: triton_ops.unpermute_weight_grad(_t(3, 8), _t(4, 8), _t(2, 2, dtype=IDX)), ValueError, r"grad_TH must have shape \[2, 8\] \(\[T, H\] from row_TK and y_NH\), got \(3, 8\)"),
    ("grad row dtype", lambda: triton_ops.unpermute_weight_grad(_t(2, 8), _t(4, 8), _t(2, 2, dtype=torch.float32)), TypeError, "row_TK.*float32"),
    ("grad y int", lambda: triton_ops.unpermute_weight_grad(_t(2, 8), _t(4, 8, dtype=torch.int64), _t(2, 2, dtype=IDX)), TypeError, "y_NH.*int64"),
]


@pytest.mark.parametrize("call,exc,match", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_names_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_available():
    assert triton_ops.available()


# ---------------------------------------------------------------------------------------------------
# tier 3: compiled kernels on CUDA at realistic shapes
# ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(triton_ops._interpreting(), reason="TRITON_INTERPRET=1 would run the interpreter, not the compiled kernels")
class TestGpu:
    """Tier 3 (gpu): the same checks compiled on CUDA at large shapes; also run by benchmarks/gpu_check.py."""

    TOL_GPU = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2 ** -7, 1e-5)}  # FMA in the accumulation

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
    @pytest.mark.parametrize("T,H,K,E", [(4096, 7168, 8, 256), (2048, 2048, 2, 16)])
    def test_kernels_match_reference(self, dtype, T, H, K, E):
        dev = torch.device("cuda")
        token_N, row_TK, N = routing(T, K, E, drop=0.05, device=dev)
        x_TH = torch.randn(T, H, device=dev).to(dtype)
        scale_N = torch.rand(N, device=dev)
        assert_bitwise(triton_ops.permute_rows(x_TH, token_N), reference.permute_rows(x_TH, token_N))
        x_NH = triton_ops.permute_rows(x_TH, token_N, scale_N)
        assert_bitwise(x_NH, reference.permute_rows(x_TH, token_N, scale_N))
        weight_TK = weights(row_TK)
        rtol, atol = self.TOL_GPU[dtype]
        torch.testing.assert_close(triton_ops.unpermute_rows(x_NH, row_TK, weight_TK).double(),
                                   reference.unpermute_rows(x_NH, row_TK, weight_TK).double(), rtol=rtol, atol=atol)
        grad_TH = torch.randn(T, H, device=dev).to(dtype)
        torch.testing.assert_close(triton_ops.unpermute_weight_grad(grad_TH, x_NH, row_TK),
                                   reference.unpermute_weight_grad(grad_TH, x_NH, row_TK), rtol=1e-4, atol=1e-6 * H)

    def test_int64_offsets(self):
        # N*H > 2^31 elements: row offsets overflow int32 unless computed in int64
        if torch.cuda.get_device_properties(0).total_memory < 40 * 2 ** 30:
            pytest.skip("needs ~20 GiB of GPU memory")
        dev = torch.device("cuda")
        T, K, H = 8192, 4, 65600
        token_N = torch.arange(T * K, device=dev).flip(0) // K
        x_TH = torch.randn(T, H, device=dev).to(torch.bfloat16)
        assert T * K * H > 2 ** 31
        x_NH = triton_ops.permute_rows(x_TH, token_N)
        assert torch.equal(x_NH[-1], x_TH[0]) and torch.equal(x_NH[0], x_TH[-1])
        assert_bitwise(x_NH, reference.permute_rows(x_TH, token_N))
        row_TK = (T * K - 1 - torch.arange(T * K, device=dev)).reshape(T, K)
        torch.testing.assert_close(triton_ops.unpermute_rows(x_NH, row_TK).double(),
                                   reference.unpermute_rows(x_NH, row_TK).double(), rtol=2 ** -7, atol=1e-5)
