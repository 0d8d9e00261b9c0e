"""The one change to suggest, and the predicted gain of every candidate (pure).

Shapes legend: T tokens per rank, H hidden, E experts (global), e = E / W local experts, W EP world
size, C chunks.

Every prediction is ``moe_comm.dispatch.autotune.predict_step``, the model ``num_chunks="auto"``
chooses by, with the overlap efficiency eta measured on this machine (``result["overlap_efficiency"]``,
``autotune.measure_overlap``): per chunk an all-to-all costs alpha + bytes / (C * beta), the experts
X / C + kappa, dispatch and combine share the link, backward is twice the forward's compute, and only
eta of the ideal overlap is real. Inputs: X = the slowest rank's bare forward experts, B = the busiest
rank's bytes per all-to-all (max of sent and received; with FP8 dispatch or dedup in the run, the mean
over the step's four transfers, ``wire.mean_bytes_per_a2a``), kappa = the largest per-chunk overhead;
with dedup in the run, alpha x ``wire.DEDUP_ALPHA_FACTOR`` (its two extra exchanges per chunk).

Only levers the library has are suggested: ``num_chunks`` (a C, or "auto"), rebalancing the experts
(``layer.rebalance`` / ``moe_comm.placement.plan_placement``, with aux-loss-free balancing,
``MoELayer(bias_update_rate=...)``, named as the routing-side alternative), more tokens per step, and,
when the run had them off, FP8 dispatch (``MoEConfig(dispatch_dtype=torch.float8_e4m3fn)``) and one copy
per (token, rank) (``MoEConfig(dedup=True)``). The model has one B for the step's four transfers
(forward dispatch and combine, their two backward transfers), so FP8, which shrinks only the forward
dispatch, enters as the mean of the four (``wire.mean_bytes_per_a2a``: (packed_width(H) / (H x element
size) + 3) / 4 of B); dedup scales all four by the distinct (token, rank) rows of the profiled routing
over its routed rows, adds its metadata bytes, and counts its two extra exchanges per chunk as alpha x
``wire.DEDUP_ALPHA_FACTOR``. Neither the quantize / dequantize passes of FP8 nor the expansion
pass of dedup on the experts' ranks is in the model (compute X is unchanged).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from moe_comm.dispatch.autotune import choose_num_chunks, predict_step
from moe_comm.tools.diagnose import wire

__all__ = ["Suggestion", "suggest", "MIN_GAIN_SHARE", "IMBALANCE_RATIO", "TOKENS_FACTOR", "ms", "mb"]

# Thresholds. Judgement calls, not measurements; each names what it compares.
MIN_GAIN_SHARE = 0.03   # a suggestion must be predicted to save >= 3% of the step, else "keep"
IMBALANCE_RATIO = 1.2   # busiest rank's rows / mean rows above this: rebalance candidate
REPLICA_MARGIN = 0.97   # replicas (memory, a gradient sync) only when they cut the busiest load 3% more
TOKENS_FACTOR = 2       # "more tokens per step" is modelled at this many times the tokens


def ms(s: float) -> str:
    """Seconds as the diagnosis' texts write them: 0.0123 -> "12.30 ms"."""
    return f"{s * 1e3:.2f} ms"


def mb(b: float) -> str:
    """Bytes as the diagnosis' texts write them: 512000 -> "0.51 MB", 2048 -> "2.0 kB"."""
    return f"{b / 1e6:.2f} MB" if b >= 1e5 else f"{b / 1e3:.1f} kB"


@dataclass
class Suggestion:
    """The one change to make. action: "chunks" | "rebalance" | "tokens" | "fp8" | "dedup" | "keep".
    predicted_gain_s: model-predicted seconds saved per step (for "tokens": per the current step's T tokens, i.e. a
    throughput gain; the step itself grows); predicted_step_s: measured step minus that gain.
    alternatives: every candidate considered, with its predicted gain, largest first."""

    action: str
    text: str
    predicted_gain_s: float
    predicted_step_s: float
    numbers: Dict[str, Any] = field(default_factory=dict)
    alternatives: List[Dict[str, Any]] = field(default_factory=list)


def _chunks(model: Callable[..., float], C: int, X: float, B: float, alpha: float, beta: float, kappa: float,
            eta: float) -> Optional[Dict[str, Any]]:
    """The C ``choose_num_chunks`` picks with the measured eta, when it differs from C and the model
    predicts it faster (a C outside its candidates may already be best)."""
    plan = choose_num_chunks(X, B, alpha, beta, kappa, overlap=eta)
    pred = dict(plan.predicted_s)
    base = pred[C] = model(C, X, B)
    best = plan.num_chunks
    if best == C or not pred[best] < base:
        return None
    return {"action": "chunks", "gain_s": base - pred[best],
            "text": (f"use num_chunks={best} ({'more' if best > C else 'fewer'} chunks than {C}; num_chunks=\"auto\" "
                     f"chooses by this model from its own measurements): with the measured overlap efficiency "
                     f"{eta:.2f} the model predicts {ms(pred[best])} vs {ms(base)} for the experts + all-to-alls"),
            "numbers": {"current_C": C, "best_C": best, "overlap_efficiency": eta,
                        "predicted_s": {str(k): v for k, v in sorted(pred.items())}}}


def _rebalance(model: Callable[..., float], ranks_info: List[Dict[str, Any]], C: int, X: float, B: float,
               row_bytes: int, wire_scale: float = 1.0) -> Optional[Dict[str, Any]]:
    """``plan_placement`` on the measured per-expert load, without replicas and with one spare slot per
    rank; the model's step with the busiest rank's expert time and received bytes scaled to the plan's
    busiest rank (logical bytes x ``wire_scale``: the run's wire format, as B is)."""
    from moe_comm.placement import plan_placement

    W = len(ranks_info)
    loads_W = [d["rows_recv"] for d in ranks_info]
    load_E = [x for d in ranks_info for x in d["rows_recv_per_expert"]]
    mean_load, max_load = sum(loads_W) / W, max(loads_W)
    if W < 2 or mean_load <= 0 or max_load / mean_load <= IMBALANCE_RATIO:
        return None
    plans = {R: plan_placement([load_E], W, R) for R in (0, W) if R <= len(load_E) * (W - 1)}
    top = {R: float(p.predicted_rank_load.max()) for R, p in plans.items()}
    R = W if W in top and top[W] < REPLICA_MARGIN * top[0] else 0
    X_bal = X * top[R] / max_load
    B_bal = max(max(d["bytes_sent"] for d in ranks_info), top[R] * row_bytes) * wire_scale
    call = (f"layer.rebalance(num_replicas={R}), then layer.sync_replica_grads() after every backward," if R
            else "layer.rebalance()")
    return {"action": "rebalance", "gain_s": model(C, X, B) - model(C, X_bal, B_bal),
            "text": (f"rebalance the experts: {call} (moe_comm.placement.plan_placement on the load history) "
                     f"takes the busiest rank from {max_load / mean_load:.2f}x to {top[R] / mean_load:.2f}x the "
                     f"mean rows, so its experts take {ms(X_bal)} instead of {ms(X)} per forward; while "
                     f"training, MoELayer(bias_update_rate=...) (aux-loss-free balancing) evens the routing "
                     f"itself instead (not modelled here)"),
            "numbers": {"load_max_over_mean": max_load / mean_load, "planned_max_over_mean": top[R] / mean_load,
                        "num_replicas": R, "expert_fwd_s": X, "expert_fwd_balanced_s": X_bal,
                        "bytes_per_a2a": B, "bytes_per_a2a_balanced": B_bal}}


def _more_tokens(model: Callable[..., float], link: Dict[str, Any], C: int, T: int, X: float,
                 B: float) -> Optional[Dict[str, Any]]:
    """Latency-bound all-to-alls: TOKENS_FACTOR x the tokens per step spreads alpha and kappa over more
    tokens (X and B scale linearly, which ignores the larger GEMMs' better efficiency)."""
    if link["regime"] != "latency":
        return None
    f = TOKENS_FACTOR
    big = model(C, f * X, f * B)
    base = model(C, X, B)
    return {"action": "tokens", "gain_s": base - big / f,
            "text": (f"more tokens per step: the all-to-alls are latency-bound (a chunk's message "
                     f"{mb(link['message_bytes'])} is below the knee {mb(link['knee_bytes'])}), so every step pays "
                     f"the fixed costs whatever its size; with {f}x the tokens (T={f * T} per rank) the model "
                     f"predicts {ms(big)} per step, {ms(big / f)} per {T} tokens instead of {ms(base)}"),
            "numbers": {"tokens_factor": f, "tokens": T, "predicted_big_step_s": big,
                        "predicted_per_current_tokens_s": big / f}}


def _fp8(model: Callable[..., float], result: Dict[str, Any], C: int, X: float,
         B: float) -> Optional[Dict[str, Any]]:
    """FP8 dispatch, when the run had it off (and there is a link): the forward dispatch's rows shrink to
    packed_width(H) bytes; B becomes the four transfers' mean (``wire.mean_bytes_per_a2a``)."""
    if wire.fp8_on(result) or result["world_size"] < 2:
        return None
    B8 = wire.mean_bytes_per_a2a(result, fp8=True, dedup=wire.dedup_on(result))
    row, packed = result["hidden"] * result["element_size"], wire.fp8_row_bytes(result)
    scales = result.get("dispatch_scales", "fp32")
    base, fast = model(C, X, B), model(C, X, B8)
    dtype = (result.get("opts") or {}).get("dtype") or f"{result['element_size']}-byte elements"
    return {"action": "fp8", "gain_s": base - fast,
            "text": ("FP8 dispatch: MoEConfig(dispatch_dtype=torch.float8_e4m3fn"
                     + (", dispatch_scales=\"ue8m0\")" if scales == "ue8m0" else ")")
                     + f": each forward dispatch row travels as {packed} bytes instead of {row} "
                     f"({packed / row:.2f}x; combine and the backward stay in {dtype}), so the step's all-to-alls "
                     f"carry {mb(B8)} instead of {mb(B)} on average and the model predicts {ms(fast)} vs "
                     f"{ms(base)} for the experts + all-to-alls (the quantize / dequantize passes not included). "
                     f"Accuracy cost: e4m3 keeps 3 mantissa bits, so the rows the experts see carry up to ~2^-4 "
                     f"(6%) relative error per element (one scale per 128 elements; the gradient passes straight "
                     f"through); compare the loss curve with and without it before keeping it"),
            "numbers": {"row_bytes": row, "fp8_row_bytes": packed, "dispatch_scales": scales,
                        "bytes_per_a2a": B, "bytes_per_a2a_fp8": B8, "predicted_fp8_s": fast}}


def _dedup(model: Callable[..., float], result: Dict[str, Any], C: int, X: float, B: float,
           alpha: float) -> Optional[Dict[str, Any]]:
    """One copy per (token, rank), when the run had it off, the result carries the distinct rows and some
    token has two experts on one rank: every transfer scales by distinct / routed rows
    (``wire.mean_bytes_per_a2a``), alpha by ``wire.DEDUP_ALPHA_FACTOR``."""
    if wire.dedup_on(result) or result["world_size"] < 2 or not wire.has_dedup_rows(result):
        return None
    ratio = wire.dedup_ratio(result)
    if ratio >= 1.0:
        return None
    Bd = wire.mean_bytes_per_a2a(result, fp8=wire.fp8_on(result), dedup=True)
    base, fast = model(C, X, B), model(C, X, Bd, alpha * wire.DEDUP_ALPHA_FACTOR)
    K = result["top_k"]
    return {"action": "dedup", "gain_s": base - fast,
            "text": (f"one copy per (token, rank): MoEConfig(dedup=True): in the profiled routing the distinct "
                     f"(token, destination rank) pairs are {ratio:.0%} of the routed rows, so every transfer of "
                     f"the step carries that share (plus {2 * K} ids and weights per row forward, {K} weight "
                     f"gradients back, and two small all-to-alls per chunk): {mb(Bd)} instead of {mb(B)} per "
                     f"all-to-all, and the model predicts {ms(fast)} vs {ms(base)} for the experts + all-to-alls "
                     f"(the experts' ranks expand each row to their experts and sum the outputs: that pass is "
                     f"not included). Exact: the same sums, in slot order"),
            "numbers": {"dedup_rows_ratio": ratio, "bytes_per_a2a": B, "bytes_per_a2a_dedup": Bd,
                        "alpha_dedup_s": alpha * wire.DEDUP_ALPHA_FACTOR, "predicted_dedup_s": fast}}


def suggest(result: Dict[str, Any], step_s: float, link: Dict[str, Any]) -> Suggestion:
    """Every applicable candidate with its predicted gain; the largest wins if it saves at least
    MIN_GAIN_SHARE of the measured step ``step_s`` ("tokens" only when no other candidate does).
    Gains are differences of one model (so part of its error cancels), all with the measured eta.
    link: the "link" finding's numbers (alpha, beta, regime, knee, the busiest rank's bytes per
    all-to-all). ``alternatives`` lists every candidate, largest gain first."""
    ranks_info = sorted(result["ranks"], key=lambda d: d["rank"])
    alpha, beta = link["alpha_s"], link["beta_bytes_per_s"]
    eta = float(result["overlap_efficiency"])
    C, T = result["num_chunks"], result["tokens"]
    X = max(d["expert_fwd_s"] for d in ranks_info)
    kappa = max(d["kappa_s"] for d in ranks_info)
    # the run's wire format: B the mean bytes of its four transfers, alpha with dedup's two extra exchanges
    B = wire.mean_bytes_per_a2a(result, fp8=wire.fp8_on(result), dedup=wire.dedup_on(result))
    logical = max(max(d["bytes_sent"], d["bytes_recv"]) for d in ranks_info)
    wire_scale = B / logical if logical > 0 else 1.0  # 1 with FP8 and dedup off
    alpha_run = alpha * (wire.DEDUP_ALPHA_FACTOR if wire.dedup_on(result) else 1.0)

    def model(C_: int, X_: float, B_: float, alpha_: float = alpha_run) -> float:
        return predict_step(C_, X_, B_, alpha_, beta, kappa, overlap=eta)

    base = model(C, X, B)
    found = (_chunks(model, C, X, B, alpha_run, beta, kappa, eta),
             _rebalance(model, ranks_info, C, X, B, result["hidden"] * result["element_size"], wire_scale),
             _more_tokens(model, link, C, T, X, B),
             _fp8(model, result, C, X, B),
             _dedup(model, result, C, X, B, alpha))
    cands = sorted((c for c in found if c is not None), key=lambda c: -c["gain_s"])
    for c in cands:
        c["predicted_step_s"] = step_s - c["gain_s"]
    model_numbers = {"model_current_s": base, "measured_step_s": step_s, "alpha_s": alpha,
                     "alpha_model_s": alpha_run, "beta_bytes_per_s": beta, "overlap_efficiency": eta,
                     "expert_fwd_s": X, "kappa_s": kappa, "bytes_per_a2a": B}
    alts = [{k: c[k] for k in ("action", "gain_s", "predicted_step_s")} for c in cands]
    enough = [c for c in cands if c["gain_s"] >= MIN_GAIN_SHARE * step_s]
    # More tokens changes the batch (and the optimisation), so it is the fallback: a lever that keeps
    # the batch and saves MIN_GAIN_SHARE is suggested first.
    enough.sort(key=lambda c: (c["action"] == "tokens", -c["gain_s"]))
    if enough:
        best = enough[0]
        return Suggestion(action=best["action"], text=best["text"], predicted_gain_s=best["gain_s"],
                          predicted_step_s=best["predicted_step_s"], numbers={**model_numbers, **best["numbers"]},
                          alternatives=alts)
    why = (f"no candidate is predicted to save {MIN_GAIN_SHARE:.0%} of the step"
           + (f" (best: {cands[0]['action']}, {ms(cands[0]['gain_s'])})" if cands else " (none applies)"))
    return Suggestion(action="keep", text=f"keep the current setup: {why}", predicted_gain_s=0.0,
                      predicted_step_s=step_s, numbers=model_numbers, alternatives=alts)
