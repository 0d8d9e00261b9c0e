"""Tier 1: pure logic, no processes. unpermute's backward as one kernel per token (#26.12).

``unpermute_backward`` of every backend ("native" C++, "triton" under TRITON_INTERPRET=1 set by
conftest.py) against the torch reference: y's gradient rows bit for bit (every float dtype), the weights'
gradient exactly on dyadic payloads (small integers times powers of two: every partial sum is exact, so
any summation order gives the reference's bits) in float64 and float32, and to fp tolerance on random
payloads; dropped slots (-1), no weights, weights that need no gradient, y that needs none, padded
layouts, T = 0. ``ops.unpermute``'s backward calls that one kernel and neither of the two it replaced.

Shapes legend: T tokens, K top-k slots, N routed rows, H hidden size, E experts (global).
"""
import shutil

import pytest
import torch

from moe_comm.kernels import native, reference, select_backend
from moe_comm.ops import make_layout, unpermute
from moe_comm.ops.layout import pad_layout

FLOATS = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=["native", "triton"])
def impl(request):
    if request.param == "native" and not native.available():
        if shutil.which("c++"):
            pytest.fail("a C++ compiler exists but moe_comm's native kernels did not build; see the warning")
        pytest.skip("no C++ compiler")
    if request.param == "triton":
        from moe_comm.kernels import triton_ops
        if not (triton_ops.available() and triton_ops._interpreting()):
            pytest.skip("triton is not importable, or was imported before TRITON_INTERPRET=1")
    return select_backend(request.param, torch.device("cpu"))


def _routing(T: int, K: int, E: int, seed: int, drop_p: float = 0.3):
    """(layout, idx_TK): distinct experts per token, a fraction of the slots dropped (-1), at least one."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K)
    idx = torch.where(torch.rand(T, K, generator=g) < drop_p, -1, idx.to(torch.int64))
    if T:
        idx[0, 0] = -1
    return make_layout(idx, E), idx


def _dyadic(shape, dtype, seed: int, scale: int = 3) -> torch.Tensor:
    """Integers in [-8, 8] times 2^-scale: products and sums of a few hundred stay exact in every dtype here."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-8, 9, shape, generator=g).double() * 2.0 ** -scale).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def _check(got, want, rows_N, exact_w: bool):
    gy, gw = got
    wy, ww = want
    assert (gy is None) == (wy is None) and (gw is None) == (ww is None)
    if wy is not None:
        assert gy.dtype == wy.dtype and gy.shape == wy.shape
        assert torch.equal(_bits(gy[rows_N]), _bits(wy[rows_N]))  # bit for bit on every row a slot points at
    if ww is not None:
        assert gw.dtype == ww.dtype and gw.shape == ww.shape
        if exact_w:
            assert torch.equal(gw, ww), (gw, ww)
        else:
            torch.testing.assert_close(gw, ww, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("K", [1, 3, 5])
@pytest.mark.parametrize("H", [1, 37, 1030])
def test_kernel_matches_reference(impl, dtype, K, H):
    T, E = 9, 8
    layout, _ = _routing(T, K, E, seed=K * 100 + H)
    N = layout.num_rows
    row_TK = layout.dest_row_TK
    rows_N = row_TK[row_TK >= 0]
    exact = dtype in (torch.float64, torch.float32)
    # dyadic payloads with at most H = 1030 products of <= 1 in magnitude: exact in float32 / float64
    grad_TH = _dyadic((T, H), dtype, 1)
    y_NH = _dyadic((N, H), dtype, 2)
    w_TK = _dyadic((T, K), torch.float32, 3).abs() + 0.5
    w_TK[row_TK < 0] = float("nan")  # a dropped slot's weight is never read
    for weight in (w_TK, None):
        for y, gy in ((y_NH, True), (None, True), (y_NH, False)):
            got = impl.unpermute_backward(grad_TH, row_TK, N, weight, y, gy)
            want = reference.unpermute_backward(grad_TH, row_TK, N, weight, y, gy)
            _check(got, want, rows_N, exact_w=exact)
            if got[1] is not None:
                assert (got[1][row_TK < 0] == 0).all()  # dropped slots: exactly 0
    # random payloads: y's rows still bit for bit; the dot products to fp tolerance
    g = torch.Generator().manual_seed(H)
    grad_TH = torch.randn(T, H, generator=g).to(dtype)
    y_NH = torch.randn(N, H, generator=g).to(dtype)
    w_TK = torch.rand(T, K, generator=g, dtype=torch.float64)  # cast to the accumulation dtype as the reference
    want = reference.unpermute_backward(grad_TH, row_TK, N, w_TK, y_NH)
    got = impl.unpermute_backward(grad_TH, row_TK, N, w_TK, y_NH)
    _check((got[0], None), (want[0], None), rows_N, exact_w=False)
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-4 * H ** 0.5)
    torch.testing.assert_close(got[1], want[1], **tol)


def test_kernel_edges(impl):
    H = 6
    for T, K, N in ((0, 2, 0), (3, 0, 0), (3, 2, 0)):  # no tokens, no slots, every slot dropped
        row_TK = torch.full((T, K), -1, dtype=torch.int64)
        grad_TH = torch.randn(T, H)
        gy, gw = impl.unpermute_backward(grad_TH, row_TK, N, torch.rand(T, K), torch.randn(N, H))
        assert gy.shape == (N, H) and gw.shape == (T, K) and (gw == 0).all()
    with pytest.raises(TypeError, match="y_NH must have dtype in \\(float32\\), got torch.float64"):
        impl.unpermute_backward(torch.randn(2, H), torch.zeros(2, 1, dtype=torch.int64), 1, None,
                                torch.randn(1, H, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"row_TK must have shape \[2, \*\] \(\[T, K\], T from grad_TH\), got"):
        impl.unpermute_backward(torch.randn(2, H), torch.zeros(3, 1, dtype=torch.int64), 1)


@pytest.mark.parametrize("backend", ["native", "triton"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
def test_ops_backward_equals_torch_exactly(backend, dtype, padded):
    T, K, E, H = 10, 3, 6, 40
    layout, idx = _routing(T, K, E, seed=7)
    if padded:  # two destination ranks of 3 local experts, room for 16 rows each: padding rows in between
        layout = pad_layout(make_layout(idx, E, num_ranks=2), 16)
        assert not layout.valid_N.all()
    N = layout.num_rows
    y0 = _dyadic((N, H), dtype, 4)
    w0 = _dyadic((T, K), dtype, 5).abs() + 0.25
    G = _dyadic((T, H), dtype, 6)
    for w_grad in (True, False):  # weights that need no gradient: y's gradient alone
        grads = {}
        for b in ("torch", backend):
            y = y0.clone().requires_grad_(True)
            w = w0.clone().requires_grad_(w_grad)
            (unpermute(y, layout, w, backend=b) * G).sum().backward()
            grads[b] = (y.grad, w.grad)
        assert torch.equal(grads[backend][0], grads["torch"][0])
        assert (grads[backend][1] is None) == (not w_grad)
        if w_grad:
            assert torch.equal(grads[backend][1], grads["torch"][1])
            assert (grads[backend][1][layout.dest_row_TK < 0] == 0).all()
        if padded:
            assert (grads[backend][0][~layout.valid_N] == 0).all()  # padding rows: zero, not stale memory
    # y that needs no gradient: the weights' alone
    w = w0.clone().requires_grad_(True)
    (unpermute(y0, layout, w, backend=backend) * G).sum().backward()
    w_ref = w0.clone().requires_grad_(True)
    (unpermute(y0, layout, w_ref, backend="torch") * G).sum().backward()
    assert torch.equal(w.grad, w_ref.grad)


@pytest.mark.parametrize("backend", ["native", "triton"])
def test_ops_backward_is_one_kernel(backend, monkeypatch):
    """The backward calls unpermute_backward once, and neither permute_rows nor unpermute_weight_grad (the
    torch reference composes its oracle from the latter, so it is not checked here)."""
    impl = select_backend(backend, torch.device("cpu"))
    calls = []
    real = impl.unpermute_backward

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def forbidden(*args, **kwargs):
        raise AssertionError("the backward ran a second kernel")

    layout, _ = _routing(6, 2, 4, seed=3)
    y = torch.randn(layout.num_rows, 8, requires_grad=True)
    w = torch.rand(6, 2, requires_grad=True)
    out = unpermute(y, layout, w, backend=backend)
    monkeypatch.setattr(impl, "unpermute_backward", counted)
    monkeypatch.setattr(impl, "permute_rows", forbidden)
    monkeypatch.setattr(impl, "unpermute_weight_grad", forbidden)
    out.sum().backward()
    assert calls == [1] and y.grad is not None and w.grad is not None
