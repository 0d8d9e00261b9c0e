"""Timeline: timed spans of compute and communication, hidden vs exposed comm, Chrome traces.

A ``Span`` is one timed interval on one rank: (rank, layer, phase, chunk, kind, direction, start,
end, track). Times are seconds on the ``time.perf_counter`` clock (CUDA spans: the GPU clock, shifted
onto that clock, see below). A ``Timeline`` records spans with almost no cost when disabled:

    tl = Timeline(rank=r, layer=0, enabled=True)           # device="cuda" for CUDA event timing
    with tl.compute("experts", chunk=c):                   # compute span + torch.profiler label
        y = expert_fn(x)
    t0 = tl.mark()                                         # just before issuing the collective
    work = dist.all_to_all_single(out, inp, async_op=True)
    tl.comm("dispatch", work, chunk=c, start=t0)           # ends when the collective COMPLETES
    ...
    spans = tl.gather()                                    # every rank's spans, on every rank
    print(format_report(overlap_report(spans)))
    to_chrome_trace(spans, "trace.json")                   # open in https://ui.perfetto.dev

How a comm span knows when the collective completed (shared/DESIGN.md "Measuring overlap honestly"):
- host clock (gloo, CPU): ``work.get_future().then(cb)``; gloo marks the future complete in its worker
  thread when the collective finishes and runs ``cb`` there, which stamps ``perf_counter``. Measured in
  tests/test_profiling.py: with the peer 0.5 s late, the span lasts >= 0.4 s while the issue returns
  in well under a millisecond. If the work is already complete when ``comm`` is called, the callback
  runs at once and the span ends at the ``comm`` call (an upper bound).
- CUDA (NCCL): ``work.wait()`` is issued on a private, otherwise idle "probe" stream and an event is
  recorded there, so the event fires when the collective finishes; neither the compute stream nor the
  host waits (NCCL's ``wait()`` only makes the current stream wait; with TORCH_NCCL_BLOCKING_WAIT=1
  it would block the host: do not profile that way). The start event is recorded on the current
  stream at the issue point, which NCCL's stream waits on before it starts. The caller still calls
  ``work.wait()`` itself where the result is consumed.
- ``work=None``: a synchronous collective that has already completed; the span ends now.
- A backend whose work has no future (``get_future`` raises) gives no span, with one warning: a comm
  span without a completion time is not a measurement.

CUDA timing: compute and comm spans are pairs of timing events, resolved lazily by ``synchronize()`` /
``spans()`` (never a host sync inside the forward). GPU times are mapped to ``perf_counter`` through
the first event this timeline recorded ("anchor"), taken to have run when it was recorded on the host;
the real GPU lag behind the host shifts every CUDA span by the same amount, so the overlap maths
between CUDA spans of one rank is exact, while comparing them with host-clocked spans is approximate.
Not for use under CUDA graph capture while enabled.

torch.profiler labels: ``compute`` and ``region`` wrap their block in
``torch.profiler.record_function("moe_comm.<phase>")`` when the timeline is enabled OR a torch profiler
is running (a ~0.1 us check), so a user's torch.profiler trace shows our phases without enabling the
timeline. record_function itself costs ~6 us per call, which is why it is skipped otherwise.

Analysis functions (``overlap_report``, ``format_report``, ``to_chrome_trace``) are pure functions of a
list of spans. Per rank: T_compute = length of the union of its compute spans, T_comm = union of its comm
spans, hidden = length of (comm union) ∩ (compute union), exposed = T_comm - hidden,
overlap_fraction = hidden / min(T_comm, T_compute) (0 when the min is 0),
T_step = T_compute + T_comm - hidden (the length of the union of both), wall = last end - first start.
"""
from __future__ import annotations

import io
import json
import time
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["Span", "Timeline", "overlap_report", "format_report", "to_chrome_trace", "KINDS", "DIRECTIONS"]

KINDS = ("compute", "comm", "region")  # region: an envelope ("forward", "backward"), outside the maths
DIRECTIONS = ("fwd", "bwd")
_TRACK_ORDER = {"compute": 0, "comm": 1, "region": 2}
_perf_counter = time.perf_counter

try:  # ~0.1 us; private but long-standing. Without it, labels only when the timeline is enabled.
    _profiler_active = torch._C._autograd._profiler_enabled
except AttributeError:  # pragma: no cover
    def _profiler_active() -> bool:
        return False


@dataclass(frozen=True)
class Span:
    """One timed interval on one rank.

    rank: rank in the EP group. layer: layer index. phase: "router", "permute", "counts", "dispatch",
    "experts", "combine", "unpermute", "shared", "forward", "backward", ... chunk: micro-chunk, -1 if
    n/a. kind: "compute" | "comm" | "region". direction: "fwd" | "bwd". start, end: seconds on the
    ``time.perf_counter`` clock. track: the row it is drawn on ("compute", "comm", "region" by default).
    """

    rank: int
    layer: int
    phase: str
    chunk: int
    kind: str
    direction: str
    start: float
    end: float
    track: str

    @property
    def duration(self) -> float:
        return self.end - self.start


class _NullContext:
    """The context manager a disabled timeline returns: one shared, stateless instance."""

    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, *exc) -> bool:
        return False


_NULL = _NullContext()


class _SpanContext:
    """Enabled ``compute``/``region`` block: a profiler label plus a host or CUDA-event span."""

    __slots__ = ("_tl", "_meta", "_label", "_start")

    def __init__(self, tl: "Timeline", meta: tuple):
        self._tl, self._meta = tl, meta
        self._label = torch.profiler.record_function(f"moe_comm.{meta[1]}")

    def __enter__(self):
        self._label.__enter__()
        tl = self._tl
        self._start = tl._record_event() if tl._cuda else _perf_counter()
        return None

    def __exit__(self, *exc) -> bool:
        tl = self._tl
        if tl._cuda:
            tl._pending_cuda.append((self._meta, self._start, tl._record_event()))
        else:
            tl._done.append(_make_span(tl.rank, self._meta, self._start, _perf_counter()))
        self._label.__exit__(*exc)
        return False


class _PendingComm:
    """A host-clocked comm span waiting for its collective's future; ``stamp`` runs in the comm thread."""

    __slots__ = ("meta", "start", "end", "future")

    def __init__(self, meta: tuple, start: float):
        self.meta, self.start, self.end, self.future = meta, start, None, None

    def stamp(self, _fut) -> None:
        self.end = _perf_counter()


def _make_span(rank: int, meta: tuple, start: float, end: float) -> Span:
    layer, phase, chunk, kind, direction, track = meta
    return Span(rank=rank, layer=layer, phase=phase, chunk=chunk, kind=kind, direction=direction,
                start=start, end=end, track=track)


class Timeline:
    """Records compute and comm spans of one rank; costs an early return when disabled.

    Args:
        rank: this rank's index in the EP group (stamped on every span; ``gather`` relies on it).
        layer: default layer index of the spans; every method also takes ``layer=`` (use it in backward,
            which runs layers in reverse, when one timeline is shared by several layers).
        enabled: record spans (False by default). May be toggled at any time.
        device: "cpu" (host ``perf_counter`` stamps, gloo future callbacks) or "cuda" (CUDA timing events
            on the current stream, resolved lazily). Pass the device of the layer's tensors.

    Not thread-safe for concurrent ``compute`` blocks of one timeline from several threads beyond what
    list appends give (each span is appended atomically).
    """

    def __init__(self, rank: int = 0, layer: int = 0, enabled: bool = False, *, device: Any = "cpu"):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {rank!r}")
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(f"layer must be an int, got {layer!r}")
        self.rank = rank
        self.layer = layer
        self.enabled = bool(enabled)
        self.device = device
        self._done: List[Span] = []
        self._pending_comm: List[_PendingComm] = []
        self._pending_cuda: List[tuple] = []  # (meta, start event, end event)
        self._anchor: Optional[Tuple[Any, float]] = None  # (CUDA event, perf_counter at its record)
        self._probe_stream = None
        self._warned_no_future = False

    @property
    def device(self) -> torch.device:
        return self._device

    @device.setter
    def device(self, device: Any) -> None:
        try:
            dev = torch.device(device)
        except (TypeError, RuntimeError) as err:
            raise ValueError(f"device must be a torch.device or a string like 'cpu'/'cuda', got {device!r}") from err
        self._device = dev
        self._cuda = dev.type == "cuda"

    # ---------------------------------------------------------------- recording
    def _meta(self, phase: str, chunk: int, kind: str, direction: str, layer: Optional[int],
              track: Optional[str]) -> tuple:
        if not isinstance(phase, str) or not phase:
            raise ValueError(f"phase must be a non-empty str, got {phase!r}")
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < -1:
            raise ValueError(f"chunk must be an int >= -1 (-1: not chunked), got {chunk!r}")
        return (self.layer if layer is None else layer, phase, chunk, kind, direction,
                kind if track is None else track)

    def compute(self, phase: str, chunk: int = -1, direction: str = "fwd", *, layer: Optional[int] = None,
                track: Optional[str] = None):
        """Context manager: times the block as a compute span and labels it ``moe_comm.<phase>``.

        Args:
            phase: e.g. "router", "permute", "experts", "unpermute", "shared".
            chunk: micro-chunk index, -1 if the phase is not chunked.
            direction: "fwd" | "bwd".
            layer: overrides ``self.layer`` for this span. track: overrides the track name ("compute").
        Disabled: returns one shared no-op context (no allocation), or just the profiler label while a
        torch profiler is running.
        """
        if not self.enabled:
            if _profiler_active():
                return torch.profiler.record_function(f"moe_comm.{phase}")
            return _NULL
        return _SpanContext(self, self._meta(phase, chunk, "compute", direction, layer, track))

    def region(self, phase: str, direction: str = "fwd", *, layer: Optional[int] = None,
               track: Optional[str] = None):
        """Context manager for an envelope ("forward", "backward", "step"): drawn in the trace on its
        own track and counted in ``wall``, but neither compute nor comm in the overlap maths."""
        if not self.enabled:
            if _profiler_active():
                return torch.profiler.record_function(f"moe_comm.{phase}")
            return _NULL
        return _SpanContext(self, self._meta(phase, -1, "region", direction, layer, track))

    def mark(self):
        """A start stamp for ``comm(start=...)``: perf_counter seconds (host) or a recorded CUDA event
        (device="cuda"); None when disabled. Take it just before issuing the collective."""
        if not self.enabled:
            return None
        return self._record_event() if self._cuda else _perf_counter()

    def comm(self, phase: str, work: Any, chunk: int = -1, direction: str = "fwd", *, start: Any = None,
             layer: Optional[int] = None, track: Optional[str] = None) -> None:
        """Register a comm span that started at issue and ends when the collective completes.

        Args:
            phase: e.g. "counts", "dispatch", "combine".
            work: the ``dist.Work`` of an ``async_op=True`` collective, or None for a synchronous one
                that has already completed (the span ends now).
            chunk, direction, layer, track: as in ``compute`` (track default "comm").
            start: issue time: a ``mark()`` taken before the issue (perf_counter float on the host, CUDA
                event on CUDA); None: now (a collective's issue takes ~0.2 ms on gloo).
        Call it right after issuing; it never waits for the collective, and does not replace the
        caller's own ``work.wait()``.
        """
        if not self.enabled:
            return None
        meta = self._meta(phase, chunk, "comm", direction, layer, track)
        if self._cuda:
            self._comm_cuda(meta, work, start)
            return None
        if start is None:
            start = _perf_counter()
        elif isinstance(start, bool) or not isinstance(start, (int, float)):
            raise TypeError(f"start must be a perf_counter float from mark() on a host timeline, "
                            f"got {type(start).__name__}")
        if work is None:
            self._done.append(_make_span(self.rank, meta, float(start), _perf_counter()))
            return None
        try:
            future = work.get_future()
        except (RuntimeError, AttributeError) as err:
            if not self._warned_no_future:
                self._warned_no_future = True
                warnings.warn(f"moe_comm Timeline: this collective's work has no future ({err}); its comm "
                              f"spans are not recorded (no completion time, no honest measurement)")
            return None
        rec = _PendingComm(meta, float(start))
        self._pending_comm.append(rec)
        # gloo: the callback runs in gloo's worker thread when the collective completes.
        rec.future = future.then(rec.stamp)
        return None

    # ---------------------------------------------------------------- CUDA events
    def _record_event(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()  # current stream
        if self._anchor is None:
            self._anchor = (ev, _perf_counter())
        return ev

    def _comm_cuda(self, meta: tuple, work: Any, start: Any) -> None:
        if start is None:
            start = self._record_event()
        elif not isinstance(start, torch.cuda.Event):
            raise TypeError(f"start must be a CUDA event from mark() on a CUDA timeline, got {type(start).__name__}")
        if work is None:
            end = self._record_event()  # current stream: runs after the synchronous collective
        else:
            if self._probe_stream is None:
                self._probe_stream = torch.cuda.Stream()
            end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self._probe_stream):
                work.wait()  # NCCL: the idle probe stream waits on the collective; the host does not
                end.record(self._probe_stream)
        self._pending_cuda.append((meta, start, end))

    # ---------------------------------------------------------------- results
    def synchronize(self, timeout: float = 10.0) -> int:
        """Resolve pending spans (collective futures, CUDA events), waiting at most ``timeout`` seconds.

        Returns the number still pending (left for a later call). A host sync: call it after the step.
        """
        deadline = _perf_counter() + timeout
        while self._pending_comm:
            if any(rec.end is None for rec in self._pending_comm) and _perf_counter() < deadline:
                time.sleep(2e-4)
                continue
            break
        still = []
        for rec in self._pending_comm:
            if rec.end is None:
                still.append(rec)
            else:
                self._done.append(_make_span(self.rank, rec.meta, rec.start, max(rec.end, rec.start)))
        self._pending_comm = still
        still_cuda = []
        for meta, start_ev, end_ev in self._pending_cuda:
            while not end_ev.query() and _perf_counter() < deadline:
                time.sleep(2e-4)
            if not end_ev.query():
                still_cuda.append((meta, start_ev, end_ev))
                continue
            anchor_ev, anchor_host = self._anchor
            t0 = anchor_host + anchor_ev.elapsed_time(start_ev) / 1e3
            t1 = anchor_host + anchor_ev.elapsed_time(end_ev) / 1e3
            self._done.append(_make_span(self.rank, meta, t0, max(t0, t1)))
        self._pending_cuda = still_cuda
        return len(self._pending_comm) + len(self._pending_cuda)

    def spans(self, timeout: float = 10.0) -> List[Span]:
        """Finished spans of this rank sorted by start, after waiting at most ``timeout`` s for pending
        ones; spans still pending are left out with a warning (and kept for the next call)."""
        left = self.synchronize(timeout)
        if left:
            warnings.warn(f"moe_comm Timeline: {left} span(s) still pending after {timeout:.3g} s "
                          f"(collective not complete); left out")
        return sorted(self._done, key=lambda s: (s.start, s.end))

    def reset(self) -> None:
        """Forget every span, finished or pending (e.g. between steps)."""
        self._done, self._pending_comm, self._pending_cuda = [], [], []

    def gather(self, group: Optional[dist.ProcessGroup] = None, timeout: float = 10.0) -> List[Span]:
        """Every rank's spans, on every rank, sorted by (rank, start). Collective: call it on all ranks
        of ``group`` (enabled or not). No process group initialised: this rank's spans.
        With NCCL, ``all_gather_object`` needs ``torch.cuda.set_device`` to have been called."""
        local = self.spans(timeout)
        if not (dist.is_available() and dist.is_initialized()):
            return local
        out: List[Optional[List[Span]]] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, local, group=group)
        merged = [s for part in out for s in (part or [])]
        return sorted(merged, key=lambda s: (s.rank, s.start, s.end))


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


# ==================================================================== analysis
def _check_spans(spans: Iterable[Span]) -> List[Span]:
    spans = list(spans)
    for s in spans:
        if not isinstance(s, Span):
            raise TypeError(f"spans must hold Span objects, got {type(s).__name__}")
        if s.kind not in KINDS:
            raise ValueError(f"span kind must be one of {KINDS}, got {s.kind!r} ({s})")
        if not s.end >= s.start:
            raise ValueError(f"span end must be >= start, got start={s.start}, end={s.end} ({s})")
    return spans


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
    phase_rows.sort(key=lambda p: (_TRACK_ORDER.get(p["kind"], 9), -p["time"], p["phase"]))
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
    spans = _check_spans(spans)
    groups: Dict[Tuple[int, str], List[Span]] = {}
    for s in spans:
        groups.setdefault((s.layer, s.direction), []).append(s)
    layers = [{"layer": layer, "direction": d, **_group_stats(groups[(layer, d)])}
              for layer, d in sorted(groups, key=lambda k: (k[0], DIRECTIONS.index(k[1])
                                                            if k[1] in DIRECTIONS else 9, k[1]))]
    return {"overall": _group_stats(spans), "layers": layers}


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
    spans = _check_spans(spans)
    t0 = min((s.start for s in spans), default=0.0)
    tracks = {name: tid for name, tid in _TRACK_ORDER.items()}
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
