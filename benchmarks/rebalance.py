"""Rebalance planner: max/mean rank load before and after a placement plan, with 0 / 4 / 8 replicas.

Shapes legend: L history steps, E experts, W ranks, R redundant replicas, K top-k, T tokens per step.

Simulated ranks (planner only, this file's first part): a Zipf(s) routing workload
(``moe_comm.workloads.zipf``, expert 0 hottest) over E experts, T tokens per step and top-K, counted
for L steps of history. ``plan_placement`` plans from that history; the plan is then scored

- planned:   predicted max/mean rank load on the history it was planned from,
- held-out:  max/mean rank load of the next L steps (fresh samples) summed, and
- per step:  the mean over those held-out steps of each step's max/mean (the all-to-all straggler
             factor a single step sees, which includes sampling noise of T*K/W slots per rank),

against the identity placement (expert g on rank g // (E/W), what MoELayer does without a plan).
A replicated expert's tokens are split evenly over its replicas. The goal with 8 replicas is
max/mean <= 1.10. (E + R) must be divisible by W (every rank holds the same number of slots), so
R = 4 is only valid for W in {1, 2, 4} when E = 64; such rows say "n/a".

Top-K matters: a token holds an expert at most once, so no expert takes more than 1/K of the slots
(K = 1 leaves pure Zipf, expert 0 with 29% of the load at s = 1.2 over 64 experts; K = 8 caps it at
12.5%). Both are reported by default.

    python benchmarks/rebalance.py --json /tmp/rebalance.json
    python benchmarks/rebalance.py --ranks 8 --replicas 0 8 16 --top-k 8 --zipf 1.0
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Dict, List

import torch

from moe_comm.rebalance import plan_placement, rank_loads
from moe_comm.workloads import count_tokens, zipf

REPEATS = 5  # plan_placement calls timed per row (median reported)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=64, help="E (default 64)")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 4], help="simulated W values (default 8 4)")
    p.add_argument("--replicas", type=int, nargs="+", default=[0, 4, 8], help="R values (default 0 4 8)")
    p.add_argument("--top-k", type=int, nargs="+", default=[1, 8], help="K values (default 1 8)")
    p.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent s (default 1.2)")
    p.add_argument("--tokens", type=int, default=4096, help="T tokens per step (default 4096)")
    p.add_argument("--steps", type=int, default=32, help="L history steps, and as many held-out steps (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str, default=None, help="write the results to this path")
    return p.parse_args(argv)


def _max_over_mean(load_W: torch.Tensor) -> float:
    return float(load_W.max() / load_W.mean())


def zipf_history(num_steps: int, first_step: int, num_tokens: int, num_experts: int, top_k: int, s: float,
                 seed: int) -> torch.Tensor:
    """[L, E] int64 tokens per expert for steps first_step .. first_step + L - 1 of the Zipf workload."""
    return torch.stack([count_tokens(zipf(num_tokens, num_experts, top_k, seed=seed, step=first_step + i, s=s),
                                     num_experts)[0] for i in range(num_steps)])


def run_simulated(args: argparse.Namespace) -> List[Dict[str, object]]:
    """Planner only, on simulated ranks: one row per (K, W, R)."""
    E, L = args.experts, args.steps
    rows: List[Dict[str, object]] = []
    for K in args.top_k:
        history_LE = zipf_history(L, 0, args.tokens, E, K, args.zipf, args.seed)
        heldout_LE = zipf_history(L, L, args.tokens, E, K, args.zipf, args.seed)
        for W in args.ranks:
            if E % W:
                raise SystemExit(f"--experts {E} must be divisible by every --ranks value, got {W}")
            identity = torch.arange(E)
            base_step = [_max_over_mean(rank_loads(identity, c, W)) for c in heldout_LE]
            for R in args.replicas:
                row: Dict[str, object] = {"num_experts": E, "num_ranks": W, "num_replicas": R, "top_k": K,
                                          "zipf_s": args.zipf, "tokens_per_step": args.tokens, "steps": L}
                if (E + R) % W:
                    row["error"] = f"(E + R) % W = ({E} + {R}) % {W} != 0"
                    rows.append(row)
                    continue
                times = []
                for _ in range(REPEATS):
                    t0 = time.perf_counter()
                    plan = plan_placement(history_LE, W, R)
                    times.append(time.perf_counter() - t0)
                after_step = [_max_over_mean(rank_loads(plan.phys_to_logical, c, W)) for c in heldout_LE]
                row.update({
                    "baseline_planned": plan.baseline_max_over_mean,
                    "planned": plan.max_over_mean,
                    "baseline_heldout": _max_over_mean(rank_loads(identity, heldout_LE, W)),
                    "heldout": _max_over_mean(rank_loads(plan.phys_to_logical, heldout_LE, W)),
                    "baseline_heldout_per_step": statistics.fmean(base_step),
                    "heldout_per_step": statistics.fmean(after_step),
                    "plan_ms_median": 1e3 * statistics.median(times),
                    "replicated": {str(g): int(c) for g, c in enumerate(plan.replica_count.tolist()) if c > 1},
                    "placement": plan.to_dict(),
                })
                rows.append(row)
    return rows


def print_simulated(rows: List[Dict[str, object]]) -> None:
    print("Planner on simulated ranks: max/mean rank load, identity placement -> plan "
          "(held-out = next steps, fresh samples)")
    print(f"{'K':>2} {'W':>2} {'R':>2} | {'planned':>16} | {'held-out (sum)':>16} | {'held-out per step':>17} | "
          f"{'plan ms':>7} | replicas")
    for r in rows:
        head = f"{r['top_k']:>2} {r['num_ranks']:>2} {r['num_replicas']:>2} | "
        if "error" in r:
            print(head + f"n/a: {r['error']}")
            continue
        arrow = lambda a, b: f"{a:5.3f} -> {b:6.4f}"  # noqa: E731
        print(head + f"{arrow(r['baseline_planned'], r['planned']):>16} | "
              f"{arrow(r['baseline_heldout'], r['heldout']):>16} | "
              f"{arrow(r['baseline_heldout_per_step'], r['heldout_per_step']):>17} | "
              f"{r['plan_ms_median']:7.2f} | {r['replicated'] or '-'}")


def main(argv=None) -> None:
    args = parse_args(argv)
    results: Dict[str, object] = {"config": {k: v for k, v in vars(args).items() if k != "json"}}
    results["simulated"] = run_simulated(args)
    print_simulated(results["simulated"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
