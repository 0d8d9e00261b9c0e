"""Tier 2: every `moe-comm` subcommand on tiny sizes (spawns gloo ranks); tier 1: argument errors.

Checks the JSON schema and that the figures are positive and consistent
(dispatch bytes = routed rows x H x element size; with FP8 the wire bytes are routed rows x
ops.packed_width(H), the raw all-to-all moves exactly those; with dedup the pipelined call sends the
distinct (token, rank) rows with their metadata).
"""
import json
import subprocess
import sys

import pytest

import moe_comm.tools.cli as cli
from moe_comm import ops


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
        # rows in their own dtype: wire = logical both ways, the raw all-to-all moves them
        assert p["dispatch_dtype"] == "" and p["dedup"] is False and p["call_s"] == 0.0
        for direction in ("dispatch", "combine"):
            assert p[f"{direction}_wire_bytes"] == p[f"{direction}_logical_bytes"] == p["dispatch_bytes"]
        assert p["raw_bytes"] == p["dispatch_bytes"] and p["raw_combine_a2a_s"] == p["raw_a2a_s"]
        # the layer step with each transport forced, and the all-to-all with the experts on expert-major rows
        assert set(p["layer_step_by_transport_s"]) == {"all_to_all", "point_to_point", "all_to_all_regroup"}
        assert all(v > 0 for v in p["layer_step_by_transport_s"].values())
    assert png.stat().st_size > 1000


@pytest.mark.multirank
def test_bench_fp8_wire_bytes(tmp_path):
    """FP8 dispatch: the dispatch direction's wire bytes are routed rows x packed_width(H) (132 of 512 bytes
    per float32 row of H=128: 0.26x logical), the raw all-to-all moves exactly those, combine stays in
    float32 (wire = logical); every GB/s is its bytes / its time."""
    out = tmp_path / "bench.json"
    r = _run("bench", "--world-size", "2", "--tokens", "32", "--hidden", "128", "--experts", "4", "--top-k", "2",
             "--repeats", "2", "--quiet", "--no-layer", "--dispatch-dtype", "fp8", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "disp wire" in r.stdout and "fp8" in r.stdout
    data = json.loads(out.read_text())
    assert data["options"]["dispatch_dtype"] == "fp8"
    (p,) = data["points"]
    assert p["dispatch_dtype"] == "float8_e4m3fn" and p["dispatch_scales"] == "fp32"
    slots = 32 * 2  # uniform routing never drops
    assert p["dispatch_logical_bytes"] == slots * 128 * 4 == p["dispatch_bytes"]
    assert p["dispatch_wire_bytes"] == slots * ops.packed_width(128) == slots * 132
    assert p["dispatch_wire_bytes"] / p["dispatch_logical_bytes"] == pytest.approx(0.258, abs=1e-3)
    assert p["combine_wire_bytes"] == p["combine_logical_bytes"] == p["dispatch_logical_bytes"]
    assert p["raw_bytes"] == p["dispatch_wire_bytes"]
    for direction in ("dispatch", "combine"):
        for kind in ("logical", "wire"):
            gbps = p[f"{direction}_{kind}_bytes"] / p[f"{direction}_s"] / 1e9
            assert p[f"{direction}_{kind}_gbps"] == pytest.approx(gbps) and 0 < gbps < 1e4
    assert p["dispatch_logical_gbps"] > p["dispatch_wire_gbps"]
    assert p["raw_gbps"] == pytest.approx(p["raw_bytes"] / p["raw_a2a_s"] / 1e9)
    ph = p["phases_s"]
    for phase in ("quantize", "dequantize", "a2a_back", "min_dispatch", "min_combine"):
        assert ph[phase] > 0, phase
    assert p["raw_combine_a2a_s"] == ph["a2a_back"] and p["raw_a2a_s"] == ph["a2a"]
    assert p["end_to_end_vs_raw"] == pytest.approx((p["raw_a2a_s"] + p["raw_combine_a2a_s"])
                                                   / (p["dispatch_s"] + p["combine_s"]))
    assert p["combine_vs_raw"] == pytest.approx(p["raw_combine_a2a_s"] / p["combine_s"])


@pytest.mark.multirank
def test_bench_dedup_times_the_pipelined_call(tmp_path):
    """--dedup: the pipelined call timed plain and with one copy per (token, rank); the dedup call sends
    the distinct rows (fewer than the routed ones: some tokens have both experts on one rank) with
    [2K] float32 ids and weights each, and gets one row per (token, rank) back; the layer step runs with
    dedup (one all-to-all: no point-to-point variant)."""
    out = tmp_path / "bench.json"
    H, T, K = 16, 32, 2
    r = _run("bench", "--world-size", "2", "--tokens", str(T), "--hidden", str(H), "--experts", "4", "--top-k",
             str(K), "--repeats", "2", "--ffn", "8", "--quiet", "--dedup", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "dedup ms" in r.stdout
    (p,) = json.loads(out.read_text())["points"]
    assert p["dedup"] is True and p["call_s"] > 0 and p["call_dedup_s"] > 0 and p["layer_step_s"] > 0
    assert set(p["layer_step_by_transport_s"]) == {"all_to_all"}
    plain, dd = p["call_bytes"], p["call_dedup_bytes"]
    assert plain["dispatch_wire"] == plain["dispatch_logical"] == T * K * H * 4
    assert plain["combine_wire"] == plain["combine_logical"] == T * K * H * 4
    assert dd["dispatch_logical"] == plain["dispatch_logical"]
    rows = dd["combine_wire"] // (H * 4)
    assert dd["combine_wire"] == rows * H * 4 and T <= rows < T * K
    assert dd["dispatch_wire"] == rows * (H * 4 + 2 * K * 4)
    ratio = (dd["dispatch_wire"] + dd["combine_wire"]) / (plain["dispatch_wire"] + plain["combine_wire"])
    assert ratio < 1 and f"{ratio:.2f}x" in r.stdout  # the table's "dedup wire" column


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
    (["bench", "--dispatch-scales", "ue8m0"], "--dispatch-scales ue8m0 only applies with --dispatch-dtype fp8"),
])
def test_bad_arguments_exit_2_with_a_message(capsys, args, needle):
    """Tier 1: validated before anything is spawned."""
    assert cli.main(args) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("args", [["bench", "--tokens", "12,x"], ["bench", "--dispatch-dtype", "int8"],
                                  ["profile", "--dispatch-scales", "e5m2"]])
def test_argparse_rejects_malformed_lists(args):
    """Tier 1: argparse exits 2 on a malformed list or an unknown choice."""
    with pytest.raises(SystemExit) as e:
        cli.main(args)
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
