"""Timeline: timed spans of compute and communication, hidden vs exposed comm, Chrome traces.

A ``Span`` is one timed interval on one rank: (rank, layer, phase, chunk, kind, direction, start,
end, track, step, name). Times are seconds on the ``time.perf_counter`` clock (CUDA spans: the GPU clock, shifted
onto that clock, see below). A ``Timeline`` records spans with almost no cost when disabled:

    tl = Timeline(rank=r, layer=0, enabled=True)           # device="cuda" for CUDA event timing
    with tl.compute("experts", chunk=c):                   # compute span + torch.profiler label
        y = expert_fn(x)
    t0 = tl.mark()                                         # just before issuing the collective
    work = dist.all_to_all_single(out, inp, async_op=True)
    tl.comm("dispatch", work, chunk=c, start=t0)           # ends when the collective COMPLETES
    ...
    spans = tl.gather()                                    # every rank's spans, on every rank
    print(format_report(overlap_report(spans)))            # per step; step 0 (warm-up) left out
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

Steps: every span carries ``step``, the timeline's step counter when it was recorded. A step is one
forward and the backward that follows: the counter advances when a forward span is recorded after a
backward one (outside autograd's backward, so an activation-checkpointing recompute stays in its step),
at ``next_step()`` (forward-only loops), and at ``reset()``. Step 0 is the timeline's first recorded
step, which ``overlap_report`` takes for warm-up (lazy init, kernel builds); after a ``reset()`` no step
is numbered 0. ``name``: the layer's module path (``model_timelines`` sets it), "" when unnamed.

What is done with the spans lives next door: ``analysis.py`` (``overlap_report``: hidden vs exposed comm)
and ``export.py`` (``format_report``, ``to_chrome_trace``), pure functions of a list of spans.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_comm._checks import check_choice, check_float, check_int

__all__ = ["Span", "Timeline", "check_spans", "KINDS", "DIRECTIONS"]

_graph_task_id = torch._C._current_graph_task_id  # -1 outside autograd's backward

KINDS = ("compute", "comm", "region")  # region: an envelope ("forward", "backward"), outside the maths
DIRECTIONS = ("fwd", "bwd")
TRACK_ORDER = {"compute": 0, "comm": 1, "region": 2}  # default tracks, top to bottom (trace tids, report rows)
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
    step: the recording timeline's step (0: its first, taken for warm-up). name: the layer's module path
    ("layers.3.moe"), "" when unnamed.
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
    step: int = 0
    name: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


def check_spans(spans: Iterable[Span]) -> List[Span]:
    """The spans as a list, each checked: a Span, a known kind, end >= start."""
    spans = list(spans)
    for s in spans:
        if not isinstance(s, Span):
            raise TypeError(f"spans must hold Span objects, got {type(s).__name__}")
        if s.kind not in KINDS:
            raise ValueError(f"span kind must be one of {KINDS}, got {s.kind!r} ({s})")
        if not s.end >= s.start:
            raise ValueError(f"span end must be >= start, got start={s.start}, end={s.end} ({s})")
    return spans


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
    layer, phase, chunk, kind, direction, track, step, name = meta
    return Span(rank=rank, layer=layer, phase=phase, chunk=chunk, kind=kind, direction=direction,
                start=start, end=end, track=track, step=step, name=name)


class Timeline:
    """Records compute and comm spans of one rank; costs an early return when disabled.

    Args:
        rank: this rank's index in the EP group (stamped on every span; ``gather`` relies on it).
        layer: default layer index of the spans; every method also takes ``layer=`` (use it in backward,
            which runs layers in reverse, when one timeline is shared by several layers).
        enabled: record spans (False by default). May be toggled at any time.
        device: "cpu" (host ``perf_counter`` stamps, gloo future callbacks) or "cuda" (CUDA timing events
            on the current stream, resolved lazily). Pass the device of the layer's tensors.
        name: the layer's module path, stamped on every span ("": unnamed; ``model_timelines`` names them).
    Attributes: ``step``, the step the next span belongs to (module docstring, "Steps").

    Not thread-safe for concurrent ``compute`` blocks of one timeline from several threads beyond what
    list appends give (each span is appended atomically).
    """

    def __init__(self, rank: int = 0, layer: int = 0, enabled: bool = False, *, device: Any = "cpu",
                 name: str = ""):
        self.rank = check_int("Timeline: rank", rank, 0)
        self.layer = check_int("Timeline: layer", layer)
        if not isinstance(name, str):
            raise TypeError(f"Timeline: name must be a str (a module path), got {type(name).__name__}")
        self.name = name
        self.enabled = bool(enabled)
        self.step = 0
        self._last_direction = ""  # of the last span recorded: a forward after a backward opens a step
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
        check_choice("direction", direction, DIRECTIONS)
        check_int("chunk (-1: not chunked)", chunk, -1)
        if layer is not None:
            check_int("layer", layer)
        # A forward span after a backward one opens the next step; inside autograd's backward every span
        # (an activation-checkpointing recompute too) belongs to the backward of the current step.
        side = "bwd" if direction == "bwd" or _graph_task_id() != -1 else "fwd"
        if side == "fwd" and self._last_direction == "bwd":
            self.step += 1
        self._last_direction = side
        return (self.layer if layer is None else layer, phase, chunk, kind, direction,
                kind if track is None else track, self.step, self.name)

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
        else:
            check_float("start (a perf_counter float from mark() on a host timeline)", start)
        if work is None:
            self._done.append(_make_span(self.rank, meta, float(start), _perf_counter()))
            return None
        try:
            future = work.get_future()
        except (RuntimeError, AttributeError) as err:
            if not self._warned_no_future:
                self._warned_no_future = True
                warnings.warn(f"moe_comm Timeline: this collective's work has no future ({err}); its comm "
                              f"spans are not recorded (no completion time, no honest measurement)", stacklevel=2)
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
                          f"(collective not complete); left out", stacklevel=2)
        return sorted(self._done, key=lambda s: (s.start, s.end))

    def reset(self) -> None:
        """Forget every span, finished or pending, and open a new step: call it after the warm-up steps,
        and the spans that follow are all counted (none is numbered step 0, the warm-up)."""
        self._done, self._pending_comm, self._pending_cuda = [], [], []
        self.next_step()

    def next_step(self) -> None:
        """Open a new step: the spans recorded from now on carry ``step + 1``. Backward-then-forward does
        this by itself; call it between the steps of a forward-only loop."""
        self.step += 1
        self._last_direction = ""

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


def __getattr__(name: str):
    # Bridge for callers that still import the analysis and export functions from here; they live in
    # analysis.py / export.py now (import them from moe_comm.profiling). Lazy: those modules import this one.
    if name == "overlap_report":
        from moe_comm.profiling.analysis import overlap_report
        return overlap_report
    if name in ("format_report", "to_chrome_trace"):
        from moe_comm.profiling import export
        return getattr(export, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
