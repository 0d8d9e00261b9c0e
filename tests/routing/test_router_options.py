"""Tier 1: pure logic, no processes. The routing options Hugging Face families need: a token mask, a router
dtype independent of the experts' dtype, routing under ``torch.autocast``, and the sigmoid-gated shared
expert; each checked on the router (``route``, ``Router``, ``count_tokens``) and end to end on a one-rank
``MoELayer``.

A masked token must behave as if it were not in the batch: the unmasked rows of a masked call equal an
unmasked call on those rows alone (routing, weights, aux and z loss, capacity aside), masked rows get -1
slots, weight 0, score 0, no routed output, and no count in the monitor.

Shapes legend: T tokens, H hidden, E experts (global), K top-k.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import moe_comm
from moe_comm.config import MoEConfig
from moe_comm.routing import Router, count_tokens, route

from test_routing import _bf_capacity, _bf_route, _logits_TE

H = 16


def _cfg(E=8, K=2, **kw) -> MoEConfig:
    return MoEConfig(hidden_size=H, ffn_hidden_size=32, num_experts=E, top_k=K, **kw)


def _mask(T: int, seed: int) -> torch.Tensor:
    m = torch.rand(T, generator=torch.Generator().manual_seed(seed)) < 0.6
    m[0], m[-1] = True, False  # at least one of each
    return m


# ----------------------------------------------------------------------------------------------- token mask
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("groups", [None, (4, 2)])
def test_masked_rows_are_not_routed_and_the_rest_is_unchanged(score_func, groups):
    extra = {} if groups is None else dict(num_groups=groups[0], topk_groups=groups[1])
    cfg = _cfg(8, 2, score_func=score_func, aux_loss_coeff=0.01, z_loss_coeff=0.001, route_scale=2.5, **extra)
    logits, mask = _logits_TE(15, 8, seed=3), _mask(15, 3)
    out = route(logits, cfg, token_mask_T=mask)
    alone = route(logits[mask], cfg)  # the unmasked tokens on their own
    assert out.topk_idx_TK[mask].tolist() == alone.topk_idx_TK.tolist()
    assert out.topk_idx_TK[~mask].eq(-1).all()
    assert torch.equal(out.topk_weight_TK[mask], alone.topk_weight_TK)
    assert out.topk_weight_TK[~mask].eq(0).all()
    assert torch.equal(out.scores_TE[mask], alone.scores_TE) and out.scores_TE[~mask].eq(0).all()
    torch.testing.assert_close(out.aux_loss, alone.aux_loss, rtol=1e-12, atol=0)
    assert out.token_mask_T is mask and out.logits_TE is logits


def test_all_true_mask_is_no_mask_and_all_false_routes_nothing():
    cfg = _cfg(8, 2, aux_loss_coeff=0.01, z_loss_coeff=0.001)
    logits = _logits_TE(9, 8, seed=4)
    plain = route(logits, cfg)
    full = route(logits, cfg, token_mask_T=torch.ones(9, dtype=torch.bool))
    assert torch.equal(full.topk_idx_TK, plain.topk_idx_TK) and torch.equal(full.topk_weight_TK, plain.topk_weight_TK)
    torch.testing.assert_close(full.aux_loss, plain.aux_loss, rtol=1e-12, atol=0)
    none = route(logits, cfg, token_mask_T=torch.zeros(9, dtype=torch.bool))
    assert none.topk_idx_TK.eq(-1).all() and none.topk_weight_TK.eq(0).all()
    assert float(none.aux_loss) == 0.0


@pytest.mark.parametrize("cf", [0.5, 1.0])
def test_masked_tokens_take_no_capacity(cf):
    """Capacity ceil(cf * T * K / E) is sized from all T rows (no host sync); the unmasked slots compete
    for it exactly as the brute force of test_routing does, the masked ones do not take any."""
    E, K, T = 4, 2, 14
    cfg = _cfg(E, K, capacity_factor=cf)
    logits, mask = _logits_TE(T, E, seed=int(cf * 10)), _mask(T, 7)
    out = route(logits, cfg, token_mask_T=mask)
    idx, _, scores = _bf_route(logits, cfg)
    idx = [row if keep else [-1] * K for row, keep in zip(idx, mask.tolist())]
    want = _bf_capacity(idx, scores, E, math.ceil(cf * T * K / E))
    assert out.topk_idx_TK.tolist() == want
    assert out.topk_weight_TK[out.topk_idx_TK < 0].eq(0).all()


def test_count_tokens_leaves_masked_tokens_out():
    idx = torch.tensor([[0, 2], [2, -1], [-1, -1], [1, 1]])
    assert [t.tolist() for t in count_tokens(idx, 3)] == [[1, 2, 2], 3]
    mask = torch.tensor([True, True, False, False])
    counts, dropped = count_tokens(idx, 3, mask)
    assert counts.tolist() == [1, 0, 2] and int(dropped) == 1
    with pytest.raises(ValueError, match=r"token_mask_T must have shape \[4\]"):
        count_tokens(idx, 3, torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"token_mask_T must have dtype in \(bool\)"):
        route(torch.zeros(4, 3), _cfg(3, 1), token_mask_T=torch.ones(4))


def test_layer_token_mask_routes_only_unmasked_tokens():
    """One rank, fp64: masked rows get only the shared experts' output; the unmasked rows equal the layer
    on those rows alone, gradients included; the monitor counts the unmasked slots only."""
    cfg = _cfg(4, 2, num_shared_experts=1, aux_loss_coeff=0.01)
    layer = moe_comm.MoELayer(cfg, seed=1).double()
    x = torch.randn(3, 5, H, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    mask = _mask(15, 1).reshape(3, 5)
    y = layer(x, mask)
    aux = layer.aux_loss
    (y.square().sum() + aux).backward()
    x2 = x.detach()[mask].clone().requires_grad_(True)
    ref = moe_comm.MoELayer(cfg, seed=1).double()
    y2 = ref(x2)
    (y2.square().sum() + ref.aux_loss).backward()
    torch.testing.assert_close(y[mask], y2)
    torch.testing.assert_close(y[~mask], layer.shared_experts(x.detach()[~mask]))
    torch.testing.assert_close(aux, ref.aux_loss)
    torch.testing.assert_close(x.grad[mask], x2.grad)
    for name in ("w1", "w3", "w2"):
        torch.testing.assert_close(getattr(layer.experts, name).grad, getattr(ref.experts, name).grad)
    torch.testing.assert_close(layer.router.weight.grad, ref.router.weight.grad)
    total = layer.monitor.summary()["total"]
    assert total["routed"] == int(mask.sum()) * 2 and total["dropped"] == 0
    with pytest.raises(ValueError, match=r"token_mask must have shape \[3, 5\] \(x's leading dimensions\)"):
        layer(x, mask.reshape(-1))


# ------------------------------------------------------------------------------------------ router dtype
def test_router_dtype_sets_weight_and_logits_dtype():
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(2))
    bf = Router(_cfg(8, 2, router_dtype=torch.bfloat16), dtype=torch.float32)
    nn_init = torch.randn(8, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        bf.weight.copy_(nn_init)
    out = bf(x)
    assert bf.weight.dtype == torch.bfloat16
    assert out.logits_TE.dtype == torch.bfloat16  # as a bf16 HF router: bf16 matmul ...
    assert torch.equal(out.logits_TE, F.linear(x.bfloat16(), bf.weight))
    assert out.scores_TE.dtype == out.topk_weight_TK.dtype == torch.float32  # ... softmax(logits.float())
    torch.testing.assert_close(out.scores_TE, out.logits_TE.float().softmax(-1), rtol=0, atol=0)
    fp = Router(_cfg(8, 2, router_dtype=torch.float32), dtype=torch.bfloat16)  # fp32 router, bf16 model
    assert fp.weight.dtype == torch.float32
    assert fp(x.bfloat16()).logits_TE.dtype == torch.float32
    default = Router(_cfg(8, 2), dtype=torch.bfloat16)
    assert default.weight.dtype == torch.bfloat16 and default(x.bfloat16()).logits_TE.dtype == torch.float32


def test_layer_keeps_an_fp32_router_next_to_bf16_experts():
    layer = moe_comm.MoELayer(_cfg(4, 2, router_dtype=torch.float32), seed=0, dtype=torch.bfloat16)
    assert layer.router.weight.dtype == torch.float32 and layer.experts.w1.dtype == torch.bfloat16
    x = torch.randn(6, H, dtype=torch.bfloat16, requires_grad=True)
    y, routing = layer(x, return_routing=True)
    assert y.dtype == torch.bfloat16 and routing.logits_TE.dtype == torch.float32
    y.float().sum().backward()
    assert layer.router.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("bad,exc", [(torch.int32, ValueError), ("bfloat16", TypeError)])
def test_router_dtype_and_shared_gate_are_validated(bad, exc):
    with pytest.raises(exc, match="MoEConfig.router_dtype"):
        _cfg(router_dtype=bad)
    with pytest.raises(ValueError, match="MoEConfig.shared_expert_gate needs num_shared_experts >= 1"):
        _cfg(shared_expert_gate=True)
    with pytest.raises(TypeError, match="MoEConfig.shared_expert_gate must be a bool"):
        _cfg(num_shared_experts=1, shared_expert_gate=1)


# -------------------------------------------------------------------------------------------- autocast
def test_router_under_autocast_stays_fp32():
    router = Router(_cfg(8, 2, score_func="sigmoid"))
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(5))
    plain = router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp = router(x)
    assert amp.logits_TE.dtype == amp.topk_weight_TK.dtype == torch.float32
    assert torch.equal(amp.logits_TE, plain.logits_TE) and torch.equal(amp.topk_idx_TK, plain.topk_idx_TK)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_layer_under_autocast(score_func):
    """fp32 layer under torch.autocast(cpu, bf16): routing identical to the fp32 run, experts in bf16
    (output within bf16 rounding of the fp32 run), y and every gradient in fp32."""
    cfg = _cfg(4, 2, score_func=score_func, num_shared_experts=1, shared_expert_gate=True)
    layer = moe_comm.MoELayer(cfg, seed=2)
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(6), requires_grad=True)
    y32, r32 = layer(x, return_routing=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, r = layer(x, return_routing=True)
    assert torch.equal(r.topk_idx_TK, r32.topk_idx_TK) and torch.equal(r.topk_weight_TK, r32.topk_weight_TK)
    assert y.dtype == torch.float32
    assert float((y - y32).detach().abs().max()) <= 2e-2 * float(y32.detach().abs().max())
    y.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in layer.parameters())


# ------------------------------------------------------------------------------------- gated shared expert
def test_shared_expert_gate_scales_the_shared_output():
    """y = routed + sigmoid(x @ g.T) * shared(x), as Qwen2-MoE; the gate's gradient flows."""
    cfg = _cfg(4, 2, num_shared_experts=1, shared_expert_gate=True)
    gated = moe_comm.MoELayer(cfg, seed=3).double()
    plain = moe_comm.MoELayer(cfg.replace(num_shared_experts=0, shared_expert_gate=False), seed=3).double()
    with torch.no_grad():
        plain.router.weight.copy_(gated.router.weight)
        for name in ("w1", "w3", "w2"):
            getattr(plain.experts, name).copy_(getattr(gated.experts, name))
    x = torch.randn(8, H, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    y = gated(x)
    g = gated.shared_expert_gate.weight
    assert g.shape == (1, H)
    want = plain(x) + torch.sigmoid(x @ g.detach().T) * gated.shared_experts(x)
    torch.testing.assert_close(y, want)
    y.sum().backward()
    assert g.grad is not None and g.grad.abs().sum() > 0
