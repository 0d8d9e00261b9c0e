"""Tier 1: pure logic, no processes. ``make_layout`` and the autograd ops ``permute`` / ``unpermute`` /
``gather_rows`` (``moe_comm.ops``) on every CPU-reachable backend.

make_layout ("torch", "native") is compared with a brute-force loop over slots; the ops ("torch",
"native", "triton" under TRITON_INTERPRET=1, set by conftest.py) are compared with brute-force loops in
the forward and with ``torch.autograd.gradcheck`` in float64 in the backward. A hypothesis property test
checks unpermute(permute(x), w) == sum_k w[t, k] * x[t] over valid slots and that all backends agree bit
for bit. Payloads encode their token id (row t of x holds t + column / 100), so a misrouted row shows
which token went where.

Shapes legend: T tokens, K top-k slots, S = T*K slots, N routed rows, H hidden size, E experts (global),
W EP ranks, e = E / W local experts, C chunks, R rows (any gather).
"""
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_comm.kernels import native
from moe_comm.ops import gather_rows, make_layout, permute, unpermute

LAYOUT_BACKENDS = ["torch", "native"]
OP_BACKENDS = ["torch", "native", "triton"]


@pytest.fixture(autouse=True, scope="module")
def _native_built():
    # "native" silently falls back to the torch reference when the build fails: that must not pass here.
    if not native.available() and shutil.which("c++"):
        pytest.fail("a C++ compiler exists but moe_comm's native kernels did not build; see the warning")


def _payload_TH(T: int, H: int, dtype=torch.float32) -> torch.Tensor:
    """Row t holds t + h/100: each row names its token."""
    return (torch.arange(T, dtype=torch.float64)[:, None] + torch.arange(H, dtype=torch.float64) / 100).to(dtype)


def _random_idx(T: int, K: int, E: int, seed: int, drop_p: float = 0.25, distinct: bool = True) -> torch.Tensor:
    """[T, K] int64 expert ids (distinct per token when ``distinct``), a fraction set to -1 (dropped)."""
    g = torch.Generator().manual_seed(seed)
    if distinct:
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K)
    else:
        idx = torch.randint(0, E, (T, K), generator=g)
    idx = idx.to(torch.int64)
    drop = torch.rand(T, K, generator=g) < drop_p
    return torch.where(drop, torch.full_like(idx, -1), idx)


# ---------------------------------------------------------------------------------------------------
# brute force
# ---------------------------------------------------------------------------------------------------
def _bf_layout(idx, E, W, C):
    """(dest_row [T][K], src_slot [S], counts [C][W][e], num_invalid) by loops over slots."""
    T = len(idx)
    K = len(idx[0]) if T else 0
    e_local = E // W
    valid = []  # (chunk, global expert, slot)
    dropped = []
    invalid = 0
    for t in range(T):
        chunk = min(C - 1, (2 * t * (C - 1) + T) // (2 * T))  # first/last chunks half-size
        for k in range(K):
            g, s = idx[t][k], t * K + k
            if g < -1 or g >= E:
                invalid += 1
            if 0 <= g < E:
                valid.append((chunk, g, s))
            else:
                dropped.append(s)
    valid.sort()  # by chunk, then expert, then slot (stable in slot order)
    dest = [[-1] * K for _ in range(T)]
    counts = [[[0] * e_local for _ in range(W)] for _ in range(C)]
    for n, (chunk, g, s) in enumerate(valid):
        dest[s // K][s % K] = n
        counts[chunk][g // e_local][g % e_local] += 1
    return dest, [s for _, _, s in valid] + sorted(dropped), counts, invalid


def _bf_permute(x, dest):
    N = sum(1 for row in dest for d in row if d >= 0)
    out = torch.zeros(N, x.shape[1], dtype=x.dtype)
    for t, row in enumerate(dest):
        for d in row:
            if d >= 0:
                out[d] = x[t]
    return out


def _bf_unpermute(y, dest, w=None):
    T = len(dest)
    out = torch.zeros(T, y.shape[1], dtype=torch.float64)
    for t, row in enumerate(dest):
        for k, d in enumerate(row):
            if d >= 0:
                out[t] += (1.0 if w is None else float(w[t, k])) * y[d].double()
    return out


def _check_layout(layout, idx_TK, E, W, C):
    idx = idx_TK.tolist()
    T, K = idx_TK.shape
    dest, src, counts, invalid = _bf_layout(idx, E, W, C)
    N = sum(1 for row in dest for d in row if d >= 0)
    assert layout.dest_row_TK.dtype == torch.int64 and layout.src_slot_S.dtype == torch.int64
    assert layout.dest_row_TK.tolist() == dest
    assert layout.src_slot_S.tolist() == src
    assert layout.token_S.tolist() == [s // K for s in src]
    assert layout.counts_CWe.shape == (C, W, E // W)
    assert layout.counts_CWe.tolist() == counts
    assert int(layout.num_invalid) == invalid
    assert layout.num_rows == N
    assert layout.num_rows == sum(1 for row in idx for g in row if 0 <= g < E)
    assert layout.tokens_per_expert_E.tolist() == [sum(row.count(g) for row in idx) for g in range(E)]
    # dest_row and src_slot are inverse maps on the routed rows
    flat_dest = layout.dest_row_TK.reshape(-1)
    src_N = layout.src_slot_N
    assert torch.equal(flat_dest[src_N], torch.arange(N))
    valid_S = flat_dest >= 0
    assert torch.equal(src_N[flat_dest[valid_S]], torch.nonzero(valid_S).reshape(-1))
    assert sorted(layout.src_slot_S.tolist()) == list(range(T * K))  # a permutation of all slots


# ---------------------------------------------------------------------------------------------------
# make_layout
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.parametrize("E,W,C", [(8, 1, 1), (8, 2, 1), (8, 4, 3), (6, 3, 2), (4, 4, 5)])
def test_make_layout_matches_brute_force(backend, K, E, W, C):
    T = 11
    for distinct in (True, False):
        idx = _random_idx(T, K, E, seed=K * 100 + E * 10 + C, distinct=distinct and K <= E)
        _check_layout(make_layout(idx, E, num_ranks=W, num_chunks=C, backend=backend), idx, E, W, C)


@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
def test_make_layout_docstring_example(backend):
    layout = make_layout(torch.tensor([[1, 0], [0, -1]]), 2, backend=backend)
    assert layout.dest_row_TK.tolist() == [[2, 0], [1, -1]]
    assert layout.src_slot_S.tolist() == [1, 2, 0, 3]
    assert layout.counts_CWe.tolist() == [[[2, 1]]]
    assert layout.num_rows == 3


@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
def test_make_layout_invalid_ids_counted_and_dropped(backend):
    idx = torch.tensor([[0, 8], [-2, 3], [7, -1], [100, -5]])
    layout = make_layout(idx, 8, num_ranks=2, backend=backend)
    assert int(layout.num_invalid) == 4  # 8, -2, 100, -5; -1 is a drop, not invalid
    assert layout.num_rows == 3
    assert layout.dest_row_TK.tolist() == [[0, -1], [-1, 1], [2, -1], [-1, -1]]
    _check_layout(layout, idx, 8, 2, 1)


@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
def test_make_layout_more_chunks_than_tokens(backend):
    idx = torch.tensor([[3, 1], [0, 2], [1, -1]])
    layout = make_layout(idx, 4, num_ranks=2, num_chunks=7, backend=backend)
    _check_layout(layout, idx, 4, 2, 7)
    # token t is in chunk t*7//3 = 0, 2, 4: rows ordered by token chunk first, expert second
    assert layout.token_N.tolist() == [0, 0, 1, 1, 2]
    assert layout.counts_CWe.sum(dim=(1, 2)).tolist() == [2, 0, 2, 0, 1, 0, 0]


@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
@pytest.mark.parametrize("K", [1, 3])
def test_make_layout_zero_tokens(backend, K):
    layout = make_layout(torch.empty(0, K, dtype=torch.int64), 8, num_ranks=2, num_chunks=2, backend=backend)
    assert layout.num_rows == 0
    assert layout.dest_row_TK.shape == (0, K)
    assert layout.src_slot_S.numel() == 0 and layout.token_N.numel() == 0
    assert layout.counts_CWe.shape == (2, 2, 4) and int(layout.counts_CWe.sum()) == 0
    assert int(layout.num_invalid) == 0


@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8])
def test_make_layout_accepts_narrow_int(backend, dtype):
    idx = _random_idx(9, 3, 6, seed=4)
    ref = make_layout(idx, 6, num_ranks=3, num_chunks=2, backend=backend)
    got = make_layout(idx.to(dtype), 6, num_ranks=3, num_chunks=2, backend=backend)
    _check_layout(got, idx, 6, 3, 2)
    assert torch.equal(got.dest_row_TK, ref.dest_row_TK) and torch.equal(got.src_slot_S, ref.src_slot_S)


def test_make_layout_backends_agree_exactly():
    idx = _random_idx(40, 4, 16, seed=9, distinct=False)
    idx[3, 2], idx[5, 0] = 16, -7
    a = make_layout(idx, 16, num_ranks=4, num_chunks=3, backend="torch")
    b = make_layout(idx, 16, num_ranks=4, num_chunks=3, backend="native")
    for name in ("dest_row_TK", "src_slot_S", "token_S", "counts_CWe", "num_invalid"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


# ---------------------------------------------------------------------------------------------------
# ops forward
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("K", [1, 2, 4])
def test_permute_unpermute_forward_brute_force(backend, dtype, K):
    T, E, H = 9, 6, 5
    idx = _random_idx(T, K, E, seed=K + 50)
    layout = make_layout(idx, E, num_ranks=2, num_chunks=2)
    dest = layout.dest_row_TK.tolist()
    x = _payload_TH(T, H, dtype)
    x_NH = permute(x, layout, backend=backend)
    assert x_NH.dtype == dtype and x_NH.shape == (layout.num_rows, H)
    assert torch.equal(x_NH, _bf_permute(x, dest))
    g = torch.Generator().manual_seed(K)
    y = torch.randn(layout.num_rows, H, generator=g).to(dtype)
    w = torch.rand(T, K, generator=g)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    out = unpermute(y, layout, w, backend=backend)
    assert out.dtype == dtype and out.shape == (T, H)
    torch.testing.assert_close(out.double(), _bf_unpermute(y, dest, w), **tol)
    torch.testing.assert_close(unpermute(y, layout, backend=backend).double(), _bf_unpermute(y, dest), **tol)


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_unpermute_docstring_example(backend):
    layout = make_layout(torch.tensor([[1, 0], [0, -1]]), 2)
    y = torch.tensor([[1.0], [2.0], [3.0]])
    out = unpermute(y, layout, torch.tensor([[0.5, 1.0], [2.0, 9.0]]), backend=backend)
    assert out.tolist() == [[2.5], [4.0]]


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_gather_rows_forward_brute_force(backend):
    R, H = 7, 3
    g = torch.Generator().manual_seed(0)
    index = torch.randperm(R, generator=g)
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(R)
    x = _payload_TH(R, H)
    out = gather_rows(x, index, inverse, backend=backend)
    for r in range(R):
        assert torch.equal(out[r], x[int(index[r])])
    assert torch.equal(gather_rows(out, inverse, index, backend=backend), x)


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_ops_zero_tokens(backend):
    layout = make_layout(torch.empty(0, 2, dtype=torch.int64), 4)
    x = torch.empty(0, 3, requires_grad=True)
    x_NH = permute(x, layout, backend=backend)
    assert x_NH.shape == (0, 3)
    out = unpermute(x_NH, layout, torch.empty(0, 2), backend=backend)
    assert out.shape == (0, 3)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 3)


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_all_dropped(backend):
    layout = make_layout(torch.full((3, 2), -1), 4)
    x = _payload_TH(3, 2).requires_grad_(True)
    x_NH = permute(x, layout, backend=backend)
    assert x_NH.shape == (0, 2)
    w = torch.rand(3, 2, requires_grad=True)
    out = unpermute(x_NH, layout, w, backend=backend)
    assert torch.equal(out, torch.zeros(3, 2))
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros(3, 2)) and torch.equal(w.grad, torch.zeros(3, 2))


# ---------------------------------------------------------------------------------------------------
# ops backward
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("K", [1, 3])
def test_permute_gradcheck(backend, K):
    T, E, H = 4, 4, 2
    layout = make_layout(_random_idx(T, K, E, seed=K), E, num_ranks=2)
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: permute(a, layout, backend=backend), (x,))


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("K", [1, 3])
def test_unpermute_gradcheck(backend, K):
    T, E, H = 4, 4, 2
    idx = _random_idx(T, K, E, seed=K + 1)
    idx[0, 0] = -1  # at least one dropped slot
    layout = make_layout(idx, E)
    y = torch.randn(layout.num_rows, H, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, K, dtype=torch.float64, requires_grad=True)
    # The interpreted Triton forward costs ~30 ms a call, so its full Jacobian (~80 calls) would take seconds:
    # it gets gradcheck's fast mode (random projections); test_unpermute_weight_grad_brute_force is exact.
    fast = backend == "triton"
    assert torch.autograd.gradcheck(lambda a, b: unpermute(a, layout, b, backend=backend), (y, w), fast_mode=fast)
    assert torch.autograd.gradcheck(lambda a: unpermute(a, layout, backend=backend), (y,), fast_mode=fast)


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_gather_rows_gradcheck(backend):
    R = 6
    index = torch.tensor([2, 0, 5, 1, 4, 3])
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(R)
    x = torch.randn(R, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: gather_rows(a, index, inverse, backend=backend), (x,))


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_unpermute_weight_grad_brute_force(backend):
    T, K, E, H = 8, 3, 6, 4
    idx = _random_idx(T, K, E, seed=33, drop_p=0.3)
    layout = make_layout(idx, E, num_ranks=3)
    dest = layout.dest_row_TK.tolist()
    g = torch.Generator().manual_seed(1)
    y = torch.randn(layout.num_rows, H, generator=g, requires_grad=True)
    w = torch.rand(T, K, generator=g, requires_grad=True)
    G = torch.randn(T, H, generator=g)
    (unpermute(y, layout, w, backend=backend) * G).sum().backward()
    dropped = idx < 0
    assert dropped.any()
    assert torch.equal(w.grad[dropped], torch.zeros(int(dropped.sum())))  # dropped slots: exactly zero
    for t in range(T):
        for k in range(K):
            d = dest[t][k]
            expected = 0.0 if d < 0 else float((G[t].double() * y[d].detach().double()).sum())
            assert w.grad[t, k].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # y's gradient: row n gets w[t, k] * G[t] for the slot (t, k) it came from
    for t in range(T):
        for k in range(K):
            d = dest[t][k]
            if d >= 0:
                torch.testing.assert_close(y.grad[d], w[t, k].detach() * G[t])


# ---------------------------------------------------------------------------------------------------
# property test
# ---------------------------------------------------------------------------------------------------
@st.composite
def _routings(draw):
    K = draw(st.integers(1, 4))
    W = draw(st.sampled_from([1, 2, 4]))
    min_local = -(-K // W)  # distinct experts per token need E >= K
    E = W * draw(st.integers(min_local, min_local + 2))
    T = draw(st.integers(0, 12))
    C = draw(st.integers(1, 4))
    H = draw(st.integers(1, 6))
    drop_p = draw(st.sampled_from([0.0, 0.3, 1.0]))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    return T, K, E, W, C, H, drop_p, seed


@settings(max_examples=30, deadline=None)
@given(_routings())
def test_roundtrip_and_backends_agree(routing):
    T, K, E, W, C, H, drop_p, seed = routing
    idx = _random_idx(T, K, E, seed, drop_p=drop_p)
    layout = make_layout(idx, E, num_ranks=W, num_chunks=C)
    valid = idx >= 0
    assert layout.num_rows == int(valid.sum())
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w = torch.rand(T, K, generator=g)
    expected = ((w * valid).double().sum(1, keepdim=True)) * x.double()
    results = {}
    for backend in OP_BACKENDS:
        x_NH = permute(x, layout, backend=backend)
        back = unpermute(x_NH, layout, w, backend=backend)
        torch.testing.assert_close(back.double(), expected, rtol=1e-5, atol=1e-6)
        results[backend] = (x_NH, back)
    ref_NH, ref_back = results["torch"]
    for backend in ("native", "triton"):
        assert torch.equal(results[backend][0], ref_NH), backend  # permute: bitwise identical
        assert torch.equal(results[backend][1], ref_back), backend  # unpermute too (documented)


# ---------------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_bad_inputs_name_the_argument(backend):
    layout = make_layout(torch.tensor([[0, 1], [1, -1], [2, 0]]), 4)
    x = torch.randn(3, 2)
    y = torch.randn(layout.num_rows, 2)
    with pytest.raises(ValueError, match="x_TH"):
        permute(torch.randn(4, 2), layout, backend=backend)
    with pytest.raises(ValueError, match="x_TH"):
        permute(torch.randn(3), layout, backend=backend)
    with pytest.raises(TypeError, match="x_TH"):
        permute(x.numpy(), layout, backend=backend)
    with pytest.raises(TypeError, match="x_TH"):
        permute(torch.ones(3, 2, dtype=torch.int64), layout, backend=backend)
    with pytest.raises(ValueError, match="y_NH"):
        unpermute(torch.randn(layout.num_rows + 1, 2), layout, backend=backend)
    with pytest.raises(ValueError, match="topk_weight_TK"):
        unpermute(y, layout, torch.rand(3, 3), backend=backend)
    with pytest.raises(ValueError, match="topk_weight_TK"):
        unpermute(y, layout, torch.rand(6), backend=backend)
    with pytest.raises(TypeError, match="topk_weight_TK"):
        unpermute(y, layout, torch.rand(3, 2).half(), backend=backend)
    with pytest.raises(TypeError, match="topk_weight_TK"):
        unpermute(y, layout, torch.ones(3, 2, dtype=torch.int64), backend=backend)
    with pytest.raises(TypeError, match="topk_weight_TK"):
        unpermute(y, layout, [[1.0, 1.0]] * 3, backend=backend)
    with pytest.raises(ValueError, match="backend"):
        permute(x, layout, backend="cuda")
    with pytest.raises(ValueError, match=r"out must have shape \[5, 2\], got \(4, 2\)"):
        permute(x, layout, backend=backend, out=torch.zeros(4, 2))
    with pytest.raises(TypeError, match="out must have x_TH's dtype float32"):
        permute(x, layout, backend=backend, out=torch.zeros(5, 2, dtype=torch.float64))
    index, inverse = torch.tensor([2, 0, 1]), torch.tensor([1, 2, 0])
    with pytest.raises(ValueError, match=r"index_R must have shape \[3\] \(R from x_RH\), got \(2,\)"):
        gather_rows(x, index[:2], inverse, backend=backend)
    with pytest.raises(TypeError, match="inverse_R must be an integer tensor"):
        gather_rows(x, index, inverse.float(), backend=backend)
    with pytest.raises(TypeError, match="x_RH must be a floating-point tensor"):
        gather_rows(x.long(), index, inverse, backend=backend)


@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
def test_make_layout_bad_inputs_name_the_argument(backend):
    with pytest.raises(ValueError, match="topk_idx_TK"):
        make_layout(torch.tensor([0, 1, 2]), 4, backend=backend)
    with pytest.raises(ValueError, match="topk_idx_TK"):
        make_layout(torch.zeros(2, 2, 2, dtype=torch.int64), 4, backend=backend)
    with pytest.raises(TypeError, match="topk_idx_TK"):
        make_layout(torch.tensor([[0.0, 1.0]]), 4, backend=backend)
    with pytest.raises(TypeError, match="topk_idx_TK"):
        make_layout(torch.tensor([[True, False]]), 4, backend=backend)
    with pytest.raises(TypeError, match="topk_idx_TK"):
        make_layout([[0, 1]], 4, backend=backend)
    with pytest.raises(ValueError, match="num_ranks"):
        make_layout(torch.tensor([[0, 1]]), 6, num_ranks=4, backend=backend)
    with pytest.raises(ValueError, match="num_experts"):
        make_layout(torch.tensor([[0, 1]]), 0, backend=backend)
    with pytest.raises(ValueError, match="num_chunks"):
        make_layout(torch.tensor([[0, 1]]), 4, num_chunks=0, backend=backend)
