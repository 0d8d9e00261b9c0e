"""Tier 2: every `moe-comm` subcommand on tiny sizes (spawns gloo ranks); tier 1: argument errors.

Checks the JSON schema and that the figures are positive and consistent
(dispatch bytes = routed rows x H x element size).
"""
import json
import subprocess
import sys

import pytest

import moe_comm.tools.cli as cli


def _run(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "moe_comm.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.multirank
def test_bench_json_schema_and_consistency(tmp_path):
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    r = _run("bench", "--world-size", "2", "--tokens", "16,48", "--hidden", "8", "--experts", "4", "--top-k", "2",
             "--repeats", "2", "--ffn", "8", "--quiet", "--json", str(out), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["command"] == "bench" and len(data["points"]) == 2
    assert data["cached_freed_memory"] is True  # spawned ranks, moe_comm.tools.launch.cache_freed_memory
    for p in data["points"]:
        for key in ("dispatch_s", "combine_s", "raw_a2a_s", "dispatch_gbps", "combine_gbps", "raw_gbps",
                    "tokens_per_s", "layer_step_s"):
            assert p[key] > 0, key
        ph = p["phases_s"]
        for phase in ("layout", "permute", "counts", "a2a", "regroup", "unpermute", "barrier", "min_dispatch",
                      "min_combine"):
            assert ph[phase] > 0, phase
        # tiny segments: one all-to-all + regroup, not point-to-point
        assert p["direct"] is False
        limit = 2 * p["raw_a2a_s"] / (ph["min_dispatch"] + ph["min_combine"])
        assert abs(p["serial_limit_vs_raw"] - limit) < 1e-9 and p["serial_limit_vs_raw"] > 0
        # uniform routing never drops: rank 0 sends T*K rows of H float32 values
        assert p["dispatch_bytes"] == p["tokens"] * p["top_k"] * p["hidden"] * 4
        assert p["bytes_per_pair"] == p["dispatch_bytes"] // p["world_size"]
        assert abs(p["dispatch_gbps"] - p["dispatch_bytes"] / p["dispatch_s"] / 1e9) < 1e-9
        assert abs(p["end_to_end_vs_raw"] - 2 * p["raw_a2a_s"] / (p["dispatch_s"] + p["combine_s"])) < 1e-9
    assert png.stat().st_size > 1000


@pytest.mark.multirank
def test_demo_runs(tmp_path):
    out = tmp_path / "demo.json"
    r = _run("demo", "--world-size", "2", "--tokens", "64", "--hidden", "16", "--ffn", "16", "--experts", "4",
             "--repeats", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "self-check" in r.stdout
    p = json.loads(out.read_text())["point"]
    assert p["dispatch_bytes"] == 64 * 2 * 16 * 4 and p["dispatch_s"] > 0


@pytest.mark.parametrize("args,needle", [
    (["bench", "--top-k", "20", "--experts", "16"], "--top-k 20 must be <= --experts 16"),
    (["bench", "--workload", "nope"], "--workload 'nope' is unknown"),
    (["bench", "--world-size", "3", "--experts", "16"], "divisible by --world-size 3"),
    (["bench", "--world-size", "64"], "more ranks than this machine"),
    (["bench", "--dtype", "int8"], "--dtype 'int8' is unknown"),
])
def test_bad_arguments_exit_2_with_a_message(capsys, args, needle):
    """Tier 1: validated before anything is spawned."""
    assert cli.main(args) == 2
    assert needle in capsys.readouterr().err


def test_argparse_rejects_malformed_lists():
    """Tier 1: argparse exits 2 on a malformed list."""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--tokens", "12,x"])
    assert e.value.code == 2


@pytest.mark.multirank
def test_profile_writes_trace_png_and_diagnosis(tmp_path):
    r = _run("profile", "--world-size", "2", "--tokens", "64", "--hidden", "16", "--ffn", "16", "--experts", "4",
             "--steps", "1", "--warmup", "1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "Suggestion" in r.stdout or "suggestion" in r.stdout.lower()
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace["traceEvents"]
    assert (tmp_path / "timeline.png").stat().st_size > 1000
    prof = json.loads((tmp_path / "profile.json").read_text())
    assert prof


def test_profile_bad_workload_param_exits_2(capsys):
    """Tier 1."""
    assert cli.main(["profile", "--workload-param", "novalue"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
