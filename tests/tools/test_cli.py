"""Tier 2: every `moe-comm` subcommand on tiny sizes (spawns gloo ranks); tier 1: argument errors, the bench
table (120 columns by default, every column with --wide, a one-line legend) and the bench plot's title on
synthetic points.

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
    assert max(len(ln) for ln in r.stdout.splitlines()) <= 120 and "T=" not in r.stdout.splitlines()[0]
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
    assert "call / dedup" in r.stdout and max(len(ln) for ln in r.stdout.splitlines()) <= 120
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


def _point(tokens=512, workload="uniform", fp8=False, dedup=False):
    """A synthetic bench point with every key ``bench_rank`` writes (figures plausible, not measured)."""
    from moe_comm.tools.bench import BenchPoint

    nbytes, wire = tokens * 2 * 1024 * 4, tokens * 2 * (ops.packed_width(1024) if fp8 else 4096)
    d, c, r = 2.5e-3 * tokens / 512, 2.8e-3 * tokens / 512, 1.9e-3 * tokens / 512
    phases = {k: 1e-4 for k in ("layout", "permute", "counts", "a2a", "regroup", "unpermute", "barrier")}
    phases.update(min_dispatch=2.1e-3 * tokens / 512, min_combine=2.2e-3 * tokens / 512)
    p = BenchPoint(world_size=4, tokens=tokens, hidden=1024, experts=16, top_k=2, dtype="float32",
                   dispatch_bytes=nbytes, dispatch_s=d, combine_s=c, raw_a2a_s=r, dispatch_gbps=nbytes / d / 1e9,
                   combine_gbps=nbytes / c / 1e9, raw_gbps=wire / r / 1e9, dispatch_vs_raw=r / d, combine_vs_raw=r / c,
                   tokens_per_s=tokens / (d + c), end_to_end_vs_raw=2 * r / (d + c), bytes_per_pair=nbytes // 4,
                   workload=workload, layer_step_s=0.0123, layer_transport="all_to_all",
                   layer_step_by_transport_s={"all_to_all": 0.0123, "point_to_point": 0.0131,
                                              "all_to_all_regroup": 0.0127},
                   phases_s=phases, serial_limit_vs_raw=0.88, cached_freed_memory=True,
                   dispatch_dtype="float8_e4m3fn" if fp8 else "", dispatch_scales="fp32" if fp8 else "",
                   dedup=dedup, dispatch_logical_bytes=nbytes, dispatch_wire_bytes=wire, combine_logical_bytes=nbytes,
                   combine_wire_bytes=nbytes, dispatch_logical_gbps=nbytes / d / 1e9, dispatch_wire_gbps=wire / d / 1e9,
                   combine_logical_gbps=nbytes / c / 1e9, combine_wire_gbps=nbytes / c / 1e9, raw_bytes=wire,
                   raw_combine_a2a_s=r)
    if dedup:
        p.call_s, p.call_dedup_s = 1.5e-3, 1.2e-3
        p.call_bytes = {"dispatch_wire": 100, "combine_wire": 100}
        p.call_dedup_bytes = {"dispatch_wire": 80, "combine_wire": 70}
    return p.as_dict()


@pytest.mark.parametrize("fp8,dedup", [(False, False), (True, False), (False, True), (True, True)])
def test_bench_table_fits_120_columns(fp8, dedup):
    """Tier 1: the default table of a 3 x 2 grid (tokens x workload) fits 120 columns: the constant axes
    in the title line, the varying ones (T, workload) as columns, one line of legend; --wide has every
    column (wider than 120)."""
    points = [_point(T, wl, fp8, dedup) for wl in ("uniform", "zipf") for T in (512, 2048, 8192)]
    text = cli.format_bench(points)
    lines = text.splitlines()
    assert max(len(ln) for ln in lines) <= cli.BENCH_WIDTH == 120, "\n".join(ln for ln in lines if len(ln) > 120)
    wire = "wire=fp8" if fp8 else "wire=x" + (" +dedup" if dedup else "")
    assert lines[0].startswith("moe-comm bench: dispatch/combine vs raw all_to_all_single | W=4 H=1024 K=2 "
                               "E=16 C=1 float32 " + wire)
    assert lines[-1] == cli.BENCH_LEGEND and len(cli.BENCH_LEGEND) <= 120      # one line of legend
    top, bottom = lines[2].split(), lines[3].split()               # two-line headers
    assert "───" in lines[4]
    assert bottom[:2] == ["T", "workload"] and {"limit", "path"} <= set(bottom)
    for word in ("KiB/", "disp", "comb", "raw", "e2e/", "layer"):
        assert word in top, word
    assert ("wire" in top) is fp8 and ("dedup" in top) is dedup
    assert sum(" zipf " in ln for ln in lines) == 3 and "12.3 (a2a)" in text
    if dedup:
        assert "1.50 / 1.20" in text and "0.75x" in text
    wide = cli.format_bench(points, wide=True)
    assert max(len(ln) for ln in wide.splitlines()) > 120
    for col in ("layout", "unperm", "layer p2p", "a2a+regroup", "tok/s"):
        assert col in wide and col not in text, col


def test_bench_plot_title_names_the_config():
    """Tier 1: the plot's title names the grid (world size, T values, H, K, E, C, dtype, wire, workload)."""
    pytest.importorskip("matplotlib")
    points = [_point(T) for T in (2048, 512)]
    title = cli.bench_figure(points).axes[0].get_title()
    assert title.splitlines()[1] == "W=4 T=512,2048 H=1024 K=2 E=16 C=1 float32 wire=x uniform"
    assert cli.bench_config(points, only_constant=True) == "W=4 H=1024 K=2 E=16 C=1 float32 wire=x uniform"


def test_profile_bad_workload_param_exits_2(capsys):
    """Tier 1."""
    assert cli.main(["profile", "--workload-param", "novalue"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


@pytest.mark.multirank
def test_bench_two_level_layer_reports_bytes_by_link(tmp_path):
    """``--ranks-per-node 2`` on 4 spawned ranks (nodes as rank blocks): the layer runs two-level, its bytes are
    split by link, and the line under the table says so."""
    out = tmp_path / "bench.json"
    r = _run("bench", "--world-size", "4", "--ranks-per-node", "2", "--tokens", "32", "--hidden", "8", "--experts",
             "8", "--top-k", "2", "--repeats", "1", "--ffn", "8", "--quiet", "--json", str(out))
    assert r.returncode == 0, r.stderr
    (p,) = json.loads(out.read_text())["points"]
    b = p["layer_bytes"]
    assert p["ranks_per_node"] == 2 and b["rows_inter"] > 0 and b["dispatch_wire_intra"] >= 0
    assert b["dispatch_wire_inter"] > 0 and b["combine_wire_inter"] == b["rows_inter"] * 8 * 4  # H x fp32
    assert f"{b['dispatch_wire_inter'] + b['combine_wire_inter']} B across nodes" in r.stdout
    # the levels' transfers and exchanges on tracks of their own: time by link
    assert p["layer_comm_s"]["comm inter-node"] > 0 and p["layer_comm_s"]["comm intra-node"] > 0
    assert "inter-node" in r.stdout and "intra-node" in r.stdout
    bad = _run("bench", "--ranks-per-node", "0")
    assert bad.returncode != 0 and "--ranks-per-node" in bad.stderr
