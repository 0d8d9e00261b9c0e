"""Tier 1: GroupedExperts against autograd of the plain per-expert SwiGLU and a float64 reference.

Paths: the loop (``_LoopSwiGLU``), torch._grouped_mm (``_GroupedSwiGLU``, where ``_grouped_mm_works``:
its 16-byte stride rule, dtypes, group count) and, for padded rows (the sync-free dispatch), the grouped
path or the [e, R, H] slab fallback (``_padded_bmm_swiglu``). Padding rows may hold NaN: their output
and input-gradient rows are 0 and the weight gradients equal an unpadded run's; no host sync
(``HostSyncs``), forward or backward.
"""
import pytest
import torch

from moe_comm.modules import experts as experts_mod
from moe_comm.modules.experts import GroupedExperts, _blocks, _grouped_mm_works, _LoopSwiGLU, _use_grouped_mm, swiglu
from moe_comm.testing.syncs import HostSyncs


@pytest.mark.parametrize("counts", [[3, 0, 5], [0, 0, 4], [0, 0, 0], [7, 1, 2]])
def test_grouped_experts_match_plain_swiglu(counts):
    torch.manual_seed(0)
    ex = GroupedExperts(3, 6, 5, seed=2).double()
    R = sum(counts)
    x = torch.randn(R, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(R, 6, dtype=torch.float64)
    y = ex(x, torch.tensor(counts), counts=counts)
    (y * g).sum().backward()
    ref, ref_x_grad, ref_w_grads = _reference(ex, x, counts, g)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(x.grad, ref_x_grad)
    for p, r in zip((ex.w1, ex.w3, ex.w2), ref_w_grads):
        torch.testing.assert_close(p.grad, r)


def test_grouped_experts_gradcheck():
    torch.manual_seed(1)
    ex = GroupedExperts(2, 4, 3, seed=0).double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    def fn(x, w1, w3, w2):
        return _LoopSwiGLU.apply(x, w1, w3, w2, _blocks([2, 3]))
    assert torch.autograd.gradcheck(fn, (x, ex.w1, ex.w3, ex.w2))


def test_counts_must_cover_the_rows():
    ex = GroupedExperts(2, 4, 3)
    with pytest.raises(ValueError, match="counts must hold e = 2 row counts summing to R = 5"):
        ex(torch.randn(5, 4), torch.tensor([2, 2]), counts=[2, 2])


@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16])
def test_grouped_experts_under_autocast(amp_dtype):
    """fp32 experts under torch.autocast(cpu): the GEMMs run in the autocast dtype (the output equals the
    same experts cast to it), the weight gradients come back to the fp32 parameters."""
    ex = GroupedExperts(3, 8, 6, seed=4)
    counts = [2, 0, 5]
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with torch.autocast("cpu", dtype=amp_dtype):
        y = ex(x, torch.tensor(counts), counts=counts)
    assert y.dtype == amp_dtype
    low = GroupedExperts(3, 8, 6, seed=4).to(amp_dtype)
    assert torch.equal(y, low(x.detach().to(amp_dtype), torch.tensor(counts), counts=counts))
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in (ex.w1, ex.w3, ex.w2))
    assert ex.w1.grad[1].eq(0).all() and ex.w1.grad[0].abs().sum() > 0  # expert 1 got no rows
    with torch.autocast("cpu", dtype=amp_dtype):  # float64 rows: autocast leaves them alone
        y64 = ex.double()(x.detach().double(), torch.tensor(counts), counts=counts)
    assert y64.dtype == torch.float64


# ---------------------------------------------------------------------------------- torch._grouped_mm path
def _experts(e, H, F_, dtype, seed=3):
    return GroupedExperts(e, H, F_, seed=seed).to(dtype)


def _reference(ex, x, counts, g):
    """float64 per-expert SwiGLU with autograd: (y, x.grad, [w1, w3, w2 grads]), all float64."""
    ws = [p.detach().double().requires_grad_(True) for p in (ex.w1, ex.w3, ex.w2)]
    x64 = x.detach().double().requires_grad_(True)
    outs, start = [], 0
    for i, n in enumerate(counts):
        outs.append(swiglu(x64[start:start + n], ws[0][i], ws[1][i], ws[2][i]))
        start += n
    y = torch.cat(outs)
    (y * g.double()).sum().backward()
    return y.detach(), x64.grad, [w.grad if w.grad is not None else torch.zeros_like(w) for w in ws]


def _run(ex, x, counts_e, g, **kw):
    """(y, x.grad, [weight grads]) of GroupedExperts on a fresh leaf copy of x."""
    for p in (ex.w1, ex.w3, ex.w2):
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    y = ex(x, torch.tensor(counts_e, device=x.device), **kw)
    y.backward(g)
    return y.detach(), x.grad, [p.grad for p in (ex.w1, ex.w3, ex.w2)]


def _loop(ex, x, counts, g):
    """The same experts through _LoopSwiGLU, whatever _use_grouped_mm says."""
    ws = [p.detach().clone().requires_grad_(True) for p in (ex.w1, ex.w3, ex.w2)]
    x = x.detach().clone().requires_grad_(True)
    y = _LoopSwiGLU.apply(x, *ws, _blocks(counts))
    y.backward(g)
    return y.detach(), x.grad, [w.grad for w in ws]


_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=5e-2, atol=5e-2),
        torch.float16: dict(rtol=1e-2, atol=1e-2), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def _operands(e, R, H, F_, dtype):
    return (torch.empty(R, H, dtype=dtype), torch.empty(e, F_, H, dtype=dtype), torch.empty(e, F_, H, dtype=dtype),
            torch.empty(e, H, F_, dtype=dtype))


@pytest.mark.parametrize("dtype, R, H, F_, e, expect", [
    (torch.float32, 10, 16, 32, 3, True),
    (torch.float32, 10, 4, 8, 1, True),        # 4 fp32 = 16 bytes
    (torch.float32, 10, 6, 8, 3, False),       # H stride 24 bytes
    (torch.bfloat16, 10, 16, 24, 3, True),
    (torch.bfloat16, 10, 12, 16, 3, False),    # H not a multiple of 8: forward would raise
    (torch.bfloat16, 10, 16, 12, 3, False),    # F not a multiple of 8: forward runs, backward would raise
    (torch.float16, 10, 8, 8, 2, True),
    (torch.float64, 10, 16, 16, 3, False),     # not a _grouped_mm dtype
    (torch.float32, 0, 16, 16, 3, False),      # R = 0: the weight-gradient GEMM has no valid stride
    (torch.float32, 10, 16, 16, 1024, False),  # CUDA kernel: fewer than 1024 groups
])
def test_grouped_mm_rule(dtype, R, H, F_, e, expect):
    ops = _operands(e, R, H, F_, dtype)
    assert _grouped_mm_works(*ops) is expect
    assert _use_grouped_mm(*ops, padded=True) is expect
    assert not _use_grouped_mm(*ops), "CPU, unpadded: the loop (as fast or faster)"
    if R and e < 1024 and dtype != torch.float64:  # the stride rule: the grouped path raises exactly there
        x, *ws = (torch.randn(t.shape).to(dtype).requires_grad_(True) for t in ops)
        counts = torch.tensor([R // e] * (e - 1) + [R - R // e * (e - 1)])

        def fwd_bwd():
            experts_mod._GroupedSwiGLU.apply(x, *ws, counts, False).sum().backward()
        if expect:
            fwd_bwd()
        else:
            with pytest.raises(RuntimeError, match="strides should be multiple of 16 bytes"):
                fwd_bwd()


def test_grouped_mm_rule_checks_every_operand_layout():
    x, w1, w3, w2 = _operands(2, 10, 16, 16, torch.float32)
    assert _grouped_mm_works(x, w1, w3, w2)
    assert not _grouped_mm_works(torch.empty(10, 18)[:, :16], w1, w3, w2)       # row stride 72 bytes
    assert _grouped_mm_works(torch.empty(10, 20)[:, :16], w1, w3, w2)           # row stride 80 bytes
    assert not _grouped_mm_works(torch.empty(1, 16).expand(10, 16), w1, w3, w2)     # row stride 0
    assert not _grouped_mm_works(x, w1, torch.empty(2, 16, 18)[..., :16], w2)   # one weight misaligned
    assert not _grouped_mm_works(x, w1, w3, w2.double())                       # mixed dtypes
    assert not _grouped_mm_works(x, torch.empty(2, 16, 1).expand(2, 16, 16), w3, w2)  # stride 0


@pytest.mark.parametrize("dtype, H, F_, counts, grouped", [
    (torch.float32, 16, 32, [3, 0, 7], True),
    (torch.float32, 16, 32, [0, 0, 6], True),     # zero-row experts
    (torch.float32, 8, 12, [9], True),            # e = 1
    (torch.bfloat16, 16, 24, [4, 5, 0, 2], True),
    (torch.float16, 16, 8, [5, 1], True),
    (torch.bfloat16, 12, 16, [3, 0, 7], False),   # H not a multiple of 8: the loop, not an error
    (torch.bfloat16, 16, 12, [3, 0, 7], False),   # F not a multiple of 8 (backward would raise)
    (torch.float32, 16, 32, [0, 0, 0], False),    # R = 0
])
def test_grouped_and_loop_match_float64_reference(dtype, H, F_, counts, grouped):
    """The grouped GEMM path, the loop, and the module (unpadded: the loop on CPU; padded=True with no
    padding row: the grouped path where it works, else the slab fallback) against float64."""
    ex = _experts(len(counts), H, F_, dtype)
    gen = torch.Generator().manual_seed(5)
    R = sum(counts)
    x = torch.randn(R, H, generator=gen).to(dtype)
    g = torch.randn(R, H, generator=gen).to(dtype)
    assert _grouped_mm_works(x, ex.w1, ex.w3, ex.w2) is grouped
    ref = _reference(ex, x, counts, g)
    runs = [_loop(ex, x, counts, g), _run(ex, x, counts, g), _run(ex, x, counts, g, padded=True)]
    if grouped:
        runs.append(_grouped(ex, x, counts, g))
    tol = _TOL[dtype]
    for run in runs:
        for got, loop, want in zip((run[0], run[1], *run[2]), (runs[0][0], runs[0][1], *runs[0][2]),
                                   (ref[0], ref[1], *ref[2])):
            assert got.dtype == dtype
            torch.testing.assert_close(got.double(), want, **tol)
            torch.testing.assert_close(got, loop, **tol)
        for i, n in enumerate(counts):
            if n == 0:
                assert all(w[i].eq(0).all() for w in run[2]), "an expert with no rows gets a zero gradient"


def _grouped(ex, x, counts, g):
    """The same experts through _GroupedSwiGLU directly."""
    ws = [p.detach().clone().requires_grad_(True) for p in (ex.w1, ex.w3, ex.w2)]
    x = x.detach().clone().requires_grad_(True)
    y = experts_mod._GroupedSwiGLU.apply(x, *ws, torch.tensor(counts, device=x.device), False)
    y.backward(g)
    return y.detach(), x.grad, [w.grad for w in ws]


def test_grouped_zero_fill_of_empty_experts(monkeypatch):
    """The CUDA-only fill of empty experts' weight gradients, run on CPU: the same gradients."""
    ex = _experts(3, 16, 16, torch.float32)
    x, g = torch.randn(7, 16), torch.randn(7, 16)
    plain = _grouped(ex, x, [3, 0, 4], g)
    monkeypatch.setattr(experts_mod, "_GMM_ZERO_EMPTY_DEVICES", ("cuda", "cpu"))
    filled = _grouped(ex, x, [3, 0, 4], g)
    assert all(torch.equal(a, b) for a, b in zip(plain[2], filled[2])) and filled[2][0][1].eq(0).all()


def test_grouped_path_takes_an_expanded_gradient():
    """y.sum().backward() hands the grouped backward a [R, H] gradient of strides (0, 0), which
    torch._grouped_mm rejects as an operand."""
    ex = _experts(2, 16, 16, torch.float32)
    x = torch.randn(6, 16, requires_grad=True)
    assert _use_grouped_mm(x, ex.w1, ex.w3, ex.w2, padded=True)
    ex(x, torch.tensor([2, 4]), padded=True).sum().backward()
    ref = _loop(ex, x, [2, 4], torch.ones(6, 16))
    torch.testing.assert_close(x.grad, ref[1])
    torch.testing.assert_close(ex.w1.grad, ref[2][0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_mm_on_cuda():
    """bf16 takes torch._grouped_mm's CUTLASS kernel on sm90 / sm100 only; the result matches the loop."""
    dev = torch.device("cuda")
    ex = GroupedExperts(4, 64, 128, seed=1).to(dev, torch.bfloat16)
    counts = [5, 0, 40, 19]
    x = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    g = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    grouped = torch.cuda.get_device_capability(dev)[0] in (9, 10)
    assert _use_grouped_mm(x, ex.w1, ex.w3, ex.w2) is grouped
    assert not _use_grouped_mm(x.float(), ex.w1.float(), ex.w3.float(), ex.w2.float())
    y, gx, gws = _run(ex, x, counts, g)
    ly, lgx, lgws = _loop(ex, x, counts, g)
    for got, loop in zip((y, gx, *gws), (ly, lgx, *lgws)):
        torch.testing.assert_close(got, loop, **_TOL[torch.bfloat16])
    assert gws[0][1].eq(0).all()
    # padded, sync-free: CUDA itself raises on a sync; padding rows hold NaN
    xp = torch.cat([x, torch.full((16, 64), float("nan"), device=dev, dtype=x.dtype)]).requires_grad_(True)
    gp = torch.cat([g, torch.full((16, 64), float("nan"), device=dev, dtype=g.dtype)])
    for module in (ex, GroupedExperts(4, 64, 128, seed=1).to(dev)):  # bf16: grouped (sm90/100); fp32: slabs
        tpe = torch.tensor(counts, device=dev)
        xi = xp.detach().to(module.w1.dtype).requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yp = module(xi, tpe, padded=True)
            yp.backward(gp.to(yp.dtype))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert yp[64:].eq(0).all() and xi.grad[64:].eq(0).all()
        assert all(p.grad.isfinite().all() for p in module.parameters())


# ---------------------------------------------------------------------------------- padded, sync-free path
_PATHS = {  # path -> (dtype, H, F): "grouped" takes torch._grouped_mm, "bmm" the [e, R, H] slab fallback
    "grouped": (torch.float32, 16, 32),
    "bmm": (torch.float32, 12, 10),      # 12 fp32 = 48 bytes: aligned; F = 10: 40 bytes, not
    "bmm_bf16": (torch.bfloat16, 12, 16),
}


def _padded_case(path, counts, P, seed=7):
    dtype, H, F_ = _PATHS[path]
    ex = _experts(len(counts), H, F_, dtype)
    gen = torch.Generator().manual_seed(seed)
    n = sum(counts)
    x_valid = torch.randn(n, H, generator=gen).to(dtype)
    g_valid = torch.randn(n, H, generator=gen).to(dtype)
    nan = torch.full((P, H), float("nan"), dtype=dtype)
    return ex, x_valid, g_valid, torch.cat([x_valid, nan]), torch.cat([g_valid, nan])


@pytest.mark.parametrize("path", list(_PATHS))
@pytest.mark.parametrize("counts, P", [([3, 0, 7], 5), ([0, 0, 0], 4), ([6], 2), ([2, 4], 0), ([0, 5, 1], 9),
                                      ([0, 0], 0)])
def test_padded_equals_unpadded_and_padding_adds_nothing(path, counts, P):
    """Padding rows (and their upstream gradient rows) full of NaN: output rows 0, input-gradient rows
    0, weight gradients equal to the unpadded run's on the valid rows alone. Same GEMM path: exactly."""
    ex, x_valid, g_valid, x, g = _padded_case(path, counts, P)
    n = x_valid.shape[0]
    assert _use_grouped_mm(x, ex.w1, ex.w3, ex.w2, padded=True) is (path == "grouped" and x.shape[0] > 0)
    y, gx, gws = _run(ex, x, counts, g, padded=True)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert y[n:].eq(0).all() and gx[n:].eq(0).all()
    assert all(w.isfinite().all() for w in gws)
    if path == "grouped" and n:  # the same per-group GEMMs, unpadded
        uy, ugx, ugws = _grouped(ex, x_valid, counts, g_valid)
    else:
        uy, ugx, ugws = _run(ex, x_valid, counts, g_valid, counts=counts)
    if path == "grouped":
        assert torch.equal(y[:n], uy) and torch.equal(gx[:n], ugx)
        assert all(torch.equal(a, b) for a, b in zip(gws, ugws))
    else:
        tol = _TOL[x.dtype]
        torch.testing.assert_close(y[:n], uy, **tol)
        torch.testing.assert_close(gx[:n], ugx, **tol)
        for a, b in zip(gws, ugws):
            torch.testing.assert_close(a, b, **tol)
    for i, c in enumerate(counts):
        if c == 0:
            assert all(w[i].eq(0).all() for w in gws)


def test_padded_bmm_matches_float64_reference(monkeypatch):
    """The slab fallback on a shape the grouped path would take (forced off), against float64."""
    monkeypatch.setattr(experts_mod, "_use_grouped_mm", lambda *a: False)
    counts, P = [4, 0, 3, 5], 3
    ex, x_valid, g_valid, x, g = _padded_case("grouped", counts, P)
    y, gx, gws = _run(ex, x, counts, g, padded=True)
    ry, rgx, rgws = _reference(ex, x_valid, counts, g_valid)
    n = x_valid.shape[0]
    for got, ref in zip((y[:n], gx[:n], *gws), (ry, rgx, *rgws)):
        torch.testing.assert_close(got.double(), ref, **_TOL[torch.float32])
    assert y[n:].eq(0).all() and gx[n:].eq(0).all()


@pytest.mark.parametrize("path", list(_PATHS))
def test_padded_path_has_no_host_sync(path):
    """No host read and no sync-prone op (nonzero, bool-mask index, bincount, unbounded repeat_interleave,
    unique, masked_select, .item/.tolist/.cpu), forward and backward."""
    ex, _, _, x, g = _padded_case(path, [3, 0, 7], 5)
    x.requires_grad_(True)
    tpe = torch.tensor([3, 0, 7])
    with HostSyncs() as s:
        ex(x, tpe, padded=True).backward(g)
    assert s.count == 0, s.report()
    with HostSyncs() as s:  # the recorder sees the unpadded loop's one read of the counts
        ex.double()(x.detach().double()[:10], tpe)
    assert [e.what for e in s.events] == ["tolist"], s.report()


@pytest.mark.parametrize("path", ["grouped", "bmm"])
def test_padded_under_autocast(path):
    """As the unpadded path: GEMMs in the autocast dtype (equal to the experts cast to it), weight
    gradients back in the parameters' dtype."""
    H, F_ = (16, 16) if path == "grouped" else (12, 10)
    ex = GroupedExperts(3, H, F_, seed=4)
    counts, P = [2, 0, 5], 3
    x = torch.randn(7 + P, H, generator=torch.Generator().manual_seed(0))
    x[7:] = float("nan")
    x.requires_grad_(True)
    tpe = torch.tensor(counts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ex(x, tpe, padded=True)
    assert y.dtype == torch.bfloat16 and y[7:].eq(0).all()
    low = GroupedExperts(3, H, F_, seed=4).to(torch.bfloat16)
    assert _use_grouped_mm(x.detach().to(torch.bfloat16), low.w1, low.w3, low.w2, True) is (path == "grouped")
    assert torch.equal(y, low(x.detach().to(torch.bfloat16), tpe, padded=True))
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and x.grad[7:].eq(0).all()
    assert all(p.grad.dtype == torch.float32 and p.grad.isfinite().all() for p in (ex.w1, ex.w3, ex.w2))
    assert ex.w1.grad[1].eq(0).all() and ex.w1.grad[0].abs().sum() > 0


def test_padded_takes_no_host_counts():
    ex = GroupedExperts(2, 8, 8)
    with pytest.raises(ValueError, match="padded=True takes no host counts"):
        ex(torch.randn(5, 8), torch.tensor([2, 2]), counts=[2, 2], padded=True)
    assert GroupedExperts.supports_padded and GroupedExperts.wants_host_counts


@pytest.mark.parametrize("path", ["loop", "grouped_padded", "bmm_padded"])
def test_weight_grads_deferred_equal_immediate(path):
    """Inside ``_wgrad.deferring()`` the experts' backward gives the input gradient only; ``run()`` then adds
    bit-identical weight gradients to .grad (through the autocast cast too)."""
    from moe_comm import _wgrad

    counts = [5, 0, 3]
    ex = GroupedExperts(3, 8, 16, seed=1)
    x = torch.randn(sum(counts) + (2 if path != "loop" else 0), 8, generator=torch.Generator().manual_seed(0))
    g = torch.randn_like(x)
    kw = dict(counts=counts) if path == "loop" else dict(padded=True)
    if path == "bmm_padded":
        ex = GroupedExperts(3, 7, 16, seed=1)  # H = 7 floats: not 16-byte rows, so no torch._grouped_mm
        x, g = x[:, :7].contiguous(), g[:, :7].contiguous()

    def grads(defer, amp):
        ex.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            y = ex(xi, torch.tensor(counts), **kw)
        if defer:
            with _wgrad.deferring() as later:
                y.backward(g.to(y.dtype))
            assert all(p.grad is None for p in ex.parameters()), "weight gradients wait for run()"
            later.run()
        else:
            y.backward(g.to(y.dtype))
        return [xi.grad] + [p.grad.clone() for p in (ex.w1, ex.w3, ex.w2)]

    for amp in (False, True):
        for a, b in zip(grads(True, amp), grads(False, amp)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("path", ["loop", "grouped_padded", "bmm_padded"])
def test_weight_grad_sums_over_chunks(path):
    """``_wgrad.GradSums``: the weight gradients of several chunks, summed (the loop's GEMMs add in place, the
    other paths' results are added) and handed to autograd once, equal the chunk-by-chunk accumulation into
    .grad to float rounding, on top of a .grad that already holds a value; nothing reaches .grad before flush."""
    from moe_comm import _wgrad

    H = 8 if path != "bmm_padded" else 7  # 7 floats: no torch._grouped_mm
    ex = GroupedExperts(3, H, 16, seed=1)
    gen = torch.Generator().manual_seed(0)
    chunks = [[5, 0, 3], [0, 4, 2], [1, 1, 6]]
    xs = [torch.randn(sum(c) + (2 if path != "loop" else 0), H, generator=gen) for c in chunks]
    gs = [torch.randn_like(x) for x in xs]
    start = [torch.randn_like(p) for p in ex.parameters()]

    def grads(summed, amp):
        for p, s in zip(ex.parameters(), start):
            p.grad = s.clone()
        sums = _wgrad.GradSums() if summed else None
        for counts, x, g in zip(chunks, xs, gs):
            kw = dict(counts=counts) if path == "loop" else dict(padded=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                y = ex(x.clone().requires_grad_(True), torch.tensor(counts), **kw)
            with _wgrad.deferring() as later:
                y.backward(g.to(y.dtype))
            later.run(sums)
            # one entry: the chunks' gradients all go to the Parameters (autocast too: no per-chunk cast inputs)
            assert sums is None or len(sums.entries) == 1
        if summed:
            assert all(torch.equal(p.grad, s) for p, s in zip(ex.parameters(), start)), "flush() adds them"
        if summed:
            sums.flush()
        return [p.grad.clone() for p in ex.parameters()]

    for amp in (False, True):
        for a, b in zip(grads(True, amp), grads(False, amp)):
            assert not torch.equal(a, ex.w1.new_zeros(a.shape))
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------- autocast: what backward keeps
_AMP_PATHS = {  # path -> (H, F, forward kwargs of chunk (counts, segments)); bf16 GEMMs
    "loop": (8, 16, lambda counts, segs: dict(counts=counts)),
    "segments": (8, 16, lambda counts, segs: dict(segments=segs)),
    "grouped_padded": (8, 16, lambda counts, segs: dict(padded=True)),
    "bmm_padded": (12, 10, lambda counts, segs: dict(padded=True)),  # F = 10 bf16: 20-byte rows, no _grouped_mm
}
_AMP_CHUNKS = [[5, 0, 3], [0, 4, 2], [1, 1, 6], [3, 2, 0]]  # rows per local expert, per chunk (C = 4)


def _forward_saving_casts(ex, x_RH, tokens_per_expert_e, counts=None, padded=False, segments=None):
    """GroupedExperts.forward under autocast as it was before issue 26.4: the weights cast with autograd, outside
    the expert Function, which saved the cast copies (one per call) for backward."""
    amp = torch.get_autocast_dtype("cpu")
    if segments is not None:
        segments = experts_mod._check_segments(segments, x_RH.shape[0], ex.num_local_experts)
    with torch.autocast("cpu", enabled=False):
        return GroupedExperts._compute(x_RH.to(amp), *(w.to(amp) for w in (ex.w1, ex.w3, ex.w2)),
                                       tokens_per_expert_e, counts, padded, segments)


def _amp_chunks(path):
    """(experts, [(x, g, counts, segments)] per chunk) for ``_AMP_PATHS[path]``; padded paths get 2 NaN rows."""
    H, F_, _ = _AMP_PATHS[path]
    ex = GroupedExperts(3, H, F_, seed=1)
    gen = torch.Generator().manual_seed(0)
    chunks = []
    for counts in _AMP_CHUNKS:
        n = sum(counts)
        x, g = torch.randn(n, H, generator=gen), torch.randn(n, H, generator=gen)
        if path.endswith("padded"):
            x = torch.cat([x, torch.full((2, H), float("nan"))])
            g = torch.cat([g, torch.full((2, H), float("nan"))])
        segs = [(i, sum(counts[:i]), c) for i, c in enumerate(counts)][::-1]  # experts in reverse row order...
        start, segments = 0, []
        for i, _, c in segs:  # ...so the rows are not expert-major
            segments.append((i, start, c))
            start += c
        chunks.append((x, g, counts, segments))
    return ex, chunks


def _amp_step(ex, chunks, path, forward, defer):
    """One pipelined-like step under bf16 autocast: every chunk's forward, then every chunk's backward with the
    weight gradients deferred and summed over the chunks as the pipeline does (``defer``), or plain backward.
    Returns ([y], [x.grad], [w.grad]) and the bytes saved for backward (distinct storages, Parameters left out)."""
    from moe_comm import _wgrad

    ex.zero_grad(set_to_none=True)
    params = {p.untyped_storage().data_ptr() for p in ex.parameters()}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    kw_of = _AMP_PATHS[path][2]
    outs = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        for x, g, counts, segments in chunks:
            xi = x.clone().requires_grad_(True)
            outs.append((xi, forward(ex, xi, torch.tensor(counts), **kw_of(counts, segments)), g))
    sums = _wgrad.GradSums()
    for xi, y, g in outs:
        if defer:
            with _wgrad.deferring() as later:
                y.backward(g.to(y.dtype))
            later.run(sums)
        else:
            y.backward(g.to(y.dtype))
    sums.flush()
    ys = [y.detach() for _, y, _ in outs]
    return ys, [xi.grad for xi, _, _ in outs], [p.grad for p in ex.parameters()], sum(saved.values())


@pytest.mark.parametrize("path", list(_AMP_PATHS))
def test_autocast_keeps_no_weight_copy_and_the_same_gradients(path):
    """Issue 26.4. Under bf16 autocast, 4 calls (the chunks of one pipelined forward) kept 4 bf16 copies of
    w1, w3, w2 for backward; now none (the fp32 Parameters are kept; backward casts them again). Outputs,
    input gradients and weight gradients are bit-identical to the path that saved the cast copies, with the
    weight gradients deferred and summed over the chunks (the pipeline's backward) or not."""
    ex, chunks = _amp_chunks(path)
    H, F_, _ = _AMP_PATHS[path]
    e, C = ex.num_local_experts, len(chunks)
    copy = 3 * e * F_ * H * 2  # w1, w3 [e, F, H] and w2 [e, H, F] in bf16
    for defer in (True, False):
        y0, gx0, gw0, saved0 = _amp_step(ex, chunks, path, _forward_saving_casts, defer)
        y1, gx1, gw1, saved1 = _amp_step(ex, chunks, path, GroupedExperts.forward, defer)
        assert saved0 - saved1 == C * copy, (saved0, saved1, C * copy)
        for a, b in zip(y0 + gx0 + gw0, y1 + gx1 + gw1):
            assert a.dtype == b.dtype and torch.equal(a.nan_to_num(), b.nan_to_num())
        assert all(g.dtype == torch.float32 for g in gw1)
    # what is left: the chunks' bf16 GEMM inputs and activations only (no [e, ...] tensor at all)
    rows = sum(x.shape[0] for x, *_ in chunks)
    if path == "bmm_padded":  # the slab fallback keeps x [e, R, H], h1 and h3 [e, R, F] per chunk (by design)
        assert saved1 >= e * rows * (H + 2 * F_) * 2
    else:
        assert saved1 <= rows * (H + 2 * F_) * 2 + 64 * C, saved1  # + offs / pad mask of the grouped path


@pytest.mark.parametrize("C", [1, 4])
def test_autocast_layer_gradients_equal_the_saved_cast_path(C, monkeypatch):
    """A whole MoELayer (W = 1, bf16 autocast, C chunks through the pipeline, weight gradients deferred and summed
    over the chunks): output and every gradient bit-identical to GroupedExperts saving its cast copies (before
    issue 26.4), from .grad = None. A second backward accumulating onto .grad agrees to rounding: the chunks'
    fp32 gradients are now summed before they are added to .grad (as without autocast), not added one by one."""
    import moe_comm

    cfg = moe_comm.MoEConfig(hidden_size=16, ffn_hidden_size=32, num_experts=4, top_k=2, num_chunks=C)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(3))
    g = torch.randn(64, 16, generator=torch.Generator().manual_seed(4))

    def grads(forward):
        with monkeypatch.context() as m:
            m.setattr(GroupedExperts, "forward", forward)
            layer = moe_comm.MoELayer(cfg, seed=5)
            out = []
            for _ in range(2):  # the second step accumulates onto .grad
                xi = x.clone().requires_grad_(True)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = layer(xi)
                y.backward(g.to(y.dtype))
                out.append([y.detach(), xi.grad] + [p.grad.clone() for p in layer.parameters() if p.grad is not None])
        return out

    (old1, old2), (new1, new2) = grads(_forward_saving_casts), grads(GroupedExperts.forward)
    assert len(old1) == len(new1) == 6  # y, x, router, w1, w3, w2
    for a, b in zip(old1, new1):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(old2, new2):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_autocast_backward_sees_an_in_place_weight_update():
    """The Parameters themselves are saved under autocast now: changing one between forward and backward is
    autograd's version error (the cast copies used to hide it, and backward used the old weights)."""
    ex = GroupedExperts(2, 8, 16, seed=1)
    x = torch.randn(6, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ex(x, torch.tensor([4, 2]), counts=[4, 2])
    with torch.no_grad():
        ex.w1.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.float().sum().backward()


# ---------------------------------------------------------------------------------- rows in (rank, expert) blocks
def test_segments_equal_expert_major_rows():
    """Rows in (source rank, expert) blocks with segments= (an expert in three blocks, one in none, a block of
    one row) give, row for row, the output and input gradient of the same rows expert-major, and the same
    weight gradients (float64)."""
    ex = GroupedExperts(3, 8, 12, seed=2).double()
    blocks = [(0, 4), (2, 1), (0, 3), (2, 5), (0, 2)]  # (expert, rows) in row order; expert 1 has none
    segments, start = [], 0
    for i, n in blocks:
        segments.append((i, start, n))
        start += n
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(start, 8, generator=gen, dtype=torch.float64)
    g = torch.randn(start, 8, generator=gen, dtype=torch.float64)
    order = sorted(range(len(blocks)), key=lambda b: blocks[b][0])  # expert-major, blocks keep their order
    index = torch.cat([torch.arange(segments[b][1], segments[b][1] + segments[b][2]) for b in order])
    counts = [sum(n for i, n in blocks if i == j) for j in range(3)]
    y, gx, gw = _run(ex, x, counts, g, segments=segments)
    y_ref, gx_ref, gw_ref = _run(ex, x[index], counts, g[index], counts=counts)
    torch.testing.assert_close(y[index], y_ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(gx[index], gx_ref, rtol=1e-13, atol=1e-13)
    for a, b in zip(gw, gw_ref):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    assert gw[0][1].eq(0).all() and gw[0][0].abs().sum() > 0


@pytest.mark.parametrize("segments,kw", [
    ([(0, 0, 2), (1, 3, 3)], {}),               # a gap: row 2 in no block
    ([(0, 0, 2), (1, 2, 2)], {}),               # short of R = 5
    ([(0, 0, 2), (2, 2, 3)], {}),               # local expert 2 of 2
    ([(0, 0, 5)], {"counts": [5, 0]}),          # segments and counts
    ("abc", {}),
])
def test_segments_must_cover_the_rows_in_order(segments, kw):
    ex = GroupedExperts(2, 4, 3)
    with pytest.raises(ValueError, match="segments"):
        ex(torch.randn(5, 4), torch.tensor([2, 3]), segments=segments, **kw)


def test_prefers_segments_on_cpu_for_large_blocks_only():
    ex = GroupedExperts(2, 16, 1024)  # F / 2 = 512 > 256
    cpu = torch.device("cpu")
    assert ex.prefers_segments(512, cpu) and not ex.prefers_segments(511, cpu)
    small = GroupedExperts(2, 16, 32)  # F / 2 = 16 < 256
    assert small.prefers_segments(256, cpu) and not small.prefers_segments(255, cpu)
    assert not ex.prefers_segments(1 << 20, torch.device("cuda", 0))


def test_a_subclass_whose_forward_takes_no_segments_keeps_expert_major_rows():
    """The Dispatcher asks ``prefers_segments`` only of experts whose call takes ``segments=``: a subclass that
    overrides ``forward`` without it (inheriting ``prefers_segments``) would otherwise get a TypeError at the
    block sizes where the rule says yes."""
    from moe_comm.dispatch.plan import rank_major_pays

    class Logged(GroupedExperts):
        def forward(self, tokens_RH, tokens_per_expert_e, counts=None, padded=False):
            return super().forward(tokens_RH, tokens_per_expert_e, counts=counts, padded=padded)

    class Passes(GroupedExperts):
        def forward(self, tokens_RH, tokens_per_expert_e, **kwargs):
            return super().forward(tokens_RH, tokens_per_expert_e, **kwargs)

    cpu = torch.device("cpu")
    args = (2, 16, 32)
    assert rank_major_pays(GroupedExperts(*args), 1024, cpu)
    assert rank_major_pays(Passes(*args), 1024, cpu)
    assert not rank_major_pays(Logged(*args), 1024, cpu)
    assert not rank_major_pays(GroupedExperts(*args), 16, cpu)  # the rule itself still decides
    assert not rank_major_pays(lambda t, n: t, 1024, cpu)  # no prefers_segments: expert-major rows

    class Unhashable:  # a callable object that cannot key a cache
        __hash__ = None

        def prefers_segments(self, block_rows, device):
            return True

        def __call__(self, tokens_RH, tokens_per_expert_e, segments=None):
            return tokens_RH

    assert rank_major_pays(Unhashable(), 1024, cpu)
