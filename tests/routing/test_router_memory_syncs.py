"""Tier 1: what the Router keeps for backward and where it would wait for a CUDA device.

The logits GEMM runs in the router dtype (float32 for a bf16 x); autograd through
``F.linear(x.to(acc), w.to(acc))`` kept the float32 copy of x (2x the bf16 activation, per layer).
``_RouterLogits`` keeps x in its own dtype and casts again in backward, with the same results bit for
bit. No routing option (aux / z loss, capacity, group-limited routing, bias, token mask, softmax or
sigmoid) reads a tensor on the host or runs a sync-prone op, forward or backward (``HostSyncs``).

Shapes legend: T tokens, H hidden, E experts (global), K top-k.
"""
import pytest
import torch
import torch.nn.functional as F

from moe_comm.config import MoEConfig
from moe_comm.routing import Router, _bin_counts, count_tokens, route
from moe_comm.testing.syncs import HostSyncs

T, H, E = 96, 64, 8


def _saved_storages(fn):
    """fn()'s result and {storage data_ptr: nbytes} of every tensor autograd saved while it ran."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, seen


def _x(dtype, seed=0):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_(True)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_keeps_x_in_its_own_dtype(score_func):
    """bf16 x, float32 router: autograd holds x itself, the weight and what ``route`` keeps; nothing of
    [T, H] in float32 (before: T * H * 4 bytes more, twice x)."""
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=32, num_experts=E, top_k=2, score_func=score_func,
                    aux_loss_coeff=0.01, z_loss_coeff=0.001)
    r = Router(cfg)
    x = _x(torch.bfloat16)
    out, saved = _saved_storages(lambda: r(x))
    logits = out.logits_TE.detach().requires_grad_(True)
    _, route_saved = _saved_storages(lambda: route(logits, cfg, r.expert_bias))
    x_ptr, w_ptr = x.untyped_storage().data_ptr(), r.weight.untyped_storage().data_ptr()
    assert saved.pop(x_ptr) == x.nbytes == T * H * 2
    assert saved.pop(w_ptr) == r.weight.nbytes == E * H * 4
    assert sum(saved.values()) == sum(route_saved.values()), (saved, route_saved)
    assert sum(saved.values()) < x.nbytes  # the [T, E] / [T, K] terms of the routing
    _, old = _saved_storages(lambda: F.linear(x.to(torch.float32), r.weight))
    assert sum(old.values()) - r.weight.nbytes == T * H * 4, "the float32 copy the old formulation kept"


@pytest.mark.parametrize("x_dtype, router_dtype", [
    (torch.bfloat16, None), (torch.float32, None), (torch.float64, None), (torch.bfloat16, torch.float64),
    (torch.float32, torch.bfloat16), (torch.float16, torch.float32),
])
def test_router_logits_and_gradients_equal_the_linear_formulation(x_dtype, router_dtype):
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=32, num_experts=E, top_k=2, router_dtype=router_dtype)
    r = Router(cfg)
    acc = router_dtype or (torch.float64 if x_dtype == torch.float64 else torch.float32)
    x, x_old = _x(x_dtype), _x(x_dtype)
    w_old = r.weight.detach().clone().requires_grad_(True)
    g_TE = torch.randn(T, E, generator=torch.Generator().manual_seed(1)).to(acc)
    logits = r(x).logits_TE
    old = F.linear(x_old.to(acc), w_old.to(acc))
    assert logits.dtype == old.dtype == acc and torch.equal(logits, old)
    (logits * g_TE).sum().backward()
    (old * g_TE).sum().backward()
    assert x.grad.dtype == x_dtype and torch.equal(x.grad, x_old.grad)
    assert r.weight.grad.dtype == r.weight.dtype and torch.equal(r.weight.grad, w_old.grad)


def test_router_backward_under_autocast_is_unchanged():
    """Backward called inside torch.autocast: the logits GEMMs stay in float32, as in forward."""
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=32, num_experts=E, top_k=2)
    r = Router(cfg)
    grads = []
    for amp in (False, True):
        x = _x(torch.bfloat16)
        r.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = r(x)
            (out.logits_TE * torch.linspace(-1, 1, T * E).view(T, E)).sum().backward()
        grads.append((x.grad, r.weight.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_bin_counts_equals_bincount():
    v = torch.randint(0, 9, (500,), generator=torch.Generator().manual_seed(2))
    for n in (9, 12):
        got, ref = _bin_counts(v, n), torch.bincount(v, minlength=n)
        assert got.dtype == ref.dtype == torch.int64 and torch.equal(got, ref)
    assert torch.equal(_bin_counts(v[:0], 4), torch.zeros(4, dtype=torch.int64))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("masked", [False, True])
def test_router_with_every_option_has_no_host_sync(score_func, masked):
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=32, num_experts=E, top_k=2, score_func=score_func,
                    norm_topk_prob=True, route_scale=2.0, num_groups=4, topk_groups=2, aux_loss_coeff=0.01,
                    z_loss_coeff=0.001, capacity_factor=0.8)
    r = Router(cfg)
    with torch.no_grad():
        r.expert_bias.copy_(torch.linspace(-0.1, 0.1, E))
    x = _x(torch.bfloat16)
    mask = (torch.arange(T) % 5 != 0) if masked else None
    with HostSyncs() as s:
        out = r(x, token_mask_T=mask)
        counts_E, dropped = count_tokens(out.topk_idx_TK, E, mask)
        (out.topk_weight_TK.sum() + out.scores_TE.sum() + out.aux_loss).backward()
    assert s.count == 0, s.report()
    assert dropped > 0 and counts_E.sum() + dropped == (T - (T // 5 + 1 if masked else 0)) * 2
    assert x.grad.abs().sum() > 0 and r.weight.grad.abs().sum() > 0
