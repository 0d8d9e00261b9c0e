"""`moe-comm` command line.

  moe-comm demo      the README's main job: a 4-rank CPU dispatch demo
  moe-comm bench     dispatch/combine throughput over a grid, next to the raw all-to-all of the same bytes
  moe-comm profile   run a layer with the timeline on and diagnose where a step's time goes

Exit codes: 0 success, 1 a run failed, 2 bad command-line input.
"""
from __future__ import annotations

import argparse
import io
import json
import sys
import time
from typing import Dict, List, Optional

import torch

__all__ = ["main"]


def _demo_rank(rank: int, world_size: int, args: dict) -> dict:
    import torch.distributed as dist

    import moe_comm
    from moe_comm.testing.payloads import self_check_dispatch
    from moe_comm.tools.bench import measure_dispatch

    E, K, T, H = args["experts"], args["top_k"], args["tokens"], args["hidden"]

    def routing_of(r):
        g = torch.Generator().manual_seed(args["seed"] * 1000 + r)
        return torch.rand(T, E, generator=g).argsort(1)[:, :K]

    d = moe_comm.Dispatcher(num_experts=E)
    # 1. correctness on self-describing payloads (small, every rank checks every row it received)
    self_check_dispatch(d, lambda r: routing_of(r)[:64], lambda r: 64, 16)
    # 2. throughput vs the raw all-to-all of the same bytes
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g)
    w = torch.rand(T, K, generator=g)
    point = measure_dispatch(x, routing_of(rank), w, d, repeats=args["repeats"])
    # 3. one MoE layer, forward + backward
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=args["ffn"], num_experts=E, top_k=K)
    torch.manual_seed(0)
    layer = moe_comm.MoELayer(cfg)
    xs = torch.randn(min(T, 1024), H, generator=g, requires_grad=True)
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        layer(xs).sum().backward()
        times.append(time.perf_counter() - t0)
    return {"point": point.as_dict(), "layer_step_s": sorted(times)[1], "layer_tokens": xs.shape[0]}


def _print_demo(result: dict, args: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    p = result["point"]
    t = Table(title=f"moe_comm dispatch demo: {p['world_size']} gloo ranks, T={p['tokens']}/rank, "
                    f"H={p['hidden']}, E={p['experts']}, K={p['top_k']}, {p['dtype']}")
    t.add_column("phase")
    for col in ("ms", "GB/s", "raw / ours"):
        t.add_column(col, justify="right")
    t.add_row("raw all_to_all_single", f"{p['raw_a2a_s'] * 1e3:.2f}", f"{p['raw_gbps']:.2f}", "1.00")
    t.add_row("dispatch", f"{p['dispatch_s'] * 1e3:.2f}",
              f"{p['dispatch_gbps']:.2f}", f"{p['dispatch_vs_raw']:.2f}")
    t.add_row("combine", f"{p['combine_s'] * 1e3:.2f}", f"{p['combine_gbps']:.2f}",
              f"{p['combine_vs_raw']:.2f}")
    ph = p["phases_s"]
    t.add_row("minimal dispatch (same transport)", f"{ph['min_dispatch'] * 1e3:.2f}", "",
              f"{p['raw_a2a_s'] / ph['min_dispatch']:.2f}")
    t.add_row("minimal combine (same transport)", f"{ph['min_combine'] * 1e3:.2f}", "",
              f"{p['raw_a2a_s'] / ph['min_combine']:.2f}")
    t.add_row(f"MoELayer fwd+bwd, {result['layer_tokens']} tokens/rank", f"{result['layer_step_s'] * 1e3:.2f}", "", "")
    t.caption = ("ms: slowest rank, median of repeats. GB/s: routed bytes leaving rank 0 / time. dispatch = layout + "
                 "counts exchange (under the permute) + transfer (+ regroup for small segments); combine = "
                 "(regroup +) transfer + unpermute. minimal: only the passes any implementation over this "
                 "transport needs (layout, counts under the permute, raw a2a; raw a2a, unpermute), back to back.")
    c = Console()
    c.print("self-check: every received row matched its (source rank, token) on all ranks")
    c.print(t)


def cmd_demo(ns: argparse.Namespace) -> int:
    from moe_comm.tools.launch import run_ranks

    args = {k: getattr(ns, k) for k in ("experts", "top_k", "tokens", "hidden", "ffn", "repeats", "seed")}
    if ns.experts % ns.world_size:
        print(f"error: --experts ({ns.experts}) must be divisible by --world-size ({ns.world_size})", file=sys.stderr)
        return 2
    if ns.top_k > ns.experts:
        print(f"error: --top-k ({ns.top_k}) must be <= --experts ({ns.experts})", file=sys.stderr)
        return 2
    result = run_ranks(_demo_rank, ns.world_size, args)
    _print_demo(result, args)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _int_list(v: str) -> List[int]:
    try:
        out = [int(x) for x in v.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {v!r}") from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {v!r}")
    return out


def _str_list(v: str) -> List[str]:
    return [x for x in v.split(",") if x]


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _check_bench_args(ns) -> Optional[str]:
    import os

    from moe_comm.testing.workloads import WORKLOADS

    limit = 4 * (os.cpu_count() or 1)
    if ns.world_size > limit:
        return (f"--world-size {ns.world_size} is more ranks than this machine can spawn sensibly "
                f"({os.cpu_count()} cores; at most {limit}); use torchrun across machines")
    for w in ns.workload:
        if w not in WORKLOADS:
            return f"--workload {w!r} is unknown; choose from {', '.join(WORKLOADS)}"
    for dt in ns.dtype:
        if dt not in ("float32", "bfloat16", "float16"):
            return f"--dtype {dt!r} is unknown; choose from float32, bfloat16, float16"
    if ns.dispatch_scales != "fp32" and ns.dispatch_dtype != "fp8":
        return f"--dispatch-scales {ns.dispatch_scales} only applies with --dispatch-dtype fp8"
    for E in ns.experts:
        if E % ns.world_size:
            return f"--experts {E} must be divisible by --world-size {ns.world_size}"
        for K in ns.top_k:
            if K > E:
                return f"--top-k {K} must be <= --experts {E}"
    return None


def _relaunch_on_link(argv: List[str], link: str) -> int:
    """Run this same command (without --link) inside a fresh namespace with a rate-limited loopback."""
    from moe_comm.tools.slow_link import run_on_slow_link

    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--link":
            skip = True
            continue
        if a.startswith("--link="):
            continue
        rest.append(a)
    try:
        return run_on_slow_link([sys.executable, "-m", "moe_comm.tools.cli"] + rest, rate=link)
    except (RuntimeError, ValueError) as e:
        return _fail(f"--link {link}: {e}")


def _relaunch_on_cluster(argv: List[str], nodes: int, inter: str, world_size: int) -> int:
    """Run this same command (without --nodes / --inter-link) under multi-node torchrun on an emulated cluster of
    ``nodes`` namespaces, world_size / nodes ranks each (``slow_link.run_on_cluster``); rank 0 reports."""
    from moe_comm.tools.slow_link import run_on_cluster

    if world_size % nodes:
        return _fail(f"--nodes {nodes} must divide --world-size {world_size} (ranks per node = world size / nodes)")
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--nodes", "--inter-link"):
            skip = True
        elif not a.startswith(("--nodes=", "--inter-link=")):
            rest.append(a)
    try:
        res = run_on_cluster([sys.executable, "-m", "moe_comm.tools.cli"] + rest, nodes=nodes,
                             ranks_per_node=world_size // nodes, inter=inter)
    except (RuntimeError, ValueError) as e:
        return _fail(f"--nodes {nodes} --inter-link {inter}: {e}")
    for ln in res.links:
        print(f"node {ln.node}: {ln.tx_bytes} bytes sent, {ln.rx_bytes} received over its {inter} link (tc)")
    return 1 if res.returncode else 0


# The grid's axes (key in a point, label): constant ones go in the title line, varying ones are columns.
_CONFIG = (("world_size", "W"), ("tokens", "T"), ("hidden", "H"), ("top_k", "K"), ("experts", "E"),
           ("num_chunks", "C"), ("dtype", ""), ("wire", "wire"), ("workload", ""))
BENCH_WIDTH = 120  # the default table fits this many columns; --wide prints every column
BENCH_LEGEND = ("GB/s = bytes/time (slowest rank, median); e2e/raw = raw a2a/ours; limit = raw/min passes; "
                "layer: fwd+bwd; --wide: all")  # one line of at most BENCH_WIDTH


def _values(points: List[dict], key: str) -> List[str]:
    return list(dict.fromkeys(_wire(p) if key == "wire" else str(p[key]) for p in points))


def bench_config(points: List[dict], only_constant: bool = False) -> str:
    """The grid in one line, e.g. "W=4 T=512,2048 H=1024 K=2 E=16 C=1 float32 wire=x uniform" (dtype and
    workload unlabelled); ``only_constant``: the axes with one value only."""
    out = []
    for key, label in _CONFIG:
        vals = _values(points, key)
        if not (only_constant and len(vals) > 1):
            out.append(f"{label}={','.join(vals)}" if label else ",".join(vals))
    return " ".join(out)


def format_bench(points: List[dict], wide: bool = False) -> str:
    """The bench table as text: by default the main figures in at most BENCH_WIDTH columns (the grid's
    constant axes in the title line, the varying ones as columns) and a one-line legend; ``wide``: every
    figure and the full legend, as wide as they need."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    if wide:
        return _format_bench_wide(points)
    varying = [(key, label or key) for key, label in _CONFIG if len(_values(points, key)) > 1]
    title = "moe-comm bench: dispatch/combine vs raw all_to_all_single | " + bench_config(points, only_constant=True)
    fp8 = any(p.get("dispatch_dtype") for p in points)
    calls = any(p.get("call_s") for p in points)
    # two-line headers: the columns are as narrow as their numbers
    cols = [lab for _, lab in varying] + ["KiB/\npair", "disp\nGB/s", "comb\nGB/s", "raw\nGB/s", "e2e/\nraw", "limit",
                                          "path", "layer\nms"]
    if fp8:
        cols.insert(cols.index("comb\nGB/s"), "disp wire\nGB/s")
    if calls:
        cols += ["call / dedup\nms", "dedup\nwire"]
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for c in cols:
        t.add_column(c, justify="right")
    for p in points:
        row = [_values([p], k)[0] for k, _ in varying]
        row += [f"{p['bytes_per_pair'] / 1024:.0f}", _num(p["dispatch_logical_gbps"]),
                _num(p["combine_logical_gbps"]), _num(p["raw_gbps"]), f"{p['end_to_end_vs_raw']:.2f}",
                f"{p['serial_limit_vs_raw']:.2f}", "p2p" if p["direct"] else "a2a",
                f"{p['layer_step_s'] * 1e3:.1f} {_short(p.get('layer_transport', ''))}" if p["layer_step_s"] else "-"]
        if fp8:
            row.insert(len(varying) + 2, _num(p["dispatch_wire_gbps"]))
        if calls:
            row += ([f"{p['call_s'] * 1e3:.2f} / {p['call_dedup_s'] * 1e3:.2f}", _dedup_wire(p)] if p.get("call_s")
                    else ["-", "-"])
        t.add_row(*row)
    console = Console(file=io.StringIO(), width=BENCH_WIDTH, color_system=None, force_terminal=False)
    console.print(title, overflow="fold")
    console.print(t)
    console.print(BENCH_LEGEND, overflow="fold")
    return console.file.getvalue()


def _print_bench(points: List[dict], wide: bool = False) -> None:
    print(format_bench(points, wide), end="")


def _format_bench_wide(points: List[dict]) -> str:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="moe-comm bench: dispatch/combine vs the raw all_to_all_single of the same bytes "
                    "(slowest rank, medians)")
    calls = any(p.get("call_s") for p in points)
    cols = ["W", "T", "H", "K", "E", "C", "dtype", "wire", "workload", "KiB/pair", "disp GB/s", "disp wire GB/s",
            "comb GB/s", "comb wire GB/s", "raw GB/s", "e2e/raw", "limit", "path", "tok/s", "layout", "permute",
            "counts", "a2a", "regroup", "unperm", "floor", "layer ms", "layer a2a", "layer p2p",
            "a2a+regroup"]
    if calls:
        cols += ["call ms", "dedup ms", "dedup wire"]
    for c in cols:
        t.add_column(c, justify="right")
    for p in points:
        ph = p["phases_s"]
        row = [str(p["world_size"]), str(p["tokens"]), str(p["hidden"]), str(p["top_k"]), str(p["experts"]),
               str(p["num_chunks"]), p["dtype"], _wire(p), p["workload"], f"{p['bytes_per_pair'] / 1024:.0f}",
               *(_num(p[k]) for k in ("dispatch_logical_gbps", "dispatch_wire_gbps", "combine_logical_gbps",
                                      "combine_wire_gbps", "raw_gbps")),
               f"{p['end_to_end_vs_raw']:.2f}", f"{p['serial_limit_vs_raw']:.2f}",
               "p2p" if p["direct"] else "a2a", f"{p['tokens_per_s']:.0f}",
               *(f"{ph[k] * 1e3:.2f}" for k in ("layout", "permute", "counts", "a2a", "regroup", "unpermute",
                                                "barrier")),
               f"{p['layer_step_s'] * 1e3:.1f} {_short(p.get('layer_transport', ''))}" if p["layer_step_s"] else "-",
               *(f"{(p.get('layer_step_by_transport_s') or {}).get(k, 0) * 1e3:.1f}"
                 if (p.get("layer_step_by_transport_s") or {}).get(k) else "-"
                 for k in ("all_to_all", "point_to_point", "all_to_all_regroup"))]
        if calls:
            row += [f"{p['call_s'] * 1e3:.2f}", f"{p['call_dedup_s'] * 1e3:.2f}", _dedup_wire(p)] if p.get("call_s") \
                else ["-", "-", "-"]
        t.add_row(*row)
    t.caption = ("disp / comb GB/s: logical bytes (routed slots x H x element size, rank 0) / time; wire GB/s: the "
                 "bytes the all-to-alls moved (FP8: packed rows with their scales) / time; raw GB/s: the raw "
                 "all-to-all of the dispatch's wire bytes and splits. wire: what the dispatch direction carries "
                 "(x: the rows' dtype; combine and backward always do). "
                 "e2e/raw = (raw dispatch + raw combine time) / (dispatch + combine time); limit = the same raw "
                 "time / (min dispatch + min combine): the unavoidable passes (layout, counts under the permute, "
                 "raw a2a [, FP8: quantize, dequantize]; raw a2a, unpermute) timed back to back, none overlapping "
                 "a transfer (moe_comm/tools/bench.py); path: p2p = rows sent point-to-point into expert-major "
                 "order, a2a = one all-to-all + regroup; phase columns in ms, each timed on its own, each "
                 "including one barrier (floor); layer ms = pipelined MoELayer forward+backward with C chunks and "
                 "the transport it chose; layer a2a / p2p = the same step with that transport forced (the layer "
                 "runs dispatch's transports); a2a+regroup = the all-to-all with the experts always on "
                 "expert-major rows (the layer skips the regroup by itself where the received blocks are large: "
                 "GroupedExperts.prefers_segments)"
                 + ("; call ms / dedup ms = pipelined Dispatcher call, identity experts, forward only, one chunk, "
                    "without / with dedup (one copy per (token, rank)); dedup wire = its wire bytes (both "
                    "directions) / the plain call's" if calls else ""))
    console = Console(file=io.StringIO(), width=1000, color_system=None, force_terminal=False)
    console.print(t)  # one row per point with every figure, no column squeezed: wider than most terminals
    return console.file.getvalue()


def _num(v: float) -> str:
    """GB/s as the table writes them: two decimals, three significant digits below 1 (small CPU runs)."""
    return f"{v:.2f}" if v >= 1 else f"{v:.3g}"


def _wire(p: dict) -> str:
    """The wire column: "x" (rows in their dtype), "fp8" or "fp8 ue8m0"; "+dedup" when the layer used dedup."""
    w = "x" if not p.get("dispatch_dtype") else "fp8" + (" ue8m0" if p.get("dispatch_scales") == "ue8m0" else "")
    return w + (" +dedup" if p.get("dedup") else "")


def _dedup_wire(p: dict) -> str:
    plain, dd = p.get("call_bytes") or {}, p.get("call_dedup_bytes") or {}
    num = dd.get("dispatch_wire", 0) + dd.get("combine_wire", 0)
    den = plain.get("dispatch_wire", 0) + plain.get("combine_wire", 0)
    return f"{num / den:.2f}x" if den > 0 else "-"


def _short(transport: str) -> str:
    return {"all_to_all": "(a2a)", "point_to_point": "(p2p)", "local": "(local)"}.get(transport, "")


def bench_figure(points: List[dict]):
    """A matplotlib Figure of throughput vs message size, titled with the grid (``bench_config``)."""
    from matplotlib.figure import Figure

    pts = sorted(points, key=lambda p: p["bytes_per_pair"])
    x = [p["bytes_per_pair"] / 2 ** 20 for p in pts]
    fig = Figure(figsize=(8, 5))  # no pyplot, no matplotlib.use: the caller's backend is untouched
    ax = fig.subplots()
    ax.plot(x, [p["raw_gbps"] for p in pts], "k--o", label="raw all_to_all_single (same wire bytes)")
    ax.plot(x, [p["dispatch_wire_gbps"] for p in pts], "-o", label="moe_comm dispatch")
    ax.plot(x, [p["combine_wire_gbps"] for p in pts], "-s", label="moe_comm combine")
    ax.plot(x, [p["dispatch_wire_bytes"] / p["phases_s"]["min_dispatch"] / 1e9 for p in pts], ":^", color="gray",
            label="minimal dispatch over the same transport")
    ax.set_xscale("log")
    ax.set_xlabel("message per rank pair (MiB)")
    ax.set_ylabel("GB/s (wire bytes leaving a rank / time)")
    ax.set_title(f"moe-comm bench: dispatch throughput vs message size\n{bench_config(pts)}" if pts else "no points",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def _plot_bench(points: List[dict], path: str) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib: pip install 'moe_comm[plot]'") from None
    bench_figure(points).savefig(path, dpi=120)


def cmd_bench(ns: argparse.Namespace) -> int:
    import os

    from moe_comm.tools.bench import bench_rank
    from moe_comm.tools.launch import launched_by_torchrun, run_ranks

    err = _check_bench_args(ns)
    if err:
        return _fail(err)
    if ns.link and ns.nodes:
        return _fail("--link and --nodes exclude each other (--inter-link sets the cluster's link)")
    if ns.nodes:
        return _relaunch_on_cluster(sys.argv[1:] if ns.argv is None else ns.argv, ns.nodes, ns.inter_link,
                                    ns.world_size)
    if ns.link:
        return _relaunch_on_link(sys.argv[1:] if ns.argv is None else ns.argv, ns.link)
    opts = {"tokens": ns.tokens, "hidden": ns.hidden, "top_k": ns.top_k, "experts": ns.experts,
            "chunks": ns.chunks, "dtype": ns.dtype, "workload": ns.workload, "repeats": ns.repeats,
            "ffn": ns.ffn, "layer": not ns.no_layer, "seed": ns.seed, "progress": not ns.quiet,
            "dispatch_dtype": ns.dispatch_dtype, "dispatch_scales": ns.dispatch_scales, "dedup": ns.dedup,
            "ranks_per_node": ns.ranks_per_node}
    points = run_ranks(bench_rank, ns.world_size, opts)
    if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
        return 0  # rank 0 reports
    if not points:
        print("error: the ranks returned no results", file=sys.stderr)
        return 1
    _print_bench(points, wide=ns.wide)
    _print_links(points)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"command": "bench", "options": opts,
                       "cached_freed_memory": all(p["cached_freed_memory"] for p in points), "points": points}, f,
                      indent=2)
    if ns.plot:
        _plot_bench(points, ns.plot)
    return 0


def cmd_profile(ns: argparse.Namespace) -> int:
    from moe_comm.tools.diagnose import profile_main

    if ns.nodes:
        if ns.link:
            return _fail("--link and --nodes exclude each other (--inter-link sets the cluster's link)")
        return _relaunch_on_cluster(sys.argv[1:] if ns.argv is None else ns.argv, ns.nodes, ns.inter_link,
                                    ns.world_size)
    params = {}
    for kv in ns.workload_param:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            return _fail(f"--workload-param must be KEY=VALUE, got {kv!r}")
        try:
            params[k] = json.loads(v)
        except json.JSONDecodeError:
            params[k] = v
    keys = ("world_size", "tokens", "hidden", "ffn", "experts", "top_k", "num_chunks", "steps", "warmup",
            "workload", "dtype", "seed", "link", "link_delay", "dispatch_dtype", "dispatch_scales", "dedup",
            "ranks_per_node")
    opts = {**{k: getattr(ns, k) for k in keys}, "workload_params": params, "timeout_s": ns.timeout}
    try:
        return profile_main(opts, ns.out)
    except (ValueError, TypeError) as e:
        return _fail(str(e))


def _print_links(points: List[Dict]) -> None:
    """With a two-level layer (--ranks-per-node): its last step's bytes by link, rank 0 (one forward)."""
    for p in points:
        b = p.get("layer_bytes") or {}
        if "dispatch_wire_inter" in b:
            inter = b["dispatch_wire_inter"] + b["combine_wire_inter"]
            intra = b["dispatch_wire_intra"] + b["combine_wire_intra"]
            comm = p.get("layer_comm_s") or {}
            times = ", ".join(f"{k.replace('comm', '').strip() or 'whole group'} {v * 1e3:.1f} ms"
                              for k, v in sorted(comm.items()))
            print(f"T={p['tokens']} H={p['hidden']}: two-level layer (L={p.get('ranks_per_node')}), rank 0's last "
                  f"forward: {inter} B across nodes ({b['rows_inter']} rows for {b['tokens']} tokens), {intra} B "
                  f"inside its node; step {p['layer_step_s'] * 1e3:.1f} ms"
                  + (f"; comm spans of one step (summed; they overlap): {times}" if times else ""))


def _positive(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _add_layer_args(sp, *, world_size: int, tokens: int, hidden: int, ffn: int, experts: int, top_k: int) -> None:
    """The single-valued layer-shape flags shared by demo and profile."""
    sp.add_argument("--world-size", type=_positive, default=world_size,
                    help="gloo ranks to spawn (ignored under torchrun)")
    sp.add_argument("--tokens", type=_positive, default=tokens, help="tokens per rank (T)")
    sp.add_argument("--hidden", type=_positive, default=hidden, help="hidden size (H)")
    sp.add_argument("--ffn", type=_positive, default=ffn, help="expert FFN size (F)")
    sp.add_argument("--experts", type=_positive, default=experts, help="experts across the group (E)")
    sp.add_argument("--top-k", type=_positive, default=top_k, help="experts per token (K)")


def _add_wire_args(sp) -> None:
    """What travels, the flags bench and profile share: ``Dispatcher(dispatch_dtype=, dispatch_scales=, dedup=)``."""
    sp.add_argument("--dispatch-dtype", choices=["none", "fp8"], default="none",
                    help="dispatch rows on the wire: none (x's dtype) or fp8 (float8_e4m3fn, one scale per 128 "
                         "elements; combine and backward stay in x's dtype)")
    sp.add_argument("--dispatch-scales", choices=["fp32", "ue8m0"], default="fp32",
                    help="FP8 block scales: fp32 (4 bytes) or ue8m0 (1-byte powers of two)")
    sp.add_argument("--dedup", action="store_true",
                    help="one copy per (token, destination rank) in the pipelined call and the layer")


def _add_cluster_args(sp) -> None:
    """The emulated cluster's flags (``slow_link.run_on_cluster``), shared by bench and profile."""
    sp.add_argument("--nodes", type=_positive, default=None,
                    help="run under multi-node torchrun on an emulated cluster of this many nodes, --world-size / "
                         "--nodes ranks each (root, ip, tc)")
    sp.add_argument("--inter-link", default="1gbit", help="with --nodes: tc rate of each node's link, each way")
    sp.add_argument("--ranks-per-node", type=_ranks_per_node, default=None,
                    help="the layer's two-level dispatch (MoEConfig.ranks_per_node): 'auto' (torchrun's "
                         "LOCAL_WORLD_SIZE: the cluster's ranks per node under --nodes) or L; default: flat. The "
                         "layer's bytes are then split by link (inter- / intra-node)")


def _ranks_per_node(v: str):
    if v == "auto":
        return v
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an int >= 1, got {v!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-comm", description="Expert-parallel MoE communication tools.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo",
                       help="multi-rank CPU dispatch demo: self-check, throughput vs raw all-to-all, layer step",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_layer_args(d, world_size=4, tokens=4096, hidden=1024, ffn=512, experts=16, top_k=2)
    d.add_argument("--repeats", type=_positive, default=10, help="timed repeats (median reported)")
    d.add_argument("--seed", type=int, default=0, help="routing seed")
    d.add_argument("--json", default=None, help="also write the figures to this JSON file")
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="dispatch/combine throughput over a grid vs the raw all-to-all of the same bytes",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Every list flag takes comma-separated values; the grid is their product. "
                                   "Spawns --world-size gloo ranks on this machine (under torchrun: the launched "
                                   "group, NCCL on CUDA).")
    b.add_argument("--world-size", type=_positive, default=4, help="gloo ranks to spawn (ignored under torchrun)")
    b.add_argument("--tokens", type=_int_list, default=[512, 2048, 8192], help="tokens per rank (T)")
    b.add_argument("--hidden", type=_int_list, default=[1024], help="hidden sizes (H)")
    b.add_argument("--top-k", type=_int_list, default=[2], help="experts per token (K)")
    b.add_argument("--experts", type=_int_list, default=[16], help="experts across the group (E)")
    b.add_argument("--chunks", type=_int_list, default=[1], help="pipeline chunks for the layer step (C)")
    b.add_argument("--dtype", type=_str_list, default=["float32"], help="float32, bfloat16, float16")
    b.add_argument("--workload", type=_str_list, default=["uniform"],
                   help="routing: uniform, zipf, hot_experts, hot_rank, drifting")
    b.add_argument("--ffn", type=_positive, default=256, help="expert FFN size of the layer step")
    b.add_argument("--repeats", type=_positive, default=10, help="timed repeats per point (median reported)")
    b.add_argument("--seed", type=int, default=0, help="routing seed")
    b.add_argument("--no-layer", action="store_true", help="skip the MoELayer forward+backward step")
    _add_wire_args(b)
    b.add_argument("--link", default=None, help="run on an emulated link of this rate, e.g. 1gbit (root, ip, tc)")
    _add_cluster_args(b)
    b.add_argument("--json", default=None, help="write all figures to this JSON file")
    b.add_argument("--plot", default=None, help="write a PNG of throughput vs message size (needs matplotlib)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--wide", action="store_true",
                   help=f"print every column (phases, layer per transport, ...) and the full legend; default: the "
                        f"main figures in {BENCH_WIDTH} columns")
    b.set_defaults(func=cmd_bench)

    pr = sub.add_parser("profile", help="run a layer N steps with the timeline on; diagnose where the step goes",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                        description="Prints, in order: is compute saturated, the communication share, the "
                                    "costliest collective, hidden vs exposed, bandwidth- or latency-bound, slow "
                                    "ranks vs expert load, and one suggestion with its predicted gain. Writes "
                                    "trace.json (Perfetto), timeline.png and profile.json into --out.")
    _add_layer_args(pr, world_size=2, tokens=1024, hidden=256, ffn=512, experts=8, top_k=2)
    pr.add_argument("--num-chunks", type=_positive, default=1, help="pipeline chunks (C)")
    pr.add_argument("--steps", type=_positive, default=3, help="profiled forward+backward steps")
    pr.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    pr.add_argument("--workload", default="uniform",
                    help="'router' (the layer's own routing) or a routing workload: uniform, zipf, hot_experts, "
                         "hot_rank, drifting")
    pr.add_argument("--workload-param", action="append", default=[], metavar="KEY=VALUE",
                    help="workload parameter, repeatable, e.g. p=0.8")
    pr.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    pr.add_argument("--seed", type=int, default=0)
    _add_wire_args(pr)
    pr.add_argument("--link", default=None, help="run on an emulated link of this tc rate, e.g. 1gbit (root, ip, tc)")
    pr.add_argument("--link-delay", default=None, help="extra one-way delay on the emulated link, e.g. 1ms (netem)")
    _add_cluster_args(pr)
    pr.add_argument("--timeout", type=float, default=900, help="seconds before the run is abandoned")
    pr.add_argument("--out", default="moe_comm_profile", help="directory for trace.json, timeline.png, profile.json")
    pr.set_defaults(func=cmd_profile)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    ns = build_parser().parse_args(argv)
    ns.argv = argv
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
