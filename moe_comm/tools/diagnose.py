"""`moe-comm profile`: run an MoE layer with the timeline on, then say where a step's time goes and what
to change.

Shapes legend: T tokens per rank, H hidden, F expert FFN size, E experts (global), e = E / W local
experts, K top-k, W EP world size, C chunks, R rows received by a rank.

Three parts, each usable alone:
- ``profile_rank(rank, W, opts)`` (collective, run through ``launch.run_ranks``): builds the layer, warms
  up, times ``steps`` forward+backward steps with the timeline on, then measures on the same group what
  the diagnosis needs: the alpha-beta fit of ``all_to_all_single``, the bare expert GEMMs on this rank's
  received rows, a plain [R, H] x [H, F] GEMM, the per-chunk overhead, and the expert load.
- ``diagnose(result) -> Diagnosis``: a pure function of that result (unit-tested on synthetic inputs).
  Findings, in order: is compute saturated; what share of the step is communication; which collective
  costs most; hidden vs exposed; bandwidth- or latency-bound; which ranks are slow and whether that follows
  expert load; then ONE suggestion with a predicted gain. ``format_diagnosis`` renders it as text.
- ``profile_main(opts, out_dir)``: runs it all (on an emulated slow link when ``opts["link"]`` is set) and
  writes ``trace.json`` (Chrome trace), ``timeline.png`` and ``profile.json``.

The step model behind every prediction is ``autochunk.predict_step`` (per chunk an all-to-all costs
alpha + bytes / (C * beta), the experts X / C + kappa, dispatch and combine share the link, backward is
twice the forward's compute); ``_model_step`` is the same model with separate byte counts per
all-to-all, which FP8 dispatch needs (only the forward dispatch shrinks).

Command line (the ``moe-comm profile`` subcommand calls ``profile_main``):
    python -m moe_comm.tools.diagnose '{"world_size": 2, "link": "1gbit", "tokens": 2048}' out/
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

from moe_comm.dispatch.autotune import choose_num_chunks, measure_alpha_beta, predict_step
from moe_comm.profiling.timeline import Span, overlap_report, to_chrome_trace

__all__ = ["DEFAULT_OPTS", "normalize_opts", "profile_rank", "Finding", "Suggestion", "Diagnosis", "diagnose",
           "format_diagnosis", "plot_timeline", "profile_main", "main"]

DEFAULT_OPTS: Dict[str, Any] = {
    "world_size": 2,        # W: gloo ranks to spawn (ignored under torchrun)
    "tokens": 1024,         # T per rank
    "hidden": 256,          # H
    "ffn": 512,             # F
    "experts": 8,           # E (global)
    "top_k": 2,             # K
    "num_chunks": 1,        # C, pipeline depth of the profiled layer
    "steps": 3,             # timed forward+backward steps
    "warmup": 1,            # untimed steps first (lazy inits, kernel builds)
    "workload": "uniform",  # a moe_comm.testing.workloads name, or "router" (the layer's own random router)
    "workload_params": {},  # e.g. {"p": 0.6} for hot_rank / hot_experts
    "dtype": "float32",
    "seed": 0,
    "link": None,           # e.g. "1gbit": re-run inside a namespace with a shaped loopback
    "link_delay": None,     # e.g. "1ms": netem delay on that link
    "timeout_s": 900,       # the whole run on the emulated link
    "emulated_link": None,  # informational: set by profile_main for the run inside the namespace
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}
_INT_OPTS = ("world_size", "tokens", "hidden", "ffn", "experts", "top_k", "num_chunks", "steps")

# Thresholds of the verdicts. Judgement calls, not measurements; each names what it compares.
SATURATED_RATIO = 0.7       # expert GEMM FLOP rate / plain GEMM rate at or above this: compute saturated
COMM_DOMINANT_SHARE = 0.5   # comm union / step above this: "communication dominates"
IMBALANCE_RATIO = 1.2       # busiest rank's rows / mean rows above this: rebalance candidate
SLOW_RANK_RATIO = 1.1       # a rank's compute / mean compute above this: "slow rank"
LOAD_CORRELATION = 0.7      # corr(compute, rows received) at or above this: slowness follows load
MIN_GAIN_SHARE = 0.03       # a suggestion must be predicted to save >= 3% of the step, else "keep"
_FLAT_FIT_BETA = 1e14       # autochunk.fit_alpha_beta clamps a flat fit to beta = 1e15 B/s
FP8_BLOCK = 128             # FP8 dispatch sends 1 byte per element + one fp32 scale per 128 elements


# ==================================================================== options
def normalize_opts(opts: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Defaults filled in and every field checked; returns a new dict (JSON-serialisable).

    Raises ValueError naming the field (unknown key, K > E, E not divisible by W, unknown workload or
    dtype, a skewed workload with H < E, too many ranks for this machine).
    """
    from moe_comm.tools.launch import launched_by_torchrun
    from moe_comm.testing.workloads import WORKLOADS, make_workload

    if opts is None:
        opts = {}
    if not isinstance(opts, dict):
        raise TypeError(f"opts must be a dict, got {type(opts).__name__}")
    unknown = sorted(set(opts) - set(DEFAULT_OPTS))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(DEFAULT_OPTS)}")
    o = {**DEFAULT_OPTS, **opts}
    o["workload_params"] = dict(o["workload_params"] or {})
    for name in _INT_OPTS:
        v = o[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if isinstance(o["warmup"], bool) or not isinstance(o["warmup"], int) or o["warmup"] < 0:
        raise ValueError(f"warmup must be an int >= 0, got {o['warmup']!r}")
    if o["top_k"] > o["experts"]:
        raise ValueError(f"top_k must be <= experts ({o['experts']}), got {o['top_k']}")
    W = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else o["world_size"]
    if o["experts"] % W:
        raise ValueError(f"experts ({o['experts']}) must be divisible by the world size, got {W}")
    max_ranks = max(8, 4 * (os.cpu_count() or 1))
    if not launched_by_torchrun() and o["world_size"] > max_ranks:
        raise ValueError(f"world_size must be <= {max_ranks} on this machine ({os.cpu_count()} cores; "
                         f"use torchrun for more), got {o['world_size']}")
    if o["dtype"] not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {o['dtype']!r}")
    if o["workload"] != "router":
        if o["workload"] not in WORKLOADS:
            raise ValueError(f"workload must be 'router' or one of {', '.join(WORKLOADS)}, got {o['workload']!r}")
        if o["workload"] == "hot_rank":
            o["workload_params"].setdefault("num_ranks", W)
        make_workload(o["workload"], **o["workload_params"])  # raises on bad parameters
        if o["hidden"] < o["experts"]:
            raise ValueError(f"hidden ({o['hidden']}) must be >= experts ({o['experts']}) to impose the "
                             f"{o['workload']!r} routing through the router; use workload='router'")
    elif o["workload_params"]:
        raise ValueError(f"workload_params must be empty for workload='router', got {o['workload_params']!r}")
    for name in ("link", "link_delay"):
        if o[name] is not None and not isinstance(o[name], str):
            raise ValueError(f"{name} must be a tc string like '1gbit' / '1ms' or None, got {o[name]!r}")
    if o["link"] is not None:
        from moe_comm.tools.slow_link import parse_rate
        parse_rate(o["link"])
    if o["link_delay"] is not None:
        from moe_comm.tools.slow_link import parse_delay
        parse_delay(o["link_delay"])
    if not isinstance(o["timeout_s"], (int, float)) or not o["timeout_s"] > 0:
        raise ValueError(f"timeout_s must be seconds > 0, got {o['timeout_s']!r}")
    return o


# ==================================================================== measuring (collective)
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: timing only, outside the profiled steps


def _median_s(fn, device: torch.device, repeats: int = 5) -> float:
    """Median seconds of ``fn()`` after one warm-up call, every rank timing at the same time (the ranks
    share the machine during a step too, so they should share it while measured)."""
    fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _inputs(opts: Dict[str, Any], rank: int, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """x_TH of one step. With a workload, the first E columns are router logits whose top-K is exactly
    that workload's routing (the router weight is pinned to [I_E | 0], see ``_pin_router``)."""
    from moe_comm.testing.workloads import make_workload, routing_logits

    T, H, E, K = opts["tokens"], opts["hidden"], opts["experts"], opts["top_k"]
    g = torch.Generator().manual_seed(opts["seed"] * 1_000_003 + rank * 1009 + step)
    x_TH = torch.randn(T, H, generator=g)
    if opts["workload"] != "router":
        wl = make_workload(opts["workload"], **opts["workload_params"])
        topk_idx_TK = wl(T, E, K, seed=opts["seed"] * 1000 + rank, step=step)
        x_TH[:, :E] = routing_logits(topk_idx_TK, E, seed=step, dtype=torch.float64).float()
    return x_TH.to(device=device, dtype=dtype)


@torch.no_grad()
def _pin_router(layer) -> None:
    """Router weight [E, H] := [I_E | 0]: logits = x[:, :E], so ``_inputs`` decides the routing."""
    w_EH = torch.zeros_like(layer.router.weight)
    w_EH[:, :w_EH.shape[0]] = torch.eye(w_EH.shape[0], dtype=w_EH.dtype, device=w_EH.device)
    layer.router.weight.copy_(w_EH)


def profile_rank(rank: int, world_size: int, opts: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Profile one MoELayer on the default process group; call it on every rank (``run_ranks``).

    Args:
        rank, world_size: this rank and W (the default group's).
        opts: see ``DEFAULT_OPTS`` (``normalize_opts`` is applied).
    Returns (rank 0; None elsewhere) a JSON-serialisable dict: "opts", "world_size", "steps",
        "num_chunks", "element_size", "spans" (every rank's spans as dicts, seconds), "step_s" (host
        wall of each timed step, rank 0, between barriers), "alpha_s", "beta_bytes_per_s", and "ranks": one
        dict per rank with "rows_sent", "rows_recv" (mean per step), "rows_recv_per_expert" [e],
        "bytes_sent", "bytes_recv" (per step, dispatch direction), "ranks_per_token" (mean distinct
        destination ranks of a token), "expert_rows" (R of the bare expert measurement),
        "expert_fwd_s", "expert_fwdbwd_s" (bare GroupedExperts on R random rows with the real
        per-expert counts), "expert_flops" (forward: 6 R H F), "gemm_s", "gemm_flops" (plain
        [max(R,1), H] x [H, F]), "kappa_s" (one more chunk's fixed cost, as num_chunks="auto" measures it).
    """
    from moe_comm.config import MoEConfig
    from moe_comm.modules.layer import MoELayer
    from moe_comm.testing.workloads import count_tokens

    opts = normalize_opts(opts)
    T, H, F, E, K, C = (opts[k] for k in ("tokens", "hidden", "ffn", "experts", "top_k", "num_chunks"))
    W, e = world_size, opts["experts"] // world_size
    dtype = _DTYPES[opts["dtype"]]
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, num_chunks=C)
    layer = MoELayer(cfg, seed=opts["seed"], device=device, dtype=dtype)
    if opts["workload"] != "router":
        _pin_router(layer)
    tl = layer.timeline
    tl.device = device

    def step(s: int) -> torch.Tensor:
        x_TH = _inputs(opts, rank, s, dtype, device).requires_grad_(True)
        with tl.region("forward"):
            y_TH = layer(x_TH)
            loss = y_TH.float().sum()
        with tl.region("backward", direction="bwd"):
            loss.backward()
        return x_TH.detach()

    for s in range(opts["warmup"]):
        step(s)
    layer.zero_grad(set_to_none=True)
    tl.reset()
    tl.enabled = True
    step_s, xs = [], []
    for s in range(opts["warmup"], opts["warmup"] + opts["steps"]):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        xs.append(step(s))
        _sync(device)
        step_s.append(time.perf_counter() - t0)
    tl.enabled = False
    spans = tl.gather()

    # Expert load of the timed steps: rows each rank received (summed over sources), mean per step.
    with torch.no_grad():
        routes = [layer.router(x_TH).topk_idx_TK for x_TH in xs]
    counts_E = torch.zeros(E, dtype=torch.int64, device=device)
    ranks_per_token, rows_sent = 0.0, 0
    for topk_idx_TK in routes:
        c_E, dropped = count_tokens(topk_idx_TK, E)
        counts_E += c_E
        rows_sent += topk_idx_TK.numel() - int(dropped)
        dest_TK = torch.where(topk_idx_TK >= 0, topk_idx_TK // e, torch.full_like(topk_idx_TK, -1))
        hit_TW = torch.zeros(T, W + 1, dtype=torch.bool, device=device)
        hit_TW.scatter_(1, dest_TK + 1, True)
        ranks_per_token += float(hit_TW[:, 1:].sum(1).double().mean()) if T else 0.0
    dist.all_reduce(counts_E)
    n = len(routes)
    counts_We = counts_E.reshape(W, e).double() / n
    elsize = torch.empty((), dtype=dtype).element_size()

    # Bare expert GEMMs on the rows this rank really received (last step's counts, one chunk).
    handle = layer.dispatcher._plan(xs[-1], routes[-1], num_chunks=1)  # collective: counts exchange
    plan = handle.chunks[0]
    R, counts_e = plan.num_recv, list(plan.counts_e)
    g = torch.Generator().manual_seed(rank + 17)
    x_RH = torch.randn(R, H, generator=g).to(device=device, dtype=dtype)
    tokens_per_expert_e = plan.tokens_per_expert_e
    with torch.no_grad():
        expert_fwd_s = _median_s(lambda: layer.experts(x_RH, tokens_per_expert_e, counts=counts_e), device)
    x_in = x_RH.clone().requires_grad_(True)
    params = [x_in] + list(layer.experts.parameters())

    def fwd_bwd():
        out_RH = layer.experts(x_in, tokens_per_expert_e, counts=counts_e)
        torch.autograd.grad(out_RH, params, grad_outputs=torch.ones_like(out_RH), allow_unused=True)

    expert_fwdbwd_s = _median_s(fwd_bwd, device)
    M = max(R, 1)
    a_MH = torch.randn(M, H, generator=g).to(device=device, dtype=dtype)
    b_HF = torch.randn(H, F, generator=g).to(device=device, dtype=dtype)
    gemm_s = _median_s(lambda: a_MH @ b_HF, device)
    kappa_s = layer.dispatcher._chunk_overhead(xs[-1], handle, layer.experts)
    alpha, beta = measure_alpha_beta(dist.group.WORLD, device)

    mine = {
        "rank": rank,
        "rows_sent": rows_sent / n,
        "rows_recv": float(counts_We[rank].sum()),
        "rows_recv_per_expert": counts_We[rank].tolist(),  # host sync: profiling, after the steps
        "bytes_sent": rows_sent / n * H * elsize,
        "bytes_recv": float(counts_We[rank].sum()) * H * elsize,
        "ranks_per_token": ranks_per_token / n,
        "expert_rows": R,
        "expert_fwd_s": expert_fwd_s,
        "expert_fwdbwd_s": expert_fwdbwd_s,
        "expert_flops": 6.0 * R * H * F,
        "gemm_s": gemm_s,
        "gemm_flops": 2.0 * M * H * F,
        "kappa_s": kappa_s,
    }
    every: List[Optional[Dict[str, Any]]] = [None] * W
    dist.all_gather_object(every, mine)
    if rank != 0:
        return None
    return {
        "opts": opts, "world_size": W, "steps": opts["steps"], "num_chunks": C, "element_size": elsize,
        "hidden": H, "ffn": F, "experts": E, "top_k": K, "tokens": T, "device": str(device),
        "backend": dist.get_backend(),
        "spans": [dataclasses.asdict(s) for s in spans], "step_s": step_s,
        "alpha_s": alpha, "beta_bytes_per_s": beta, "ranks": every,
    }


# ==================================================================== diagnosis (pure)
@dataclass
class Finding:
    """One answer of the diagnosis: ``key`` (stable id), ``title`` (the question), ``verdict`` (one
    sentence), ``numbers`` (what the verdict is based on; seconds are per step)."""

    key: str
    title: str
    verdict: str
    numbers: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Suggestion:
    """The one change to make. action: "chunks" | "group_limited" | "rebalance" | "fp8_dispatch" |
    "keep". predicted_gain_s: model-predicted seconds saved per step; predicted_step_s: measured step
    minus that gain. alternatives: every candidate considered, with its predicted gain."""

    action: str
    text: str
    predicted_gain_s: float
    predicted_step_s: float
    numbers: Dict[str, Any] = field(default_factory=dict)
    alternatives: List[Dict[str, Any]] = field(default_factory=list)


@dataclass
class Diagnosis:
    """Findings in the fixed order (compute, comm_share, collective, overlap, link, ranks) and the
    suggestion. ``step_s``: measured step (mean over ranks of the forward+backward envelope)."""

    findings: List[Finding]
    suggestion: Suggestion
    step_s: float
    header: str = ""

    def finding(self, key: str) -> Finding:
        for f in self.findings:
            if f.key == key:
                return f
        raise KeyError(f"no finding {key!r}; have {[f.key for f in self.findings]}")

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _model_step(C: int, expert_s: float, bytes_by_a2a: Sequence[float], alpha: float, beta: float,
                kappa: float) -> float:
    """``autochunk.predict_step``'s model with a byte count per all-to-all: bytes_by_a2a = (forward
    dispatch, forward combine, backward combine-gradient, backward dispatch-gradient), whole step.
    Equal bytes give exactly ``predict_step`` (tested)."""
    def c(nbytes: float) -> float:
        return alpha + (nbytes / (C * beta) if beta != float("inf") else 0.0)

    total = 0.0
    for X, (b1, b2) in ((expert_s, bytes_by_a2a[:2]), (2.0 * expert_s, bytes_by_a2a[2:])):
        x = X / C + kappa * (X / expert_s if expert_s > 0 else 1.0)
        total += max(C * x + c(b1) + c(b2), C * (c(b1) + c(b2)) + x)
    return total


def _pearson(a: Sequence[float], b: Sequence[float]) -> Optional[float]:
    n = len(a)
    if n < 2:
        return None
    ma, mb = sum(a) / n, sum(b) / n
    va = sum((x - ma) ** 2 for x in a)
    vb = sum((y - mb) ** 2 for y in b)
    if va <= 0 or vb <= 0:
        return None
    return sum((x - ma) * (y - mb) for x, y in zip(a, b)) / math.sqrt(va * vb)


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def _mb(b: float) -> str:
    return f"{b / 1e6:.2f} MB" if b >= 1e5 else f"{b / 1e3:.1f} kB"


def _union_length(intervals: Iterable[tuple]) -> float:
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _step_windows(spans: List[Span]) -> Dict[int, float]:
    """Per rank: length of the union of its region spans (forward + backward envelopes), i.e. the
    measured step time of all timed steps together. Falls back to the compute ∪ comm union."""
    out: Dict[int, float] = {}
    for r in sorted({s.rank for s in spans}):
        mine = [s for s in spans if s.rank == r]
        regions = [(s.start, s.end) for s in mine if s.kind == "region"]
        if not regions:
            regions = [(s.start, s.end) for s in mine]
        out[r] = _union_length(regions)
    return out


def _mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


@dataclass
class _Ctx:
    """What every finding reads: the result, its spans' overlap report, per-step totals (mean over ranks)."""

    result: Dict[str, Any]
    spans: List[Span]
    report: Dict[str, Any]
    ranks_info: List[Dict[str, Any]]   # profile_rank's per-rank dicts, by rank
    windows: Dict[int, float]          # rank -> union of its forward/backward envelopes, all steps
    steps: int
    step_s: float                      # measured step: mean over ranks of windows / steps
    comm_s: float                      # comm union per step
    compute_s: float                   # compute union per step

    @property
    def per_rank(self) -> Dict[int, Dict[str, float]]:
        return self.report["overall"]["per_rank"]


def diagnose(result: Dict[str, Any]) -> Diagnosis:
    """Diagnose a ``profile_rank`` result (or a synthetic dict with the same keys). Pure.

    Every seconds figure in the findings is per step (totals over the timed steps / ``steps``), a mean
    over ranks unless the name says otherwise. Findings, in order: compute, comm_share, collective,
    overlap, link, ranks; then the suggestion.
    """
    spans = [s if isinstance(s, Span) else Span(**s) for s in result["spans"]]
    if not spans:
        raise ValueError("result['spans'] is empty: nothing was recorded (was the timeline enabled?)")
    steps = result["steps"]
    report = overlap_report(spans)
    windows = _step_windows(spans)
    ctx = _Ctx(result=result, spans=spans, report=report, ranks_info=sorted(result["ranks"], key=lambda d: d["rank"]),
               windows=windows, steps=steps, step_s=_mean(windows.values()) / steps,
               comm_s=report["overall"]["T_comm"] / steps, compute_s=report["overall"]["T_compute"] / steps)
    findings = [_finding_compute(ctx), _finding_comm_share(ctx), _finding_collective(ctx), _finding_overlap(ctx),
                _finding_link(ctx), _finding_ranks(ctx)]
    suggestion = _suggest(ctx, findings[4].numbers, findings[5].numbers)
    r, o = result, result.get("opts", {})
    dims = (f"W={r['world_size']} T={r['tokens']} H={r['hidden']} F={r['ffn']} E={r['experts']} K={r['top_k']} "
            f"C={r['num_chunks']} {o.get('dtype', '')} workload={o.get('workload', '?')}")
    link = o.get("emulated_link") or o.get("link")
    header = f"moe_comm profile: {dims}, {steps} steps" + (f", emulated link {link}" if link else "")
    return Diagnosis(findings=findings, suggestion=suggestion, step_s=ctx.step_s, header=header)


def _finding_compute(ctx: _Ctx) -> Finding:
    """1. Is compute saturated? Expert GEMM FLOP rate vs a plain GEMM on as many rows."""
    rates = []
    for d in ctx.ranks_info:
        exp_rate = d["expert_flops"] / d["expert_fwd_s"] if d["expert_fwd_s"] > 0 else 0.0
        gemm_rate = d["gemm_flops"] / d["gemm_s"] if d["gemm_s"] > 0 else 0.0
        rates.append((d["rank"], exp_rate, gemm_rate, exp_rate / gemm_rate if gemm_rate > 0 else 0.0))
    ratio = _mean(r[3] for r in rates)
    in_step = sum(p["time"] for L in ctx.report["layers"] if L["direction"] == "fwd"
                  for p in L["phases"] if p["phase"] == "experts" and p["kind"] == "compute") / ctx.steps
    bare = _mean(d["expert_fwd_s"] for d in ctx.ranks_info)
    n = {"expert_gflops": _mean(r[1] for r in rates) / 1e9, "gemm_gflops": _mean(r[2] for r in rates) / 1e9,
         "ratio": ratio, "per_rank_ratio": {r[0]: r[3] for r in rates},
         "rows_per_rank": _mean(d["expert_rows"] for d in ctx.ranks_info),
         "local_experts": len(ctx.ranks_info[0]["rows_recv_per_expert"]),
         "expert_fwd_bare_s": bare, "expert_fwd_in_step_s": in_step,
         "in_step_over_bare": in_step / bare if bare > 0 else 0.0}
    if ratio >= SATURATED_RATIO:
        v = (f"yes: the expert GEMMs run at {n['expert_gflops']:.1f} GFLOP/s, {ratio:.0%} of a plain "
             f"[R,H]x[H,F] GEMM ({n['gemm_gflops']:.1f} GFLOP/s)")
    else:
        v = (f"no: the expert GEMMs reach {n['expert_gflops']:.1f} GFLOP/s, only {ratio:.0%} of a plain "
             f"GEMM on the same rows ({n['gemm_gflops']:.1f} GFLOP/s): {n['local_experts']} experts split "
             f"~{n['rows_per_rank']:.0f} rows into small GEMMs")
    if ratio > 1.1:
        v += " (faster than the plain GEMM: a noisy measurement, e.g. other processes on these cores)"
    v += (f"; in the step the forward experts (with their regroup) took {_ms(in_step)} vs {_ms(bare)} bare "
          f"({n['in_step_over_bare']:.2f}x)")
    return Finding("compute", "Is compute saturated?", v, n)


def _finding_comm_share(ctx: _Ctx) -> Finding:
    """2. What share of the step has a collective in flight (comm union / forward+backward envelope)."""
    step_s, union_s = ctx.step_s, ctx.report["overall"]["T_step"] / ctx.steps
    share = ctx.comm_s / step_s if step_s > 0 else 0.0
    n = {"step_s": step_s, "comm_s": ctx.comm_s, "compute_s": ctx.compute_s, "comm_share": share,
         "compute_share": ctx.compute_s / step_s if step_s > 0 else 0.0,
         "untracked_s": max(step_s - union_s, 0.0), "step_wall_rank0_s": _mean(ctx.result.get("step_s") or [0.0])}
    v = (f"{share:.0%} of the {_ms(step_s)} step has a collective in flight ({_ms(ctx.comm_s)}); compute spans "
         f"cover {_ms(ctx.compute_s)} ({n['compute_share']:.0%}); {_ms(n['untracked_s'])} is neither "
         f"(autograd of permute/unpermute/router, Python)")
    if share > COMM_DOMINANT_SHARE:
        v = "communication dominates: " + v
    return Finding("comm_share", "What share of the step is communication?", v, n)


def _finding_collective(ctx: _Ctx) -> Finding:
    """3. Which collective costs most: comm time per (phase, direction), summed over layers."""
    nr = max(len(ctx.per_rank), 1)
    merged: Dict[tuple, Dict[str, Any]] = {}
    for L in ctx.report["layers"]:
        for p in L["phases"]:
            if p["kind"] != "comm":
                continue
            acc = merged.setdefault((p["phase"], L["direction"]), {
                "phase": p["phase"], "direction": L["direction"], "time_s": 0.0, "exposed_s": 0.0, "hidden_s": 0.0,
                "calls_per_rank_step": 0.0})
            acc["time_s"] += p["time"] / ctx.steps
            acc["exposed_s"] += p["exposed"] / ctx.steps
            acc["hidden_s"] += p["overlapped"] / ctx.steps
            acc["calls_per_rank_step"] += p["count"] / nr / ctx.steps
    rows = sorted(merged.values(), key=lambda r: -r["time_s"])
    if not rows or ctx.comm_s <= 0:
        return Finding("collective", "Which collective costs most?", "no collective recorded (single rank?)",
                       {"collectives": rows})
    top = rows[0]
    v = (f"{top['phase']} ({top['direction']}): {_ms(top['time_s'])} per step, "
         f"{top['time_s'] / ctx.comm_s:.0%} of the comm time")
    if top["phase"] == "counts":
        v += ("; the counts exchange is the layer's one host sync, so its time is mostly ranks waiting for the "
              "slowest one to reach it")
    return Finding("collective", "Which collective costs most?", v, {"collectives": rows})


def _finding_overlap(ctx: _Ctx) -> Finding:
    """4. Hidden (covered by a compute span on the same rank) vs exposed comm."""
    o = ctx.report["overall"]
    hidden, exposed = o["hidden"] / ctx.steps, o["exposed"] / ctx.steps
    C = ctx.result["num_chunks"]
    n = {"hidden_s": hidden, "exposed_s": exposed, "overlap_fraction": o["overlap_fraction"],
         "exposed_share_of_step": exposed / ctx.step_s if ctx.step_s > 0 else 0.0, "num_chunks": C}
    v = (f"{_ms(hidden)} hidden behind compute, {_ms(exposed)} exposed ({n['exposed_share_of_step']:.0%} of the "
         f"step); overlap fraction {o['overlap_fraction']:.0%} of the possible")
    if C == 1:
        v += " (num_chunks=1: nothing to overlap the all-to-alls with but the router/layout)"
    return Finding("overlap", "How much of it is hidden?", v, n)


def _finding_link(ctx: _Ctx) -> Finding:
    """5. Bandwidth- or latency-bound: a chunk's message (busiest rank, max of sent and received bytes
    per all-to-all / C) against the knee alpha * beta of the fit."""
    alpha, beta = float(ctx.result["alpha_s"]), float(ctx.result["beta_bytes_per_s"])
    C, W = ctx.result["num_chunks"], ctx.result["world_size"]
    bytes_busy = max(max(d["bytes_sent"], d["bytes_recv"]) for d in ctx.ranks_info)
    msg = bytes_busy / C
    measured = _mean(s.duration for s in ctx.spans if s.kind == "comm" and s.phase in ("dispatch", "combine"))
    if beta == float("inf") or W == 1:
        knee, regime, bw_frac, predicted = 0.0, "none", 0.0, alpha
        v = "single rank: no link"
    else:
        knee, predicted = alpha * beta, alpha + msg / beta
        bw_frac = (msg / beta) / predicted if predicted > 0 else 0.0
        regime = "bandwidth" if msg > knee else "latency"
        if beta >= _FLAT_FIT_BETA:
            v = (f"latency-bound: the alpha-beta fit found no bandwidth term (all-to-all time flat over the fit's "
                 f"sizes at alpha {alpha * 1e6:.0f} us); a chunk's message is {_mb(msg)}; measured "
                 f"dispatch/combine spans average {_ms(measured)}")
        else:
            v = (f"{regime}-bound: a chunk's message is {_mb(msg)} vs the knee alpha*beta = {_mb(knee)} "
                 f"(alpha {alpha * 1e6:.0f} us, beta {beta / 1e9:.3f} GB/s), so {bw_frac:.0%} of a predicted "
                 f"{_ms(predicted)} all-to-all is bytes; measured dispatch/combine spans average {_ms(measured)}")
        if predicted > 0 and measured > 1.5 * predicted:
            v += f" ({measured / predicted:.1f}x the fit: waiting for the peers, not the link)"
    n = {"alpha_s": alpha, "beta_bytes_per_s": beta, "knee_bytes": knee, "message_bytes": msg,
         "bytes_per_a2a_busiest": bytes_busy, "bandwidth_fraction": bw_frac, "regime": regime,
         "predicted_a2a_s": predicted, "measured_a2a_s": measured}
    return Finding("link", "Bandwidth-bound or latency-bound?", v, n)


def _finding_ranks(ctx: _Ctx) -> Finding:
    """6. Slow ranks (compute union per step) and their correlation with the rows they receive."""
    load = {d["rank"]: d["rows_recv"] for d in ctx.ranks_info}
    mean_load = _mean(load.values())
    imbalance = max(load.values()) / mean_load if mean_load > 0 else 1.0
    ids = sorted(ctx.per_rank)
    comp = {r: ctx.per_rank[r]["T_compute"] / ctx.steps for r in ids}
    mean_comp = _mean(comp.values())
    slowest = max(ids, key=lambda r: (comp[r], -r))
    spread = comp[slowest] / mean_comp if mean_comp > 0 else 1.0
    common = [r for r in ids if r in load]
    corr = _pearson([comp[r] for r in common], [load[r] for r in common])
    table = [{"rank": r, "compute_s": comp[r], "comm_s": ctx.per_rank[r]["T_comm"] / ctx.steps,
              "step_s": ctx.windows[r] / ctx.steps, "rows_recv": load.get(r, 0.0)} for r in ids]
    n = {"per_rank": table, "slowest_rank": slowest, "compute_over_mean": spread, "load_max_over_mean": imbalance,
         "correlation": corr, "busiest_rank": max(load, key=lambda r: (load[r], -r))}
    follows = corr is not None and corr >= LOAD_CORRELATION and imbalance > 1.05
    if spread > SLOW_RANK_RATIO:
        v = f"rank {slowest} is slow: compute {_ms(comp[slowest])} per step, {spread:.2f}x the mean"
        if follows:
            v += (f"; it follows the expert load (corr {corr:+.2f}; the busiest rank receives {imbalance:.2f}x "
                  f"the mean rows)")
        else:
            v += f"; not explained by expert load (load max/mean {imbalance:.2f}"
            v += f", corr {corr:+.2f})" if corr is not None else ")"
    else:
        v = (f"no slow rank: compute within {spread:.2f}x of the mean (rank {slowest} slowest); expert load "
             f"max/mean {imbalance:.2f}")
    if corr is not None and len(common) == 2:
        v += " [2 ranks: the correlation is +-1 by construction; read the ratios]"
    return Finding("ranks", "Which ranks are slow, and does that follow expert load?", v, n)


def _suggest(ctx: _Ctx, link: Dict[str, Any], ranks: Dict[str, Any]) -> Suggestion:
    """Every applicable candidate with its model-predicted gain; the largest gain wins if it saves at
    least MIN_GAIN_SHARE of the step. Gains are differences of one model, so part of its error cancels.
    Model inputs: X = the slowest rank's bare forward experts, B = the busiest rank's bytes per all-to-all,
    kappa = the largest per-chunk overhead, alpha and beta of the fit."""
    result, ranks_info, step_s = ctx.result, ctx.ranks_info, ctx.step_s
    alpha, beta = link["alpha_s"], link["beta_bytes_per_s"]
    C, W, H, elsize = result["num_chunks"], result["world_size"], result["hidden"], result["element_size"]
    imbalance, regime = ranks["load_max_over_mean"], link["regime"]
    X = max(d["expert_fwd_s"] for d in ranks_info)
    kappa = max(d["kappa_s"] for d in ranks_info)
    B = link["bytes_per_a2a_busiest"]
    K, E = result["top_k"], result["experts"]
    e = E // W
    cands: List[Dict[str, Any]] = []
    base = predict_step(C, X, B, alpha, beta, kappa)

    # more / fewer chunks
    plan = choose_num_chunks(X, B, alpha, beta, kappa)
    pred = dict(plan.predicted_s)
    pred[C] = base
    if plan.num_chunks != C and pred[plan.num_chunks] < base:  # C outside CANDIDATES may already be best
        best = plan.num_chunks
        cands.append({"action": "chunks", "gain_s": base - pred[best],
                      "text": (f"use num_chunks={best} ({'more' if best > C else 'fewer'} chunks than {C}): the "
                               f"model predicts {_ms(pred[best])} vs {_ms(base)} for the experts + all-to-alls"),
                      "numbers": {"current_C": C, "best_C": best, "expert_fwd_s": X, "bytes_per_a2a": B,
                                  "kappa_s": kappa, "predicted_s": {str(k): v for k, v in sorted(pred.items())}}})

    # group-limited routing: tokens reach many ranks
    d_bar = sum(d["ranks_per_token"] for d in ranks_info) / len(ranks_info)
    M = max(2, math.ceil(K / e))
    if W > 2 and d_bar > M + 0.25:
        b_now, b_lim = B * d_bar / K, B * M / K
        gain = (predict_step(C, X, b_now, alpha, beta, kappa) - predict_step(C, X, b_lim, alpha, beta, kappa))
        cands.append({"action": "group_limited", "gain_s": gain,
                      "text": (f"group-limited routing, MoEConfig(num_groups={W}, topk_groups={M}): a token now "
                               f"reaches {d_bar:.2f} of {W} ranks; at most {M} cuts a deduplicating dispatch's bytes "
                               f"{_mb(b_now)} -> {_mb(b_lim)} per all-to-all (moe_comm's Dispatcher sends one row per "
                               f"(token, expert), so the gain needs per-rank deduplication)"),
                      "numbers": {"ranks_per_token": d_bar, "topk_groups": M, "num_groups": W,
                                  "bytes_dedup_now": b_now, "bytes_dedup_limited": b_lim}})

    # rebalancing: the busiest rank receives > 1.2x the mean rows
    if imbalance > IMBALANCE_RATIO:
        loads = [d["rows_recv"] for d in ranks_info]
        mean_load = sum(loads) / len(loads)
        X_bal = X * mean_load / max(loads)
        B_bal = max(max(d["bytes_sent"] for d in ranks_info), mean_load * H * elsize)
        gain = base - predict_step(C, X_bal, B_bal, alpha, beta, kappa)
        cands.append({"action": "rebalance", "gain_s": gain,
                      "text": (f"rebalance experts across ranks (moe_comm.placement.plan_placement on the load "
                               f"history, or router.expert_bias): the busiest rank receives {imbalance:.2f}x the "
                               f"mean rows; balanced, its experts take {_ms(X_bal)} instead of {_ms(X)} per forward"),
                      "numbers": {"load_max_over_mean": imbalance, "expert_fwd_s": X, "expert_fwd_balanced_s": X_bal,
                                  "bytes_per_a2a": B, "bytes_per_a2a_balanced": B_bal}})

    # FP8 dispatch: bandwidth-bound -> the forward dispatch shrinks to 1 byte/element + block scales
    if regime == "bandwidth":
        factor = (H + 4 * math.ceil(H / FP8_BLOCK)) / (H * elsize)
        if factor < 1.0:
            after = _model_step(C, X, (B * factor, B, B, B), alpha, beta, kappa)
            saved_comm = B * (1 - factor) / beta
            cands.append({"action": "fp8_dispatch", "gain_s": base - after,
                          "text": (f"FP8 dispatch: the forward dispatch shrinks from {elsize} to "
                                   f"{factor * elsize:.2f} bytes/element ({_mb(B)} -> {_mb(B * factor)} per step), "
                                   f"{_ms(saved_comm)} less link time; combine and backward stay {elsize}-byte"),
                          "numbers": {"bytes_factor": factor, "bytes_per_a2a": B, "comm_saved_s": saved_comm}})

    for c in cands:
        c["predicted_step_s"] = step_s - c["gain_s"]
    cands.sort(key=lambda c: -c["gain_s"])
    model = {"model_current_s": base, "measured_step_s": step_s, "alpha_s": alpha, "beta_bytes_per_s": beta,
             "expert_fwd_s": X, "kappa_s": kappa, "bytes_per_a2a": B}
    alts = [{k: c[k] for k in ("action", "gain_s", "predicted_step_s")} for c in cands]
    if cands and cands[0]["gain_s"] >= MIN_GAIN_SHARE * step_s:
        best = cands[0]
        return Suggestion(action=best["action"], text=best["text"], predicted_gain_s=best["gain_s"],
                          predicted_step_s=best["predicted_step_s"], numbers={**model, **best["numbers"]},
                          alternatives=alts)
    why = (f"no candidate is predicted to save {MIN_GAIN_SHARE:.0%} of the step"
           + (f" (best: {cands[0]['action']}, {_ms(cands[0]['gain_s'])})" if cands else " (none applies)"))
    return Suggestion(action="keep", text=f"keep the current setup: {why}", predicted_gain_s=0.0,
                      predicted_step_s=step_s, numbers=model, alternatives=alts)


def format_diagnosis(d: Diagnosis, *, width: int = 110) -> str:
    """Plain-text rendering of a Diagnosis (rich, no colour): the findings in order, the collectives and
    ranks tables, then the suggestion with its predicted gain."""
    from rich.console import Console
    from rich.padding import Padding
    from rich.table import Table

    con = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)

    def say(first: str, text: str) -> None:  # wrapped, continuation lines indented under the text
        con.print(textwrap.fill(text, width=width, initial_indent=first,
                                subsequent_indent=" " * len(first)), highlight=False, soft_wrap=True)

    con.print(d.header, highlight=False, soft_wrap=True)
    for i, f in enumerate(d.findings, 1):
        con.print(f"{i}. {f.title}", highlight=False)
        say("   ", f.verdict)
        if f.key == "collective" and f.numbers["collectives"]:
            t = Table(title=None, box=None, padding=(0, 2), show_edge=False)
            for col in ("collective", "dir", "ms/step", "exposed ms", "hidden ms", "calls/step"):
                t.add_column(col, justify="left" if col in ("collective", "dir") else "right")
            for r in f.numbers["collectives"]:
                t.add_row(r["phase"], r["direction"], f"{r['time_s'] * 1e3:.2f}", f"{r['exposed_s'] * 1e3:.2f}",
                          f"{r['hidden_s'] * 1e3:.2f}", f"{r['calls_per_rank_step']:.0f}")
            con.print(Padding(t, (0, 0, 0, 3), expand=False))
        if f.key == "ranks":
            t = Table(title=None, box=None, padding=(0, 2), show_edge=False)
            for col in ("rank", "step ms", "compute ms", "comm ms", "rows recv"):
                t.add_column(col, justify="right")
            for r in f.numbers["per_rank"]:
                t.add_row(str(r["rank"]), f"{r['step_s'] * 1e3:.2f}", f"{r['compute_s'] * 1e3:.2f}",
                          f"{r['comm_s'] * 1e3:.2f}", f"{r['rows_recv']:.0f}")
            con.print(Padding(t, (0, 0, 0, 3), expand=False))
    s = d.suggestion
    say("Suggestion: ", s.text)
    if s.action != "keep":
        say("   ", f"predicted step {_ms(s.predicted_step_s)} vs measured {_ms(d.step_s)} "
                   f"(-{_ms(s.predicted_gain_s)}, {s.predicted_gain_s / d.step_s:.0%})")
    if s.alternatives:
        say("   considered: ", "; ".join(f"{a['action']} -{_ms(a['gain_s'])}" for a in s.alternatives))
    return con.file.getvalue()


# ==================================================================== picture
_COMPUTE_COLOURS = {"experts": "#1f77b4", "router": "#9467bd", "layout": "#8c564b", "permute": "#2ca02c",
                    "unpermute": "#17becf", "shared": "#bcbd22"}
_COMM_COLOURS = {"dispatch": "#d62728", "combine": "#ff7f0e", "counts": "#7f7f7f"}


def _sub_lanes(spans_sorted: List[Span], max_lanes: int = 4) -> List[int]:
    """Greedy interval packing: for spans sorted by start, the first sub-lane (0..max_lanes-1) whose
    last span has ended; the last sub-lane when all are busy. Example: [0,2], [1,3], [2.5,4] -> 0, 1, 0."""
    ends: List[float] = []
    out = []
    for s in spans_sorted:
        k = next((i for i, e in enumerate(ends) if e <= s.start), None)
        if k is None:
            if len(ends) < max_lanes:
                ends.append(s.end)
                k = len(ends) - 1
            else:
                k = len(ends) - 1
                ends[k] = max(ends[k], s.end)
        else:
            ends[k] = s.end
        out.append(k)
    return out


def plot_timeline(spans: Iterable[Any], path: str, title: Optional[str] = None) -> str:
    """Write a PNG timeline: one row per rank with two lanes (compute above, comm below), a colour per
    phase (legend), backward spans hatched, forward/backward envelopes shaded, time in ms from the
    first span. spans: Span objects or their dicts. Returns ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = [s if isinstance(s, Span) else Span(**s) for s in spans]
    if not spans:
        raise ValueError("spans must not be empty")
    t0 = min(s.start for s in spans)
    ranks = sorted({s.rank for s in spans})
    lane_h, gap = 0.8, 0.6
    row_h = 2 * lane_h + gap
    fig, ax = plt.subplots(figsize=(15, 1.2 + 1.35 * len(ranks)), dpi=120)
    other = iter(plt.get_cmap("tab20").colors)
    colours: Dict[str, Any] = {}

    def colour(phase: str, kind: str):
        table = _COMPUTE_COLOURS if kind == "compute" else _COMM_COLOURS
        if phase not in colours:
            colours[phase] = table.get(phase) or next(other)
        return colours[phase]

    end_ms = (max(s.end for s in spans) - t0) * 1e3
    yticks, ylabels, used = [], [], {}
    for i, r in enumerate(ranks):
        base = (len(ranks) - 1 - i) * row_h
        lanes = {"compute": base + lane_h + gap / 2, "comm": base}
        for s in spans:
            if s.rank != r or s.kind != "region":
                continue
            ax.broken_barh([((s.start - t0) * 1e3, (s.end - s.start) * 1e3)], (base - gap / 4, row_h - gap / 2),
                           facecolors="#eeeeee" if s.direction == "fwd" else "#dde5ee", zorder=0)
        for kind, lane_y in lanes.items():
            mine = sorted((s for s in spans if s.rank == r and s.kind == kind), key=lambda s: (s.start, s.end))
            sub = _sub_lanes(mine)  # collectives in flight together get their own thinner bars
            n_sub = max(sub, default=0) + 1
            h = lane_h / n_sub
            for s, k in zip(mine, sub):
                x, w = (s.start - t0) * 1e3, max((s.end - s.start) * 1e3, end_ms * 1e-4)
                y = lane_y + (n_sub - 1 - k) * h
                c = colour(s.phase, s.kind)
                ax.broken_barh([(x, w)], (y, h), facecolors=c, edgecolor="black", linewidth=0.3,
                               hatch="///" if s.direction == "bwd" else None, zorder=2)
                used[(s.kind, s.phase)] = c
                if w > end_ms * 0.025 and s.chunk >= 0:
                    ax.text(x + w / 2, y + h / 2, f"{s.phase[0].upper()}{s.chunk}", ha="center", va="center",
                            fontsize=7, color="white", zorder=3)
        yticks += [lanes["compute"] + lane_h / 2, lanes["comm"] + lane_h / 2]
        ylabels += [f"rank {r} compute", f"rank {r} comm"]
    # forward/backward labels along the top, once per envelope of the first rank
    top = (len(ranks) - 1) * row_h + 2 * lane_h + gap
    for s in spans:
        if s.kind == "region" and s.rank == ranks[0] and (s.end - s.start) * 1e3 > end_ms * 0.03:
            ax.text(((s.start + s.end) / 2 - t0) * 1e3, top + 0.1, "fwd" if s.direction == "fwd" else "bwd",
                    ha="center", va="bottom", fontsize=8, color="#555555")
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=9)
    ax.set_ylim(-0.3, top + 0.6)
    ax.set_xlim(0, end_ms * 1.01)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", linestyle=":", alpha=0.6, zorder=1)
    handles = [Patch(facecolor=c, edgecolor="black", label=f"{p} ({k})") for (k, p), c in
               sorted(used.items(), key=lambda kv: (kv[0][0] != "compute", kv[0][1]))]
    handles += [Patch(facecolor="white", edgecolor="black", hatch="///", label="backward"),
                Patch(facecolor="#eeeeee", label="fwd envelope"), Patch(facecolor="#dde5ee", label="bwd envelope")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or "moe_comm timeline (labels: D dispatch, E experts, C combine + chunk)", fontsize=10)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


# ==================================================================== entry point
def _error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)


def _jsonable(obj: Any) -> Any:
    """Strict JSON: non-finite floats (beta = inf on one rank) become None, keys become str."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def profile_main(opts: Dict[str, Any], out_dir: str) -> int:
    """Run the profile and write ``out_dir``/{trace.json, timeline.png, profile.json}; print the diagnosis.

    opts: see ``DEFAULT_OPTS``. With ``opts["link"]`` (e.g. "1gbit") the whole run happens in a fresh
    network namespace with a shaped loopback (``slow_link.run_on_slow_link``, needs root).
    Returns the exit code: 0 done (also on non-zero ranks under torchrun), 1 the run failed (a rank
    raised, the link could not be set up, timeout), 2 invalid options.
    """
    try:
        opts = normalize_opts(opts)
    except (TypeError, ValueError) as err:
        _error(str(err))
        return 2
    from moe_comm.tools.launch import launched_by_torchrun, run_ranks

    if opts["link"]:
        if launched_by_torchrun():
            _error("link emulation spawns its own ranks; do not combine it with torchrun")
            return 2
        from moe_comm.tools.slow_link import link_available, run_on_slow_link
        ok, why = link_available()
        if not ok:
            _error(why)
            return 1
        inner = {**opts, "link": None, "link_delay": None, "emulated_link": opts["link"]
                 + (f" + {opts['link_delay']} delay" if opts["link_delay"] else "")}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        cmd = [sys.executable, "-m", "moe_comm.tools.diagnose", json.dumps(inner), os.path.abspath(out_dir)]
        try:
            return run_on_slow_link(cmd, rate=opts["link"], delay=opts["link_delay"], env=env,
                                    timeout=opts["timeout_s"])
        except Exception as err:  # noqa: BLE001 -- setup failures and timeouts become exit code 1
            _error(f"profile on the emulated link failed: {err}")
            return 1
    try:
        result = run_ranks(profile_rank, opts["world_size"], opts)
    except Exception as err:  # noqa: BLE001 -- a rank's failure becomes exit code 1
        _error(f"profile run failed: {err}")
        return 1
    if result is None:  # a non-zero rank under torchrun: rank 0 reports
        return 0
    d = diagnose(result)
    print(format_diagnosis(d))
    os.makedirs(out_dir, exist_ok=True)
    spans = [Span(**s) for s in result["spans"]]
    paths = {name: os.path.join(out_dir, name) for name in ("trace.json", "timeline.png", "profile.json")}
    to_chrome_trace(spans, paths["trace.json"])
    plot_timeline(spans, paths["timeline.png"], title=d.header)
    with open(paths["profile.json"], "w") as f:
        json.dump(_jsonable({"result": result, "diagnosis": d.as_dict()}), f, indent=1)
    print("wrote " + ", ".join(paths.values()))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m moe_comm.tools.diagnose OPTS_JSON OUT_DIR``: what ``profile_main`` runs inside the namespace."""
    p = argparse.ArgumentParser(prog="python -m moe_comm.tools.diagnose", description=main.__doc__)
    p.add_argument("opts", help=f"JSON object of options; keys: {', '.join(DEFAULT_OPTS)}")
    p.add_argument("out_dir", help="where trace.json, timeline.png and profile.json go")
    ns = p.parse_args(argv)
    try:
        opts = json.loads(ns.opts)
    except json.JSONDecodeError as err:
        _error(f"opts must be a JSON object, got {ns.opts!r} ({err})")
        return 2
    return profile_main(opts, ns.out_dir)


if __name__ == "__main__":
    sys.exit(main())
