"""Overlap analysis of timeline spans: hidden vs exposed communication, per step, rank, layer and phase.

Pure functions of a list of ``Span`` (see ``timeline.py``). Per rank and step: T_compute = length of the
union of its compute spans, T_comm = union of its comm spans, hidden = length of (comm union) ∩ (compute
union), exposed = T_comm - hidden, overlap_fraction = hidden / min(T_comm, T_compute) (0 when the min is 0),
T_step = T_compute + T_comm - hidden (the length of the union of both), wall = last end - first start.
Region spans ("forward", "backward") count only towards wall. Figures are per step: the sum over the
counted steps / their number (``per_step=False``: the sums); step 0 (a timeline's first recorded step:
lazy init, kernel builds) is left out when later steps are there.
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
_ADDITIVE = ("T_compute", "T_comm", "hidden", "exposed", "T_step", "wall")


def _fraction(hidden: float, t_comm: float, t_compute: float) -> float:
    m = min(t_comm, t_compute)
    return hidden / m if m > 0 else 0.0


def _rank_stats(spans: List[Span]) -> Dict[str, float]:
    """One rank's figures over ``spans`` (one step)."""
    comp = _union((s.start, s.end) for s in spans if s.kind == "compute")
    comm = _union((s.start, s.end) for s in spans if s.kind == "comm")
    t_compute, t_comm = _length(comp), _length(comm)
    hidden = _length(_intersection(comm, comp))
    return {"T_compute": t_compute, "T_comm": t_comm, "hidden": hidden, "exposed": t_comm - hidden,
            "T_step": t_compute + t_comm - hidden, "wall": max(s.end for s in spans) - min(s.start for s in spans)}


def _group_stats(steps: Sequence[List[Span]], div: int) -> Dict[str, Any]:
    """Stats of one group of spans, given step by step: each figure summed over the steps and divided by
    ``div`` (the number of counted steps, or 1 for sums); per rank, their mean over ranks, and per phase."""
    per_rank: Dict[int, Dict[str, float]] = {}
    walls = 0.0
    phases: Dict[Tuple[str, str], Dict[str, float]] = {}
    num_spans = 0
    for spans in steps:
        if not spans:
            continue
        num_spans += len(spans)
        walls += max(s.end for s in spans) - min(s.start for s in spans)
        by_rank: Dict[int, List[Span]] = {}
        for s in spans:
            by_rank.setdefault(s.rank, []).append(s)
        for r, rs in by_rank.items():
            acc = per_rank.setdefault(r, dict.fromkeys(_ADDITIVE, 0.0))
            for k, v in _rank_stats(rs).items():
                acc[k] += v
            # Per phase: its own union; "overlapped" = the part covered by the other kind's union (for a
            # comm phase, its hidden time; for a compute phase, the time it ran with comm in flight).
            unions = {k: _union((s.start, s.end) for s in rs if s.kind == k) for k in ("compute", "comm")}
            for key in {(s.phase, s.kind) for s in rs}:
                mine = [s for s in rs if (s.phase, s.kind) == key]
                u = _union((s.start, s.end) for s in mine)
                other = {"compute": unions["comm"], "comm": unions["compute"]}.get(key[1], [])
                ph = phases.setdefault(key, {"time": 0.0, "overlapped": 0.0, "count": 0})
                ph["time"] += _length(u)
                ph["overlapped"] += _length(_intersection(u, other))
                ph["count"] += len(mine)
    for st in per_rank.values():
        for k in _ADDITIVE:
            st[k] /= div
        st["overlap_fraction"] = _fraction(st["hidden"], st["T_comm"], st["T_compute"])
    per_rank = {r: per_rank[r] for r in sorted(per_rank)}
    n = len(per_rank)
    mean = {k: (sum(st[k] for st in per_rank.values()) / n if n else 0.0)
            for k in ("T_compute", "T_comm", "hidden", "exposed")}
    mean["overlap_fraction"] = _fraction(mean["hidden"], mean["T_comm"], mean["T_compute"])
    mean["T_step"] = mean["T_compute"] + mean["T_comm"] - mean["hidden"]
    mean["wall"] = walls / div
    slowest = max(per_rank, key=lambda r: (per_rank[r]["wall"], -r)) if per_rank else None
    phase_rows = []
    for (phase, kind), ph in phases.items():
        t, o = ph["time"] / n / div, ph["overlapped"] / n / div
        phase_rows.append({"phase": phase, "kind": kind, "time": t, "overlapped": o, "exposed": t - o,
                           "count": ph["count"] / div})
    phase_rows.sort(key=lambda p: (TRACK_ORDER.get(p["kind"], 9), -p["time"], p["phase"]))
    return {**mean, "num_ranks": n, "num_spans": num_spans, "slowest_rank": slowest,
            "per_rank": per_rank, "phases": phase_rows}


def _by_step(spans: Iterable[Span], step_ids: Sequence[int]) -> List[List[Span]]:
    at = {st: i for i, st in enumerate(step_ids)}
    out: List[List[Span]] = [[] for _ in step_ids]
    for s in spans:
        out[at[s.step]].append(s)
    return out


def _direction_key(d: str):
    return (DIRECTIONS.index(d) if d in DIRECTIONS else 9, d)


def overlap_report(spans: Iterable[Span], *, per_step: bool = True, skip_warmup: bool = True) -> Dict[str, Any]:
    """Hidden vs exposed communication per step: overall, per direction, and per (layer, direction).

    Args:
        spans: Spans of one or many ranks and layers (``Timeline.gather()``, ``gather_spans(...)``); seconds.
        per_step: every figure is the sum over the counted steps / their number (False: the sums).
        skip_warmup: leave out step 0 (a timeline's first recorded step: lazy init, kernel builds,
            autotuning) when the spans hold later steps too. Spans recorded after ``Timeline.reset()`` have
            no step 0. With step 0 alone it is kept, and "warmup" says so.
    Returns: {"overall": stats of every span (fwd and bwd together),
              "directions": [{"direction": d, **stats of every layer's d spans}, ...] (fwd, bwd),
              "layers": [{"layer": index, "name": module path or "", "direction": d, **stats}, ...]
                        (sorted by layer, then fwd before bwd),
              "steps": number of steps counted, "step_ids": their step numbers,
              "warmup": "excluded" (step 0 left out), "included" (step 0 counted) or "none" (no step 0),
              "per_step": per_step}, where
        stats = {"T_compute", "T_comm", "hidden", "exposed", "T_step": per step, means over the ranks present;
        "overlap_fraction": hidden / min(T_comm, T_compute) of those means (0 if the min is 0);
        "wall": last end - first start of the group's spans within a step (all ranks), per step;
        "num_ranks", "num_spans" (counted spans, all steps); "slowest_rank": rank with the largest own
        wall (None if no spans); "per_rank": {rank: the same keys for that rank alone};
        "phases": [{"phase", "kind", "time" (union, per step, mean over ranks), "overlapped" (covered by
                    the other kind: hidden for comm phases), "exposed", "count" (spans per step, all ranks)}]}.
    Forward and backward never run at the same time, so overall = fwd + bwd for every figure but
    overlap_fraction and wall; overall is the sum of the layers' figures while no two layers run at once.
    Region spans count only towards "wall". Example: compute [0, 2], comm [1, 4] on one rank, one step ->
    T_compute 2, T_comm 3, hidden 1, exposed 2, overlap_fraction 0.5, T_step 4, wall 4.
    """
    spans = check_spans(spans)
    step_ids = sorted({s.step for s in spans})
    warmup = "none"
    if step_ids and step_ids[0] == 0:
        warmup = "excluded" if skip_warmup and len(step_ids) > 1 else "included"
        if warmup == "excluded":
            step_ids = step_ids[1:]
            spans = [s for s in spans if s.step != 0]
    div = max(len(step_ids), 1) if per_step else 1
    groups: Dict[Tuple[int, str, str], List[Span]] = {}
    directions: Dict[str, List[Span]] = {}
    for s in spans:
        groups.setdefault((s.layer, s.name, s.direction), []).append(s)
        directions.setdefault(s.direction, []).append(s)
    layers = []
    for key in sorted(groups, key=lambda k: (k[0], k[1], _direction_key(k[2]))):
        layers.append({"layer": key[0], "name": key[1], "direction": key[2],
                       **_group_stats(_by_step(groups[key], step_ids), div)})
    by_direction = [{"direction": d, **_group_stats(_by_step(directions[d], step_ids), div)}
                    for d in sorted(directions, key=_direction_key)]
    return {"overall": _group_stats(_by_step(spans, step_ids), div), "directions": by_direction, "layers": layers,
            "steps": len(step_ids), "step_ids": step_ids, "warmup": warmup, "per_step": per_step}
