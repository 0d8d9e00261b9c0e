"""Tier 1: pure logic, no processes. The router (``moe_comm.routing``) and ``MoEConfig`` validation.

Every routing result is compared with a brute-force recomputation written with Python loops over tokens
(``math.exp``, ``sorted``), independent of router.py: softmax / sigmoid scores, top-K, norm_topk_prob,
route_scale, group-limited routing (group score = sum of the group's top-2 scores), expert_bias,
capacity drops, the Switch aux loss and the z-loss. Logits are float64 and have no ties, so the
brute force and the router must choose exactly the same experts.

Shapes legend: T tokens, H hidden, E experts (global), K top-k, G expert groups, W EP ranks.
"""
import dataclasses
import math

import pytest
import torch

from moe_comm.config import MoEConfig
from moe_comm.routing import Router, count_tokens, route

H = 16


def _cfg(E=8, K=2, **kw) -> MoEConfig:
    return MoEConfig(hidden_size=H, ffn_hidden_size=32, num_experts=E, top_k=K, **kw)


def _logits_TE(T: int, E: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, E, generator=g, dtype=torch.float64) * 2.0


# ---------------------------------------------------------------------------------------------------
# brute force (loops over tokens; no torch)
# ---------------------------------------------------------------------------------------------------
def _bf_scores(logits_rows, score_func):
    out = []
    for row in logits_rows:
        if score_func == "softmax":
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            s = sum(ex)
            out.append([v / s for v in ex])
        else:
            out.append([1.0 / (1.0 + math.exp(-v)) for v in row])
    return out


def _bf_allowed_experts(sel_row, E, num_groups, topk_groups):
    """Experts in the token's best ``topk_groups`` groups (group score = sum of its top-2 values)."""
    if not num_groups:
        return list(range(E))
    per = E // num_groups
    group_score = []
    for g in range(num_groups):
        members = sorted((sel_row[e] for e in range(g * per, (g + 1) * per)), reverse=True)
        group_score.append(sum(members[:2]))
    best = sorted(range(num_groups), key=lambda g: -group_score[g])[:topk_groups]
    return [e for e in range(E) if e // per in best]


def _bf_route(logits_TE, cfg, bias=None):
    """(idx [T][K], weight [T][K], scores [T][E]) without capacity, descending selection order."""
    E, K = cfg.num_experts, cfg.top_k
    scores = _bf_scores(logits_TE.tolist(), cfg.score_func)
    idx, weight = [], []
    for sc in scores:
        sel = [sc[e] + (bias[e] if bias is not None else 0.0) for e in range(E)]
        allowed = _bf_allowed_experts(sel, E, cfg.num_groups, cfg.topk_groups)
        chosen = sorted(allowed, key=lambda e: -sel[e])[:K]
        w = [sc[e] for e in chosen]
        if cfg.norm_topk_prob:
            s = sum(w)
            w = [v / s for v in w]
        idx.append(chosen)
        weight.append([v * cfg.route_scale for v in w])
    return idx, weight, scores


def _bf_capacity(idx, scores, E, capacity):
    """Keep each expert's ``capacity`` highest-score slots (ties: earlier slot); the rest become -1."""
    kept = [list(row) for row in idx]
    for e in range(E):
        slots = [(t, k) for t in range(len(idx)) for k in range(len(idx[t])) if idx[t][k] == e]
        slots.sort(key=lambda tk: -scores[tk[0]][e])  # sort is stable: equal scores keep slot order
        for t, k in slots[capacity:]:
            kept[t][k] = -1
    return kept


def _bf_aux(logits_TE, idx, E, K, aux_coeff, z_coeff, score_func="softmax"):
    """Switch: E * sum_e f_e * P_e * coeff (f = routed slots / (T*K), P = mean prob) + z-loss."""
    rows = logits_TE.tolist()
    T = len(rows)
    probs = _bf_scores(rows, score_func)
    if score_func == "sigmoid":  # the router normalises sigmoid scores to a distribution for P
        probs = [[v / sum(p) for v in p] for p in probs]
    f = [0.0] * E
    for row in idx:
        for e in row:
            if e >= 0:
                f[e] += 1.0 / (T * K)
    P = [sum(probs[t][e] for t in range(T)) / T for e in range(E)]
    aux = aux_coeff * E * sum(f[e] * P[e] for e in range(E))
    lse_sq = []
    for row in rows:
        m = max(row)
        lse_sq.append((m + math.log(sum(math.exp(v - m) for v in row))) ** 2)
    return aux + z_coeff * sum(lse_sq) / T


def _assert_matches(out, idx, weight, scores):
    assert out.topk_idx_TK.dtype == torch.int64
    assert out.topk_idx_TK.tolist() == idx
    torch.testing.assert_close(out.topk_weight_TK, torch.tensor(weight, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out.scores_TE, torch.tensor(scores, dtype=torch.float64), rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------------
# scores, top-K, normalisation, scale
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("route_scale", [1.0, 2.5])
@pytest.mark.parametrize("E,K", [(8, 1), (8, 2), (6, 4), (5, 5)])
def test_route_matches_brute_force(score_func, norm, route_scale, E, K):
    cfg = _cfg(E, K, score_func=score_func, norm_topk_prob=norm, route_scale=route_scale)
    logits = _logits_TE(13, E, seed=E * 10 + K)
    out = route(logits, cfg)
    _assert_matches(out, *_bf_route(logits, cfg))
    assert out.topk_weight_TK.dtype == torch.float64
    if norm:  # the K weights of each token sum to route_scale
        torch.testing.assert_close(out.topk_weight_TK.sum(-1), torch.full((13,), route_scale, dtype=torch.float64))
    assert float(out.aux_loss) == 0.0  # both coefficients are 0


def test_route_docstring_example():
    out = route(torch.tensor([[0.0, math.log(3.0)]]), _cfg(2, 1))
    torch.testing.assert_close(out.scores_TE, torch.tensor([[0.25, 0.75]]))
    assert out.topk_idx_TK.tolist() == [[1]]
    torch.testing.assert_close(out.topk_weight_TK, torch.tensor([[1.0]]))


def test_router_module_float32_matches_brute_force():
    cfg = _cfg(8, 2)
    torch.manual_seed(0)
    router = Router(cfg)
    x = torch.randn(11, H)
    out = router(x)
    logits = (x.double() @ router.weight.double().T)
    idx, weight, scores = _bf_route(logits, cfg)
    assert out.topk_idx_TK.tolist() == idx
    assert out.topk_weight_TK.dtype == torch.float32
    torch.testing.assert_close(out.topk_weight_TK, torch.tensor(weight, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.scores_TE, torch.tensor(scores, dtype=torch.float32), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# group-limited routing
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("E,K,G,topk_groups", [(16, 4, 4, 2), (16, 2, 8, 1), (12, 3, 3, 2), (8, 3, 8, 3),
                                               (8, 4, 2, 2)])
def test_group_limited_matches_brute_force(score_func, E, K, G, topk_groups):
    cfg = _cfg(E, K, score_func=score_func, num_groups=G, topk_groups=topk_groups)
    logits = _logits_TE(32, E, seed=G * 100 + K)
    out = route(logits, cfg)
    idx, weight, scores = _bf_route(logits, cfg)
    _assert_matches(out, idx, weight, scores)
    per = E // G
    # chosen experts all come from the token's best groups (brute-force loop over groups)
    for t, row in enumerate(out.topk_idx_TK.tolist()):
        allowed = set(_bf_allowed_experts(scores[t], E, G, topk_groups))
        assert set(row) <= allowed
        assert len({e // per for e in row}) <= topk_groups
    if topk_groups < G and per > 1:  # the restriction must bite somewhere, or the test proves nothing
        free_idx, _, _ = _bf_route(logits, _cfg(E, K, score_func=score_func))
        assert free_idx != idx


def test_group_score_is_top2_sum_not_max():
    # Group 0 = {0, 1}: max 0.9, top-2 sum 0.9+0.0; group 1 = {2, 3}: max 0.6, top-2 sum 1.2.
    # Sigmoid inverse so the scores are exactly these values.
    probs = torch.tensor([[0.9, 1e-9, 0.6, 0.6 - 1e-3]], dtype=torch.float64)
    logits = torch.log(probs / (1 - probs))
    out = route(logits, _cfg(4, 1, score_func="sigmoid", num_groups=2, topk_groups=1))
    assert out.topk_idx_TK.tolist() == [[2]]  # best group by top-2 sum is group 1, even though 0.9 is global max


@pytest.mark.parametrize("W,topk_groups,K", [(4, 2, 4), (8, 3, 6), (4, 1, 2)])
def test_group_limited_caps_ranks_per_token_under_ep(W, topk_groups, K):
    # experts per rank == experts per group: groups map onto EP ranks
    E = 32
    e_local = E // W
    cfg = _cfg(E, K, num_groups=W, topk_groups=topk_groups)
    logits = _logits_TE(64, E, seed=W + K)
    idx = route(logits, cfg).topk_idx_TK
    ranks_per_token = [len({e // e_local for e in row}) for row in idx.tolist()]
    assert max(ranks_per_token) <= topk_groups
    assert max(ranks_per_token) == min(topk_groups, K)  # typical tokens use all their groups
    free = route(logits, _cfg(E, K)).topk_idx_TK
    assert max(len({e // e_local for e in row}) for row in free.tolist()) > topk_groups


# ---------------------------------------------------------------------------------------------------
# expert bias (selection only)
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_expert_bias_changes_selection_not_weights(score_func):
    E, K = 8, 2
    cfg = _cfg(E, K, score_func=score_func, norm_topk_prob=False)
    logits = _logits_TE(20, E, seed=7)
    bias = torch.zeros(E, dtype=torch.float64)
    bias[5] = 10.0  # expert 5 always wins selection
    out = route(logits, cfg, bias)
    idx, weight, scores = _bf_route(logits, cfg, bias.tolist())
    _assert_matches(out, idx, weight, scores)
    assert all(row[0] == 5 for row in out.topk_idx_TK.tolist())
    # weight is the unbiased score, not score + bias
    torch.testing.assert_close(out.topk_weight_TK[:, 0], out.scores_TE[:, 5], rtol=0, atol=0)
    assert out.topk_weight_TK.max() < 1.0
    assert route(logits, cfg).topk_idx_TK.tolist() != idx


def test_expert_bias_with_groups_matches_brute_force():
    E, K = 16, 4
    cfg = _cfg(E, K, score_func="sigmoid", num_groups=4, topk_groups=2, route_scale=2.5)
    logits = _logits_TE(24, E, seed=3)
    bias = torch.linspace(-0.3, 0.3, E, dtype=torch.float64)
    _assert_matches(route(logits, cfg, bias), *_bf_route(logits, cfg, bias.tolist()))


def test_router_expert_bias_buffer_is_used():
    cfg = _cfg(8, 2)
    torch.manual_seed(1)
    router = Router(cfg, dtype=torch.float64)
    x = torch.randn(10, H, dtype=torch.float64)
    before = router(x)
    with torch.no_grad():
        router.expert_bias[3] = 5.0
    after = router(x)
    assert (after.topk_idx_TK == 3).any(dim=1).all()
    assert before.topk_idx_TK.tolist() != after.topk_idx_TK.tolist()
    torch.testing.assert_close(after.topk_weight_TK, before.scores_TE.gather(1, after.topk_idx_TK)
                               / before.scores_TE.gather(1, after.topk_idx_TK).sum(-1, keepdim=True))


# ---------------------------------------------------------------------------------------------------
# capacity
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cf", [0.5, 1.0, 1.1, 1.25])  # 1.1: cf*T*K/E = 13.2, ceil matters
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_capacity_drops_lowest_score_slots(cf, score_func):
    T, E, K = 24, 4, 2
    cfg = _cfg(E, K, score_func=score_func, capacity_factor=cf)
    logits = _logits_TE(T, E, seed=11)
    logits[:, 0] += 1.5  # overload expert 0 so something is dropped for every cf
    out = route(logits, cfg)
    capacity = math.ceil(cf * T * K / E)
    idx_free, w_free, scores = _bf_route(logits, cfg.replace(capacity_factor=None))
    expected = _bf_capacity(idx_free, scores, E, capacity)
    idx = out.topk_idx_TK.tolist()
    assert idx == expected
    assert any(v == -1 for row in idx for v in row)
    for e in range(E):
        kept = [(t, k) for t in range(T) for k in range(K) if idx[t][k] == e]
        dropped = [(t, k) for t in range(T) for k in range(K) if idx_free[t][k] == e and idx[t][k] == -1]
        assert len(kept) <= capacity
        if dropped:  # full expert, and every kept slot scores at least as high as every dropped one
            assert len(kept) == capacity
            assert min(scores[t][e] for t, _ in kept) >= max(scores[t][e] for t, _ in dropped)
    w = out.topk_weight_TK
    for t in range(T):
        for k in range(K):
            if idx[t][k] == -1:
                assert w[t, k].item() == 0.0
            else:  # kept slots keep their capacity-free weight
                assert idx[t][k] == idx_free[t][k]
                assert w[t, k].item() == pytest.approx(w_free[t][k], rel=1e-12)


def test_capacity_ties_keep_earlier_slot():
    # every token has identical logits -> equal scores; the earliest `capacity` tokens keep expert 0
    T, E, K = 8, 4, 1
    logits = torch.tensor([[3.0, 0.0, 1.0, 2.0]] * T, dtype=torch.float64)
    out = route(logits, _cfg(E, K, capacity_factor=1.0))
    assert out.topk_idx_TK[:, 0].tolist() == [0, 0, -1, -1, -1, -1, -1, -1]


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_large_capacity_drops_nothing(score_func):
    T, E, K = 20, 8, 3
    logits = _logits_TE(T, E, seed=5)
    logits[:, 2] += 5.0
    cfg_free = _cfg(E, K, score_func=score_func)
    out = route(logits, cfg_free.replace(capacity_factor=float(E)))  # capacity = T*K
    free = route(logits, cfg_free)
    assert (out.topk_idx_TK >= 0).all()
    assert torch.equal(out.topk_idx_TK, free.topk_idx_TK)
    assert torch.equal(out.topk_weight_TK, free.topk_weight_TK)


# ---------------------------------------------------------------------------------------------------
# aux loss and z-loss
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("aux_coeff,z_coeff", [(0.01, 0.0), (0.0, 1e-3), (0.02, 1e-3)])
@pytest.mark.parametrize("cf", [None, 0.75])
def test_aux_and_z_loss_match_hand_formula(score_func, aux_coeff, z_coeff, cf):
    T, E, K = 17, 6, 2
    cfg = _cfg(E, K, score_func=score_func, aux_loss_coeff=aux_coeff, z_loss_coeff=z_coeff, capacity_factor=cf)
    logits = _logits_TE(T, E, seed=21)
    logits[:, 1] += 1.0
    out = route(logits, cfg)
    expected = _bf_aux(logits, out.topk_idx_TK.tolist(), E, K, aux_coeff, z_coeff, score_func)
    assert out.aux_loss.dim() == 0
    assert out.aux_loss.item() == pytest.approx(expected, rel=1e-12)
    assert expected > 0
    if cf is not None:  # f counts routed slots only: drops lower the aux term
        assert (out.topk_idx_TK == -1).any()


def test_aux_loss_uniform_routing_is_coeff():
    # perfectly balanced: f_e = 1/E, P_e = 1/E -> E * sum_e (1/E)(1/E) = 1, so aux == coeff
    E = 4
    logits = torch.zeros(E, E, dtype=torch.float64)
    logits += torch.eye(E, dtype=torch.float64) * 1e-3  # token t prefers expert t; P stays ~1/E
    out = route(logits, _cfg(E, 1, aux_loss_coeff=0.5))
    assert out.topk_idx_TK[:, 0].tolist() == list(range(E))
    assert out.aux_loss.item() == pytest.approx(0.5, rel=1e-12)


@pytest.mark.parametrize("aux_coeff,z_coeff", [(0.01, 0.0), (0.0, 1e-2), (0.01, 1e-2)])
def test_aux_loss_backpropagates_to_router_weight(aux_coeff, z_coeff):
    E, K, T = 8, 2, 12
    cfg = _cfg(E, K, aux_loss_coeff=aux_coeff, z_loss_coeff=z_coeff)
    torch.manual_seed(2)
    router = Router(cfg, dtype=torch.float64)
    x = torch.randn(T, H, dtype=torch.float64)
    out = router(x)
    out.aux_loss.backward()
    grad = router.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    # same gradient from the hand formula with f held constant (f comes from a discrete top-k)
    W = router.weight.detach().clone().requires_grad_(True)
    logits = x @ W.T
    f_E = torch.bincount(out.topk_idx_TK.reshape(-1), minlength=E).double() / (T * K)
    hand = aux_coeff * E * (f_E * logits.softmax(-1).mean(0)).sum() \
        + z_coeff * torch.logsumexp(logits, -1).square().mean()
    hand.backward()
    torch.testing.assert_close(grad, W.grad, rtol=1e-10, atol=1e-14)
    # and a finite-difference check of route() itself (fast mode: one random projection of the Jacobian)
    assert torch.autograd.gradcheck(lambda w: route(x @ w.T, cfg).aux_loss,
                                    (W.detach().clone().requires_grad_(True),), fast_mode=True)


def test_weights_backpropagate_to_router_weight():
    torch.manual_seed(3)
    router = Router(_cfg(8, 2), dtype=torch.float64)
    x = torch.randn(6, H, dtype=torch.float64)
    out = router(x)
    (out.topk_weight_TK * torch.arange(12, dtype=torch.float64).reshape(6, 2)).sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------
# T = 0
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_zero_tokens(score_func):
    E, K = 8, 2
    cfg = _cfg(E, K, score_func=score_func, aux_loss_coeff=0.01, z_loss_coeff=1e-3, capacity_factor=1.0,
               num_groups=4, topk_groups=2)
    out = route(torch.zeros(0, E), cfg)
    assert out.topk_idx_TK.shape == (0, K) and out.topk_idx_TK.dtype == torch.int64
    assert out.topk_weight_TK.shape == (0, K)
    assert out.scores_TE.shape == (0, E)
    assert out.aux_loss.dim() == 0 and torch.isfinite(out.aux_loss) and out.aux_loss.item() == 0.0
    router = Router(cfg)
    rout = router(torch.zeros(0, H))
    assert rout.topk_idx_TK.shape == (0, K)
    assert torch.isfinite(rout.aux_loss) and rout.aux_loss.item() == 0.0
    rout.aux_loss.backward()  # keeps the graph: backward works and gives a zero gradient
    assert router.weight.grad is not None and torch.count_nonzero(router.weight.grad) == 0


# ---------------------------------------------------------------------------------------------------
# MoEConfig validation
# ---------------------------------------------------------------------------------------------------
BASE = dict(hidden_size=16, ffn_hidden_size=32, num_experts=8, top_k=2)


def test_valid_config_builds():
    cfg = MoEConfig(**BASE, num_groups=4, topk_groups=1, capacity_factor=1.5, aux_loss_coeff=0.0)
    assert cfg.topk_groups * (cfg.num_experts // cfg.num_groups) >= cfg.top_k
    assert cfg.replace(top_k=8, num_groups=None, topk_groups=None).top_k == 8


@pytest.mark.parametrize("changes,exc,field", [
    (dict(top_k=9), ValueError, "top_k"),
    (dict(top_k=0), ValueError, "top_k"),
    (dict(score_func="relu"), ValueError, "score_func"),
    (dict(score_func="Softmax"), ValueError, "score_func"),
    (dict(num_groups=4), ValueError, "topk_groups"),
    (dict(topk_groups=2), ValueError, "num_groups"),
    (dict(num_groups=3, topk_groups=1), ValueError, "num_groups"),
    (dict(num_groups=4, topk_groups=5), ValueError, "topk_groups"),
    (dict(top_k=3, num_groups=4, topk_groups=1), ValueError, "topk_groups"),
    (dict(top_k=5, num_groups=8, topk_groups=4), ValueError, "topk_groups"),
    (dict(aux_loss_coeff=-0.1), ValueError, "aux_loss_coeff"),
    (dict(z_loss_coeff=-1e-3), ValueError, "z_loss_coeff"),
    (dict(capacity_factor=0.0), ValueError, "capacity_factor"),
    (dict(capacity_factor=-1.0), ValueError, "capacity_factor"),
    (dict(route_scale=0.0), ValueError, "route_scale"),
    (dict(hidden_size=16.0), TypeError, "hidden_size"),
    (dict(ffn_hidden_size="32"), TypeError, "ffn_hidden_size"),
    (dict(num_experts=8.5), TypeError, "num_experts"),
    (dict(num_chunks=2.0), TypeError, "num_chunks"),
    (dict(top_k=True), TypeError, "top_k"),
    (dict(hidden_size=True), TypeError, "hidden_size"),
    (dict(num_groups=True, topk_groups=1), TypeError, "num_groups"),
    (dict(num_shared_experts=False), TypeError, "num_shared_experts"),
    (dict(norm_topk_prob=1), TypeError, "norm_topk_prob"),
    (dict(num_chunks="Auto"), ValueError, "num_chunks"),
    (dict(route_scale="2"), TypeError, "route_scale"),
    (dict(capacity_factor=float("inf")), ValueError, "capacity_factor"),
    (dict(aux_loss_coeff=True), TypeError, "aux_loss_coeff"),
])
def test_config_errors_name_the_field(changes, exc, field):
    with pytest.raises(exc, match=rf"\b{field}\b"):
        MoEConfig(**{**BASE, **changes})


def test_config_is_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        MoEConfig(16, 32, 8, 2)  # noqa
    cfg = MoEConfig(**BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.top_k = 3
    with pytest.raises(ValueError, match="top_k"):
        cfg.replace(top_k=9)


def test_route_and_count_tokens_bad_inputs_name_the_argument():
    cfg = _cfg(8, 2)
    with pytest.raises(ValueError, match=r"logits_TE must have shape \[\*, 8\].*got \(3, 7\)"):
        route(torch.zeros(3, 7), cfg)
    with pytest.raises(TypeError, match="logits_TE must be a floating-point tensor"):
        route(torch.zeros(3, 8, dtype=torch.int64), cfg)
    with pytest.raises(ValueError, match=r"expert_bias_E must have shape \[8\]"):
        route(torch.zeros(3, 8), cfg, torch.zeros(7))
    with pytest.raises(TypeError, match="cfg must be a MoEConfig"):
        route(torch.zeros(3, 8), {"top_k": 2})
    with pytest.raises(TypeError, match=r"topk_idx_TK must have dtype in \(int64\), got torch.float32"):
        count_tokens(torch.zeros(3, 2), 8)
    with pytest.raises(ValueError, match="num_experts must be >= 1, got 0"):
        count_tokens(torch.zeros(3, 2, dtype=torch.int64), 0)
