"""`moe-comm profile` (moe_comm.tools.diagnose).

Tier 1 (pure logic, no processes): ``diagnose`` on synthetic results with hand-computed spans (every
finding's numbers, each branch of the suggestion logic, its predicted gain against autochunk's model),
``format_diagnosis``, ``plot_timeline`` on synthetic spans, option checking.
Tier 2 (multi-rank gloo, 2 spawned ranks): ``profile_main`` end to end on tiny sizes with a skewed
workload: the three files exist and parse, figures are positive, rows are conserved, and the diagnosis'
communication share is what the Chrome trace's own spans give. ~8 s.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest

from moe_comm.dispatch.autotune import choose_num_chunks, predict_step
from moe_comm.tools.diagnose import (MIN_GAIN_SHARE, Diagnosis, _model_step, _sub_lanes, diagnose, format_diagnosis,
                               normalize_opts, plot_timeline, profile_main)
from moe_comm.profiling.timeline import Span

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
          expert_fwd=2e-3, gemm_ratio=1.0, rows=None, ranks_per_token=1.5, kappa=1e-5, compute_scale=None,
          bytes_scale=1.0):
    """A profile_rank-shaped result. rows: rows received per rank (default: balanced T*K)."""
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
                      "ranks_per_token": ranks_per_token, "expert_rows": int(R), "expert_fwd_s": fwd,
                      "expert_fwdbwd_s": 3 * fwd, "expert_flops": flops,
                      "gemm_s": fwd * gemm_ratio / 3.0, "gemm_flops": 2.0 * R * H * F, "kappa_s": kappa})
    opts = {"dtype": "float32", "workload": "uniform"}
    return {"opts": opts, "world_size": W, "steps": steps, "num_chunks": C, "element_size": elsize, "hidden": H,
            "ffn": F, "experts": E, "top_k": K, "tokens": T, "spans": spans, "step_s": [0.02] * steps,
            "alpha_s": alpha, "beta_bytes_per_s": beta, "ranks": ranks}


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
def _check_suggestion_consistent(d: Diagnosis):
    s = d.suggestion
    assert s.predicted_step_s == pytest.approx(d.step_s - s.predicted_gain_s)
    gains = [a["gain_s"] for a in s.alternatives]
    assert gains == sorted(gains, reverse=True)
    if s.action != "keep":
        assert s.alternatives[0]["action"] == s.action and s.predicted_gain_s == pytest.approx(gains[0])
        assert s.predicted_gain_s >= MIN_GAIN_SHARE * d.step_s


def test_suggest_more_chunks():
    """Tier 1: comm ~ compute, bandwidth-bound bf16: chunking hides more than FP8 saves."""
    r = synth(elsize=2, expert_fwd=5e-3, beta=2e8, bytes_scale=1.0)
    d = diagnose(r)
    _check_suggestion_consistent(d)
    s = d.suggestion
    assert s.action == "chunks" and s.numbers["best_C"] > 1 and "more chunks" in s.text
    B = 2000 * 64 * 2
    X = 5e-3
    best = choose_num_chunks(X, B, 1e-4, 2e8, 1e-5).num_chunks
    assert s.numbers["best_C"] == best
    assert s.predicted_gain_s == pytest.approx(predict_step(1, X, B, 1e-4, 2e8, 1e-5)
                                               - predict_step(best, X, B, 1e-4, 2e8, 1e-5))
    assert {a["action"] for a in s.alternatives} == {"chunks", "fp8_dispatch"}


def test_suggest_fewer_chunks():
    """Tier 1: latency-bound with C=8: every chunk pays alpha, so fewer chunks."""
    d = diagnose(synth(C=8, alpha=5e-3, expert_fwd=1e-3))
    _check_suggestion_consistent(d)
    assert d.suggestion.action == "chunks" and d.suggestion.numbers["best_C"] < 8 and "fewer" in d.suggestion.text
    assert d.finding("link").numbers["regime"] == "latency"


def test_suggest_rebalance():
    """Tier 1: one rank receives 2x the mean rows on a latency-bound link (no FP8), C already best."""
    rows = [4000.0, 4000.0 / 3, 4000.0 / 3, 4000.0 / 3]
    d = diagnose(synth(W=4, E=8, rows=rows, alpha=2e-2, expert_fwd=8e-3))
    _check_suggestion_consistent(d)
    s = d.suggestion
    assert s.action == "rebalance", s
    assert s.numbers["load_max_over_mean"] == pytest.approx(2.0)
    assert s.numbers["expert_fwd_balanced_s"] == pytest.approx(8e-3 / 2)


def test_suggest_fp8_dispatch():
    """Tier 1: bandwidth-bound, experts negligible (chunking cannot hide anything): FP8 dispatch,
    whose gain is the model's step with the forward dispatch at (H + 4 H/128) / (4 H) of its bytes."""
    H = 256
    d = diagnose(synth(H=H, F=64, expert_fwd=1e-5, beta=1e8))
    _check_suggestion_consistent(d)
    s = d.suggestion
    assert s.action == "fp8_dispatch", s
    B = 2000 * H * 4
    factor = (H + 4 * 2) / (H * 4)
    assert s.numbers["bytes_factor"] == pytest.approx(factor)
    X = 1e-5
    want = predict_step(1, X, B, 1e-4, 1e8, 1e-5) - _model_step(1, X, (B * factor, B, B, B), 1e-4, 1e8, 1e-5)
    assert s.predicted_gain_s == pytest.approx(want)
    # no compute to hide behind: the gain is the forward dispatch's saved link time
    assert s.predicted_gain_s == pytest.approx(B * (1 - factor) / 1e8, rel=1e-6)


def test_suggest_group_limited_routing():
    """Tier 1: 8 ranks of 4 experts, K=8, tokens reach 6.5 ranks: limiting them to 2 ranks (2 * 4 >= K)."""
    d = diagnose(synth(W=8, E=32, K=8, T=250, expert_fwd=1e-5, beta=1e8, ranks_per_token=6.5))
    _check_suggestion_consistent(d)
    s = d.suggestion
    assert s.action == "group_limited", s
    assert s.numbers["topk_groups"] == 2 and s.numbers["num_groups"] == 8
    B = 2000 * 64 * 4
    assert s.numbers["bytes_dedup_now"] == pytest.approx(B * 6.5 / 8)
    assert s.numbers["bytes_dedup_limited"] == pytest.approx(B * 2 / 8)
    assert "num_groups=8, topk_groups=2" in s.text


def test_suggest_keep_when_nothing_gains():
    """Tier 1: negligible comm (fast link, tiny alpha), C=1 already best: keep."""
    d = diagnose(synth(alpha=1e-7, beta=1e13, expert_fwd=5e-3))
    _check_suggestion_consistent(d)
    assert d.suggestion.action == "keep" and d.suggestion.predicted_gain_s == 0.0


def test_model_step_equals_predict_step_for_equal_bytes():
    """Tier 1: the per-a2a model reduces to autochunk.predict_step."""
    for C in (1, 2, 4, 8):
        for X, B, a, b in ((1e-3, 1e6, 1e-4, 1e8), (5e-2, 3e5, 2e-3, 1e9), (0.0, 1e6, 1e-5, float("inf"))):
            assert _model_step(C, X, (B, B, B, B), a, b, 2e-4) == pytest.approx(predict_step(C, X, B, a, b, 2e-4))


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


def test_sub_lanes_packing():
    spans = [Span(0, 0, "dispatch", c, "comm", "fwd", a, b, "comm") for c, (a, b) in
             enumerate([(0, 2), (1, 3), (2.5, 4), (3.1, 5)])]
    assert _sub_lanes(spans) == [0, 1, 0, 1]


@pytest.mark.parametrize("bad, needle", [({"colour": 1}, "unknown option"), ({"top_k": 9}, "top_k"),
                                         ({"experts": 6, "world_size": 4}, "divisible"),
                                         ({"workload": "nope"}, "workload"),
                                         ({"hidden": 4, "experts": 8}, "hidden"),
                                         ({"tokens": 0}, "tokens"), ({"link": "fast"}, "rate")])
def test_bad_options(bad, needle):
    with pytest.raises(ValueError, match=needle):
        normalize_opts(bad)


def test_profile_main_exit_code_2_on_bad_options(tmp_path, capsys):
    assert profile_main({"top_k": 99}, str(tmp_path)) == 2
    assert "top_k" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


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
    assert {e["name"].split()[0] for e in ev if e["cat"] == "comm"} == {"counts", "dispatch", "combine"}
    sug = diag["suggestion"]
    assert sug["predicted_step_s"] == pytest.approx(diag["step_s"] - sug["predicted_gain_s"])
