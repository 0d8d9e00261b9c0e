"""`moe-comm` command line: `moe-comm demo` (the README's main job)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional

import torch

__all__ = ["main"]


def _demo_rank(rank: int, world_size: int, args: dict) -> dict:
    import torch.distributed as dist

    import moe_comm
    from moe_comm.bench import measure_dispatch, self_check_dispatch

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
    t.add_row(f"MoELayer fwd+bwd, {result['layer_tokens']} tokens/rank", f"{result['layer_step_s'] * 1e3:.2f}", "", "")
    t.caption = ("ms: slowest rank, median of repeats. GB/s: routed bytes leaving rank 0 / time. dispatch = layout + "
                 "permute + counts exchange + all-to-all + regroup; combine = regroup + all-to-all + unpermute.")
    c = Console()
    c.print("self-check: every received row matched its (source rank, token) on all ranks")
    c.print(t)


def cmd_demo(ns: argparse.Namespace) -> int:
    from .launch import run_ranks

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


def _positive(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-comm", description="Expert-parallel MoE communication tools.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="multi-rank CPU dispatch demo: self-check, throughput vs raw all-to-all, layer step",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d.add_argument("--world-size", type=_positive, default=4, help="gloo ranks to spawn (ignored under torchrun)")
    d.add_argument("--tokens", type=_positive, default=4096, help="tokens per rank (T)")
    d.add_argument("--hidden", type=_positive, default=1024, help="hidden size (H)")
    d.add_argument("--ffn", type=_positive, default=512, help="expert FFN size (F)")
    d.add_argument("--experts", type=_positive, default=16, help="experts across the group (E)")
    d.add_argument("--top-k", type=_positive, default=2, help="experts per token (K)")
    d.add_argument("--repeats", type=_positive, default=10, help="timed repeats (median reported)")
    d.add_argument("--seed", type=int, default=0, help="routing seed")
    d.add_argument("--json", default=None, help="also write the figures to this JSON file")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    ns = build_parser().parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
