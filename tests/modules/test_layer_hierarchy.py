"""MoELayer with two-level dispatch (``MoEConfig(ranks_per_node=)``), tier 2 (gloo ranks; nodes are rank blocks).

- The same layer flat and two-level, 2 x 2 and 2 x 4 ranks (same seed: same weights): output, input, router and
  expert gradients agree (float64: 1e-12; fp32: 1e-5), C = 1 and 4; with node-limited routing (num_groups = nodes,
  topk_groups = 1) every token's experts lie on one node and at most one row per token crosses; FP8 dispatch
  equals flat FP8 to 1e-5.
- An expert backward failing on one rank: every rank raises in ``backward()`` and no rank holds a partial
  expert gradient; the next step works.
- node_limited with num_groups that are not the nodes raises on every rank naming the fields.
"""
from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm.testing.faults import raise_in_backward

H, F, E, K = 8, 16, 8, 3


def _cfg(**kw):
    return moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, **kw)


def _step(layer, x):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    (y * torch.arange(1, H + 1, dtype=y.dtype)).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    load = {k: v.tolist() for k, v in layer.monitor.read_state().items()}
    return y.detach(), x.grad, grads, dict(layer.dispatcher.last_bytes), load


def _rank_compare(rank, world_size, L, dtype, extra):
    x = torch.randn(9 + 3 * rank, H, generator=torch.Generator().manual_seed(rank), dtype=dtype)
    out = {}
    for C in (1, 4):
        flat_extra = {k: v for k, v in extra.items() if k != "node_limited"}  # the same group-limited routing
        flat = moe_comm.MoELayer(_cfg(num_chunks=C, **flat_extra), seed=7, dtype=dtype)
        two = moe_comm.MoELayer(_cfg(num_chunks=C, ranks_per_node=L, **extra), seed=7, dtype=dtype)
        assert two.dispatcher.ranks_per_node == L
        out[C] = (_step(flat, x), _step(two, x))
    return out


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if a.numel() else 0.0


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,L,dtype,tol,extra", [
    (4, 2, torch.float64, 1e-12, {}),
    (4, 2, torch.float32, 1e-5, {}),
    (4, 2, torch.float64, 1e-12, dict(num_groups=2, topk_groups=1, node_limited=True)),
    (4, 2, torch.float32, 1e-5, dict(dispatch_dtype=torch.float8_e4m3fn)),
    (8, 4, torch.float64, 1e-12, dict(num_groups=2, topk_groups=1, node_limited=True)),  # 2 nodes x 4 ranks
    (8, 4, torch.float32, 1e-5, dict(dispatch_dtype=torch.float8_e4m3fn)),
])
def test_two_levels_equal_flat(ranks, world_size, L, dtype, tol, extra):
    for rank, res in enumerate(ranks(world_size).run(_rank_compare, L, dtype, extra)):
        for C, ((y, xg, grads, _, load), (y2, xg2, grads2, b, load2)) in res.items():
            assert repr(load) == repr(load2), (rank, C)  # the monitor saw the same global load
            assert _rel(y2, y) <= tol, (rank, C)
            assert _rel(xg2, xg) <= tol, (rank, C)
            assert grads.keys() == grads2.keys() and len(grads) >= 4  # router + the experts' three weights
            for n in grads:
                assert _rel(grads2[n], grads[n]) <= tol, (rank, C, n)
            if extra.get("node_limited"):  # one node per token: nothing or one row per token crosses
                assert b["rows_inter"] <= b["tokens"], (rank, b)
            assert b["dispatch_wire_inter"] + b["dispatch_wire_intra"] <= b["dispatch_wire"]


def _rank_failed_backward(rank, world_size):
    layer = moe_comm.MoELayer(_cfg(num_chunks=2, ranks_per_node=2), seed=4, timeout=30.0, monitor=False)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    if rank == 3:
        original = layer.experts.forward
        layer.experts.forward = lambda *a, **k: raise_in_backward(original(*a, **k))
    error = None
    try:
        layer(x).sum().backward()
    except Exception as e:  # noqa: BLE001 - the test reads the type and text
        error = f"{type(e).__name__}: {e}"
    if rank == 3:
        del layer.experts.forward
    partial = [p.grad is not None for p in layer.experts.parameters()]
    layer.zero_grad(set_to_none=True)
    x2 = torch.randn(12, H, generator=torch.Generator().manual_seed(10 + rank), requires_grad=True)
    layer(x2).sum().backward()
    next_ok = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in layer.experts.parameters())
    return error, partial, next_ok


@pytest.mark.multirank
def test_failed_backward_leaves_no_partial_expert_gradient(ranks):
    for rank, (error, partial, next_ok) in enumerate(ranks(4).run(_rank_failed_backward)):
        if rank == 3:
            assert error.startswith("RuntimeError: injected expert backward fault"), error
        else:
            assert error.startswith("PeerFailed") and "EP rank(s) [3]" in error, (rank, error)
        assert not any(partial), rank
        assert next_ok, rank


def _rank_groups_not_nodes(rank, world_size):
    try:
        moe_comm.MoELayer(_cfg(ranks_per_node=2, num_groups=4, topk_groups=2, node_limited=True), seed=1)
        return "built"
    except ValueError as e:
        return str(e)


@pytest.mark.multirank
def test_node_limited_groups_must_be_the_nodes(ranks):
    for text in ranks(4).run(_rank_groups_not_nodes):
        assert "node_limited: num_groups (4) must equal the number of nodes" in text, text


def test_config_checks():
    with pytest.raises(ValueError, match="node_limited needs ranks_per_node and num_groups"):
        _cfg(node_limited=True)
    with pytest.raises(ValueError, match="ranks_per_node"):
        _cfg(ranks_per_node=0)
    with pytest.raises(ValueError, match="ranks_per_node .* max_tokens_per_rank"):
        _cfg(ranks_per_node=2, max_tokens_per_rank=4)
