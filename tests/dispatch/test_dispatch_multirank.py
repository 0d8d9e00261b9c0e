"""Tier 2: raw dispatch/combine on W = 1, 2, 4 gloo ranks with self-checking payloads.

Each row carries (source rank, token id); every received row is checked against all ranks'
routing, including dropped slots, ranks with zero tokens and a rank whose tokens all pick one expert.
"""
import pytest
import torch

import moe_comm
from moe_comm.testing.payloads import self_check_dispatch

H = 12


def _tokens(rank):
    return [9, 0, 17, 5][rank]


def _routing(seed, E, K, drop, one_expert_rank):
    def routing_of(rank):
        g = torch.Generator().manual_seed(seed * 100 + rank)
        T = _tokens(rank)
        idx = torch.rand(T, E, generator=g).argsort(1)[:, :K]
        if rank == one_expert_rank:
            idx = torch.arange(K).expand(T, K).clone()
        if drop:
            idx[torch.rand(T, K, generator=g) < 0.3] = -1
        return idx
    return routing_of


def _dispatcher(E, direct, backend="auto"):
    # direct_min_bytes=0: point-to-point straight into expert-major rows; huge: all-to-all + regroup.
    return moe_comm.Dispatcher(num_experts=E, direct_min_bytes=0 if direct else 1 << 40, backend=backend)


def _rank_dispatch(rank, world_size, seed, E, K, drop, one_expert_rank, dtype, direct):
    d = _dispatcher(E, direct)
    routing_of = _routing(seed, E, K, drop, one_expert_rank)
    received = self_check_dispatch(d, routing_of, _tokens, H, dtype)
    took = d.dispatch(payload_rows(rank, dtype), routing_of(rank)).handle.direct
    return received, took


def payload_rows(rank, dtype):
    return torch.zeros(_tokens(rank), H, dtype=dtype)


@pytest.mark.multirank
@pytest.mark.parametrize("direct", [False, True], ids=["a2a_regroup", "direct"])
@pytest.mark.parametrize("world_size,E,K,drop,one_expert_rank,dtype", [
    (1, 4, 2, False, None, torch.float32),
    (2, 4, 3, True, None, torch.float32),
    (2, 2, 1, False, 0, torch.bfloat16),
    (4, 8, 2, True, 2, torch.float32),
    (4, 4, 4, False, None, torch.float16),
])
def test_dispatch_self_checking_payload(ranks, world_size, E, K, drop, one_expert_rank, dtype, direct):
    results = ranks(world_size).run(_rank_dispatch, 11, E, K, drop, one_expert_rank, dtype, direct)
    routing_of = _routing(11, E, K, drop, one_expert_rank)
    assert sum(r for r, _ in results) == sum(int((routing_of(r) >= 0).sum()) for r in range(world_size))
    # The path taken: direct only where asked and useful (more than one rank and local expert).
    assert {took for _, took in results} == {direct and world_size > 1 and E // world_size > 1}


def _rank_gradients(rank, world_size, direct, backend):
    """dispatch -> (rows * (g + 1)) -> combine: d y / d x = sum_k w_k (g_k + 1); d y / d w_k = (g_k + 1) x."""
    E, K, T = 8, 2, _tokens(rank)
    d = _dispatcher(E, direct, backend)
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    x = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, K, generator=g, dtype=torch.float64, requires_grad=True)
    out = d.dispatch(x, idx)
    e = d.num_local_experts
    scale_R = torch.repeat_interleave(torch.arange(rank * e, rank * e + e, dtype=torch.float64) + 1,
                                      out.tokens_per_expert, output_size=out.tokens.shape[0])
    assert out.handle.direct == direct
    y = d.combine(out.tokens * scale_R[:, None], w, out.handle)
    y.sum().backward()
    factor = (idx + 1).double()
    torch.testing.assert_close(y, x.detach() * (w.detach() * factor).sum(1, keepdim=True))
    torch.testing.assert_close(x.grad, ((w.detach() * factor).sum(1, keepdim=True)).expand(T, H))
    torch.testing.assert_close(w.grad, x.detach().sum(1, keepdim=True) * factor)
    return True


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("direct", [False, True], ids=["a2a_regroup", "direct"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_combine_gradients(ranks, world_size, direct, backend):
    assert all(ranks(world_size).run(_rank_gradients, direct, backend))


def _rank_direct_equals_a2a(rank, world_size, iters):
    """Random shapes per call (T may be 0 on some ranks, drops, skew): the point-to-point path and the
    all-to-all + regroup path give bit-identical tokens, outputs and gradients."""
    direct, a2a = {}, {}
    for it in range(iters):
        g = torch.Generator().manual_seed(1000 * it + rank)
        shared = torch.Generator().manual_seed(it)  # the same E, K on every rank
        E = world_size * int(torch.randint(1, 4, (1,), generator=shared))
        K = int(torch.randint(1, min(E, 4) + 1, (1,), generator=shared))
        T = int(torch.randint(0, 40, (1,), generator=g)) if rank != it % world_size else 0
        idx = torch.rand(T, E, generator=g).argsort(1)[:, :K]
        if it % 3 == 1:  # skew: most slots to expert 0
            idx[torch.rand(T, K, generator=g) < 0.6] = -1
            idx[:, 0] = 0
        x = torch.randn(T, H, generator=g, dtype=torch.float64)
        w = torch.rand(T, K, generator=g, dtype=torch.float64)
        results = []
        for table, use_direct in ((direct, True), (a2a, False)):
            d = table.setdefault(E, _dispatcher(E, use_direct))
            xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            out = d.dispatch(xg, idx)
            assert out.handle.direct == (use_direct and E > world_size)
            y = d.combine(out.tokens * 2 + 1, wg, out.handle)
            y.square().sum().backward()
            results.append((out.tokens.detach(), y.detach(), xg.grad, wg.grad))
        for a, b in zip(*results):
            assert torch.equal(a, b), (it, rank)
    return True


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_direct_path_equals_all_to_all_path(ranks, world_size):
    assert all(ranks(world_size).run(_rank_direct_equals_a2a, 24))


def _rank_timeline(rank, world_size, direct):
    E, K, T = 8, 2, 6
    d = _dispatcher(E, direct)
    d.timeline.enabled = True
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g, requires_grad=True)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    out = d.dispatch(x, idx)
    d.combine(out.tokens, torch.ones(T, K), out.handle).sum().backward()
    return sorted({(s.phase, s.kind, s.direction) for s in d.timeline.spans()})


@pytest.mark.multirank
@pytest.mark.parametrize("direct", [False, True], ids=["a2a_regroup", "direct"])
def test_dispatch_combine_timeline_spans(ranks, direct):
    """Every phase of dispatch/combine, forward and backward, is on the timeline; the regroup is a
    compute span of its own (not inside the comm span), and there is none on the direct path."""
    for phases in ranks(2).run(_rank_timeline, direct):
        expected = {("layout", "compute", "fwd"), ("permute", "compute", "fwd"), ("counts", "comm", "fwd"),
                    ("unpermute", "compute", "fwd"),
                    ("dispatch", "comm", "fwd"), ("combine", "comm", "fwd"),
                    ("combine", "comm", "bwd"), ("dispatch", "comm", "bwd"),
                    # control exchanges: combine's argument check, each backward's check-in
                    ("control", "comm", "fwd"), ("control", "comm", "bwd")}
        if not direct:
            expected |= {("regroup", "compute", d) for d in ("fwd", "bwd")}
        assert set(phases) == expected, phases


def _rank_combine_failed(rank, world_size):
    import moe_comm as mc

    E, T, K = 2 * world_size, 6, 2
    g = torch.Generator().manual_seed(rank)
    x, idx = torch.randn(T, 8, generator=g), torch.rand(T, E, generator=g).argsort(1)[:, :K]
    w = torch.rand(T, K, generator=g)
    d = mc.Dispatcher(E, timeout=20)
    out = d.dispatch(x, idx)
    err = RuntimeError("experts failed on purpose") if rank == world_size - 1 else None
    try:
        d.combine(out.tokens * 2.0 if err is None else None, w, out.handle, failed=err)
        first = "returned"
    except Exception as e:  # noqa: BLE001 - the test reads the type and text
        first = f"{type(e).__name__}: {e}"
    out = d.dispatch(x, idx)  # the next call works
    y = d.combine(out.tokens * 2.0, w, out.handle)
    return first, bool(torch.allclose(y, 2 * w.sum(1, keepdim=True) * x, atol=1e-6))


@pytest.mark.multirank
def test_combine_failed_raises_on_every_rank_instead_of_waiting(ranks):
    """combine(failed=err): an error met between dispatch() and combine() (the experts) goes out in combine's
    exchange, so every rank raises at once (not after a timeout), and the next call works."""
    for rank, (first, ok) in enumerate(ranks(2).run(_rank_combine_failed)):
        if rank == 1:
            assert first.startswith("RuntimeError: experts failed on purpose"), first
        else:
            assert first.startswith("PeerFailed") and "EP rank(s) [1]" in first, first
        assert ok, rank
