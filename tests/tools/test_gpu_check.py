"""Tier 2 (multi-rank gloo, CPU): ``benchmarks/gpu_check.py --dry-run-cpu``, the device verdict's logic in CI.

The dry run (Triton interpreted, a gloo world of one in a subprocess, two spawned gloo ranks) must exit 0,
write every section to its JSON, FAIL none, and PASS every section that can run on CPU; the CUDA-only ones
are NOT COVERED with a reason. ``host_syncs`` counts with ``moe_comm.testing.syncs.HostSyncs`` and
``sync_free`` needs ``MoEConfig.max_tokens_per_rank``: each PASSes where this checkout has it, else is NOT
COVERED naming what is missing. A section made to fail (``--inject-failure``) turns the verdict to FAIL.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest

import moe_comm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")

SECTIONS = ["env", "kernels", "kernels_int64", "bandwidth", "experts", "layer", "host_syncs", "sync_free",
            "fp8_dispatch", "nccl_world1", "two_ranks", "timeline", "pytest_gpu"]
RUN_ON_CPU = ["env", "kernels", "bandwidth", "experts", "layer", "fp8_dispatch", "nccl_world1", "two_ranks",
              "timeline"]
CUDA_ONLY = ["kernels_int64", "pytest_gpu"]


def _dry_run(tmp_path, *args):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--dry-run-cpu", "--json", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    return proc, result, {s["section"]: s for s in result["sections"]}


@pytest.mark.multirank
def test_dry_run_passes_every_section_it_can(tmp_path):
    proc, result, by_name = _dry_run(tmp_path)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    assert [s["section"] for s in result["sections"]] == SECTIONS
    assert result["complete"] and result["verdict"] == "PASS", log
    failed = {n: s["reason"] for n, s in by_name.items() if s["status"] not in ("PASS", "NOT COVERED")}
    assert not failed, failed
    for name in RUN_ON_CPU:
        assert by_name[name]["status"] == "PASS", (name, by_name[name]["reason"])
        assert any(c["status"] == "PASS" for c in by_name[name]["checks"]), name
    for name in CUDA_ONLY:
        assert by_name[name]["status"] == "NOT COVERED" and "CUDA" in by_name[name]["reason"], by_name[name]
    has_syncs = importlib.util.find_spec("moe_comm.testing.syncs") is not None
    sync_free = "max_tokens_per_rank" in {f.name for f in dataclasses.fields(moe_comm.MoEConfig)}
    for name, present, missing in (("host_syncs", has_syncs, "moe_comm.testing.syncs"),
                                   ("sync_free", sync_free, "max_tokens_per_rank")):
        sec = by_name[name]
        if present:
            assert sec["status"] == "PASS", (name, sec["reason"])
        else:
            assert sec["status"] == "NOT COVERED" and missing in sec["reason"], (name, sec["reason"])
    for sec in result["sections"]:
        assert sec["status"] != "NOT COVERED" or sec["reason"], sec["section"]
    for name in SECTIONS:  # the final table names every section
        assert name in proc.stdout


def test_injected_failure_fails_the_verdict(tmp_path):
    proc, result, by_name = _dry_run(tmp_path, "--only", "env", "--inject-failure", "env")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert by_name["env"]["status"] == "FAIL" and "injected" in by_name["env"]["reason"]
    assert result["verdict"] == "FAIL"
    for name in SECTIONS[1:]:
        assert by_name[name]["status"] == "NOT COVERED" and "not selected" in by_name[name]["reason"]
    assert "FAIL" in proc.stdout
