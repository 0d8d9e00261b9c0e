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


def format_report(report: Dict[str, Any], *, width: int = 110) -> str:
    """A short text rendering (rich tables, no colour) of ``overlap_report``'s result; times in ms."""
    from rich.console import Console
    from rich.table import Table

    summary = Table(title="moe_comm overlap (ms, mean over ranks)", title_justify="left")
    for col in ("layer", "dir", "T_compute", "T_comm", "hidden", "exposed", "overlap", "T_step", "wall",
                "slowest"):
        summary.add_column(col, justify="left" if col in ("layer", "dir") else "right")

    def row(label: str, d: str, st: Dict[str, Any]) -> None:
        summary.add_row(label, d, _ms(st["T_compute"]), _ms(st["T_comm"]), _ms(st["hidden"]),
                        _ms(st["exposed"]), f"{st['overlap_fraction'] * 100:.0f}%", _ms(st["T_step"]),
                        _ms(st["wall"]), "-" if st["slowest_rank"] is None else f"rank {st['slowest_rank']}")

    for st in report["layers"]:
        row(str(st["layer"]), st["direction"], st)
    row("all", "", report["overall"])

    phases = Table(title="phases (all layers, ms, mean over ranks)", title_justify="left")
    for col in ("phase", "kind", "time", "overlapped", "exposed", "spans"):
        phases.add_column(col, justify="left" if col in ("phase", "kind") else "right")
    for p in report["overall"]["phases"]:
        phases.add_row(p["phase"], p["kind"], _ms(p["time"]), _ms(p["overlapped"]), _ms(p["exposed"]),
                       str(p["count"]))

    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
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
                       "args": {"layer": s.layer, "phase": s.phase, "chunk": s.chunk, "direction": s.direction,
                                "kind": s.kind}})
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace
