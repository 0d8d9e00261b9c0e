"""Tier 2: multi-rank on CPU. Runs ``benchmarks/wire.py --quick --links none`` end to end.

Tiny shapes on plain loopback (2 spawned gloo ranks, ~35 s here): the script must exit 0 or 1 (1: a
verdict failed; no timing goal applies on loopback, so only counting and accuracy can fail it), write a
JSON with every section, and the counting verdict must pass (wire rows per token of one copy per rank
within 2% of the expected distinct-rank count, uniform routing).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "wire.py")
VERDICT_KEYS = {"goal", "measured", "limit", "applies", "pass"}


@pytest.mark.multirank
def test_wire_bench_quick_writes_every_section_and_the_counting_verdict_passes(tmp_path):
    path = tmp_path / "wire.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--links", "none", "--json", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1), f"exit code {proc.returncode}:\n{out[-4000:]}"
    res = json.loads(path.read_text())
    assert set(res) >= {"params", "counting", "timing", "accuracy", "verdicts"}

    counting = res["counting"]
    assert {(r["W"], r["e"], r["K"]) for r in counting["rows"]} == {
        (W, e, K) for W in (4, 8) for e in (2, 4, 8) for K in (2, 4, 8)}
    for r in counting["rows"]:
        assert 1.0 <= r["wire_rows_per_token"] <= min(r["K"], r["W"]), r
        assert abs(r["ratio"] - 1.0) <= 0.02, r
    assert res["verdicts"]["counting"]["pass"] and res["verdicts"]["counting"]["applies"]

    (timing,) = res["timing"]  # --quick: W = 2 only
    assert timing["link"] == "none" and timing["world_size"] == 2
    for k in ("dispatch_fp32", "dispatch_fp8", "raw_fp32", "raw_fp8", "call", "call_dedup", "call_dedup_fp8",
              "raw_dedup", "raw_dedup_rt", "call_dedup.dispatch", "call_dedup.combine"):
        assert timing["median_s"][k] > 0, k
    assert timing["wire_rows_per_token"] == pytest.approx(2.0)  # top-8 of 16 experts on 2 ranks: both ranks
    assert timing["routed_rows_per_token"] == 8
    fp32_bytes, fp8_bytes = (timing["last_bytes_rank0"][k]["dispatch_wire"] for k in ("dispatch_fp32", "dispatch_fp8"))
    assert fp8_bytes / fp32_bytes == pytest.approx(timing["packed_width"] / timing["row_bytes_fp32"])
    assert timing["raw_bytes_rank0"]["raw_fp8"] == fp8_bytes  # the raw all-to-all moves the dispatch's wire bytes

    assert len(res["accuracy"]["rows"]) == 4  # {fp32, ue8m0 scales} x {randn, outliers}
    for name, v in res["verdicts"].items():
        assert set(v) == VERDICT_KEYS, name
        assert v["applies"] == (not name.startswith(("fp8_dispatch_", "dedup_"))), name  # loopback: no timing goal
    assert res["verdicts"]["fp8_accuracy_elementwise"]["pass"]
    assert "Verdicts" in proc.stdout
