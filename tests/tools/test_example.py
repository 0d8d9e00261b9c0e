"""Tier 2: multi-rank on CPU. Runs ``examples/train_ep_moe.py`` end to end.

Four spawned gloo ranks train a small MoE transformer (attention + MoE FFN) as EP 2 x DP 2 with FSDP2
(``moe_comm.parallel.fully_shard_moe``), save a torch.distributed.checkpoint halfway, resume in a fresh
model at EP 4 x DP 1, and compare every step's loss with the same model trained in one process. The script
must exit 0, print a curve within fp32 noise of the one-process curve (relative difference <= 1e-4 at every
step, both before and after the resharded resume), and a final loss below the first.
A short second run on 2 ranks with ``--fp8-dispatch --dedup`` (FP8 rows, one copy per rank) must finish with
a finite final loss within the script's 2% of the fp32 one-process run.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "train_ep_moe.py")
ROW_RE = re.compile(r"^\s*(\d+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.e+-]+)\s+EP (\d) x DP (\d)$", re.MULTILINE)
CURVE_RE = re.compile(r"^curve vs one process: max relative difference ([0-9.e+-]+) over (\d+) steps .*: OK$",
                      re.MULTILINE)
FINAL_RE = re.compile(r"^final: loss first ([0-9.]+) -> last ([0-9.]+)", re.MULTILINE)
FP8_RE = re.compile(r"^fp8 dispatch: final loss (\S+) vs fp32 one process (\S+): relative difference (\S+) "
                    r"\(tolerance 2e-02\): OK$", re.MULTILINE)


@pytest.mark.multirank
def test_train_example_matches_one_process_across_a_resharded_resume(tmp_path):
    ckpt = tmp_path / "dcp"
    # --dedup: one copy per (token, rank) changes only the summation order, the curve still matches to 1e-4
    cmd = [sys.executable, SCRIPT, "--world-size", "4", "--ep", "2", "--resume-ep", "4", "--steps", "16", "--dedup",
           "--timeout", "120", "--checkpoint", str(ckpt)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{out[-4000:]}"
    rows = [(int(s), float(ref), float(got), float(rel), (int(ep), int(dp)))
            for s, ref, got, rel, ep, dp in ROW_RE.findall(proc.stdout)]
    assert rows, f"no curve printed:\n{out[-4000:]}"
    assert {grid for *_, grid in rows} == {(2, 2), (4, 1)}, rows  # both sides of the checkpoint shown
    for step, ref, got, rel, grid in rows:
        assert grid == ((2, 2) if step <= 8 else (4, 1))
        assert abs(got - ref) <= 1e-4 * abs(ref), (step, ref, got)
    curve, final = CURVE_RE.search(proc.stdout), FINAL_RE.search(proc.stdout)
    assert curve and final, out[-4000:]
    assert float(curve.group(1)) <= 1e-4 and int(curve.group(2)) == 16
    assert float(final.group(2)) < float(final.group(1))
    assert "checkpoint: dcp.save after step 8 at EP 2 x DP 2 (4 files, one per rank)" in proc.stdout
    assert sorted(p.name for p in ckpt.iterdir() if p.suffix == ".distcp") == [f"__{r}_0.distcp" for r in range(4)]


@pytest.mark.multirank
def test_train_example_with_fp8_dispatch_and_dedup_finishes_near_the_fp32_loss(tmp_path):
    cmd = [sys.executable, SCRIPT, "--world-size", "2", "--ep", "2", "--resume-ep", "2", "--steps", "6",
           "--fp8-dispatch", "--timeout", "120", "--checkpoint", str(tmp_path / "dcp")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{out[-4000:]}"
    assert "wire (EP x DP model; the one-process reference keeps fp32 rows): FP8" in out
    m = FP8_RE.search(proc.stdout)
    assert m, out[-4000:]
    got, ref, rel = (float(v) for v in m.groups())
    assert math.isfinite(got) and math.isfinite(ref)
    assert 0 < rel <= 2e-2  # FP8 rows change the loss a little, not more
