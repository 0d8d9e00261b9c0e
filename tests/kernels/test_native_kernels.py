"""Tier 1: pure logic, no processes. The C++ CPU kernels (``moe_comm.kernels.native``) against the oracles.

Every launcher is compared with ``moe_comm.kernels.reference`` / ``moe_comm.ops.layout.layout_reference``:
permute bit for bit (any dtype, with and without scale), unpermute bit for bit (every float dtype), its
weight gradient close, make_layout exactly. Covers dropped slots (-1), T = 0, experts with zero tokens,
K = 1..4 (and K = 6, which takes the column-tile path), non-contiguous inputs and outputs, invalid expert
ids and several chunks. Each kernel path (AVX2 + F16C row loops or the generic ones, streaming stores or
plain) is forced in turn with ``native._kernel_config``; the output cache the launchers allocate fresh
outputs from is checked for reuse, its limit and resizing.

Shapes legend: T tokens, K top-k slots, S = T*K slots, N routed rows, H hidden size, E experts, C chunks.

If the extension cannot be built while a C++ compiler exists, the tests fail (not skip): a broken build
must be noticed, not hidden behind the torch fallback.
"""
import shutil
import warnings

try:
    import resource
except ImportError:  # not POSIX
    resource = None

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_comm.kernels import native, reference
from moe_comm.ops.layout import layout_reference

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# (rtol, atol) for half-precision unpermute: one rounding of the output (the fp32 sums agree exactly).
LOW_TOL = {torch.bfloat16: (2 ** -7, 1e-6), torch.float16: (2 ** -10, 1e-6)}


@pytest.fixture(autouse=True, scope="module")
def _native_built():
    if not native.available():
        if shutil.which("c++"):
            pytest.fail("a C++ compiler exists but moe_comm's native kernels did not build; see the warning")
        pytest.skip("no C++ compiler: the native kernels cannot be built here")


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
def routing(T, K, E, *, drop=0.0, used_experts=None, seed=0):
    """(topk_idx_TK, token_N, row_TK): random top-k over the first ``used_experts`` experts (the rest
    get zero tokens), a fraction ``drop`` of slots set to -1, laid out by the reference layout."""
    g = torch.Generator().manual_seed(seed)
    used = E if used_experts is None else used_experts
    topk_idx_TK = torch.randint(0, used, (T, K), generator=g)
    if drop:
        topk_idx_TK[torch.rand(T, K, generator=g) < drop] = -1
    dest_row_TK, src_slot_S, counts_CE, _ = layout_reference(topk_idx_TK, E)
    N = int(counts_CE.sum())
    return topk_idx_TK, src_slot_S[:N] // K, dest_row_TK


def token_rows(T, H, dtype):
    """x_TH whose row t holds t*256 + h (h < 256, so exact in every float dtype for small T): a wrong
    route shows which token landed where."""
    h = torch.arange(H) % 256
    return (torch.arange(T)[:, None] * 256 + h[None, :]).to(dtype)


def random_rows(n, H, dtype, seed):
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_bitwise(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), f"max abs diff {(got.double() - want.double()).abs().max().item()}"


# ---------------------------------------------------------------------------------------------------
# permute_rows
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS + [torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("use_out", [False, True])
def test_permute_bitwise(dtype, use_out):
    T, K, E, H = 40, 2, 8, 33
    _, token_N, _ = routing(T, K, E, drop=0.2, used_experts=5)
    x_TH = token_rows(T, H, torch.float64).to(dtype) if dtype != torch.bool else torch.rand(T, H) > 0.5
    out = torch.empty(token_N.numel(), H, dtype=dtype) if use_out else None
    got = native.permute_rows(x_TH, token_N, out=out)
    assert_bitwise(got, reference.permute_rows(x_TH, token_N))
    if use_out:
        assert got.data_ptr() == out.data_ptr()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float64])
def test_permute_scaled_bitwise(dtype, scale_dtype):
    T, K, E, H = 37, 3, 6, 70
    _, token_N, _ = routing(T, K, E, drop=0.1, seed=1)
    x_TH = random_rows(T, H, dtype, seed=2)
    scale_N = torch.rand(token_N.numel(), generator=torch.Generator().manual_seed(3)).to(scale_dtype)
    assert_bitwise(native.permute_rows(x_TH, token_N, scale_N), reference.permute_rows(x_TH, token_N, scale_N))


def test_permute_noncontiguous_inputs_and_out():
    T, H = 24, 10
    x_HT = token_rows(T, H, torch.float32).t().contiguous()
    x_TH = x_HT.t()  # non-contiguous view
    token_2N = torch.randint(0, T, (2 * 30,), generator=torch.Generator().manual_seed(4))
    token_N = token_2N[::2]
    out_HN = torch.zeros(H, token_N.numel())
    got = native.permute_rows(x_TH, token_N, out=out_HN.t())
    assert_bitwise(got, reference.permute_rows(x_TH, token_N))
    assert_bitwise(out_HN.t(), reference.permute_rows(x_TH, token_N))


def test_permute_empty():
    x_TH = random_rows(0, 8, torch.float32, seed=0)
    got = native.permute_rows(x_TH, torch.zeros(0, dtype=torch.int64))
    assert got.shape == (0, 8)
    x_TH = random_rows(5, 0, torch.float32, seed=0)
    assert native.permute_rows(x_TH, torch.tensor([4, 0])).shape == (2, 0)


# ---------------------------------------------------------------------------------------------------
# unpermute_rows
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("K", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("weights", [None, torch.float32, torch.float64])
def test_unpermute_bitwise(dtype, K, weights):
    # H = 1100 crosses a 1024-column tile; K = 6 sums more than 4 rows, the tiled path.
    T, E, H = 29, 8, 1100 if K == 6 else 67
    _, token_N, row_TK = routing(T, K, E, drop=0.25, used_experts=6, seed=K)
    y_NH = random_rows(token_N.numel(), H, dtype, seed=5)
    weight_TK = None if weights is None else torch.rand(T, K, generator=torch.Generator().manual_seed(6)).to(weights)
    want = reference.unpermute_rows(y_NH, row_TK, weight_TK)
    assert_bitwise(native.unpermute_rows(y_NH, row_TK, weight_TK), want)
    out = torch.full((T, H), float("nan"), dtype=dtype)
    assert native.unpermute_rows(y_NH, row_TK, weight_TK, out=out) is out
    assert_bitwise(out, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weighted", [False, True])
def test_unpermute_low_precision_close(dtype, weighted):
    T, K, E, H = 50, 4, 8, 45
    _, token_N, row_TK = routing(T, K, E, drop=0.2, seed=7)
    y_NH = random_rows(token_N.numel(), H, dtype, seed=8)
    weight_TK = torch.rand(T, K, generator=torch.Generator().manual_seed(9)) if weighted else None
    got = native.unpermute_rows(y_NH, row_TK, weight_TK)
    want = reference.unpermute_rows(y_NH, row_TK, weight_TK)
    assert got.dtype == dtype
    rtol, atol = LOW_TOL[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)


def test_unpermute_all_dropped_token_is_zero_and_T0():
    y_NH = random_rows(3, 5, torch.float32, seed=0)
    row_TK = torch.tensor([[2, -1], [-1, -1], [0, 1]])
    got = native.unpermute_rows(y_NH, row_TK, torch.ones(3, 2))
    assert torch.equal(got[1], torch.zeros(5))
    assert_bitwise(got, reference.unpermute_rows(y_NH, row_TK, torch.ones(3, 2)))
    empty = native.unpermute_rows(random_rows(0, 5, torch.float32, 0), torch.zeros(0, 2, dtype=torch.int64))
    assert empty.shape == (0, 5)


def test_unpermute_noncontiguous_inputs_and_out():
    T, K, E, H = 21, 3, 5, 16
    _, token_N, row_TK = routing(T, K, E, drop=0.2, seed=10)
    y_HN = random_rows(H, token_N.numel(), torch.float32, seed=11)
    weight_KT = torch.rand(K, T, generator=torch.Generator().manual_seed(12))
    row_KT = row_TK.t().contiguous()
    want = reference.unpermute_rows(y_HN.t(), row_TK, weight_KT.t())
    out_HT = torch.zeros(H, T)
    native.unpermute_rows(y_HN.t(), row_KT.t(), weight_KT.t(), out=out_HT.t())
    assert_bitwise(out_HT.t(), want)


def test_unpermute_token_payload_reads_back():
    # Self-checking payload: y row n holds the token it came from; unpermute with one slot per token
    # must give each token its own id back.
    T, H = 12, 4
    topk_idx_TK, token_N, row_TK = routing(T, 1, 3, seed=13)
    y_NH = token_rows(T, H, torch.float32).index_select(0, token_N)
    assert_bitwise(native.unpermute_rows(y_NH, row_TK), token_rows(T, H, torch.float32))


# ---------------------------------------------------------------------------------------------------
# kernel paths: AVX2 + F16C row loops or the generic ones, streaming stores or plain
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(params=[(True, True), (True, False), (False, True), (False, False)],
                ids=["avx2-stream", "avx2-store", "generic-stream", "generic-store"])
def kernel_path(request):
    """Forces one path for the test (streaming from 0 bytes, or never), then restores the defaults."""
    use_avx2, stream = request.param
    saved = native._kernel_config()
    try:
        native._kernel_config(stream_min_bytes=0 if stream else 2 ** 62, use_avx2=use_avx2)
    except ValueError:
        pytest.skip("this CPU (or compiler) has no AVX2 + F16C path")
    yield request.param
    native._kernel_config(*saved)


def misaligned_out(n, H, dtype):
    """A contiguous [n, H] buffer starting one element past a 64-byte boundary: the streaming stores'
    unaligned head (and, for most H, unaligned rows)."""
    return torch.full((n * H + 1,), 7, dtype=dtype)[1:].view(n, H)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("H", [1, 7, 8, 9, 33, 1031])
def test_paths_permute_bitwise(kernel_path, dtype, H):
    T, K, E = 19, 2, 5
    _, token_N, _ = routing(T, K, E, drop=0.2, seed=H)
    N = token_N.numel()
    x_TH = random_rows(T, H, dtype, seed=21)
    scale_N = torch.rand(N, generator=torch.Generator().manual_seed(22)).to(reference.acc_dtype(dtype))
    assert_bitwise(native.permute_rows(x_TH, token_N), reference.permute_rows(x_TH, token_N))
    want = reference.permute_rows(x_TH, token_N, scale_N)
    assert_bitwise(native.permute_rows(x_TH, token_N, scale_N), want)
    out = misaligned_out(N, H, dtype)
    assert native.permute_rows(x_TH, token_N, scale_N, out=out) is out
    assert_bitwise(out, want)
    out_HN = torch.zeros(H, N, dtype=dtype)  # non-contiguous out: staged, then copied in
    native.permute_rows(x_TH, token_N, out=out_HN.t())
    assert_bitwise(out_HN.t(), reference.permute_rows(x_TH, token_N))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("K,H", [(1, 1), (2, 7), (2, 9), (3, 33), (4, 16), (6, 1031), (2, 2053)])
@pytest.mark.parametrize("weighted", [False, True])
def test_paths_unpermute_bitwise(kernel_path, dtype, K, H, weighted):
    # K = 6 > 4 rows: the column-tile path, its last group streamed; H = 1031, 2053 cross 1024-column
    # tiles with a ragged end; odd H leaves rows unaligned for the streaming stores.
    T, E = 23, 6
    _, token_N, row_TK = routing(T, K, E, drop=0.25, seed=K * H)
    row_TK[0] = -1  # every slot of token 0 dropped: a row of +0
    y_NH = random_rows(token_N.numel(), H, dtype, seed=23)
    weight_TK = torch.rand(T, K, generator=torch.Generator().manual_seed(24)) if weighted else None
    if weighted and dtype == torch.float64:
        weight_TK = weight_TK.double()
    want = reference.unpermute_rows(y_NH, row_TK, weight_TK)
    assert_bitwise(native.unpermute_rows(y_NH, row_TK, weight_TK), want)
    assert torch.equal(want[0], torch.zeros(H, dtype=dtype))
    out = misaligned_out(T, H, dtype)
    assert native.unpermute_rows(y_NH, row_TK, weight_TK, out=out) is out
    assert_bitwise(out, want)
    out_HT = torch.zeros(H, T, dtype=dtype)
    native.unpermute_rows(y_NH, row_TK, weight_TK, out=out_HT.t())
    assert_bitwise(out_HT.t(), want)


def test_paths_empty_inputs(kernel_path):
    for dtype in FLOATS:
        assert native.permute_rows(random_rows(0, 8, dtype, 0), torch.zeros(0, dtype=torch.int64)).shape == (0, 8)
        assert native.permute_rows(random_rows(3, 0, dtype, 0), torch.tensor([2, 0])).shape == (2, 0)
        scale = torch.ones(2, dtype=reference.acc_dtype(dtype))
        assert native.permute_rows(random_rows(3, 0, dtype, 0), torch.tensor([2, 0]), scale).shape == (2, 0)
        assert native.unpermute_rows(random_rows(0, 5, dtype, 0), torch.zeros(0, 2, dtype=torch.int64)).shape == (0, 5)
        got = native.unpermute_rows(random_rows(0, 5, dtype, 0), torch.full((3, 2), -1))  # N = 0, all dropped
        assert torch.equal(got, torch.zeros(3, 5, dtype=dtype))
        assert native.unpermute_rows(random_rows(4, 0, dtype, 0), torch.tensor([[1, 3]])).shape == (1, 0)


@pytest.mark.parametrize("dtype", FLOATS)
def test_paths_nan_rows_stay_nan(kernel_path, dtype):
    # NaN bit patterns differ between torch's own paths (bf16: 0x7FC0 scalar, 0xFFFF vectorised), so
    # only where NaNs land is compared; every other element stays bit for bit.
    T, K, H = 9, 2, 37
    _, token_N, row_TK = routing(T, K, 4, seed=25)
    y_NH = random_rows(token_N.numel(), H, dtype, seed=26)
    y_NH[1, 3] = float("nan")
    got = native.unpermute_rows(y_NH, row_TK, torch.rand(T, K).to(reference.acc_dtype(dtype)))
    want = reference.unpermute_rows(y_NH, row_TK, torch.rand(T, K).to(reference.acc_dtype(dtype)))
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 1


# ---------------------------------------------------------------------------------------------------
# output cache: fresh outputs of 1 MiB and more reuse freed blocks
# ---------------------------------------------------------------------------------------------------
@pytest.mark.skipif(resource is None, reason="page fault counts need the resource module")
def test_plain_calls_reuse_cached_blocks_without_page_faults():
    # 16 MiB fp32 output; each result is kept until the next call returns, as `y = f(x)` in a loop does.
    T, K, E, H = 2048, 2, 8, 2048
    _, token_N, row_TK = routing(T, K, E, seed=27)
    y_NH = random_rows(token_N.numel(), H, torch.float32, seed=28)
    weight_TK = torch.rand(T, K, generator=torch.Generator().manual_seed(29))
    want = reference.unpermute_rows(y_NH, row_TK, weight_TK)
    y_TH = native.unpermute_rows(y_NH, row_TK, weight_TK)
    y_TH = native.unpermute_rows(y_NH, row_TK, weight_TK)  # two blocks in play from here on
    before = native.output_cache_stats()
    faults = []
    for _ in range(4):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        y_TH = native.unpermute_rows(y_NH, row_TK, weight_TK)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    after = native.output_cache_stats()
    assert after["hits"] - before["hits"] == 4 and after["misses"] == before["misses"]
    assert max(faults) < 100, faults  # a fresh 16 MiB in 4 KiB pages: 4096
    assert_bitwise(y_TH, want)


def test_output_cache_limit_resize_and_small_outputs():
    x_TH = random_rows(256, 1024, torch.float32, seed=30)  # 1 MiB rows: the cache's smallest size
    token_N = torch.arange(256)
    old = native.set_output_cache_limit(0)
    try:
        assert native.output_cache_stats()["idle_bytes"] == 0 and native.output_cache_stats()["limit_bytes"] == 0
        out = native.permute_rows(x_TH, token_N)  # in use: the limit does not touch it
        mapped = native.output_cache_stats()["mapped_bytes"]
        assert mapped >= out.nbytes
        assert native.set_output_cache_limit(1 << 30) == 0
        del out  # freed below the limit: kept idle
        assert native.output_cache_stats()["idle_bytes"] >= x_TH.nbytes
        out = native.permute_rows(x_TH, token_N)
        out.resize_(512, 1024)  # a cached tensor's storage grows through the same allocator
        assert_bitwise(out[:256], x_TH)
        assert native.set_output_cache_limit(0) == 1 << 30  # unmaps every idle block at once
        assert native.output_cache_stats()["idle_bytes"] == 0
        del out
        assert native.output_cache_stats()["idle_bytes"] == 0  # above the limit: unmapped on free
    finally:
        native.set_output_cache_limit(old)
    small = native.permute_rows(x_TH[:, :8], token_N)  # 8 KiB: torch's allocator, not the cache
    assert_bitwise(small, x_TH[:, :8])
    with pytest.raises(ValueError, match="limit_bytes"):
        native.set_output_cache_limit(-1)
    with pytest.raises(TypeError, match="limit_bytes"):
        native.set_output_cache_limit(1.5)


# ---------------------------------------------------------------------------------------------------
# unpermute_weight_grad
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("K", [1, 2, 4])
def test_weight_grad_close(dtype, K):
    T, E, H = 31, 7, 53
    _, token_N, row_TK = routing(T, K, E, drop=0.2, used_experts=5, seed=14)
    y_NH = random_rows(token_N.numel(), H, dtype, seed=15)
    grad_TH = random_rows(T, H, dtype, seed=16)
    got = native.unpermute_weight_grad(grad_TH, y_NH, row_TK)
    want = reference.unpermute_weight_grad(grad_TH, y_NH, row_TK)
    assert got.dtype == reference.acc_dtype(dtype) and got.shape == (T, K)
    assert torch.all(got[row_TK < 0] == 0)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_weight_grad_fp32_grad_with_bf16_rows_and_T0():
    T, K, H = 9, 2, 20
    _, token_N, row_TK = routing(T, K, 4, drop=0.3, seed=17)
    y_NH = random_rows(token_N.numel(), H, torch.bfloat16, seed=18)
    grad_TH = random_rows(T, H, torch.float32, seed=19)
    torch.testing.assert_close(native.unpermute_weight_grad(grad_TH, y_NH, row_TK),
                               reference.unpermute_weight_grad(grad_TH, y_NH, row_TK), rtol=1e-5, atol=1e-5)
    empty = native.unpermute_weight_grad(torch.zeros(0, H), torch.zeros(0, H), torch.zeros(0, K, dtype=torch.int64))
    assert empty.shape == (0, K) and empty.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------
# make_layout
# ---------------------------------------------------------------------------------------------------
def assert_layout_equal(topk_idx_TK, E, C):
    got = native.make_layout(topk_idx_TK, E, C)
    want = layout_reference(topk_idx_TK.to(torch.int64), E, C)
    for name, g, w in zip(("dest_row_TK", "src_slot_S", "counts_CE", "num_invalid"), got, want):
        assert g.dtype == w.dtype == torch.int64, name
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
        assert torch.equal(g, w), f"{name}: {g.tolist()} vs {w.tolist()}"


@pytest.mark.parametrize("C", [1, 2, 3])
@pytest.mark.parametrize("K", [1, 2, 4])
def test_make_layout_equals_reference(C, K):
    T, E = 50, 9
    g = torch.Generator().manual_seed(20 + K)
    topk_idx_TK = torch.randint(-3, E + 3, (T, K), generator=g)  # includes -1 and invalid ids
    assert_layout_equal(topk_idx_TK, E, C)


def test_make_layout_docstring_example_and_edges():
    got = native.make_layout(torch.tensor([[1, 0], [0, -1]]), 2, 1)
    assert got[0].tolist() == [[2, 0], [1, -1]] and got[1].tolist() == [1, 2, 0, 3]
    assert got[2].tolist() == [[2, 1]] and int(got[3]) == 0
    assert_layout_equal(torch.zeros(0, 2, dtype=torch.int64), 4, 2)  # T = 0
    assert_layout_equal(torch.full((5, 2), -1), 3, 2)  # everything dropped
    assert_layout_equal(torch.tensor([[7, 0], [1, -5]]), 2, 1)  # num_invalid = 2
    assert_layout_equal(torch.randint(0, 2, (3, 2)), 16, 5)  # C > T, most experts empty
    assert_layout_equal(torch.randint(0, 4, (7, 3)).to(torch.int32), 4, 2)  # int32 input


# ---------------------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(T=st.integers(0, 24), K=st.integers(1, 4), E=st.integers(1, 6), H=st.integers(1, 19),
       C=st.integers(1, 3), data=st.data())
def test_roundtrip_permute_unpermute_counts_slots(T, K, E, H, C, data):
    """unpermute(permute(x)) without weights == x * (valid slots of each token)."""
    ids = data.draw(st.lists(st.integers(-2, E), min_size=T * K, max_size=T * K))
    topk_idx_TK = torch.tensor(ids, dtype=torch.int64).reshape(T, K)
    dest_row_TK, src_slot_S, counts_CE, _ = native.make_layout(topk_idx_TK, E, C)
    N = int(counts_CE.sum())
    x_TH = (torch.arange(T * H) % 97 - 48).reshape(T, H).to(torch.float32)  # small ints: sums are exact
    y_NH = native.permute_rows(x_TH, src_slot_S[:N] // K)
    back_TH = native.unpermute_rows(y_NH, dest_row_TK)
    valid_T = (dest_row_TK >= 0).sum(1).to(torch.float32)
    assert torch.equal(back_TH, x_TH * valid_T[:, None])


# ---------------------------------------------------------------------------------------------------
# argument checks and the fallback
# ---------------------------------------------------------------------------------------------------
def test_bad_arguments_name_the_argument():
    x_TH, token_N = torch.zeros(4, 3), torch.tensor([0, 3])
    with pytest.raises(TypeError, match="token_N"):
        native.permute_rows(x_TH, token_N.float())
    with pytest.raises(ValueError, match="out"):
        native.permute_rows(x_TH, token_N, out=torch.zeros(3, 3))
    with pytest.raises(TypeError, match="out"):
        native.permute_rows(x_TH, token_N, out=torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"token_N values must be in \[0, 4\), got 4"):
        native.permute_rows(x_TH, torch.tensor([4]))
    with pytest.raises(ValueError, match="row_TK"):
        native.unpermute_rows(torch.zeros(2, 3), torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match="weight_TK"):
        native.unpermute_rows(torch.zeros(2, 3), torch.tensor([[0, 1]]), torch.ones(2, 1))
    with pytest.raises(TypeError, match="y_NH"):
        native.unpermute_rows(torch.zeros(2, 3, dtype=torch.int32), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="grad_TH"):
        native.unpermute_weight_grad(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="num_chunks"):
        native.make_layout(torch.zeros(2, 1, dtype=torch.int64), 4, 0)


def test_missing_sources_warn_once_and_fall_back(monkeypatch, tmp_path):
    native._extension.cache_clear()
    monkeypatch.setattr(native, "_CSRC_DIR", tmp_path)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert native.available() is False
            assert native.available() is False
        assert len(caught) == 1 and "torch" in str(caught[0].message)
        with pytest.raises(RuntimeError, match="not available"):
            native.permute_rows(torch.zeros(1, 1), torch.tensor([0]))
    finally:
        monkeypatch.undo()
        native._extension.cache_clear()
    assert native.available()  # rebuilt from torch's extension cache
