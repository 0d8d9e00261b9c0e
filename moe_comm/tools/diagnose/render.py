"""Render a diagnosis: ``format_diagnosis`` (text, through rich) and ``plot_timeline`` (a PNG, matplotlib).

Shapes legend: W EP world size, C chunks.

Neither touches global state: text goes to a private rich Console, the picture is a backend-free
``matplotlib.figure.Figure`` saved with ``fig.savefig`` (no ``matplotlib.use``, no pyplot).
"""
from __future__ import annotations

import io
import textwrap
from typing import Any, Dict, Iterable, List, Optional

from moe_comm.profiling import Span
from moe_comm.tools.diagnose.findings import Diagnosis
from moe_comm.tools.diagnose.suggest import ms

__all__ = ["format_diagnosis", "plot_timeline"]


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
        say("   ", f"predicted step {ms(s.predicted_step_s)} vs measured {ms(d.step_s)} "
                   f"(-{ms(s.predicted_gain_s)}, {s.predicted_gain_s / d.step_s:.0%})")
    if s.alternatives:
        say("   considered: ", "; ".join(f"{a['action']} -{ms(a['gain_s'])}"
                                         + (" per T tokens (changes the batch)" if a["action"] == "tokens" else "")
                                         for a in s.alternatives))
    return con.file.getvalue()


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
    from matplotlib.colors import to_hex
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    spans = [s if isinstance(s, Span) else Span(**s) for s in spans]
    if not spans:
        raise ValueError("spans must not be empty")
    t0 = min(s.start for s in spans)
    ranks = sorted({s.rank for s in spans})
    lane_h, gap = 0.8, 0.6
    row_h = 2 * lane_h + gap
    fig = Figure(figsize=(15, 1.2 + 1.35 * len(ranks)), dpi=120)  # no pyplot: the caller's backend is untouched
    ax = fig.subplots()
    fixed = {*_COMPUTE_COLOURS.values(), *_COMM_COLOURS.values()}  # a new phase never borrows a fixed colour
    other = iter([c for c in matplotlib.colormaps["tab20"].colors if to_hex(c) not in fixed])
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
    return path
