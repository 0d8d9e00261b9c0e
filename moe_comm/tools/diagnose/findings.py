"""Where a profiled step's time goes (pure): ``diagnose(result) -> Diagnosis``.

Shapes legend: T tokens per rank, H hidden, F expert FFN size, E experts (global), e = E / W local
experts, K top-k, W EP world size, C chunks, R rows received by a rank.

``result`` is what ``collect.profile_rank`` returns (or a synthetic dict with the same keys: the
findings are unit-tested on hand-laid spans). Findings, in order: is compute saturated; what share of
the step is communication; which collective costs most; hidden vs exposed (and the overlap efficiency
eta measured on this machine); bandwidth- or latency-bound; which ranks are slow and whether that
follows expert load. Then ONE suggestion with a predicted gain (``suggest``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence

from moe_comm.dispatch.autotune import BETA_MAX
from moe_comm.profiling import Span, overlap_report
from moe_comm.tools.diagnose import wire
from moe_comm.tools.diagnose.suggest import Suggestion, mb, ms, suggest

__all__ = ["Finding", "Diagnosis", "diagnose", "SATURATED_RATIO", "COMM_DOMINANT_SHARE", "SLOW_RANK_RATIO",
           "LOAD_CORRELATION"]

# Thresholds of the verdicts. Judgement calls, not measurements; each names what it compares.
SATURATED_RATIO = 0.7       # expert GEMM FLOP rate / plain GEMM rate at or above this: compute saturated
COMM_DOMINANT_SHARE = 0.5   # comm union / step above this: "communication dominates"
SLOW_RANK_RATIO = 1.1       # a rank's compute / mean compute above this: "slow rank"
LOAD_CORRELATION = 0.7      # corr(compute, rows received) at or above this: slowness follows load
_FLAT_FIT_BETA = BETA_MAX   # autotune.fit_link's bound: where it stands, the bandwidth was not measurable


@dataclass
class Finding:
    """One answer of the diagnosis: ``key`` (stable id), ``title`` (the question), ``verdict`` (one
    sentence), ``numbers`` (what the verdict is based on; seconds are per step)."""

    key: str
    title: str
    verdict: str
    numbers: Dict[str, Any] = field(default_factory=dict)


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


def _pearson(a: Sequence[float], b: Sequence[float]) -> Optional[float]:
    n = len(a)
    if n < 2:
        return None
    mean_a, mean_b = sum(a) / n, sum(b) / n
    va = sum((x - mean_a) ** 2 for x in a)
    vb = sum((y - mean_b) ** 2 for y in b)
    if va <= 0 or vb <= 0:
        return None
    return sum((x - mean_a) * (y - mean_b) for x, y in zip(a, b)) / math.sqrt(va * vb)


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


_RESULT_KEYS = ("spans", "steps", "ranks", "world_size", "num_chunks", "tokens", "hidden", "ffn", "experts", "top_k",
                "element_size", "alpha_s", "beta_bytes_per_s", "overlap_efficiency")


def diagnose(result: Dict[str, Any]) -> Diagnosis:
    """Diagnose a ``profile_rank`` result (or a synthetic dict with the same keys). Pure.

    Every seconds figure in the findings is per step (totals over the timed steps / ``steps``), a mean
    over ranks unless the name says otherwise. Findings, in order: compute, comm_share, collective,
    overlap, link, ranks; then the suggestion.
    Raises ValueError when a key ``profile_rank`` writes is missing or nothing was recorded.
    """
    missing = [k for k in _RESULT_KEYS if k not in result]
    if missing:
        raise ValueError(f"result lacks {', '.join(missing)} (a profile_rank result has them all)")
    if wire.dedup_on(result) and not wire.has_dedup_rows(result):
        raise ValueError("result has dedup=True but its ranks lack rows_sent_dedup / rows_recv_dedup (a "
                         "profile_rank result has them): the bytes of one copy per rank cannot be known")
    spans = [s if isinstance(s, Span) else Span(**s) for s in result["spans"]]
    if not spans:
        raise ValueError("result['spans'] is empty: nothing was recorded (was the timeline enabled?)")
    steps = result["steps"]
    report = overlap_report(spans, per_step=False)  # sums over the timed steps: divided by ``steps`` below
    windows = _step_windows(spans)
    ctx = _Ctx(result=result, spans=spans, report=report, ranks_info=sorted(result["ranks"], key=lambda d: d["rank"]),
               windows=windows, steps=steps, step_s=_mean(windows.values()) / steps,
               comm_s=report["overall"]["T_comm"] / steps, compute_s=report["overall"]["T_compute"] / steps)
    findings = [_finding_compute(ctx), _finding_comm_share(ctx), _finding_collective(ctx), _finding_overlap(ctx),
                _finding_link(ctx), _finding_ranks(ctx)]
    suggestion = suggest(result, ctx.step_s, findings[4].numbers)
    r, o = result, result.get("opts", {})
    dims = (f"W={r['world_size']} T={r['tokens']} H={r['hidden']} F={r['ffn']} E={r['experts']} K={r['top_k']} "
            f"C={r['num_chunks']} {o.get('dtype', '')} workload={o.get('workload', '?')}"
            + (" fp8-dispatch" if wire.fp8_on(r) else "") + (" dedup" if wire.dedup_on(r) else ""))
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
    v += (f"; in the step the forward experts (with their regroup) took {ms(in_step)} vs {ms(bare)} bare "
          f"({n['in_step_over_bare']:.2f}x)")
    return Finding("compute", "Is compute saturated?", v, n)


def _finding_comm_share(ctx: _Ctx) -> Finding:
    """2. What share of the step has a collective in flight (comm union / forward+backward envelope)."""
    step_s, union_s = ctx.step_s, ctx.report["overall"]["T_step"] / ctx.steps
    share = ctx.comm_s / step_s if step_s > 0 else 0.0
    n = {"step_s": step_s, "comm_s": ctx.comm_s, "compute_s": ctx.compute_s, "comm_share": share,
         "compute_share": ctx.compute_s / step_s if step_s > 0 else 0.0,
         "untracked_s": max(step_s - union_s, 0.0), "step_wall_rank0_s": _mean(ctx.result.get("step_s") or [0.0])}
    v = (f"{share:.0%} of the {ms(step_s)} step has a collective in flight ({ms(ctx.comm_s)}); compute spans "
         f"cover {ms(ctx.compute_s)} ({n['compute_share']:.0%}); {ms(n['untracked_s'])} is neither "
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
    v = (f"{top['phase']} ({top['direction']}): {ms(top['time_s'])} per step, "
         f"{top['time_s'] / ctx.comm_s:.0%} of the comm time")
    if top["phase"] == "counts":
        v += ("; the counts exchange is the layer's one host sync, so its time is mostly ranks waiting for the "
              "slowest one to reach it")
    elif top["phase"] == "control":
        v += ("; the control exchange is a small fixed-size header, so its time is mostly ranks waiting for the "
              "slowest one to reach it")
    return Finding("collective", "Which collective costs most?", v, {"collectives": rows})


def _finding_overlap(ctx: _Ctx) -> Finding:
    """4. Hidden (covered by a compute span on the same rank) vs exposed comm."""
    o = ctx.report["overall"]
    hidden, exposed = o["hidden"] / ctx.steps, o["exposed"] / ctx.steps
    C, eta = ctx.result["num_chunks"], float(ctx.result["overlap_efficiency"])
    n = {"hidden_s": hidden, "exposed_s": exposed, "overlap_fraction": o["overlap_fraction"],
         "exposed_share_of_step": exposed / ctx.step_s if ctx.step_s > 0 else 0.0, "num_chunks": C,
         "overlap_efficiency": eta, "overlap_probe_bytes": ctx.result.get("overlap_probe_bytes")}
    v = (f"{ms(hidden)} hidden behind compute, {ms(exposed)} exposed ({n['exposed_share_of_step']:.0%} of the "
         f"step); overlap fraction {o['overlap_fraction']:.0%} of the possible")
    if C == 1:
        v += " (num_chunks=1: nothing to overlap the all-to-alls with but the router/layout)"
    v += (f"; this machine delivers {eta:.0%} of an ideal overlap (an all-to-all under a GEMM of equal length, "
          f"as num_chunks=\"auto\" measures it), and every prediction below uses that")
    return Finding("overlap", "How much of it is hidden?", v, n)


def _finding_link(ctx: _Ctx) -> Finding:
    """5. Bandwidth- or latency-bound: a chunk's message (busiest rank, max of sent and received bytes
    per all-to-all / C; with FP8 dispatch or dedup in the run the mean over the step's four transfers,
    ``wire.mean_bytes_per_a2a``) against the knee alpha * beta of the fit."""
    alpha, beta = float(ctx.result["alpha_s"]), float(ctx.result["beta_bytes_per_s"])
    C, W = ctx.result["num_chunks"], ctx.result["world_size"]
    bytes_busy = wire.mean_bytes_per_a2a(ctx.result, fp8=wire.fp8_on(ctx.result), dedup=wire.dedup_on(ctx.result))
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
                 f"sizes at alpha {alpha * 1e6:.0f} us); a chunk's message is {mb(msg)}; measured "
                 f"dispatch/combine spans average {ms(measured)}")
        else:
            v = (f"{regime}-bound: a chunk's message is {mb(msg)} vs the knee alpha*beta = {mb(knee)} "
                 f"(alpha {alpha * 1e6:.0f} us, beta {beta / 1e9:.3f} GB/s), so {bw_frac:.0%} of a predicted "
                 f"{ms(predicted)} all-to-all is bytes; measured dispatch/combine spans average {ms(measured)}")
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
        v = f"rank {slowest} is slow: compute {ms(comp[slowest])} per step, {spread:.2f}x the mean"
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
