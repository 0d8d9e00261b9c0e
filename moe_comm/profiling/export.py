"""Renderings of timeline results: ``format_report`` (text tables of ``overlap_report``; rich is imported
inside the function, so importing moe_comm never loads it) and ``to_chrome_trace`` (Perfetto / chrome://tracing).
"""
from __future__ import annotations

import io
import json
from typing import Any, Dict, Iterable, List, Optional

from moe_comm.profiling.timeline import TRACK_ORDER, Span, check_spans

__all__ = ["format_report", "to_chrome_trace"]


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


_WARMUP_NOTE = {
    "excluded": "step 0 left out: the timelines' first recorded step (warm-up: lazy init, kernel builds)",
    "included": ("step 0 counted: the timelines' first recorded step, warm-up if the layers had not run before "
                 "(run a warm-up step, then timeline.reset(), for clean figures)"),
    "none": "",
}
_LEGEND = ("T_compute / T_comm: time with compute / comm running (union of spans); hidden: comm under compute; "
           "exposed = T_comm - hidden; overlap = hidden / min(T_comm, T_compute); T_step = T_compute + exposed; "
           "wall: first start to last end of the row's spans in a step. fwd+bwd = fwd + bwd in every column but "
           "overlap and wall; 'all' = every layer together (the sum of the layers while none runs at the same "
           "time as another).")


def _label(layer: Dict[str, Any]) -> str:
    return layer.get("name") or str(layer["layer"])


def _steps_text(report: Dict[str, Any]) -> str:
    ids = report.get("step_ids", [])
    n = report.get("steps", len(ids))
    which = "" if not ids else f" ({ids[0]})" if len(ids) == 1 else f" ({ids[0]}-{ids[-1]})" \
        if ids == list(range(ids[0], ids[-1] + 1)) else f" ({', '.join(map(str, ids))})"
    return f"{n} step{'s' if n != 1 else ''}{which}"


def format_report(report: Dict[str, Any], *, width: int = 110) -> str:
    """A short text rendering (rich tables, no colour) of ``overlap_report``'s result: ms per step (or
    summed over the steps when the report was made with ``per_step=False``), rows named by module path
    (``model_timelines``) or layer index, a line on the warm-up step and a legend of every column."""
    from rich.console import Console
    from rich.table import Table

    overall = report["overall"]
    per = "per step" if report.get("per_step", True) else "summed over steps"
    summary = Table(title=f"moe_comm overlap: ms {per}, mean over {_steps_text(report)} and "
                          f"{overall['num_ranks']} rank{'s' if overall['num_ranks'] != 1 else ''}",
                    title_justify="left", caption=_LEGEND, caption_justify="left")
    for col in ("layer", "dir", "T_compute", "T_comm", "hidden", "exposed", "overlap", "T_step", "wall",
                "slowest"):
        summary.add_column(col, justify="left" if col in ("layer", "dir") else "right")

    def row(label: str, d: str, st: Dict[str, Any], end_section: bool = False) -> None:
        summary.add_row(label, d, _ms(st["T_compute"]), _ms(st["T_comm"]), _ms(st["hidden"]),
                        _ms(st["exposed"]), f"{st['overlap_fraction'] * 100:.0f}%", _ms(st["T_step"]),
                        _ms(st["wall"]), "-" if st["slowest_rank"] is None else f"rank {st['slowest_rank']}",
                        end_section=end_section)

    layers = report["layers"]
    for i, st in enumerate(layers):
        row(_label(st), st["direction"], st, end_section=i == len(layers) - 1)
    directions = report.get("directions", [])
    if len({(L["layer"], L.get("name", "")) for L in layers}) > 1:
        for st in directions:
            row("all", st["direction"], st)
    row("all", "+".join(st["direction"] for st in directions), overall)

    phases = Table(title=f"phases, all layers (ms {per})", title_justify="left", caption_justify="left",
                   caption="time: union of the phase's spans, mean over ranks; overlapped: under the other "
                           f"kind (hidden, for comm); spans: {per}, all ranks")
    for col in ("phase", "kind", "time", "overlapped", "exposed", "spans"):
        phases.add_column(col, justify="left" if col in ("phase", "kind") else "right")
    for p in overall["phases"]:
        phases.add_row(p["phase"], p["kind"], _ms(p["time"]), _ms(p["overlapped"]), _ms(p["exposed"]),
                       f"{p['count']:.3g}")

    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    note = _WARMUP_NOTE.get(report.get("warmup", "none"), "")
    if note:
        console.print(note)
    console.print(summary)
    console.print(phases)
    return console.file.getvalue()


def to_chrome_trace(spans: Iterable[Span], path: Optional[str] = None) -> Dict[str, Any]:
    """Chrome Trace Event Format (opens in Perfetto / chrome://tracing).

    One process per rank (pid = rank, named "rank N"), one thread per track (tid 0 "compute",
    1 "comm", 2 "region", then other track names), one "X" (complete) event per span with ts/dur in
    microseconds from the earliest span. Example: Span(rank=1, phase="dispatch", chunk=0, kind="comm",
    start=t0 + 0.001, end=t0 + 0.003) -> {"ph": "X", "pid": 1, "tid": 1, "name": "dispatch c0",
    "ts": 1000.0, "dur": 2000.0, ...}.

    Args:
        spans: Spans of any ranks. path: where to write the JSON (None: do not write).
    Returns: the trace dict ({"traceEvents": [...], "displayTimeUnit": "ms"}).
    """
    spans = check_spans(spans)
    t0 = min((s.start for s in spans), default=0.0)
    tracks = {name: tid for name, tid in TRACK_ORDER.items()}
    for name in sorted({s.track for s in spans} - set(tracks)):
        tracks[name] = len(tracks)
    events: List[Dict[str, Any]] = []
    for rank in sorted({s.rank for s in spans}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for name in sorted({s.track for s in spans if s.rank == rank}, key=tracks.__getitem__):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tracks[name],
                           "args": {"name": name}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tracks[name],
                           "args": {"sort_index": tracks[name]}})
    for s in sorted(spans, key=lambda s: (s.rank, s.start)):
        name = s.phase + (f" c{s.chunk}" if s.chunk >= 0 else "") + (" (bwd)" if s.direction == "bwd" else "")
        events.append({"ph": "X", "name": name, "cat": s.kind, "pid": s.rank, "tid": tracks[s.track],
                       "ts": (s.start - t0) * 1e6, "dur": (s.end - s.start) * 1e6,
                       "args": {"layer": s.layer, "name": s.name, "step": s.step, "phase": s.phase,
                                "chunk": s.chunk, "direction": s.direction, "kind": s.kind}})
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace
