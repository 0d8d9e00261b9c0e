"""Soak: train a small MoELayer stack for N steps on W gloo ranks under shifting load, checking every step
against an exact invariant and tracking each rank's resident memory.

Shapes legend: T tokens of one rank in one step (may be 0), H hidden, F FFN size, E experts (global),
e = E / W local experts, K top-k, C chunks, R received rows, W EP world size.

Every step, on every rank, with the step's shape drawn from a generator seeded by (seed, step) so that
all ranks agree on it (and the per-rank data from (seed, step, rank)):

1. Dispatcher check (random K, random C, dropped slots, empty ranks, drifting hot spots). Routings come
   from ``moe_comm.testing.workloads`` "drifting" (2 hot experts holding 60% of the slots, moving one expert every
   ``--period`` steps), K in [1, --max-top-k], C in [1, --max-chunks], a random share of slots set to -1
   (dropped). The expert function multiplies each row by (global expert id + 1), so
   ``y_t = x_t * sum_k w_tk (g_tk + 1)`` over the kept slots. x holds small integers (column 0 the source
   rank, column 1 the token id: a wrong row says where it came from) and the weights are multiples of 1/16,
   in float64, so every product and sum is exact: y, dL/dx and dL/dw are compared with ``torch.equal``.
2. Training step of ``--layers`` residual MoELayers (E experts, K = 2, aux loss on) with AdamW on a fixed
   teacher. Drift: ``router.expert_bias`` follows the same drifting hot set; chunks: the layers'
   dispatchers get a random C per step; empty ranks: the same ranks as in 1 pass T = 0 tokens. The router
   gradient is all-reduced (it is replicated, as DDP would). Invariant: loss, output and gradients finite;
   every ``--replica-check`` steps the router weights are bit-identical on all ranks.
3. Resident memory: one read of /proc/self/statm per step (resident and file-backed pages) into a
   preallocated array, after the step's tensors are released.

Why RSS is noisy, and how it is measured here (see ``rss_summary``):
- glibc malloc: every thread that allocates (the main thread, gloo's I/O threads) may get its own arena,
  freed chunks stay in the arena (resident) until the top of the heap is free, and the mmap threshold
  rises after the first large free (up to 32 MiB), so sizes that were mmap'd (and returned on free) move
  into the heap and stay resident. Together they ratchet RSS up during the first steps and then plateau.
- PyTorch's CPU allocator does not cache; but Python's gc frees autograd cycles in batches, so RSS saws.
- File-backed pages of libtorch / gloo become resident when a code path first runs (a rare C, an all-empty
  step), which looks like growth but is code, not data. statm's ``shared`` field separates them: we report
  anonymous RSS (resident - shared, the heap: where a leak shows) next to total RSS.
So: the first ``--warmup-steps`` steps are not judged; then the median of the ``--window`` samples right
after warm-up is compared with the median of the last ``--window`` samples (medians ignore the gc sawtooth
and single spikes), and the least-squares slope over all post-warm-up samples is reported in bytes/step (a
true leak is a steady slope; allocator noise is not). The goal is growth < 2% of RSS on every rank. We do
not set MALLOC_ARENA_MAX or call malloc_trim: the figures are what a user's process would see.

    python benchmarks/soak.py --steps 2000 --world-size 4 --json /tmp/soak.json
    python benchmarks/soak.py --steps 300 --warmup-steps 100 --world-size 2         # quick
Exit status: 0 when every invariant held and RSS growth < --max-growth-pct on every rank, else 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import time
from array import array
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import moe_comm  # noqa: E402
from moe_comm.tools.launch import run_ranks  # noqa: E402
from moe_comm.testing.workloads import make_workload, target_shares  # noqa: E402

_PAGE = os.sysconf("SC_PAGE_SIZE")
_MAX_MESSAGES = 10  # error messages kept per rank (all errors are counted)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SoakConfig:
    """Sizes and knobs of one soak run (the same on every rank)."""

    steps: int = 2000
    warmup_steps: int = 200
    window: int = 50  # RSS samples per median (clipped to half the post-warm-up steps)
    seed: int = 0
    hidden: int = 32  # H of the trained layers
    ffn: int = 64  # F
    experts: int = 8  # E (divisible by W)
    layers: int = 2
    check_hidden: int = 16  # H of the dispatcher check
    max_tokens: int = 64  # T per rank is drawn from [1, max_tokens] (0 on empty ranks)
    max_top_k: int = 4
    max_chunks: int = 4
    p_empty: float = 0.15  # chance that a rank has T = 0 in a step
    all_empty_every: int = 250  # every this many steps (offset by half) every rank is empty; 0 disables
    max_drop: float = 0.2  # share of dropped (-1) slots is drawn from [0, max_drop]
    period: int = 10  # steps between moves of the drifting hot set
    replica_check: int = 100  # steps between router replica comparisons
    max_errors: int = 20  # stop early (on every rank together) past this many errors

    def __post_init__(self) -> None:
        for name in ("steps", "window", "hidden", "ffn", "experts", "layers", "check_hidden", "max_tokens",
                     "max_top_k", "max_chunks", "period", "replica_check", "max_errors"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SoakConfig.{name} must be an int >= 1, got {v!r}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"SoakConfig.warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps}")
        if self.max_top_k > self.experts:
            raise ValueError(f"SoakConfig.max_top_k must be <= experts ({self.experts}), got {self.max_top_k}")
        for name in ("p_empty", "max_drop"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"SoakConfig.{name} must be in [0, 1], got {getattr(self, name)!r}")


# --------------------------------------------------------------------------------------------------------
# Memory

def read_rss() -> Tuple[int, int]:
    """(resident bytes, anonymous resident bytes) of this process, from /proc/self/statm.
    statm fields are pages: size resident shared text lib data dt; shared = file-backed + shmem."""
    with open("/proc/self/statm", "rb") as f:
        fields = f.read().split()
    resident, shared = int(fields[1]), int(fields[2])
    return resident * _PAGE, (resident - shared) * _PAGE


def _slope(samples: List[int]) -> float:
    """Least-squares slope of samples against their index (bytes per step)."""
    n = len(samples)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2.0, statistics.fmean(samples)
    num = sum((i - mx) * (y - my) for i, y in enumerate(samples))
    return num / sum((i - mx) ** 2 for i in range(n))


def rss_summary(samples: List[int], warmup_steps: int, window: int) -> Dict[str, float]:
    """Median of the ``window`` samples right after warm-up vs the median of the last ``window``.

    samples: one value (bytes) per completed step. window is clipped to half the post-warm-up samples so
    the two medians never share a sample.
    """
    post = samples[warmup_steps:]
    w = max(1, min(window, len(post) // 2))
    start, end = statistics.median(post[:w]), statistics.median(post[-w:])
    return {"start_mb": start / 2 ** 20, "end_mb": end / 2 ** 20, "growth_pct": 100.0 * (end - start) / start,
            "slope_kb_per_step": _slope(post) / 1024.0, "min_mb": min(post) / 2 ** 20,
            "max_mb": max(post) / 2 ** 20, "window": w}


# --------------------------------------------------------------------------------------------------------
# Per-step plan: shared by all ranks (seed, step) or private to one rank (seed, step, rank)

@dataclasses.dataclass
class StepPlan:
    top_k: int  # K of the dispatcher check
    chunks: int  # C of the dispatcher check
    layer_chunks: int  # C of the trained layers' dispatchers
    empty_W: List[bool]  # ranks with T = 0 this step
    drop: float  # share of dropped slots in the dispatcher check


def step_plan(cfg: SoakConfig, step: int, world_size: int) -> StepPlan:
    rng = random.Random(f"soak:{cfg.seed}:{step}")  # str seeds hash with sha512: the same on every rank
    all_empty = cfg.all_empty_every and step % cfg.all_empty_every == cfg.all_empty_every // 2
    return StepPlan(top_k=rng.randint(1, cfg.max_top_k), chunks=rng.randint(1, cfg.max_chunks),
                    layer_chunks=rng.randint(1, cfg.max_chunks),
                    empty_W=[bool(all_empty) or rng.random() < cfg.p_empty for _ in range(world_size)],
                    drop=rng.uniform(0.0, cfg.max_drop))


def _rank_generator(cfg: SoakConfig, step: int, rank: int, what: str) -> torch.Generator:
    return torch.Generator().manual_seed(random.Random(f"soak:{cfg.seed}:{step}:{rank}:{what}").getrandbits(63))


# --------------------------------------------------------------------------------------------------------
# 1. Dispatcher check: exact invariant in float64

class ScaleByExpertId:
    """expert_fn: each expert-major row times (its global expert id + 1); linear, so the combine is exact."""

    def __init__(self, first_expert: int, num_local_experts: int):
        self.ids_e = torch.arange(first_expert, first_expert + num_local_experts, dtype=torch.float64)

    def __call__(self, tokens_RH: torch.Tensor, tokens_per_expert_e: torch.Tensor) -> torch.Tensor:
        R = tokens_RH.shape[0]
        scale_R = torch.repeat_interleave(self.ids_e + 1, tokens_per_expert_e, output_size=R)
        return tokens_RH * scale_R[:, None]


def check_dispatch(dispatcher: moe_comm.Dispatcher, expert_fn: ScaleByExpertId, cfg: SoakConfig, plan: StepPlan,
                   step: int, rank: int) -> Optional[str]:
    """One dispatch -> experts -> combine + backward; None if y, dL/dx and dL/dw are exact, else what differed."""
    E, K, H = cfg.experts, plan.top_k, cfg.check_hidden
    g = _rank_generator(cfg, step, rank, "check")
    T = 0 if plan.empty_W[rank] else int(torch.randint(1, cfg.max_tokens + 1, (), generator=g))
    # Drifting hot spots; per-rank routing seed, the step drives the drift.
    topk_idx_TK = make_workload("drifting", hot=2, period=cfg.period, p=0.6)(T, E, K, seed=cfg.seed * 1009 + rank,
                                                                            step=step)
    dropped_TK = torch.rand(T, K, generator=g) < plan.drop
    topk_idx_TK = topk_idx_TK.masked_fill(dropped_TK, -1)
    # Self-checking payload: column 0 = source rank, column 1 = token id, the rest small integers.
    x_TH = torch.randint(-8, 9, (T, H), generator=g).to(torch.float64)
    x_TH[:, 0] = rank
    x_TH[:, 1] = torch.arange(T, dtype=torch.float64)
    # Weights on a 1/16 grid (dropped slots get a weight too: it must be ignored).
    w_TK = torch.randint(1, 17, (T, K), generator=g).to(torch.float64) / 16
    grad_TH = torch.randint(-3, 4, (T, H), generator=g).to(torch.float64)
    x_TH.requires_grad_(True)
    w_TK.requires_grad_(True)

    y_TH = dispatcher(x_TH, topk_idx_TK, w_TK, expert_fn, num_chunks=plan.chunks)
    y_TH.backward(grad_TH)  # collective: every rank runs it, even with T = 0

    kept_TK = topk_idx_TK >= 0
    with torch.no_grad():
        factor_TK = torch.where(kept_TK, (topk_idx_TK + 1).to(torch.float64), torch.zeros((), dtype=torch.float64))
        factor_T = (w_TK * factor_TK).sum(1)
        want_y = x_TH * factor_T[:, None]
        want_gx = grad_TH * factor_T[:, None]
        want_gw = factor_TK * (x_TH * grad_TH).sum(1, keepdim=True)
    where = f"step {step} rank {rank} (T={T}, K={K}, C={plan.chunks})"
    if tuple(y_TH.shape) != (T, H):
        return f"{where}: y has shape {tuple(y_TH.shape)}, want {(T, H)}"
    if not torch.equal(y_TH.detach(), want_y):
        t = int((y_TH.detach() != want_y).any(1).nonzero()[0])
        got = (y_TH[t, 2:] / x_TH[t, 2:]).detach()
        got = got[torch.isfinite(got)]
        return (f"{where}: y wrong for token {t} (source rank {int(x_TH[t, 0])}, token {int(x_TH[t, 1])}): "
                f"experts {topk_idx_TK[t].tolist()} want factor {float(factor_T[t])}, "
                f"got {got[:1].tolist()}")
    if x_TH.grad is None or not torch.equal(x_TH.grad, want_gx):
        err = "None" if x_TH.grad is None else float((x_TH.grad - want_gx).abs().max())
        return f"{where}: dL/dx wrong (max err {err})"
    gw = w_TK.grad
    if gw is None or not torch.equal(gw, want_gw):
        err = "None" if gw is None else float((gw - want_gw).abs().max())
        return f"{where}: dL/dw wrong (max err {err})"
    return None


# --------------------------------------------------------------------------------------------------------
# 2. Training step

class Stack(torch.nn.Module):
    """Residual stack of MoELayers: h = h + layer(h)."""

    def __init__(self, cfg: SoakConfig):
        super().__init__()
        layer_cfg = moe_comm.MoEConfig(hidden_size=cfg.hidden, ffn_hidden_size=cfg.ffn, num_experts=cfg.experts,
                                       top_k=2, aux_loss_coeff=1e-2)
        self.layers = torch.nn.ModuleList(moe_comm.MoELayer(layer_cfg, seed=cfg.seed + 100 * i)
                                          for i in range(cfg.layers))

    def forward(self, x_TH: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        aux = x_TH.new_zeros(())
        for layer in self.layers:
            x_TH = x_TH + layer(x_TH)
            aux = aux + layer.aux_loss
        return x_TH, aux


def train_step(model: Stack, opt: torch.optim.Optimizer, teacher_HH: torch.Tensor, cfg: SoakConfig,
               plan: StepPlan, step: int, rank: int, world_size: int) -> Optional[str]:
    """Forward + backward + AdamW step; None if loss, output and gradients are finite, else what was not."""
    g = _rank_generator(cfg, step, rank, "train")
    T = 0 if plan.empty_W[rank] else int(torch.randint(1, cfg.max_tokens + 1, (), generator=g))
    x_TH = torch.randn(T, cfg.hidden, generator=g)
    target_TH = torch.tanh(x_TH @ teacher_HH)
    bias_E = target_shares("drifting", cfg.experts, step, hot=2, period=cfg.period, p=0.6).float()
    for layer in model.layers:
        layer.router.expert_bias.copy_(bias_E)  # drifting hot spots (selection only, not the weights)
        layer.dispatcher.num_chunks = plan.layer_chunks  # random C (validated by step_plan's range)
    y_TH, aux = model(x_TH)
    # Sum over rows / max(T, 1): finite for T = 0 (a mean would be NaN) and still in the graph.
    loss = (y_TH - target_TH).square().sum() / (max(T, 1) * cfg.hidden) + aux
    loss.backward()  # collective
    routers = [layer.router.weight for layer in model.layers]
    flat = torch.cat([(r.grad if r.grad is not None else torch.zeros_like(r)).reshape(-1) for r in routers])
    dist.all_reduce(flat)  # replicated router weight: average its gradient, as DDP would
    flat /= world_size
    offset = 0
    for r in routers:
        r.grad = flat[offset:offset + r.numel()].view_as(r).clone()
        offset += r.numel()
    bad = None
    if not (torch.isfinite(loss) and torch.isfinite(y_TH).all()):
        bad = f"step {step} rank {rank} (T={T}): loss {float(loss)} or output not finite"
    elif not all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters()):
        bad = f"step {step} rank {rank} (T={T}): a gradient is not finite"
    opt.step()
    opt.zero_grad(set_to_none=True)
    return bad


def check_replicas(model: Stack, step: int, rank: int) -> Optional[str]:
    """Router weights bit-identical across ranks (max == min elementwise)."""
    w = torch.cat([layer.router.weight.detach().reshape(-1) for layer in model.layers])
    hi, lo = w.clone(), w.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    if not torch.equal(hi, lo):
        return f"step {step} rank {rank}: router replicas differ across ranks by up to {float((hi - lo).max())}"
    return None


# --------------------------------------------------------------------------------------------------------
# The rank function

def rank_main(rank: int, world_size: int, cfg: SoakConfig) -> Optional[dict]:
    """Run the soak on this rank; rank 0 returns every rank's figures (others return None)."""
    if cfg.experts % world_size:
        raise ValueError(f"experts ({cfg.experts}) must be divisible by the world size, got {world_size}")
    torch.manual_seed(cfg.seed)
    e = cfg.experts // world_size
    dispatcher = moe_comm.Dispatcher(num_experts=cfg.experts)
    expert_fn = ScaleByExpertId(rank * e, e)
    model = Stack(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    teacher_HH = torch.randn(cfg.hidden, cfg.hidden, generator=torch.Generator().manual_seed(cfg.seed)) \
        * cfg.hidden ** -0.5

    rss = array("q", [0] * cfg.steps)  # preallocated: the record itself must not grow
    anon = array("q", [0] * cfg.steps)
    errors, messages = 0, []
    objects: Dict[str, int] = {}
    flag = torch.zeros(1, dtype=torch.int64)
    t_start = time.perf_counter()
    t_warm = t_start
    steps_done = 0
    for step in range(cfg.steps):
        plan = step_plan(cfg, step, world_size)
        found = []
        try:
            found.append(check_dispatch(dispatcher, expert_fn, cfg, plan, step, rank))
            found.append(train_step(model, opt, teacher_HH, cfg, plan, step, rank, world_size))
            if (step + 1) % cfg.replica_check == 0:
                found.append(check_replicas(model, step, rank))
        except Exception as err:  # noqa: BLE001 (a soak counts every failure and reports it)
            found.append(f"step {step} rank {rank}: {type(err).__name__}: {err}")
        for msg in filter(None, found):
            errors += 1
            if len(messages) < _MAX_MESSAGES:
                messages.append(msg)
        rss[step], anon[step] = read_rss()
        steps_done = step + 1
        # Every rank stops together once any rank has too many errors (one 8-byte all-reduce per step).
        flag.fill_(errors)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag) > cfg.max_errors:
            break
        if step + 1 == cfg.warmup_steps:
            t_warm = time.perf_counter()
            objects["after_warmup"] = len(gc.get_objects())
        if rank == 0 and (step + 1) % max(1, cfg.steps // 10) == 0:
            print(f"step {step + 1:5d}  {(step + 1) / (time.perf_counter() - t_start):6.1f} steps/s  "
                  f"rank-0 RSS {rss[step] / 2 ** 20:7.1f} MiB (anon {anon[step] / 2 ** 20:6.1f})  "
                  f"errors {errors}", flush=True)
    t_end = time.perf_counter()
    objects["end"] = len(gc.get_objects())

    mine = {"rank": rank, "steps": steps_done, "errors": errors, "messages": messages,
            "python_objects": objects, "wall_s": t_end - t_start,
            "steps_per_s": steps_done / (t_end - t_start),
            "steps_per_s_after_warmup": (steps_done - cfg.warmup_steps) / max(t_end - t_warm, 1e-9)}
    if steps_done > cfg.warmup_steps:
        mine["rss"] = rss_summary(list(rss[:steps_done]), cfg.warmup_steps, cfg.window)
        mine["anon_rss"] = rss_summary(list(anon[:steps_done]), cfg.warmup_steps, cfg.window)
        stride = max(1, steps_done // 100)
        mine["rss_trace_mb"] = [round(rss[i] / 2 ** 20, 2) for i in range(0, steps_done, stride)]
        mine["trace_stride"] = stride
    every = [None] * world_size
    dist.all_gather_object(every, mine)
    return {"config": dataclasses.asdict(cfg), "world_size": world_size, "ranks": every} if rank == 0 else None


# --------------------------------------------------------------------------------------------------------
# Report

def verdict(result: dict, max_growth_pct: float) -> List[str]:
    """Reasons the soak failed (empty when it passed)."""
    cfg, reasons = result["config"], []
    for r in result["ranks"]:
        if r["errors"]:
            reasons.append(f"rank {r['rank']}: {r['errors']} error(s), first: {r['messages'][0]}")
        if r["steps"] < cfg["steps"]:
            reasons.append(f"rank {r['rank']}: stopped after {r['steps']} of {cfg['steps']} steps")
        if "rss" not in r:
            reasons.append(f"rank {r['rank']}: no step after warm-up, RSS not judged")
        elif not r["rss"]["growth_pct"] < max_growth_pct:
            reasons.append(f"rank {r['rank']}: RSS grew {r['rss']['growth_pct']:.2f}% after warm-up "
                           f"(limit {max_growth_pct}%)")
    return reasons


def print_report(result: dict, max_growth_pct: float) -> None:
    cfg = result["config"]
    print(f"\nsoak: {result['world_size']} ranks, {cfg['steps']} steps ({cfg['warmup_steps']} warm-up), "
          f"E={cfg['experts']} H={cfg['hidden']} F={cfg['ffn']} layers={cfg['layers']} "
          f"T<={cfg['max_tokens']} K<={cfg['max_top_k']} C<={cfg['max_chunks']}")
    print("rank  steps  errors  RSS start -> end MiB  growth   slope KiB/step  anon start -> end MiB  growth  "
          "py objects  steps/s")
    for r in result["ranks"]:
        s, a, o = r.get("rss"), r.get("anon_rss"), r["python_objects"]
        mem = (f"{s['start_mb']:8.1f} -> {s['end_mb']:7.1f}  {s['growth_pct']:+6.2f}%  {s['slope_kb_per_step']:+9.3f}"
               f"       {a['start_mb']:7.1f} -> {a['end_mb']:6.1f}   {a['growth_pct']:+6.2f}%" if s else
               "  (not judged)")
        objs = f"{o.get('after_warmup', '-')}->{o['end']}"
        print(f"{r['rank']:4d}  {r['steps']:5d}  {r['errors']:6d}  {mem}  {objs:>11}  {r['steps_per_s']:6.1f}")
    reasons = verdict(result, max_growth_pct)
    print("PASS" if not reasons else "FAIL:\n  " + "\n  ".join(reasons))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--window", type=int, default=50, help="RSS samples per median (default 50)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-growth-pct", type=float, default=2.0, help="RSS growth limit after warm-up (default 2)")
    p.add_argument("--max-tokens", type=int, default=SoakConfig.max_tokens)
    p.add_argument("--experts", type=int, default=SoakConfig.experts)
    p.add_argument("--layers", type=int, default=SoakConfig.layers)
    p.add_argument("--json", default=None, help="write the figures to this path")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    cfg = SoakConfig(steps=a.steps, warmup_steps=a.warmup_steps, window=a.window, seed=a.seed,
                     max_tokens=a.max_tokens, experts=a.experts, layers=a.layers,
                     max_top_k=min(SoakConfig.max_top_k, a.experts))
    t0 = time.perf_counter()
    result = run_ranks(rank_main, a.world_size, cfg)
    result["wall_s_total"] = time.perf_counter() - t0
    result["max_growth_pct"] = a.max_growth_pct
    result["failures"] = verdict(result, a.max_growth_pct)
    print_report(result, a.max_growth_pct)
    print(f"wall time {result['wall_s_total']:.1f} s (including spawning the ranks)")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
