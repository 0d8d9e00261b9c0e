"""Tier 1: the num_chunks="auto" model (alpha-beta fit, step prediction, choice), its bounds on
degenerate measurements ("not measurable here", the fallback and its reason), the AutoChunker's fallback
paths; tier 2: a layer on 2 gloo ranks plans once and keeps its choice."""
import re
import statistics

import pytest
import torch

import moe_comm
from moe_comm.dispatch import autotune
from moe_comm.dispatch.autotune import (BETA_MAX, DEFAULT_C, AutoChunker, LinkFit, OverlapProbe, choose_num_chunks,
                                        fit_alpha_beta, fit_link, judge_overlap, predict_step)

SIZES = [4 << 10, 64 << 10, 512 << 10, 2 << 20]  # measure_link's default probe sizes


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


def _no_impossible_number(text):
    """No GB/s figure above BETA_MAX, no inf/nan, no overlap efficiency printed in a fallback's reason."""
    assert "inf" not in text and "nan" not in text
    for gbps in re.findall(r"([0-9.e+]+) GB/s", text):
        assert float(gbps) <= BETA_MAX / 1e9, text


@pytest.mark.parametrize("times,why", [
    ([50e-6] * 4, "does not grow with size above its noise"),                     # flat: latency only
    ([80e-6, 70e-6, 60e-6, 55e-6], "does not grow with size above its noise"),    # falling
    ([100e-6, 160e-6, 90e-6, 150e-6], "does not grow with size above its noise"),  # growth within the noise
    ([50e-6 + s / 1e15 for s in SIZES], "more than any link"),                     # a 1e6 GB/s fit
])
def test_degenerate_fit_is_bounded_and_not_measurable(times, why):
    """Tier 1: probe times that do not show the bytes give beta = BETA_MAX (never 1e6 GB/s), alpha the
    median probe time, measurable False and the reason; the plan built on it is DEFAULT_C with no model
    figure, and says "not measurable here" and why."""
    fit = fit_link(SIZES, times)
    assert not fit.measurable and why in fit.reason
    assert fit.beta_bytes_per_s == BETA_MAX and fit.alpha_s == pytest.approx(statistics.median(times))
    assert "4 KiB-2 MiB per rank took" in fit.reason
    _no_impossible_number(fit.reason)
    assert fit_alpha_beta(SIZES, times) == (fit.alpha_s, BETA_MAX)
    plan = choose_num_chunks(0.01, 8e6, fit.alpha_s, fit.beta_bytes_per_s, link_reason=fit.reason)
    assert plan.num_chunks == DEFAULT_C == 1 and plan.predicted_s == {}
    assert not plan.link_measured and not plan.overlap_measured and plan.overlap_efficiency is None
    assert plan.reason.startswith("C=1, the default: the link's bandwidth is not measurable here (")
    assert why in plan.reason and "overlap efficiency" not in plan.reason
    _no_impossible_number(plan.reason)


def test_fit_bounds_alpha_and_keeps_one_slow_probe_out():
    """Tier 1: a negative intercept is bounded to 0, alpha never exceeds the fastest probe, and one slow
    probe (measured on 2 shared cores: 512 KiB slower than 2 MiB) does not make the link unmeasurable."""
    fit = fit_link([1e5, 1e6, 2e6], [1e-5, 5e-4, 1e-3])
    assert fit.measurable and fit.alpha_s == 0.0 and 0 < fit.beta_bytes_per_s <= BETA_MAX
    fit = fit_link(SIZES, [165e-6, 124e-6, 3663e-6, 1648e-6])
    assert fit.measurable and 1.3e9 < fit.beta_bytes_per_s < 1.45e9 and fit.alpha_s == 124e-6
    fit = fit_link([1e3, 1e6], [30e-6, 530e-6])
    assert fit.measurable and fit.alpha_s <= 30e-6 and fit.beta_bytes_per_s == pytest.approx(999e3 / 500e-6)


def test_fit_rejects_bad_measurements():
    with pytest.raises(ValueError, match="times must be finite seconds >= 0"):
        fit_link(SIZES, [1e-5, float("nan"), 1e-4, 1e-3])
    with pytest.raises(ValueError, match="times must have one entry per size"):
        fit_link(SIZES, [1e-5, 1e-4])
    with pytest.raises(ValueError, match="at least 2 distinct values"):
        fit_link([1e3, 1e3], [1e-5, 1e-4])


@pytest.mark.parametrize("t_gemm,t_a2a,t_both,measurable,eta,why", [
    (10e-3, 10e-3, [12e-3, 12.1e-3, 11.9e-3], True, 0.8, ""),
    (10e-3, 10e-3, [9.5e-3, 9.6e-3, 9.4e-3], True, 1.0, ""),                    # raw 1.05 reads as 1
    (10e-3, 10e-3, [25e-3, 25e-3, 25e-3], False, 0.0, "longer than running them apart"),
    (10e-3, 10e-3, [5e-3, 5e-3, 5e-3], False, 1.0, "less than the longer one alone"),
    (10e-3, 30e-6, [10e-3, 10.4e-3, 9.9e-3], False, 1.0, "within the timing noise"),  # a2a too short to time
])
def test_overlap_probe_judges_measurability(t_gemm, t_a2a, t_both, measurable, eta, why):
    """Tier 1: eta only where the probe can show it; otherwise "not measurable" with the reason, and a
    plan built on it is DEFAULT_C that prints no overlap efficiency."""
    probe = judge_overlap(t_gemm, t_a2a, t_both)
    assert probe.measurable is measurable and probe.eta == pytest.approx(eta, abs=1e-9) and why in probe.reason
    if not measurable:
        plan = choose_num_chunks(0.01, 8e6, 1e-4, 1e9, overlap_reason=probe.reason)
        assert plan.num_chunks == DEFAULT_C and plan.overlap_efficiency is None and plan.link_measured
        assert "the overlap efficiency is not measurable here" in plan.reason and why in plan.reason
        assert "overlap efficiency 0.00" not in plan.reason
    with pytest.raises(ValueError, match="t_both needs at least one timing"):
        judge_overlap(t_gemm, t_a2a, [])


def test_one_rank_prints_no_infinite_bandwidth():
    plan = choose_num_chunks(0.01, 8e6, 0.0, float("inf"))
    assert plan.num_chunks == 1 and "no link (one rank)" in plan.reason
    _no_impossible_number(plan.reason)


def _chunker(monkeypatch, link, probe):
    monkeypatch.setattr(autotune, "measure_link", lambda group, device: link)
    monkeypatch.setattr(autotune, "probe_overlap", lambda group, device, nbytes: probe)
    return AutoChunker(None, torch.device("cpu"))


def test_auto_falls_back_when_the_link_is_not_measurable(monkeypatch):
    """Tier 1: the AutoChunker takes DEFAULT_C for good, without trials, and warns with the reason."""
    link = fit_link(SIZES, [50e-6] * 4)
    auto = _chunker(monkeypatch, link, None)  # the overlap probe is not reached
    with pytest.warns(UserWarning, match=r"num_chunks='auto': C=1, the default: the link's bandwidth is not "
                                         r"measurable here \(the all-to-all time does not grow"):
        auto.make_plan(expert_s=0.05, nbytes=64e6, kappa=2e-4)
    assert auto.plan is not None and auto.plan.num_chunks == DEFAULT_C and auto.order is None
    assert auto.step() == (DEFAULT_C, False, False)


def test_auto_trials_decide_when_the_overlap_is_not_measurable(monkeypatch):
    """Tier 1: a measured link but an unmeasurable eta: the shortlist is DEFAULT_C and the ideal-overlap
    model's C, the trials pick, and the reason says the efficiency was not measurable (no 0.00)."""
    link = LinkFit(alpha_s=100e-6, beta_bytes_per_s=0.125e9, measurable=True)
    probe = judge_overlap(10e-3, 10e-3, [25e-3] * 3)
    assert not probe.measurable and probe.eta == 0.0
    auto = _chunker(monkeypatch, link, probe)
    with pytest.warns(UserWarning, match="overlap efficiency is not measurable here"):
        auto.make_plan(expert_s=0.1, nbytes=12.5e6, kappa=2e-4)
    ideal = choose_num_chunks(0.1, 12.5e6, 100e-6, 0.125e9, 2e-4, overlap=1.0).num_chunks
    assert ideal > 1 and auto.order == [1, ideal, 1, ideal]
    for C, sec in zip(auto.order, [0.3, 0.2, 0.31, 0.21]):
        assert auto.step()[0] == C
        auto.record_trial(sec)
    plan = auto.plan
    assert plan.num_chunks == ideal and plan.overlap_efficiency is None and not plan.overlap_measured
    assert "not measurable here" in plan.reason and f"pick between C=1 and C={ideal}" in plan.reason
    assert "overlap efficiency 0.00" not in plan.reason
    _no_impossible_number(plan.reason)


def test_auto_with_measured_link_and_overlap_keeps_the_model(monkeypatch):
    link = LinkFit(alpha_s=100e-6, beta_bytes_per_s=0.125e9, measurable=True)
    auto = _chunker(monkeypatch, link, OverlapProbe(eta=0.9, measurable=True))
    auto.make_plan(expert_s=0.1, nbytes=12.5e6, kappa=2e-4)
    assert auto.order is not None and auto.model.overlap_efficiency == 0.9 and auto.model.overlap_measured
    assert "overlap efficiency 0.90" in auto.model.reason


def _rank_auto(rank, world_size):
    cfg = moe_comm.MoEConfig(hidden_size=32, ffn_hidden_size=32, num_experts=4, top_k=2, num_chunks="auto")
    layer = moe_comm.MoELayer(cfg, seed=0)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(rank))
    ref = moe_comm.MoELayer(cfg.replace(num_chunks=1), seed=0)
    outs = []
    for _ in range(10):  # warm-up, timed call, then up to 6 shortlist trials
        outs.append(torch.allclose(layer(x), ref(x), rtol=1e-5, atol=1e-6))
    plan = layer.pipeline_plan
    return plan.num_chunks, plan.reason, all(outs), plan.link_measured, plan.overlap_measured


@pytest.mark.multirank
def test_auto_plans_once_identically_on_every_rank(ranks):
    res = ranks(2).run(_rank_auto)
    assert res[0][0] == res[1][0] and res[0][0] in (1, 2, 4, 8, 16)
    assert all(r[2] for r in res)  # auto's results equal the unchunked layer's
    assert res[0][3:] == res[1][3:]  # the same fit and probe verdicts on every rank
    _, reason, _, link_ok, overlap_ok = res[0]
    assert ("overlap efficiency 0." in reason or "overlap efficiency 1." in reason) if link_ok and overlap_ok \
        else "not measurable here" in reason
    _no_impossible_number(reason)
