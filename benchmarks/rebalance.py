"""Rebalancing: max/mean rank load before and after a placement plan, with 0 / 4 / 8 replicas.

Shapes legend: L history steps, E experts, W ranks, R redundant replicas, K top-k, T tokens per step.

Simulated ranks (planner only, this file's first part): a Zipf(s) routing workload
(``moe_comm.testing.workloads.zipf``, expert 0 hottest) over E experts, T tokens per step and top-K, counted
for L steps of history. ``plan_placement`` plans from that history; the plan is then scored

- planned:   predicted max/mean rank load on the history it was planned from,
- held-out:  max/mean rank load of the next L steps (fresh samples) summed, and
- per step:  the mean over those held-out steps of each step's max/mean (the all-to-all straggler
             factor a single step sees, which includes sampling noise of T*K/W slots per rank),

against the identity placement (expert g on rank g // (E/W), what MoELayer does without a plan).
A replicated expert's tokens are split evenly over its replicas. The goal with 8 replicas is
max/mean <= 1.10. (E + R) must be divisible by W (every rank holds the same number of slots), so
R = 4 is only valid for W in {1, 2, 4} when E = 64; such rows say "n/a".

Real ranks (end to end, second part): ``--real-ranks`` W gloo ranks spawned with ``moe_comm.tools.launch.run_ranks``
run a real MoELayer (forward + backward + ``sync_replica_grads``) on the same Zipf workload: each rank's
tokens are routed to the workload's experts exactly (router weight [I_E | 0], the first E features of x are
``workloads.routing_logits``). The layer's own monitor records ``--steps`` warm-up steps; ``plan_placement``
plans from that history, ``layer.apply_placement`` moves the experts (each placement from the previous
one), and the same held-out steps are measured for the identity placement and for every R: rows received
per rank, counted from the real dispatch (the rows the experts module receives), max/mean per step and
summed, next to the planner's prediction; and the step time (max over ranks, median over steps).

Measured here (4 gloo ranks on 2 CPU cores, E=64, T=1024/rank, H=128, F=512, K=4, Zipf 1.2): real rank
max/mean 3.155 -> 1.144 (R=0), 1.006 (R=4), 1.007 (R=8), matching the planner's prediction; step time
349 -> 245 / 262 / 260 ms. The ranks share 2 cores, so a balanced step cannot beat total work / 2 cores:
the step-time gain understates what separate devices would see, and replicas cost a little extra
(one more slot per rank, the replica-gradient all_reduce).

Top-K matters: a token holds an expert at most once, so no expert takes more than 1/K of the slots
(K = 1 leaves pure Zipf, expert 0 with 29% of the load at s = 1.2 over 64 experts; K = 8 caps it at
12.5%). Both are reported by default.

    python benchmarks/rebalance.py --json /tmp/rebalance.json
    python benchmarks/rebalance.py --ranks 8 --replicas 0 8 16 --top-k 8 --zipf 1.0 --real-ranks 0
    python benchmarks/rebalance.py --ranks 4 --real-experts 16 --real-top-k 2   # smaller real run
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from moe_comm.placement.planner import plan_placement, rank_loads
from moe_comm.testing.workloads import count_tokens, routing_logits, zipf

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
    p.add_argument("--real-ranks", type=int, default=4, help="W of the end-to-end run on gloo ranks (0: skip)")
    p.add_argument("--real-experts", type=int, default=64, help="E of the real run (default 64)")
    p.add_argument("--real-top-k", type=int, nargs="+", default=[4], help="K values of the real run (default 4)")
    p.add_argument("--real-tokens", type=int, default=512, help="tokens per rank per step (default 512)")
    p.add_argument("--real-hidden", type=int, default=128, help="H (>= E: x carries the routing logits)")
    p.add_argument("--real-ffn", type=int, default=128, help="F of each expert (default 128)")
    p.add_argument("--real-steps", type=int, default=6, help="held-out steps measured per placement (default 6)")
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


# ------------------------------------------------------------------------------------------ real ranks

def _real_rank(rank: int, world_size: int, E: int, K: int, T: int, H: int, F: int, s: float, history_steps: int,
               measure_steps: int, replicas: List[int], seed: int) -> List[Dict[str, object]]:
    """One EP rank of the end-to-end run (see the module docstring); rank 0 returns the rows."""
    import moe_comm

    W = world_size
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K)
    layer = moe_comm.MoELayer(cfg, seed=seed, monitor={"window": history_steps})
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, :E] = torch.eye(E)  # logits = x[:, :E]
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    noise_TH = torch.randn(T, H, generator=gen) * 0.5
    gy_TH = torch.randn(T, H, generator=gen)

    def tokens(step: int) -> torch.Tensor:
        x = noise_TH.clone()
        x[:, :E] = routing_logits(zipf(T, E, K, seed=seed * 1000 + rank, step=step, s=s), E, seed=step)
        return x

    rows_seen: List[int] = []

    def count_rows(module, args, out):
        rows_seen.append(args[0].shape[0])  # rows this rank's experts received (per chunk)

    def run(step: int) -> float:
        x = tokens(step).requires_grad_(True)
        dist.barrier()
        t0 = time.perf_counter()
        y = layer(x)
        (y * gy_TH).sum().backward()
        layer.sync_replica_grads()
        dt = time.perf_counter() - t0
        layer.zero_grad(set_to_none=True)
        return dt

    hook = layer.experts.register_forward_hook(count_rows)
    for step in range(history_steps):  # warm-up: the monitor records the load history
        run(step)
    history_LE = layer.monitor.load_history()  # host sync: identical global counts on every rank

    def measure(label_R) -> Dict[str, object]:
        rows_seen.clear()
        times = []
        for i in range(measure_steps):
            n0 = len(rows_seen)
            times.append(run(history_steps + i))
            rows_seen[n0:] = [sum(rows_seen[n0:])]
        stats = torch.tensor([rows_seen, times], dtype=torch.float64)  # [2, steps]
        every = [torch.zeros_like(stats) for _ in range(W)]
        dist.all_gather(every, stats)
        rows_WS = torch.stack([e[0] for e in every])
        step_s = torch.stack([e[1] for e in every]).max(0).values
        per_step = rows_WS.max(0).values / rows_WS.mean(0)
        total_W = rows_WS.sum(1)
        return {"rows_per_rank": total_W.tolist(),
                "max_over_mean": float(total_W.max() / total_W.mean()),
                "max_over_mean_per_step": statistics.fmean(per_step.tolist()),
                "step_ms_median": 1e3 * statistics.median(step_s.tolist()),
                "step_ms_all": [1e3 * t for t in step_s.tolist()]}

    rows = []
    base = measure(None)
    for R in replicas:
        row: Dict[str, object] = {"num_experts": E, "num_ranks": W, "num_replicas": R, "top_k": K, "zipf_s": s,
                                  "tokens_per_rank": T, "hidden": H, "ffn": F, "history_steps": history_steps,
                                  "measured_steps": measure_steps, "baseline": base}
        if (E + R) % W:
            row["error"] = f"n/a: (E + R) % W = ({E} + {R}) % {W} != 0"
            rows.append(row)
            continue
        plan = plan_placement(history_LE, W, R)
        hook.remove()
        t0 = time.perf_counter()
        layer.apply_placement(plan)  # from the previous placement: weights move rank to rank
        dist.barrier()
        apply_ms = 1e3 * (time.perf_counter() - t0)
        hook = layer.experts.register_forward_hook(count_rows)
        row.update({"predicted_max_over_mean": plan.max_over_mean,
                    "predicted_baseline_max_over_mean": plan.baseline_max_over_mean,
                    "after": measure(R), "apply_placement_ms": apply_ms,
                    "replicated": {str(g): int(c) for g, c in enumerate(plan.replica_count.tolist()) if c > 1}})
        rows.append(row)
    return rows


def run_real(args: argparse.Namespace) -> List[Dict[str, object]]:
    """End to end on ``--real-ranks`` spawned gloo ranks: one row per (K, R)."""
    from moe_comm.tools.launch import run_ranks

    W, E = args.real_ranks, args.real_experts
    if E % W:
        raise SystemExit(f"--real-experts {E} must be divisible by --real-ranks {W}")
    if args.real_hidden < E:
        raise SystemExit(f"--real-hidden must be >= --real-experts (x carries the logits), got {args.real_hidden}")
    rows = []
    for K in args.real_top_k:
        rows += run_ranks(_real_rank, W, E, K, args.real_tokens, args.real_hidden, args.real_ffn, args.zipf,
                          args.steps, args.real_steps, list(args.replicas), args.seed)
    return rows


def print_real(rows: List[Dict[str, object]]) -> None:
    if not rows:
        return
    r0 = rows[0]
    print(f"\nReal ranks (end to end, {r0['num_ranks']} gloo ranks, E={r0['num_experts']}, T={r0['tokens_per_rank']}"
          f"/rank, H={r0['hidden']}, F={r0['ffn']}): rows received per rank, identity -> placed "
          f"(plan from {r0['history_steps']} warm-up steps, {r0['measured_steps']} held-out steps)")
    print(f"{'K':>2} {'R':>2} | {'predicted':>16} | {'real (sum)':>16} | {'real per step':>16} | "
          f"{'step ms (median)':>16} | {'apply ms':>8}")
    for r in rows:
        head = f"{r['top_k']:>2} {r['num_replicas']:>2} | "
        if "error" in r:
            print(head + r["error"])
            continue
        b, a = r["baseline"], r["after"]
        arrow = lambda x, y, f="5.3f": f"{x:{f}} -> {y:{f}}"  # noqa: E731
        print(head + f"{arrow(r['predicted_baseline_max_over_mean'], r['predicted_max_over_mean']):>16} | "
              f"{arrow(b['max_over_mean'], a['max_over_mean']):>16} | "
              f"{arrow(b['max_over_mean_per_step'], a['max_over_mean_per_step']):>16} | "
              f"{arrow(b['step_ms_median'], a['step_ms_median'], '6.1f'):>16} | {r['apply_placement_ms']:8.1f}")


def main(argv=None) -> None:
    args = parse_args(argv)
    results: Dict[str, object] = {"config": {k: v for k, v in vars(args).items() if k != "json"}}
    results["simulated"] = run_simulated(args)
    print_simulated(results["simulated"])
    if args.real_ranks:
        results["real_ranks"] = run_real(args)
        print_real(results["real_ranks"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
