"""Tier 2 (multi-rank gloo, CPU): ``benchmarks/gpu_check.py --dry-run-cpu``, the device verdict's logic in CI.

The dry run (Triton interpreted, a gloo world of one in a subprocess, two spawned gloo ranks) must exit 0,
write every section to its JSON, FAIL none, and PASS every section that can run on CPU; the CUDA-only ones
are NOT COVERED with a reason. ``host_syncs`` counts with ``moe_comm.testing.syncs.HostSyncs`` and
``sync_free`` needs ``MoEConfig.max_tokens_per_rank``: each PASSes where this checkout has it, else is NOT
COVERED naming what is missing. A section made to fail (``--inject-failure``) turns the verdict to FAIL.
``nccl_ranks`` (W >= 2 over NCCL) is NOT COVERED with fewer GPUs than ranks, saying why; ``--nccl-ranks 2`` runs
its logic on 2 gloo ranks. Tier 1: the timeline's device at construction, which the dry run's CPU layer cannot
show (its channel is on the CPU too), checked on a meta layer.
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

SECTIONS = ["env", "kernels", "kernels_int64", "bandwidth", "experts", "regroup", "layer", "host_syncs", "sync_free",
            "fp8_dispatch", "nccl_world1", "two_ranks", "nccl_ranks", "timeline", "pytest_gpu"]
RUN_ON_CPU = ["env", "kernels", "bandwidth", "experts", "regroup", "layer", "fp8_dispatch", "nccl_world1", "two_ranks",
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
    # fewer GPUs (0) than NCCL ranks (2): not covered, and the output says why
    nccl = by_name["nccl_ranks"]
    assert nccl["status"] == "NOT COVERED" and not nccl["checks"], nccl
    assert "needs 2 GPUs" in nccl["reason"] and "two ranks on one device" in nccl["reason"], nccl["reason"]
    assert "NOT COVERED" in proc.stdout and "two ranks on one device" in proc.stdout
    for name in ("host_syncs", "timeline"):
        checks = {c["check"]: c["status"] for c in by_name[name]["checks"]}
        assert all(s in ("PASS", "NOT COVERED") for s in checks.values()), (name, checks)
    assert [c for c in by_name["timeline"]["checks"] if "construction" in c["check"]], by_name["timeline"]
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
    # issue #26 item 11's candidates: all three paths ran and agreed on the dry run's shapes (timings: data only)
    regroup = by_name["regroup"]
    assert all(c["status"] == "PASS" for c in regroup["checks"] if "vs segments" in c["check"]), regroup["checks"]
    assert len([c for c in regroup["checks"] if "vs segments" in c["check"]]) == 2 * 2 * 5
    assert all({"regroup_ms", "per_source_ms", "segments_ms"} <= set(r) for r in regroup["data"]["regroup"])


def test_injected_failure_fails_the_verdict(tmp_path):
    proc, result, by_name = _dry_run(tmp_path, "--only", "env", "--inject-failure", "env")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert by_name["env"]["status"] == "FAIL" and "injected" in by_name["env"]["reason"]
    assert result["verdict"] == "FAIL"
    for name in SECTIONS[1:]:
        assert by_name[name]["status"] == "NOT COVERED" and "not selected" in by_name[name]["reason"]
    assert "FAIL" in proc.stdout


@pytest.mark.multirank
def test_nccl_ranks_section_runs_on_gloo_ranks(tmp_path):
    """``--dry-run-cpu --nccl-ranks 2``: the W >= 2 section on 2 gloo ranks (what N GPUs run over NCCL): the layer
    against the reference, one host sync forward and one backward per rank, a mid-call failure raised on every
    rank (eager in the call, deferred at check()) and a right call after it."""
    proc, result, by_name = _dry_run(tmp_path, "--only", "nccl_ranks", "--nccl-ranks", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sec = by_name["nccl_ranks"]
    assert sec["status"] == "PASS" and sec["data"]["backend"] == "gloo", sec["reason"]
    checks = {c["check"]: c["status"] for c in sec["checks"]}
    assert checks.pop("set_sync_debug_mode") == "NOT COVERED"
    assert set(checks.values()) == {"PASS"}, checks
    want = ["2 ranks over gloo", "uneven all_to_all_single", "routing equals the reference", "output", "grad x",
            "grad w2", "rank 0 HostSyncs: forward 1, backward 1", "rank 1 HostSyncs: forward 1, backward 1",
            "rank 0: mid-call failure on rank 1, eager: raises PeerFailed in the call",
            "rank 1: mid-call failure on rank 1, eager: raises ValueError in the call",
            "rank 0: mid-call failure on rank 1, deferred: the call returns, check() raises PeerFailed",
            "rank 1: the next call after each failure is right"]
    assert not [w for w in want if w not in checks], sorted(checks)
    eager = sec["data"]["failure"][0]["eager"][0]
    assert eager.startswith("PeerFailed:") and "[1]" in eager and "on purpose" in eager, eager


def test_nccl_ranks_needs_two_ranks():
    proc = subprocess.run([sys.executable, SCRIPT, "--dry-run-cpu", "--nccl-ranks", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--nccl-ranks: N >= 2" in proc.stderr, proc.stderr[-2000:]


CFG = dict(hidden_size=16, ffn_hidden_size=24, num_experts=4, top_k=2)


def test_timeline_on_the_layer_device_from_construction():
    """Tier 1: gpu_check's timeline section checks the timeline's device before the first forward, on CUDA. The
    dry run's layer is on the CPU like its channel, so it cannot tell; a layer built on meta (a device other
    than the channel's, as CUDA is) can."""
    layer = moe_comm.MoELayer(moe_comm.MoEConfig(**CFG), seed=1, device="meta", allow_single_process=True)
    assert layer.router.weight.device.type == "meta"
    assert layer.timeline.device.type == "meta", f"timeline on {layer.timeline.device}"


def test_timeline_follows_a_moved_layer():
    """Tier 1: a layer built on the CPU and moved (``.to(device)``) takes its timeline along."""
    layer = moe_comm.MoELayer(moe_comm.MoEConfig(**CFG), seed=1, allow_single_process=True).to("meta")
    assert layer.router.weight.device.type == "meta"
    assert layer.timeline.device.type == "meta", f"timeline on {layer.timeline.device}"
