"""Overlap analysis of timeline spans: hidden vs exposed communication, per rank, layer and phase.

Pure functions of a list of ``Span`` (see ``timeline.py``). Per rank: T_compute = length of the union of its
compute spans, T_comm = union of its comm spans, hidden = length of (comm union) ∩ (compute union),
exposed = T_comm - hidden, overlap_fraction = hidden / min(T_comm, T_compute) (0 when the min is 0),
T_step = T_compute + T_comm - hidden (the length of the union of both), wall = last end - first start.
Region spans ("forward", "backward") count only towards wall.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Sequence, Tuple

from moe_comm.profiling.timeline import DIRECTIONS, TRACK_ORDER, Span, check_spans

__all__ = ["overlap_report"]


# ==================================================================== interval maths
def _union(intervals: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """Sorted, disjoint union. Example: [(0, 2), (1, 3), (5, 6)] -> [(0, 3), (5, 6)]."""
    out: List[List[float]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(union: Sequence[Tuple[float, float]]) -> float:
    return sum(e - s for s, e in union)


def _intersection(a: Sequence[Tuple[float, float]], b: Sequence[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """Intersection of two sorted disjoint unions (two pointers).
    Example: [(0, 3), (5, 6)] ∩ [(2, 5.5)] -> [(2, 3), (5, 5.5)]."""
    i = j = 0
    out = []
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


# ==================================================================== per rank, layer, phase
def _fraction(hidden: float, t_comm: float, t_compute: float) -> float:
    m = min(t_comm, t_compute)
    return hidden / m if m > 0 else 0.0


def _rank_stats(spans: List[Span]) -> Dict[str, float]:
    comp = _union((s.start, s.end) for s in spans if s.kind == "compute")
    comm = _union((s.start, s.end) for s in spans if s.kind == "comm")
    t_compute, t_comm = _length(comp), _length(comm)
    hidden = _length(_intersection(comm, comp))
    return {"T_compute": t_compute, "T_comm": t_comm, "hidden": hidden, "exposed": t_comm - hidden,
            "overlap_fraction": _fraction(hidden, t_comm, t_compute), "T_step": t_compute + t_comm - hidden,
            "wall": max(s.end for s in spans) - min(s.start for s in spans)}


def _group_stats(spans: List[Span]) -> Dict[str, Any]:
    """Stats of one group of spans: per rank, their mean over ranks, and per phase."""
    by_rank: Dict[int, List[Span]] = {}
    for s in spans:
        by_rank.setdefault(s.rank, []).append(s)
    per_rank = {r: _rank_stats(by_rank[r]) for r in sorted(by_rank)}
    n = len(per_rank)
    mean = {k: (sum(st[k] for st in per_rank.values()) / n if n else 0.0)
            for k in ("T_compute", "T_comm", "hidden", "exposed")}
    mean["overlap_fraction"] = _fraction(mean["hidden"], mean["T_comm"], mean["T_compute"])
    mean["T_step"] = mean["T_compute"] + mean["T_comm"] - mean["hidden"]
    mean["wall"] = (max(s.end for s in spans) - min(s.start for s in spans)) if spans else 0.0
    slowest = max(per_rank, key=lambda r: (per_rank[r]["wall"], -r)) if per_rank else None

    # Per phase: its own union per rank; "overlapped" = the part covered by the other kind's union
    # (for a comm phase, its hidden time; for a compute phase, the time it ran with comm in flight).
    phases: Dict[Tuple[str, str], Dict[str, float]] = {}
    for r, rs in by_rank.items():
        unions = {k: _union((s.start, s.end) for s in rs if s.kind == k) for k in ("compute", "comm")}
        for key in {(s.phase, s.kind) for s in rs}:
            mine = [s for s in rs if (s.phase, s.kind) == key]
            u = _union((s.start, s.end) for s in mine)
            other = {"compute": unions["comm"], "comm": unions["compute"]}.get(key[1], [])
            acc = phases.setdefault(key, {"time": 0.0, "overlapped": 0.0, "count": 0})
            acc["time"] += _length(u)
            acc["overlapped"] += _length(_intersection(u, other))
            acc["count"] += len(mine)
    phase_rows = []
    for (phase, kind), acc in phases.items():
        t, o = acc["time"] / n, acc["overlapped"] / n
        phase_rows.append({"phase": phase, "kind": kind, "time": t, "overlapped": o, "exposed": t - o,
                           "count": acc["count"]})
    phase_rows.sort(key=lambda p: (TRACK_ORDER.get(p["kind"], 9), -p["time"], p["phase"]))
    return {**mean, "num_ranks": n, "num_spans": len(spans), "slowest_rank": slowest,
            "per_rank": per_rank, "phases": phase_rows}


def overlap_report(spans: Iterable[Span]) -> Dict[str, Any]:
    """Hidden vs exposed communication, overall and per (layer, direction).

    Args:
        spans: Spans of one or many ranks (e.g. ``Timeline.gather()``); seconds.
    Returns: {"overall": stats, "layers": [{"layer": L, "direction": d, **stats}, ...]} (sorted), where
        stats = {"T_compute", "T_comm", "hidden", "exposed", "T_step": means over the ranks present;
        "overlap_fraction": hidden / min(T_comm, T_compute) of those means (0 if the min is 0);
        "wall": last end - first start over all ranks; "num_ranks", "num_spans";
        "slowest_rank": rank with the largest own wall (None if no spans);
        "per_rank": {rank: the same keys for that rank alone};
        "phases": [{"phase", "kind", "time" (union, mean over ranks), "overlapped" (covered by the
                    other kind: hidden for comm phases), "exposed", "count"}]}.
    Region spans count only towards "wall". Example: compute [0, 2], comm [1, 4] on one rank ->
    T_compute 2, T_comm 3, hidden 1, exposed 2, overlap_fraction 0.5, T_step 4, wall 4.
    """
    spans = check_spans(spans)
    groups: Dict[Tuple[int, str], List[Span]] = {}
    for s in spans:
        groups.setdefault((s.layer, s.direction), []).append(s)
    layers = [{"layer": layer, "direction": d, **_group_stats(groups[(layer, d)])}
              for layer, d in sorted(groups, key=lambda k: (k[0], DIRECTIONS.index(k[1])
                                                            if k[1] in DIRECTIONS else 9, k[1]))]
    return {"overall": _group_stats(spans), "layers": layers}
