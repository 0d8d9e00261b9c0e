"""Tier 1: the num_chunks="auto" model (alpha-beta fit, step prediction, choice); tier 2: a layer on
2 gloo ranks plans once and keeps its choice."""
import pytest
import torch

import moe_comm
from moe_comm.dispatch.autotune import choose_num_chunks, fit_alpha_beta, predict_step


def test_fit_recovers_alpha_and_beta():
    sizes = [1e3, 1e4, 1e5, 1e6]
    alpha, beta = 50e-6, 2e9
    a, b = fit_alpha_beta(sizes, [alpha + s / beta for s in sizes])
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    with pytest.raises(ValueError, match="sizes needs at least 2 points"):
        fit_alpha_beta([1.0], [1.0])


def test_c1_is_exactly_serial():
    # C = 1: x + 2c forward, 2x + 2c backward, whatever the overlap efficiency
    for eta in (0.0, 0.5, 1.0):
        t = predict_step(1, 0.1, 1e8, 1e-4, 1e9, kappa=0.0, overlap=eta)
        assert t == pytest.approx(0.1 + 2 * (1e-4 + 0.1) + 0.2 + 2 * (1e-4 + 0.1))


def test_picks_one_chunk_when_comm_is_negligible():
    plan = choose_num_chunks(expert_s=0.1, nbytes=1e3, alpha=20e-6, beta=10e9, kappa=2e-4)
    assert plan.num_chunks == 1 and "C=1" in plan.reason


def test_picks_a_deeper_pipeline_when_comm_matters():
    plan = choose_num_chunks(expert_s=0.1, nbytes=12.5e6, alpha=100e-6, beta=0.125e9, kappa=2e-4, overlap=0.9)
    assert plan.num_chunks >= 4
    assert plan.predicted_s[plan.num_chunks] < 0.8 * plan.predicted_s[1]


def test_no_overlap_efficiency_means_no_chunking():
    plan = choose_num_chunks(expert_s=0.1, nbytes=12.5e6, alpha=100e-6, beta=0.125e9, kappa=2e-4, overlap=0.0)
    assert plan.num_chunks == 1


def _rank_auto(rank, world_size):
    cfg = moe_comm.MoEConfig(hidden_size=32, ffn_hidden_size=32, num_experts=4, top_k=2, num_chunks="auto")
    layer = moe_comm.MoELayer(cfg, seed=0)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(rank))
    ref = moe_comm.MoELayer(cfg.replace(num_chunks=1), seed=0)
    outs = []
    for _ in range(10):  # warm-up, timed call, then up to 6 shortlist trials
        outs.append(torch.allclose(layer(x), ref(x), rtol=1e-5, atol=1e-6))
    plan = layer.pipeline_plan
    return plan.num_chunks, plan.reason, all(outs)


@pytest.mark.multirank
def test_auto_plans_once_identically_on_every_rank(ranks):
    res = ranks(2).run(_rank_auto)
    assert res[0][0] == res[1][0] and res[0][0] in (1, 2, 4, 8, 16)
    assert all(ok for _, _, ok in res)  # auto's results equal the unchunked layer's
    assert "overlap efficiency" in res[0][1]
