"""`moe-comm profile` (the package moe_comm.tools.diagnose).

Tier 1 (pure logic, no processes): ``diagnose`` on synthetic results with hand-computed spans (every
finding's numbers, each branch of the suggestion logic, every predicted gain against
``autotune.predict_step`` / ``choose_num_chunks`` with the measured overlap efficiency eta, FP8 dispatch
and dedup with the bytes of ``wire``),
``format_diagnosis``, ``plot_timeline`` on synthetic spans (and that it leaves pyplot unloaded), option
checking, and ``python -m moe_comm.tools.diagnose`` as the namespace re-launch builds it (one child
Python, no ranks).
Tier 2 (multi-rank gloo, 2 spawned ranks): ``profile_main`` end to end on tiny sizes with a skewed
workload: the three files exist and parse, figures are positive, rows are conserved, the diagnosis'
communication share is what the Chrome trace's own spans give, and the model behind the suggestion is
``predict_step`` with the eta the run measured; a run with FP8 dispatch and dedup whose collected
distinct rows are the Dispatcher's own byte counts. ~8 s each (longer on a loaded machine).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from moe_comm import ops
from moe_comm.dispatch.autotune import choose_num_chunks, predict_step
from moe_comm.placement import plan_placement
from moe_comm.profiling import Span
from moe_comm.tools.diagnose import (MIN_GAIN_SHARE, Diagnosis, diagnose, format_diagnosis, normalize_opts,
                                     plot_timeline, profile_main)
from moe_comm.tools.diagnose.collect import distinct_rows_W
from moe_comm.tools.diagnose.render import _sub_lanes
from moe_comm.tools.diagnose.run import relaunch_command

MS = 1e-3


def S(rank, kind, phase, start_ms, end_ms, direction="fwd", chunk=-1):
    return dataclasses.asdict(Span(rank=rank, layer=0, phase=phase, chunk=chunk, kind=kind, direction=direction,
                                   start=start_ms * MS, end=end_ms * MS, track=kind))


def step_spans(rank, t0=0.0, compute_scale=1.0):
    """One 20 ms step, hand-laid (ms):
    fwd region [0, 10]: router [0, 1], counts [1, 2], dispatch [2, 4], experts [3, 6], combine [6, 8]
    bwd region [10, 20]: combine [10, 12], experts [12, 12 + 4 * compute_scale], dispatch [16, 19]
    comm union 1 + 2 + 2 + 2 + 3 = 10; compute 1 + 3 + 4s; hidden 1 (dispatch ∩ experts [3, 4])."""
    x = lambda a: t0 + a  # noqa: E731
    return [S(rank, "region", "forward", x(0), x(10)), S(rank, "region", "backward", x(10), x(20), "bwd"),
            S(rank, "compute", "router", x(0), x(1)), S(rank, "comm", "counts", x(1), x(2)),
            S(rank, "comm", "dispatch", x(2), x(4), chunk=0), S(rank, "compute", "experts", x(3), x(6), chunk=0),
            S(rank, "comm", "combine", x(6), x(8), chunk=0),
            S(rank, "comm", "combine", x(10), x(12), "bwd", 0),
            S(rank, "compute", "experts", x(12), x(12 + 4 * compute_scale), "bwd", 0),
            S(rank, "comm", "dispatch", x(16), x(19), "bwd", 0)]


def synth(*, W=2, steps=2, C=1, H=64, F=64, E=4, K=2, T=1000, elsize=4, alpha=1e-4, beta=1e9,
          expert_fwd=2e-3, gemm_ratio=1.0, rows=None, kappa=1e-5, compute_scale=None, bytes_scale=1.0, eta=0.8,
          dispatch_dtype=None, dedup=False, dedup_rows=None):
    """A profile_rank-shaped result. rows: rows received per rank (default: balanced T*K); eta: the
    measured overlap efficiency; dispatch_dtype / dedup: what the run used; dedup_rows: per rank
    (rows_sent_dedup, rows_recv_dedup), the distinct (token, rank) rows (None: not collected)."""
    rows = rows or [float(T * K)] * W
    compute_scale = compute_scale or [1.0] * W
    spans = [s for r in range(W) for k in range(steps)
             for s in step_spans(r, t0=20.0 * k, compute_scale=compute_scale[r])]
    ranks = []
    for r in range(W):
        R = rows[r]
        flops = 6.0 * R * H * F
        fwd = expert_fwd * R / max(rows)
        ranks.append({"rank": r, "rows_sent": float(T * K), "rows_recv": R,
                      "rows_recv_per_expert": [R / (E // W)] * (E // W),
                      "bytes_sent": T * K * H * elsize * bytes_scale, "bytes_recv": R * H * elsize * bytes_scale,
                      "expert_rows": int(R), "expert_fwd_s": fwd, "expert_fwdbwd_s": 3 * fwd, "expert_flops": flops,
                      "gemm_s": fwd * gemm_ratio / 3.0, "gemm_flops": 2.0 * R * H * F, "kappa_s": kappa})
        if dedup_rows is not None:
            ranks[-1]["rows_sent_dedup"], ranks[-1]["rows_recv_dedup"] = dedup_rows[r]
    opts = {"dtype": "float32", "workload": "uniform"}
    return {"opts": opts, "world_size": W, "steps": steps, "num_chunks": C, "element_size": elsize, "hidden": H,
            "dispatch_dtype": dispatch_dtype, "dispatch_scales": "fp32", "dedup": dedup,
            "ffn": F, "experts": E, "top_k": K, "tokens": T, "spans": spans, "step_s": [0.02] * steps,
            "alpha_s": alpha, "beta_bytes_per_s": beta, "overlap_efficiency": eta, "overlap_probe_bytes": 64000,
            "ranks": ranks}


# ============================================================ tier 1: findings
def test_findings_order_and_hand_numbers():
    """Tier 1: every finding's numbers equal the hand-computed values of ``step_spans``."""
    d = diagnose(synth())
    assert [f.key for f in d.findings] == ["compute", "comm_share", "collective", "overlap", "link", "ranks"]
    assert d.step_s == pytest.approx(20 * MS)
    share = d.finding("comm_share").numbers
    assert share["comm_s"] == pytest.approx(10 * MS)
    assert share["compute_s"] == pytest.approx(8 * MS)
    assert share["comm_share"] == pytest.approx(0.5)
    assert share["untracked_s"] == pytest.approx(20 * MS - 17 * MS)  # step - (compute ∪ comm)
    top = d.finding("collective").numbers["collectives"][0]
    assert (top["phase"], top["direction"]) == ("dispatch", "bwd")
    assert top["time_s"] == pytest.approx(3 * MS) and top["calls_per_rank_step"] == pytest.approx(1)
    assert sum(r["time_s"] for r in d.finding("collective").numbers["collectives"]) == pytest.approx(10 * MS)
    ov = d.finding("overlap").numbers
    assert ov["hidden_s"] == pytest.approx(1 * MS) and ov["exposed_s"] == pytest.approx(9 * MS)
    assert ov["hidden_s"] + ov["exposed_s"] == pytest.approx(share["comm_s"])
    assert d.finding("compute").numbers["expert_fwd_in_step_s"] == pytest.approx(3 * MS)


@pytest.mark.parametrize("gemm_ratio, saturated", [(1.0, True), (0.75, True), (0.5, False)])
def test_compute_saturation_verdict(gemm_ratio, saturated):
    """Tier 1: expert rate / plain GEMM rate = gemm_s * 3 / expert_fwd_s (6RHF vs 2RHF FLOPs)."""
    f = diagnose(synth(gemm_ratio=gemm_ratio)).finding("compute")
    assert f.numbers["ratio"] == pytest.approx(gemm_ratio)
    assert f.verdict.startswith("yes" if saturated else "no")


def test_link_regime_from_the_knee():
    """Tier 1: message = busiest rank's bytes / C against alpha * beta."""
    # 2000 rows * 64 * 4 B = 512 kB per a2a; knee 1e-4 s * 1e9 B/s = 100 kB -> bandwidth-bound
    f = diagnose(synth()).finding("link")
    assert f.numbers["message_bytes"] == pytest.approx(2000 * 64 * 4)
    assert f.numbers["knee_bytes"] == pytest.approx(1e5)
    assert f.numbers["regime"] == "bandwidth" and f.verdict.startswith("bandwidth-bound")
    assert f.numbers["predicted_a2a_s"] == pytest.approx(1e-4 + 512000 / 1e9)
    f = diagnose(synth(alpha=1e-2, C=4)).finding("link")  # knee 10 MB >> 128 kB per chunk
    assert f.numbers["regime"] == "latency" and f.numbers["message_bytes"] == pytest.approx(512000 / 4)


def test_slow_rank_follows_expert_load():
    """Tier 1: 4 ranks, rank 2 gets twice the rows and computes 1.5x longer in backward."""
    rows = [1500.0, 1500.0, 3000.0, 1500.0]
    d = diagnose(synth(W=4, E=8, rows=rows, compute_scale=[1.0, 1.0, 2.0, 1.0]))
    n = d.finding("ranks").numbers
    assert n["slowest_rank"] == 2 and n["busiest_rank"] == 2
    assert n["load_max_over_mean"] == pytest.approx(3000 / 1875)
    assert n["correlation"] == pytest.approx(1.0)
    assert n["compute_over_mean"] == pytest.approx(12 / 9)  # compute 1 + 3 + 8 vs mean (8 * 3 + 12) / 4
    assert "follows the expert load" in d.finding("ranks").verdict
    balanced = diagnose(synth(W=4, E=8)).finding("ranks")
    assert balanced.verdict.startswith("no slow rank")


# ============================================================ tier 1: suggestions
ALLOWED_ACTIONS = {"chunks", "rebalance", "tokens", "fp8", "dedup", "keep"}  # levers the library has today


def _check_suggestion_consistent(d: Diagnosis):
    s = d.suggestion
    assert s.action in ALLOWED_ACTIONS
    assert s.predicted_step_s == pytest.approx(d.step_s - s.predicted_gain_s)
    gains = [a["gain_s"] for a in s.alternatives]
    assert gains == sorted(gains, reverse=True)
    if s.action != "keep":
        chosen = [a for a in s.alternatives if a["action"] == s.action]
        assert len(chosen) == 1 and s.predicted_gain_s == pytest.approx(chosen[0]["gain_s"])
        assert s.predicted_gain_s >= MIN_GAIN_SHARE * d.step_s
        if s.action == "tokens":  # the fallback: no lever that keeps the batch reaches the threshold
            assert all(a["gain_s"] < MIN_GAIN_SHARE * d.step_s for a in s.alternatives if a["action"] != "tokens")
        else:
            assert s.predicted_gain_s == pytest.approx(max(a["gain_s"] for a in s.alternatives
                                                           if a["action"] != "tokens"))


def _model_inputs(r):
    """What the suggestion feeds predict_step: slowest rank's experts, busiest rank's bytes, largest kappa."""
    X = max(d["expert_fwd_s"] for d in r["ranks"])
    B = max(max(d["bytes_sent"], d["bytes_recv"]) for d in r["ranks"])
    kappa = max(d["kappa_s"] for d in r["ranks"])
    return X, B, kappa


def test_model_is_predict_step_with_the_measured_eta():
    """Tier 1: the suggestion's model of the current step and its per-C predictions are predict_step /
    choose_num_chunks with the result's overlap_efficiency, nothing else."""
    for eta in (0.0, 0.35, 1.0):
        for C in (1, 2, 3, 8):
            r = synth(C=C, elsize=2, expert_fwd=5e-3, beta=2e8, eta=eta)
            n = diagnose(r).suggestion.numbers
            X, B, kappa = _model_inputs(r)
            assert n["overlap_efficiency"] == eta
            assert n["model_current_s"] == pytest.approx(predict_step(C, X, B, 1e-4, 2e8, kappa, overlap=eta))
            if "predicted_s" in n:  # a chunks suggestion: every candidate C as choose_num_chunks predicts it
                plan = choose_num_chunks(X, B, 1e-4, 2e8, kappa, overlap=eta)
                assert {int(k): v for k, v in n["predicted_s"].items() if int(k) != C} == pytest.approx(
                    {k: v for k, v in plan.predicted_s.items() if k != C})


@pytest.mark.parametrize("eta", [0.0, 0.3, 0.6, 0.8, 1.0])
def test_suggested_chunks_follow_the_measured_eta(eta):
    """Tier 1: comm ~ compute, bandwidth-bound bf16. The suggested C is choose_num_chunks' C with the
    measured eta; where eta is too low for chunking to pay (the model's C is 1), no chunk suggestion."""
    r = synth(elsize=2, expert_fwd=5e-3, beta=2e8, eta=eta)
    d = diagnose(r)
    _check_suggestion_consistent(d)
    s = d.suggestion
    X, B, kappa = _model_inputs(r)
    assert B == 2000 * 64 * 2 and X == 5e-3
    want = choose_num_chunks(X, B, 1e-4, 2e8, kappa, overlap=eta).num_chunks
    chunk_alts = [a for a in s.alternatives if a["action"] == "chunks"]
    if want == 1:
        assert not chunk_alts and s.action == "keep"
    else:
        assert s.action == "chunks" and s.numbers["best_C"] == want and "more chunks" in s.text
        assert s.predicted_gain_s == pytest.approx(predict_step(1, X, B, 1e-4, 2e8, kappa, overlap=eta)
                                                   - predict_step(want, X, B, 1e-4, 2e8, kappa, overlap=eta))


def test_low_eta_turns_chunking_off():
    """Tier 1: the same workload with eta = 0 (no real overlap) and eta = 1: chunking is suggested only
    where the measured eta makes the model predict a gain."""
    assert diagnose(synth(elsize=2, expert_fwd=5e-3, beta=2e8, eta=1.0)).suggestion.action == "chunks"
    assert diagnose(synth(elsize=2, expert_fwd=5e-3, beta=2e8, eta=0.0)).suggestion.action == "keep"


def test_suggest_fewer_chunks():
    """Tier 1: latency-bound with C=8: every chunk pays alpha, so fewer chunks (preferred over more tokens)."""
    r = synth(C=8, alpha=5e-3, expert_fwd=1e-3)
    d = diagnose(r)
    _check_suggestion_consistent(d)
    s = d.suggestion
    assert s.action == "chunks" and s.numbers["best_C"] < 8 and "fewer" in s.text
    X, B, kappa = _model_inputs(r)
    assert s.numbers["best_C"] == choose_num_chunks(X, B, 5e-3, 1e9, kappa, overlap=0.8).num_chunks
    assert d.finding("link").numbers["regime"] == "latency"
    assert {a["action"] for a in s.alternatives} == {"chunks", "tokens", "fp8"}


def test_suggest_rebalance():
    """Tier 1: one rank receives 2x the mean rows, C already best: rebalance, with the gain of the
    placement plan_placement really finds (not of a perfect balance)."""
    rows = [4000.0, 4000.0 / 3, 4000.0 / 3, 4000.0 / 3]
    r = synth(W=4, E=8, rows=rows, alpha=2e-2, expert_fwd=8e-3)
    d = diagnose(r)
    _check_suggestion_consistent(d)
    s = d.suggestion
    assert s.action == "rebalance", s
    assert s.numbers["load_max_over_mean"] == pytest.approx(2.0)
    load_E = [2000.0, 2000.0] + [4000.0 / 6] * 6
    R = s.numbers["num_replicas"]
    assert R in (0, 4) and f"layer.rebalance({'num_replicas=4' if R else ''})" in s.text
    top = float(plan_placement([load_E], 4, R).predicted_rank_load.max())
    # without replicas the two hot experts go to two ranks with a cold one each: 2000 + 667 rows
    assert float(plan_placement([load_E], 4, 0).predicted_rank_load.max()) == pytest.approx(2000 + 4000 / 6)
    assert s.numbers["planned_max_over_mean"] == pytest.approx(top / 2000)
    X_bal = 8e-3 * top / 4000
    assert s.numbers["expert_fwd_balanced_s"] == pytest.approx(X_bal)
    X, B, kappa = _model_inputs(r)
    B_bal = max(2000 * 64 * 4, top * 64 * 4)
    assert s.predicted_gain_s == pytest.approx(predict_step(1, X, B, 2e-2, 1e9, kappa, overlap=0.8)
                                               - predict_step(1, X_bal, B_bal, 2e-2, 1e9, kappa, overlap=0.8))
    assert "bias_update_rate" in s.text


def test_suggest_more_tokens_when_latency_bound():
    """Tier 1: latency-bound, C=1 already best, balanced: twice the tokens spread alpha and kappa; the
    gain is per the current T tokens: predict_step(T) - predict_step(2T) / 2."""
    r = synth(alpha=5e-3, expert_fwd=1e-3)
    d = diagnose(r)
    _check_suggestion_consistent(d)
    s = d.suggestion
    assert s.action == "tokens", s
    X, B, kappa = _model_inputs(r)
    big = predict_step(1, 2 * X, 2 * B, 5e-3, 1e9, kappa, overlap=0.8)
    assert s.numbers["predicted_big_step_s"] == pytest.approx(big)
    assert s.predicted_gain_s == pytest.approx(predict_step(1, X, B, 5e-3, 1e9, kappa, overlap=0.8) - big / 2)
    assert "T=2000" in s.text


def test_suggest_keep_when_nothing_gains():
    """Tier 1: negligible comm (fast link, tiny alpha), C=1 already best: keep."""
    d = diagnose(synth(alpha=1e-7, beta=1e13, expert_fwd=5e-3))
    _check_suggestion_consistent(d)
    assert d.suggestion.action == "keep" and d.suggestion.predicted_gain_s == 0.0


# ============================================================ tier 1: FP8 dispatch and dedup
# comm-bound: 1000 x 2 rows of H=128 float32 = 1.024 MB per all-to-all at 100 MB/s (10 ms), experts 0.1 ms
COMM_BOUND = dict(H=128, expert_fwd=1e-4, beta=1e8, alpha=1e-5)


def _fp8_bytes(B, H=128, elsize=4):
    """B with FP8 dispatch: the forward dispatch in packed rows, the other three transfers unchanged."""
    return B * (ops.packed_width(H) / (H * elsize) + 3) / 4


def test_fp8_is_the_suggestion_when_comm_bound():
    """Tier 1: comm-bound float32: FP8 dispatch wins; its gain is predict_step with B and with the mean
    of the step's four transfers (the forward dispatch at 132 / 512 bytes per row), and the text says
    what it costs in accuracy."""
    r = synth(**COMM_BOUND)
    d = diagnose(r)
    _check_suggestion_consistent(d)
    s = d.suggestion
    assert s.action == "fp8", s
    X, B, kappa = _model_inputs(r)
    B8 = _fp8_bytes(B)
    assert ops.packed_width(128) == 132 and B8 == pytest.approx(B * (132 / 512 + 3) / 4)
    assert s.numbers["bytes_per_a2a_fp8"] == pytest.approx(B8) and s.numbers["fp8_row_bytes"] == 132
    want = (predict_step(1, X, B, 1e-5, 1e8, kappa, overlap=0.8)
            - predict_step(1, X, B8, 1e-5, 1e8, kappa, overlap=0.8))
    assert s.predicted_gain_s == pytest.approx(want) and want > MIN_GAIN_SHARE * d.step_s
    assert "dispatch_dtype=torch.float8_e4m3fn" in s.text
    assert "3 mantissa bits" in s.text and "2^-4" in s.text
    assert "FP8 dispatch" in format_diagnosis(d)


def test_fp8_already_on_is_never_suggested():
    """Tier 1: the same comm-bound run with FP8 on: no FP8 candidate, and the model's current step (and
    the link finding's message) already use the FP8 bytes."""
    for kw in (COMM_BOUND, *SCENARIOS):
        r = synth(**kw, dispatch_dtype="float8_e4m3fn")
        d = diagnose(r)
        _check_suggestion_consistent(d)
        assert d.suggestion.action != "fp8"
        assert "fp8" not in {a["action"] for a in d.suggestion.alternatives}
    r = synth(**COMM_BOUND, dispatch_dtype="float8_e4m3fn")
    d = diagnose(r)
    X, B, kappa = _model_inputs(r)
    assert d.suggestion.numbers["model_current_s"] == pytest.approx(
        predict_step(1, X, _fp8_bytes(B), 1e-5, 1e8, kappa, overlap=0.8))
    assert d.finding("link").numbers["bytes_per_a2a_busiest"] == pytest.approx(_fp8_bytes(B))
    assert "fp8-dispatch" in d.header


def _dedup_bytes(r):
    """B with one copy per rank: busiest rank's distinct rows, [2K] + [K] float32 metadata per row over the
    four transfers (the two extra exchanges per chunk are 6 / 4 of alpha, not bytes)."""
    row, K = r["hidden"] * r["element_size"], r["top_k"]
    busiest = max(max(d["rows_sent_dedup"], d["rows_recv_dedup"]) for d in r["ranks"]) * row
    return busiest * (4 + 3 * K * 4 / row) / 4


def test_alternatives_carry_fp8_and_dedup():
    """Tier 1: a comm-bound run whose routing sends 70% of its routed rows as distinct (token, rank)
    pairs: both FP8 and dedup are candidates, each gain predict_step's; dedup (every transfer shrinks)
    beats FP8 (only the forward dispatch does)."""
    rows_dedup = [(1400.0, 1400.0), (1400.0, 1400.0)]  # of 2000 routed rows per rank
    r = synth(**COMM_BOUND, dedup_rows=rows_dedup)
    d = diagnose(r)
    _check_suggestion_consistent(d)
    s = d.suggestion
    gains = {a["action"]: a["gain_s"] for a in s.alternatives}
    assert {"fp8", "dedup"} <= set(gains)
    X, B, kappa = _model_inputs(r)

    def model(B_, alpha=1e-5):
        return predict_step(1, X, B_, alpha, 1e8, kappa, overlap=0.8)

    Bd = _dedup_bytes(r)
    assert gains["fp8"] == pytest.approx(model(B) - model(_fp8_bytes(B)))
    assert gains["dedup"] == pytest.approx(model(B) - model(Bd, 1.5e-5))
    assert s.action == "dedup" and s.numbers["dedup_rows_ratio"] == pytest.approx(0.7)
    assert "dedup=True" in s.text and "70%" in s.text


def test_dedup_needs_the_distinct_rows_and_a_shared_rank():
    """Tier 1: no dedup candidate without the distinct-rows counts or when every token's experts are on
    different ranks (ratio 1); a run with dedup on is diagnosed with its own bytes and never suggests it;
    dedup on without the counts is rejected, named."""
    assert "dedup" not in {a["action"] for a in diagnose(synth(**COMM_BOUND)).suggestion.alternatives}
    flat = synth(**COMM_BOUND, dedup_rows=[(2000.0, 2000.0)] * 2)
    assert "dedup" not in {a["action"] for a in diagnose(flat).suggestion.alternatives}
    on = synth(**COMM_BOUND, dedup=True, dedup_rows=[(1400.0, 1400.0)] * 2)
    d = diagnose(on)
    assert "dedup" not in {a["action"] for a in d.suggestion.alternatives}
    X, _, kappa = _model_inputs(on)
    assert d.suggestion.numbers["bytes_per_a2a"] == pytest.approx(_dedup_bytes(on))
    assert d.suggestion.numbers["alpha_model_s"] == pytest.approx(1.5e-5)
    assert d.suggestion.numbers["model_current_s"] == pytest.approx(
        predict_step(1, X, _dedup_bytes(on), 1.5e-5, 1e8, kappa, overlap=0.8))
    # FP8 on top of dedup: the dedup rows' forward dispatch in packed rows, with dedup's alpha
    fp8 = [a for a in d.suggestion.alternatives if a["action"] == "fp8"]
    row = 128 * 4
    B8 = 1400 * row * (132 / row + 3 + 3 * 2 * 4 / row) / 4
    assert fp8 and fp8[0]["gain_s"] == pytest.approx(
        predict_step(1, X, _dedup_bytes(on), 1.5e-5, 1e8, kappa, overlap=0.8)
        - predict_step(1, X, B8, 1.5e-5, 1e8, kappa, overlap=0.8))
    with pytest.raises(ValueError, match="rows_sent_dedup"):
        diagnose(synth(**COMM_BOUND, dedup=True))


def test_distinct_rows_per_rank():
    """Tier 1: the docstring example of collect.distinct_rows_W (a dropped slot sends nothing)."""
    idx = torch.tensor([[0, 1], [3, 0], [-1, 2]])
    assert distinct_rows_W(idx, 2, 2).tolist() == [2, 2]
    assert distinct_rows_W(torch.tensor([[0, 2], [1, 3]]), 2, 2).tolist() == [2, 2]
    assert distinct_rows_W(torch.tensor([[0, 1], [1, 0]]), 2, 2).tolist() == [2, 0]


SCENARIOS = [dict(), dict(elsize=2, expert_fwd=5e-3, beta=2e8), dict(C=8, alpha=5e-3, expert_fwd=1e-3),
             dict(W=4, E=8, rows=[4000.0, 4000.0 / 3, 4000.0 / 3, 4000.0 / 3], alpha=2e-2, expert_fwd=8e-3),
             dict(alpha=5e-3, expert_fwd=1e-3), dict(H=256, F=64, expert_fwd=1e-5, beta=1e8),
             dict(W=8, E=32, K=8, T=250, expert_fwd=1e-5, beta=1e8), dict(alpha=1e-7, beta=1e13, expert_fwd=5e-3)]


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("kw", SCENARIOS)
def test_suggestions_use_only_levers_the_library_has(kw, eta):
    """Tier 1: across bandwidth-bound, latency-bound, skewed and negligible-comm results, the suggestion
    and every alternative are num_chunks / rebalance / more tokens / FP8 dispatch / dedup / keep, no
    routing change it cannot turn into fewer bytes; FP8 is a candidate (the run had it off) and its text
    names the accuracy cost; dedup is none (these results carry no distinct-rows counts); a chunks
    suggestion's C is choose_num_chunks' with the measured eta."""
    r = synth(**kw, eta=eta)
    d = diagnose(r)
    _check_suggestion_consistent(d)
    s = d.suggestion
    actions = {a["action"] for a in s.alternatives}
    assert actions <= ALLOWED_ACTIONS and "dedup" not in actions
    if s.action == "fp8":
        assert "3 mantissa bits" in s.text and "2^-4" in s.text
    if s.action == "chunks":
        X, B, kappa = _model_inputs(r)
        assert s.numbers["best_C"] == choose_num_chunks(X, B, r["alpha_s"], r["beta_bytes_per_s"], kappa,
                                                        overlap=eta).num_chunks


def test_missing_overlap_efficiency_is_named():
    """Tier 1: a result without the measured eta is rejected, not diagnosed with a guessed one."""
    r = synth()
    del r["overlap_efficiency"]
    with pytest.raises(ValueError, match="overlap_efficiency"):
        diagnose(r)


# ============================================================ tier 1: rendering, options
def test_format_diagnosis_has_every_finding_and_numbers():
    d = diagnose(synth())
    text = format_diagnosis(d)
    for i, f in enumerate(d.findings, 1):
        assert f"{i}. {f.title}" in text
    assert "50% of the 20.00 ms step" in text
    assert "Suggestion:" in text and "considered:" in text
    json.dumps(d.as_dict())  # serialisable


def test_plot_timeline_synthetic(tmp_path):
    path = plot_timeline(synth(W=3, E=6)["spans"], str(tmp_path / "t.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 10_000


def test_plot_timeline_leaves_the_backend_alone(tmp_path):
    """Tier 1 (one child Python): plotting neither loads pyplot nor picks a backend; the caller's
    configured backend is what it was."""
    code = ("import sys, matplotlib\n"
            "from moe_comm.tools.diagnose import plot_timeline\n"
            "from moe_comm.profiling import Span\n"
            "matplotlib.use('svg')  # the caller's choice\n"
            "spans = [Span(0, 0, 'experts', 0, 'compute', 'fwd', 0.0, 1e-3, 'compute'),\n"
            "         Span(1, 0, 'dispatch', 0, 'comm', 'fwd', 0.0, 2e-3, 'comm')]\n"
            f"plot_timeline(spans, {str(tmp_path / 'p.png')!r})\n"
            "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot was imported'\n"
            "assert matplotlib.get_backend() == 'svg', matplotlib.get_backend()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_sub_lanes_packing():
    spans = [Span(0, 0, "dispatch", c, "comm", "fwd", a, b, "comm") for c, (a, b) in
             enumerate([(0, 2), (1, 3), (2.5, 4), (3.1, 5)])]
    assert _sub_lanes(spans) == [0, 1, 0, 1]


@pytest.mark.parametrize("bad, needle", [({"colour": 1}, "unknown option"), ({"top_k": 9}, "top_k"),
                                         ({"experts": 6, "world_size": 4}, "divisible"),
                                         ({"workload": "nope"}, "workload"),
                                         ({"hidden": 4, "experts": 8}, "hidden"),
                                         ({"tokens": 0}, "tokens"), ({"link": "fast"}, "rate"),
                                         ({"dispatch_dtype": "int8"}, "dispatch_dtype"), ({"dedup": 1}, "dedup"),
                                         ({"dispatch_scales": "e5m2"}, "dispatch_scales")])
def test_bad_options(bad, needle):
    with pytest.raises(ValueError, match=needle):
        normalize_opts(bad)


def test_wire_options_normalised():
    """Tier 1: "fp8" / "none" become the dtype name / None."""
    assert normalize_opts({"dispatch_dtype": "fp8"})["dispatch_dtype"] == "float8_e4m3fn"
    assert normalize_opts({"dispatch_dtype": "none"})["dispatch_dtype"] is None
    assert normalize_opts({})["dedup"] is False and normalize_opts({})["dispatch_scales"] == "fp32"


def test_profile_main_exit_code_2_on_bad_options(tmp_path, capsys):
    assert profile_main({"top_k": 99}, str(tmp_path)) == 2
    assert "top_k" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_relaunch_command_runs_the_package_from_anywhere(tmp_path):
    """Tier 1 (one child Python, no ranks): the command the emulated-link path runs inside the network
    namespace is ``python -m moe_comm.tools.diagnose OPTS_JSON OUT_DIR`` with this checkout on
    PYTHONPATH; started from another directory it reaches profile_main (bad options: exit 2, named)."""
    out = tmp_path / "out"
    cmd, env = relaunch_command(normalize_opts({}) | {"top_k": 99}, str(out))
    assert cmd[1:3] == ["-m", "moe_comm.tools.diagnose"] and cmd[-1] == str(out)
    root = env["PYTHONPATH"].split(os.pathsep)[0]
    assert os.path.isfile(os.path.join(root, "moe_comm", "tools", "diagnose", "__main__.py"))
    r = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "top_k" in r.stderr and not out.exists()


# ============================================================ tier 2: end to end
def _union_us(events):
    total, end = 0.0, -math.inf
    for s, e in sorted((ev["ts"], ev["ts"] + ev["dur"]) for ev in events):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


@pytest.mark.multirank
def test_profile_main_two_ranks(tmp_path, capsys):
    """Tier 2: 2 spawned gloo ranks, hot_rank workload (rank 0's experts get 80% of the slots)."""
    opts = {"world_size": 2, "tokens": 96, "hidden": 32, "ffn": 48, "experts": 4, "top_k": 2, "num_chunks": 2,
            "steps": 2, "warmup": 1, "workload": "hot_rank", "workload_params": {"p": 0.8}}
    assert profile_main(opts, str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "1. Is compute saturated?" in out and "Suggestion:" in out
    for name in ("trace.json", "timeline.png", "profile.json"):
        assert os.path.getsize(tmp_path / name) > 0
    prof = json.loads((tmp_path / "profile.json").read_text())
    trace = json.loads((tmp_path / "trace.json").read_text())
    res, diag = prof["result"], prof["diagnosis"]
    assert res["alpha_s"] >= 0 and res["beta_bytes_per_s"] > 0 and all(t > 0 for t in res["step_s"])
    for r in res["ranks"]:
        for k in ("expert_fwd_s", "expert_fwdbwd_s", "gemm_s", "kappa_s", "rows_sent", "expert_flops"):
            assert r[k] > 0, k
        assert r["rows_sent"] == 96 * 2 and r["bytes_sent"] == 96 * 2 * 32 * 4
    assert sum(r["rows_recv"] for r in res["ranks"]) == pytest.approx(2 * 96 * 2)  # every routed row lands
    ranks = {f["key"]: f for f in diag["findings"]}["ranks"]["numbers"]
    assert ranks["busiest_rank"] == 0 and ranks["load_max_over_mean"] > 1.2

    # The diagnosis' comm share is the trace's: per rank union of comm events / union of envelopes.
    ev = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    pids = sorted({e["pid"] for e in ev})
    assert pids == [0, 1]
    comm = sum(_union_us([e for e in ev if e["pid"] == p and e["cat"] == "comm"]) for p in pids)
    region = sum(_union_us([e for e in ev if e["pid"] == p and e["cat"] == "region"]) for p in pids)
    share = {f["key"]: f for f in diag["findings"]}["comm_share"]["numbers"]
    assert 0 < share["comm_share"] < 1
    assert share["comm_share"] == pytest.approx(comm / region, rel=1e-6)
    assert share["step_s"] == pytest.approx(region / len(pids) / 2 * 1e-6, rel=1e-6)
    # (plus "control" spans where the dispatcher exchanges its wire header)
    assert {e["name"].split()[0] for e in ev if e["cat"] == "comm"} - {"control"} == {"counts", "dispatch", "combine"}
    sug = diag["suggestion"]
    assert sug["predicted_step_s"] == pytest.approx(diag["step_s"] - sug["predicted_gain_s"])

    # The suggestion's model is predict_step with the overlap efficiency this run measured.
    eta = res["overlap_efficiency"]
    assert 0.0 <= eta <= 1.0 and res["overlap_probe_bytes"] == 96 * 2 * 32 * 4 // 4
    X, B, kappa = _model_inputs(res)
    n = sug["numbers"]
    assert n["overlap_efficiency"] == eta
    assert n["model_current_s"] == pytest.approx(predict_step(2, X, B, res["alpha_s"], res["beta_bytes_per_s"],
                                                              kappa, overlap=eta))
    assert sug["action"] in ALLOWED_ACTIONS
    # FP8 and dedup were off: both are candidates, dedup from the distinct (token, rank) rows collected
    assert res["dispatch_dtype"] is None and res["dedup"] is False and res["fp8_row_bytes"] == 36
    for r in res["ranks"]:
        assert 0 < r["rows_sent_dedup"] <= r["rows_sent"] and 0 < r["rows_recv_dedup"] <= r["rows_recv"]
        assert r["last_bytes"]["dispatch_wire"] == r["last_bytes"]["dispatch_logical"] > 0
    assert {"fp8", "dedup"} <= {a["action"] for a in sug["alternatives"]}
    assert sum(r["rows_sent_dedup"] for r in res["ranks"]) == pytest.approx(sum(r["rows_recv_dedup"]
                                                                               for r in res["ranks"]))
    if sug["action"] == "chunks":
        assert n["best_C"] == choose_num_chunks(X, B, res["alpha_s"], res["beta_bytes_per_s"], kappa,
                                                overlap=eta).num_chunks


@pytest.mark.multirank
def test_profile_fp8_dedup_counts_match_the_dispatchers_bytes(tmp_path, capsys):
    """Tier 2: 2 spawned gloo ranks, the layer with FP8 dispatch and dedup, one timed step: the distinct
    (token, rank) rows collect derives from the routing are the rows the Dispatcher says it sent
    (last_bytes: packed rows + [2K] float32 metadata forward, float32 rows back), and neither lever is
    suggested again."""
    opts = {"world_size": 2, "tokens": 64, "hidden": 32, "ffn": 16, "experts": 4, "top_k": 2, "steps": 1,
            "warmup": 1, "dispatch_dtype": "fp8", "dedup": True}
    assert profile_main(opts, str(tmp_path)) == 0
    assert "fp8-dispatch dedup" in capsys.readouterr().out
    prof = json.loads((tmp_path / "profile.json").read_text())
    res, sug = prof["result"], prof["diagnosis"]["suggestion"]
    assert res["dispatch_dtype"] == "float8_e4m3fn" and res["dedup"] is True
    for r in res["ranks"]:
        rows = r["rows_sent_dedup"]
        assert 64 <= rows < 128 and rows == int(rows)
        assert r["last_bytes"]["combine_wire"] == rows * 32 * 4
        assert r["last_bytes"]["dispatch_wire"] == rows * (ops.packed_width(32) + 2 * 2 * 4)
    assert not {"fp8", "dedup"} & {a["action"] for a in sug["alternatives"]}
