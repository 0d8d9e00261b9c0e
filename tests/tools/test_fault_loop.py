"""``benchmarks/fault_loop.py``, the random single-rank fault loop of issue #27 ("Reliability II").

Tier 1 (pure logic): the draw is seeded, the same in every process, and never draws a combination that does not
apply or is excluded; the checker flags a rank that returned a value from a failed call, a healthy rank's error
that does not name the failing rank, and an inexact good call.
Tier 2 (multi-rank gloo, its own processes: the CLI as a user runs it): 30 iterations at W = 2 (the full run is
200 at W = 2 and 4: ``python benchmarks/fault_loop.py --iters 200 --world-size 4``) end with every rank alive,
every failed call raised on every rank, every good call exact, memory flat, and cover several kinds and modes.
The combinations the loop excludes (``fault_loop.EXCLUDED``: findings) are replayed under xfail(strict): they
fail until the library is fixed, then XPASS tells whoever fixes it to drop them from the list.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "fault_loop.py")


def _import_loop():
    benchmarks = os.path.join(ROOT, "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    import fault_loop
    return fault_loop


def _run_cli(tmp_path, *args, timeout=150):
    """Run the loop as a user does; a hang fails the test (the whole process group is killed)."""
    out = tmp_path / "fault_loop.json"
    cmd = [sys.executable, SCRIPT, "--world-size", "2", "--json", str(out), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"fault loop did not finish within {timeout} s: {' '.join(cmd)}")
    assert out.exists(), text[-4000:]
    return proc.returncode, json.loads(out.read_text()), text


def test_draw_is_seeded_and_draws_only_what_applies():
    fl = _import_loop()
    cases = [fl.draw(3, it, 4) for it in range(2000)]
    assert cases[:50] == [fl.draw(3, it, 4) for it in range(50)]  # str seeds: the same in every process
    assert cases[:50] != [fl.draw(4, it, 4) for it in range(50)]
    for c in cases:
        assert c.phase in fl._applies(c.kind)[c.mode], c
        assert (c.kind, c.mode, c.phase) not in fl.EXCLUDED, c
        assert 0 <= c.bad < 4 and 1 <= c.C <= 3 and (c.chunk == -1) == (c.kind != "expert_fn") and c.chunk < c.C
        if c.mode == "sync_free" or c.kind == "piece":
            assert c.C == 1, c
    drawn = {c.kind for c in cases}
    # every kind with a combination left is drawn; the excluded ones never
    assert drawn == {k for k in fl.KINDS
                     if any((k, m, p) not in fl.EXCLUDED for m, ps in fl._applies(k).items() for p in ps)}
    every = {(c.kind, c.mode, c.phase) for c in (fl.draw(3, it, 4, with_excluded=True) for it in range(4000))}
    assert set(fl.EXCLUDED) <= every  # --with-excluded puts them back


def _recs(case, calls, afters):
    return [{"it": 0, "rank": r, "case": case, "call": c, "after": a} for r, (c, a) in enumerate(zip(calls, afters))]


def test_judge_flags_what_breaks_the_rules():
    fl = _import_loop()
    case = {"kind": "permute", "mode": "eager", "phase": "fwd", "chunk": -1, "C": 1, "bad": 1, "K": 2}
    ok = {"raised": None, "at": None, "nan_grad": False, "mismatch": None}
    own = {"raised": {"type": "RuntimeError", "message": "injected send permute fault"}, "at": "forward",
           "nan_grad": False, "mismatch": None}
    peer = {"raised": {"type": "PeerFailed", "message": "EP rank(s) [1] failed: injected send permute fault"},
            "at": "forward", "nan_grad": False, "mismatch": None}
    assert fl.judge(case, _recs(case, [peer, own], [ok, ok])) == (True, [])
    fired, problems = fl.judge(case, _recs(case, [ok, own], [ok, ok]))
    assert fired and "returned a value from the failed call" in problems[0]
    unnamed = dict(peer, raised={"type": "PeerFailed", "message": "EP rank(s) [0] failed"})
    assert "mis-raised" in fl.judge(case, _recs(case, [unnamed, own], [ok, ok]))[1][0]
    wrong = dict(ok, mismatch="y wrong (max err 1, token 0)")
    assert "the good call after" in fl.judge(case, _recs(case, [peer, own], [ok, wrong]))[1][0]
    assert "did not fire" in fl.judge(case, _recs(case, [ok, ok], [ok, ok]))[1][0]


def test_compare_is_exact_and_fp8_within_its_bound():
    fl = _import_loop()
    case = fl.Case(kind="none", mode="eager", phase="fwd", chunk=-1, C=1, bad=0, K=2)
    x, idx, w, g = fl.make_inputs(0, 0, 1, case, 4, "call")
    factor = (w * torch.where(idx >= 0, idx + 1.0, 0.0)).sum(1, keepdim=True)
    gw = torch.where(idx >= 0, idx + 1.0, 0.0) * (x * g).sum(1, keepdim=True)
    assert fl.compare(x * factor, g * factor, gw, x, idx, w, g, fp8=False) is None
    assert "y wrong" in fl.compare(x * factor + 2 ** -40, g * factor, gw, x, idx, w, g, fp8=False)
    assert fl.compare(x * factor * (1 + 2 ** -5), g * factor, gw, x, idx, w, g, fp8=True) is None
    assert "y wrong" in fl.compare(x * factor * (1 + 2 ** -3), g * factor, gw, x, idx, w, g, fp8=True)


@pytest.mark.multirank
def test_short_fault_loop_holds_all_four_properties(tmp_path):
    rc, res, text = _run_cli(tmp_path, "--iters", "30", "--seed", "1")
    assert res["properties"] == {"alive": True, "raised_everywhere": True, "exact": True, "rss_flat": True}, \
        (res["problems"], res["rss"], text[-3000:])
    assert rc == 0 and res["ok"] and res["iters_done"] == 30
    assert res["faults_not_fired"] == 0 and res["good_calls"] == res["exact_calls"] >= 60
    # the draw covered several kinds and modes, and most calls failed on purpose
    assert len([k for k, n in res["failed_calls"]["kind"].items() if n]) >= 6, res["failed_calls"]
    assert len(res["counts"]["mode"]) >= 4 and len(res["counts"]["C"]) == 3, res["counts"]
    assert sum(res["failed_calls"]["kind"].values()) >= 20, res["failed_calls"]
    assert res["raised_types"].get("healthy:PeerFailed@forward", 0) >= 10, res["raised_types"]
    for r in res["rss"]:
        assert r["tensor_growth"] <= 16, r


FINDINGS = {
    # every deferred failure is kept alive on the failing rank (EXCLUDED: LEAK)
    "deferred_failure_retained": ["expert_fn,deferred,fwd,0,1,1,2", "sf_permute,sync_free,fwd,-1,1,1,2"],
    # a sync-free final unpermute fault never reaches the healthy ranks
    "sync_free_unpermute_not_carried": ["unpermute,sync_free,fwd,-1,1,1,2"],
}


@pytest.mark.multirank
@pytest.mark.parametrize("finding", sorted(FINDINGS))
@pytest.mark.xfail(strict=True, reason="issue #27 findings excluded from the loop's draw (fault_loop.EXCLUDED); "
                                       "drop them from EXCLUDED once this passes")
def test_excluded_combinations_hold_too(tmp_path, finding):
    args = ["--iters", "12"] + [a for c in FINDINGS[finding] for a in ("--case", c)]
    rc, res, text = _run_cli(tmp_path, *args)
    assert res["properties"]["alive"], text[-3000:]  # the findings kill no rank
    assert res["ok"], (res["problems"][:4], [(r["live_tensors"], r["growth_mb"]) for r in res["rss"]])
