"""Bytes per all-to-all as the step model sees them, for each wire format (pure).

Shapes legend: H hidden, K top-k, C chunks, W EP world size.

A training step moves rows four times per chunk: forward, dispatch (to the experts' ranks) and combine
(back); backward, the gradient of combine (the dispatch way) and the input gradient (back).
- FP8 dispatch (``dispatch_dtype=torch.float8_e4m3fn``) shrinks only the forward dispatch: its rows are
  packed rows of ``ops.packed_width(H)`` bytes (payload and block scales) instead of H x element size;
  combine and both backward transfers stay in x's dtype.
- Dedup (one copy per (token, destination rank)) shrinks all four to the distinct (token, rank) rows,
  adds the slot metadata per row ([2K] local ids and weights forward with the rows, [K] weight
  gradients back with the input gradient, in the weights' dtype) and two small all-to-alls per chunk
  (that metadata's own transfers, one forward, one backward).

``autotune.predict_step`` has one B for all four transfers (dispatch and combine share the link), so B
here is the busiest rank's mean over the four of max(sent, received) bytes: the total bytes of the step
are exact, how they split between overlapped and exposed transfers is the model's average. Dedup's two
extra exchanges enter as alpha: 6C transfers per step where the model counts 4C, so its alpha is
DEDUP_ALPHA_FACTOR = 6 / 4 times the fitted one (whatever C the model tries). With both formats off, B
is the busiest rank's max(bytes_sent, bytes_recv), the link finding's figure.

Inputs (``collect.profile_rank``'s result; a synthetic one may omit the optional keys): "hidden",
"element_size", "top_k", "ranks" (each with "bytes_sent", "bytes_recv", logical, per step, and for dedup
"rows_sent", "rows_recv", "rows_sent_dedup", "rows_recv_dedup": routed and distinct (token, rank) rows,
mean per step), optional "dispatch_dtype" (None or "float8_e4m3fn"), "dispatch_scales" ("fp32"
default), "dedup" (False default), "weight_element_size" (4 default: float32 routing weights).
"""
from __future__ import annotations

from typing import Any, Dict

__all__ = ["DEDUP_ALPHA_FACTOR", "fp8_on", "dedup_on", "has_dedup_rows", "fp8_row_bytes", "dedup_ratio",
           "mean_bytes_per_a2a"]

# dedup: per chunk and step, rows + metadata forward, rows back; gradient rows forward, gradient rows +
# weight gradients back: 6 transfers where predict_step counts 4, so 6 / 4 of alpha per modelled transfer
DEDUP_ALPHA_FACTOR = 6 / 4


def fp8_on(result: Dict[str, Any]) -> bool:
    """The profiled run dispatched in FP8."""
    return result.get("dispatch_dtype") is not None


def dedup_on(result: Dict[str, Any]) -> bool:
    """The profiled run sent one copy per (token, rank)."""
    return bool(result.get("dedup", False))


def has_dedup_rows(result: Dict[str, Any]) -> bool:
    """The result carries every rank's distinct (token, rank) rows (what dedup's bytes are computed from)."""
    return all("rows_sent_dedup" in d and "rows_recv_dedup" in d for d in result["ranks"])


def fp8_row_bytes(result: Dict[str, Any]) -> int:
    """Bytes of one packed FP8 row of H elements with the result's scales: ``ops.packed_width``.
    Example: H = 512, fp32 scales -> 528 (vs 2048 in float32)."""
    from moe_comm import ops

    return int(result.get("fp8_row_bytes") or ops.packed_width(result["hidden"],
                                                              ue8m0=result.get("dispatch_scales") == "ue8m0"))


def dedup_ratio(result: Dict[str, Any]) -> float:
    """Distinct (token, rank) rows / routed rows, over all ranks (1.0: no token has two experts on a rank)."""
    routed = sum(d["rows_sent"] for d in result["ranks"])
    return sum(d["rows_sent_dedup"] for d in result["ranks"]) / routed if routed > 0 else 1.0


def mean_bytes_per_a2a(result: Dict[str, Any], *, fp8: bool, dedup: bool) -> float:
    """The busiest rank's bytes per all-to-all, mean over a step's four transfers (module docstring), with
    FP8 dispatch and / or dedup on or off (whatever the profiled run used: its logical bytes and routing
    give every format's bytes). Example: H = 512 float32, fp8 only: B x (528 / 2048 + 3) / 4 = 0.81 B."""
    row = result["hidden"] * result["element_size"]
    dispatch_row = fp8_row_bytes(result) / row if fp8 else 1.0
    meta = 3 * result["top_k"] * result.get("weight_element_size", 4) / row if dedup else 0.0
    per_row = (dispatch_row + 3.0 + meta) / 4.0  # four transfers: dispatch, combine, 2 backward; [2K] + [K] meta

    def busiest(d: Dict[str, Any]) -> float:
        if not dedup:
            return max(d["bytes_sent"], d["bytes_recv"])
        sent = d["bytes_sent"] * d["rows_sent_dedup"] / d["rows_sent"] if d["rows_sent"] > 0 else 0.0
        recv = d["bytes_recv"] * d["rows_recv_dedup"] / d["rows_recv"] if d["rows_recv"] > 0 else 0.0
        return max(sent, recv)

    return max(busiest(d) for d in result["ranks"]) * per_row
