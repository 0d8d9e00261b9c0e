"""Tier 2: the whole MoELayer on W = 1, 2, 4 gloo ranks against a dense float64 reference.

Forward output and every gradient (x, router weight, w1, w3, w2, shared experts) must match the
reference computed in one process to a relative error <= 1e-4 (fp32 layer).
"""
from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm.modules.checkpoint import full_state_dict, load_full_state_dict

H, F = 24, 40


def _case(seed, cfg_kwargs, tokens_per_rank, same_expert_rank):
    """Global float64 data of one case, identical in every process."""
    g = torch.Generator().manual_seed(seed)
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, **cfg_kwargs)
    E, T = cfg.num_experts, sum(tokens_per_rank)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    if same_expert_rank is not None and tokens_per_rank[same_expert_rank] > 0:
        start = sum(tokens_per_rank[:same_expert_rank])
        x[start:start + tokens_per_rank[same_expert_rank]] = x[start]  # identical tokens: identical routing
    rw = torch.randn(E, H, generator=g, dtype=torch.float64) * H ** -0.5
    w1 = torch.randn(E, F, H, generator=g, dtype=torch.float64) * H ** -0.5
    w3 = torch.randn(E, F, H, generator=g, dtype=torch.float64) * H ** -0.5
    w2 = torch.randn(E, H, F, generator=g, dtype=torch.float64) * F ** -0.5
    Fs = cfg.shared_ffn_size
    shared = None
    if Fs:
        shared = (torch.randn(Fs, H, generator=g, dtype=torch.float64) * H ** -0.5,
                  torch.randn(Fs, H, generator=g, dtype=torch.float64) * H ** -0.5,
                  torch.randn(H, Fs, generator=g, dtype=torch.float64) * Fs ** -0.5)
    gy = torch.randn(T, H, generator=g, dtype=torch.float64)
    return cfg, x, rw, w1, w3, w2, shared, gy


def _rank_layer(rank, world_size, seed, cfg_kwargs, tokens_per_rank, same_expert_rank, backend):
    cfg, x, rw, w1, w3, w2, shared, gy = _case(seed, cfg_kwargs, tokens_per_rank, same_expert_rank)
    layer = moe_comm.MoELayer(cfg, backend=backend)
    e = cfg.num_experts // world_size
    local = slice(rank * e, (rank + 1) * e)
    with torch.no_grad():
        layer.router.weight.copy_(rw)
        layer.experts.w1.copy_(w1[local])
        layer.experts.w3.copy_(w3[local])
        layer.experts.w2.copy_(w2[local])
        if shared is not None:
            for p, v in zip((layer.shared_experts.w1, layer.shared_experts.w3, layer.shared_experts.w2), shared):
                p.copy_(v)
    start = sum(tokens_per_rank[:rank])
    rows = slice(start, start + tokens_per_rank[rank])
    x_local = x[rows].float().reshape(-1, 1, H).requires_grad_(True)  # a 3-D input: [..., H]
    y = layer(x_local)
    loss = (y.reshape(-1, H).double() * gy[rows]).sum() + layer.aux_loss
    loss.backward()
    grads = {"x": x_local.grad.reshape(-1, H), "router": layer.router.weight.grad}
    for name in ("w1", "w3", "w2"):
        p = getattr(layer.experts, name)
        grads[name] = torch.zeros_like(p) if p.grad is None else p.grad
    if shared is not None:
        grads["shared"] = torch.cat([p.grad.reshape(-1) for p in layer.shared_experts.parameters()])
    return y.detach().reshape(-1, H), float(layer.aux_loss), grads


def _rel(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    if b.numel() == 0:
        return 0.0
    # floor: a gradient that is 0 in exact arithmetic
    return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-6))


def _check_against_dense(results, seed, cfg_kwargs, tokens_per_rank, same_expert_rank):
    cfg, x, rw, w1, w3, w2, shared, gy = _case(seed, cfg_kwargs, tokens_per_rank, same_expert_rank)
    params = [t.clone().requires_grad_(True) for t in (x, rw, w1, w3, w2)]
    sp = None if shared is None else [t.clone().requires_grad_(True) for t in shared]
    xr, rwr, w1r, w3r, w2r = params
    ys, aux_total, start = [], 0.0, 0
    for T_r in tokens_per_rank:  # routing, capacity and the aux loss are per rank: its own tokens
        y_r, aux_r, _ = moe_comm.dense_moe(xr[start:start + T_r], rwr, w1r, w3r, w2r, cfg, shared=sp)
        ys.append(y_r)
        aux_total = aux_total + aux_r
        start += T_r
    y_ref = torch.cat(ys)
    ((y_ref * gy).sum() + aux_total).backward()

    W = len(tokens_per_rank)
    e = cfg.num_experts // W
    y = torch.cat([r[0] for r in results])
    assert _rel(y, y_ref.detach()) <= 1e-4
    aux_ref = float(aux_total.detach())
    assert abs(sum(r[1] for r in results) - aux_ref) <= 1e-4 * max(1.0, abs(aux_ref))
    assert _rel(torch.cat([r[2]["x"] for r in results]), xr.grad) <= 1e-4
    # Router weight is replicated; each rank holds its own tokens' gradient: they sum to the dense one.
    assert _rel(sum(r[2]["router"].double() for r in results), rwr.grad) <= 1e-4
    for name, ref in (("w1", w1r), ("w3", w3r), ("w2", w2r)):
        got = torch.cat([r[2][name] for r in results])
        assert got.shape[0] == W * e
        assert _rel(got, ref.grad) <= 1e-4, name
    if sp is not None:
        ref = torch.cat([p.grad.reshape(-1) for p in sp])
        assert _rel(sum(r[2]["shared"].double() for r in results), ref) <= 1e-4


CASES = [
    # (world size, cfg kwargs, tokens per rank, rank whose tokens all pick the same experts)
    (1, dict(num_experts=4, top_k=2), [13], None),
    (1, dict(num_experts=4, top_k=1, score_func="sigmoid"), [0], None),
    (2, dict(num_experts=4, top_k=2, aux_loss_coeff=0.01, z_loss_coeff=0.001), [11, 5], None),
    (2, dict(num_experts=6, top_k=3, score_func="sigmoid", norm_topk_prob=False), [9, 0], None),
    (2, dict(num_experts=4, top_k=1, norm_topk_prob=False, num_shared_experts=1), [7, 12], 1),
    (4, dict(num_experts=8, top_k=2, score_func="sigmoid", aux_loss_coeff=0.01), [10, 0, 6, 17], 2),
    (4, dict(num_experts=8, top_k=3, num_groups=4, topk_groups=2), [5, 9, 1, 8], None),
    (4, dict(num_experts=4, top_k=1, norm_topk_prob=False, capacity_factor=1.0), [12, 12, 3, 0], 0),
    (4, dict(num_experts=8, top_k=2, num_chunks=3), [6, 11, 0, 4], 3),
]


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,cfg_kwargs,tokens_per_rank,same_expert_rank", CASES)
def test_layer_matches_dense_reference(ranks, world_size, cfg_kwargs, tokens_per_rank, same_expert_rank):
    seed = 1234 + world_size + sum(tokens_per_rank)
    results = ranks(world_size).run(_rank_layer, seed, cfg_kwargs, tokens_per_rank, same_expert_rank, "auto")
    _check_against_dense(results, seed, cfg_kwargs, tokens_per_rank, same_expert_rank)


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_layer_backends_match_dense_reference(ranks, backend):
    """The torch reference and the Triton kernels (interpreted on CPU) give the same layer."""
    args = (77, dict(num_experts=4, top_k=2), [6, 3], None)
    results = ranks(2).run(_rank_layer, *args, backend)
    _check_against_dense(results, *args)


def _rank_checkpoint(rank, world_size, path, save_world):
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4, top_k=2)
    torch.manual_seed(5)
    layer = moe_comm.MoELayer(cfg)
    if world_size == save_world:
        with torch.no_grad():
            for p in layer.experts.parameters():
                p.add_(float(rank + 1))  # make the experts differ from a fresh init
        sd = full_state_dict(layer)
        if rank == 0:
            torch.save(sd, path)
        return sorted(sd)
    sd = torch.load(path)
    result = load_full_state_dict(layer, sd)
    assert not result.missing_keys and not result.unexpected_keys
    return {g: layer.experts.w1[i].detach().clone() for i, g in enumerate(layer.local_expert_ids)}, sd


@pytest.mark.multirank
def test_checkpoint_moves_between_ep_sizes(ranks, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    keys = ranks(2).run(_rank_checkpoint, path, 2)[0]
    assert [k for k in keys if k.startswith("experts.w1.")] == [f"experts.w1.{g}" for g in range(4)]
    loaded = ranks(4).run(_rank_checkpoint, path, 2)
    sd = loaded[0][1]
    for rank_result, _ in loaded:
        for g, w in rank_result.items():
            assert torch.equal(w, sd[f"experts.w1.{g}"])
    assert len({g for r, _ in loaded for g in r}) == 4


def test_same_seed_same_experts_at_any_ep_size():
    """Tier 1: expert g is initialised from seed + g, independent of the EP size."""
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4, top_k=2)
    a = moe_comm.MoELayer(cfg, seed=3)
    b = moe_comm.GroupedExperts(2, H, F, first_expert=2, seed=4)  # the layer's experts use seed + 1
    assert torch.equal(a.experts.w1[2:], b.w1) and torch.equal(a.experts.w2[2:], b.w2)
