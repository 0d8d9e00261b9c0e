"""Timeline tests.

Tier 1 (pure logic, no processes): interval maths and ``overlap_report`` on hand-computed synthetic
spans (per step, warm-up step left out, fwd + bwd = all), Chrome trace JSON, ``format_report``, the
disabled-path cost, profiler labels, step numbering, the future callback mechanism on a hand-completed
``torch.futures.Future``, and a two-layer model's report named by module path (one process).
Tier 2 (multi-rank gloo, 2 ranks): a comm span ends when the all-to-all COMPLETES, not when it is
issued; hidden vs exposed comm measured on a real async all-to-all; ``gather`` on every rank; a
two-layer model's spans gathered from both ranks with ``gather_spans``.
"""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from moe_comm.profiling import (Span, Timeline, format_report, gather_spans, model_timelines, overlap_report,
                                to_chrome_trace)
from moe_comm.profiling.analysis import _intersection, _length, _union


def S(rank, kind, start, end, phase=None, layer=0, direction="fwd", chunk=-1, track=None, step=0, name=""):
    phase = phase or {"compute": "experts", "comm": "dispatch", "region": "forward"}[kind]
    return Span(rank=rank, layer=layer, phase=phase, chunk=chunk, kind=kind, direction=direction,
                start=float(start), end=float(end), track=track or kind, step=step, name=name)


def approx(x):
    return pytest.approx(x, abs=1e-9)


# ============================================================ tier 1: interval maths
def test_union_and_intersection_hand_cases():
    """Tier 1: overlapping, nested, touching, disjoint, zero-length and empty intervals."""
    assert _union([]) == []
    assert _union([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]               # overlapping + disjoint
    assert _union([(0, 10), (2, 3), (4, 5)]) == [(0, 10)]                     # nested
    assert _union([(3, 4), (0, 1), (1, 2)]) == [(0, 2), (3, 4)]               # touching, unsorted
    assert _union([(1, 1), (2, 2)]) == []                                     # zero length
    assert _length(_union([(0, 2), (1, 3), (5, 6)])) == 4
    assert _intersection([(0, 3), (5, 6)], [(2, 5.5)]) == [(2, 3), (5, 5.5)]
    assert _intersection([(0, 1)], [(1, 2)]) == []                            # touching: nothing shared
    assert _intersection([(0, 10)], [(1, 2), (3, 4), (9, 12)]) == [(1, 2), (3, 4), (9, 10)]
    assert _intersection([], [(0, 1)]) == []


def test_overlap_report_single_rank_partial_overlap():
    """Tier 1: compute [0,2], comm [1,4] -> hidden 1, exposed 2, fraction 1/min(3,2) = 0.5, T_step 4."""
    st = overlap_report([S(0, "compute", 0, 2), S(0, "comm", 1, 4)])["overall"]
    assert st["T_compute"] == approx(2) and st["T_comm"] == approx(3)
    assert st["hidden"] == approx(1) and st["exposed"] == approx(2)
    assert st["overlap_fraction"] == approx(0.5)
    assert st["T_step"] == approx(4) and st["wall"] == approx(4)
    assert st["slowest_rank"] == 0 and st["num_ranks"] == 1 and st["num_spans"] == 2


def test_overlap_report_unions_before_intersecting():
    """Tier 1: overlapping spans of one kind are not double counted; nested comm is fully hidden.

    compute [0,4] and [2,6] (union [0,6], 6 s); comm chunks [1,2], [1.5,3] (union [1,3]) and [7,8]:
    T_comm 3, hidden 2 (all of [1,3]), exposed 1 ([7,8]), fraction 2/3, T_step 7, wall 8.
    """
    spans = [S(0, "compute", 0, 4, chunk=0), S(0, "compute", 2, 6, chunk=1),
             S(0, "comm", 1, 2, chunk=0), S(0, "comm", 1.5, 3, chunk=1), S(0, "comm", 7, 8, "combine")]
    st = overlap_report(spans)["overall"]
    assert st["T_compute"] == approx(6) and st["T_comm"] == approx(3)
    assert st["hidden"] == approx(2) and st["exposed"] == approx(1)
    assert st["overlap_fraction"] == approx(2 / 3)
    assert st["T_step"] == approx(7) and st["wall"] == approx(8)
    phases = {(p["phase"], p["kind"]): p for p in st["phases"]}
    assert phases[("dispatch", "comm")]["time"] == approx(2) and phases[("dispatch", "comm")]["exposed"] == approx(0)
    assert phases[("combine", "comm")]["time"] == approx(1) and phases[("combine", "comm")]["exposed"] == approx(1)
    assert phases[("experts", "compute")]["time"] == approx(6)
    assert phases[("experts", "compute")]["overlapped"] == approx(2)   # ran with comm in flight for 2 s
    assert phases[("dispatch", "comm")]["count"] == 2


def test_overlap_report_disjoint_and_multi_rank():
    """Tier 1: rank 0 fully serial (no overlap), rank 1 fully hidden; means, per rank, slowest rank."""
    spans = [S(0, "compute", 0, 2), S(0, "comm", 2, 5),          # rank 0: wall 5, hidden 0
             S(1, "compute", 10, 14), S(1, "comm", 11, 12)]      # rank 1: wall 4, hidden 1
    st = overlap_report(spans)["overall"]
    r0, r1 = st["per_rank"][0], st["per_rank"][1]
    assert r0["hidden"] == approx(0) and r0["exposed"] == approx(3) and r0["overlap_fraction"] == 0
    assert r0["T_step"] == approx(5) and r0["wall"] == approx(5)
    assert r1["hidden"] == approx(1) and r1["exposed"] == approx(0) and r1["overlap_fraction"] == approx(1)
    assert r1["T_step"] == approx(4) and r1["wall"] == approx(4)
    assert st["slowest_rank"] == 0
    assert st["T_compute"] == approx(3) and st["T_comm"] == approx(2) and st["hidden"] == approx(0.5)
    assert st["exposed"] == approx(1.5) and st["overlap_fraction"] == approx(0.25)
    assert st["T_step"] == approx(4.5)
    assert st["wall"] == approx(14)                               # across ranks: 0 .. 14


def test_overlap_report_layers_directions_regions_and_empty():
    """Tier 1: grouping by (layer, direction); regions only widen the wall; empty input is all zeros."""
    spans = [S(0, "region", 0, 10, "forward"), S(0, "compute", 1, 3), S(0, "comm", 2, 4),
             S(0, "compute", 20, 21, layer=1), S(0, "comm", 30, 33, layer=0, direction="bwd"),
             S(0, "compute", 31, 32, layer=0, direction="bwd")]
    rep = overlap_report(spans)
    keys = [(g["layer"], g["direction"]) for g in rep["layers"]]
    assert keys == [(0, "fwd"), (0, "bwd"), (1, "fwd")]
    l0f = rep["layers"][0]
    assert l0f["T_compute"] == approx(2) and l0f["T_comm"] == approx(2) and l0f["hidden"] == approx(1)
    assert l0f["wall"] == approx(10)                               # the region counts for wall only
    l0b = rep["layers"][1]
    assert l0b["hidden"] == approx(1) and l0b["exposed"] == approx(2) and l0b["overlap_fraction"] == approx(1)
    l1 = rep["layers"][2]
    assert l1["T_comm"] == 0 and l1["overlap_fraction"] == 0 and l1["T_step"] == approx(1)
    assert rep["overall"]["hidden"] == approx(2)

    empty = overlap_report([])
    assert empty["layers"] == [] and empty["overall"]["slowest_rank"] is None
    assert all(empty["overall"][k] == 0 for k in ("T_compute", "T_comm", "hidden", "exposed", "wall", "T_step"))
    assert "all" in format_report(empty)


def test_overlap_report_rejects_bad_spans():
    """Tier 1: a span that ends before it starts, or of unknown kind, is a ValueError naming it."""
    with pytest.raises(ValueError, match="end must be >= start"):
        overlap_report([S(0, "comm", 2, 1)])
    with pytest.raises(ValueError, match="kind"):
        overlap_report([Span(0, 0, "x", -1, "gpu", "fwd", 0.0, 1.0, "gpu")])
    with pytest.raises(TypeError, match="Span"):
        overlap_report([(0, 1)])


# ============================================================ tier 1: trace and text
def test_chrome_trace_is_valid_and_matches(tmp_path):
    """Tier 1: valid JSON, one X event per span with µs durations, pid = rank, named tracks."""
    t0 = 100.0
    spans = [S(0, "compute", t0 + 0.001, t0 + 0.004, chunk=0), S(0, "comm", t0, t0 + 0.002, chunk=0),
             S(1, "comm", t0 + 0.001, t0 + 0.003, "combine", chunk=1, direction="bwd"),
             S(1, "region", t0, t0 + 0.005, "forward")]
    path = tmp_path / "trace.json"
    to_chrome_trace(spans, str(path))
    trace = json.loads(path.read_text())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(spans)
    for e, s in zip(sorted(xs, key=lambda e: (e["pid"], e["ts"])), sorted(spans, key=lambda s: (s.rank, s.start))):
        assert e["pid"] == s.rank
        assert e["dur"] == pytest.approx((s.end - s.start) * 1e6)
        assert e["ts"] == pytest.approx((s.start - t0) * 1e6)
        assert e["cat"] == s.kind and e["args"]["phase"] == s.phase
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert procs == {0: "rank 0", 1: "rank 1"}
    assert threads == {(0, 0): "compute", (0, 1): "comm", (1, 1): "comm", (1, 2): "region"}
    assert {e["tid"] for e in xs if e["cat"] == "comm"} == {1}
    assert any(e["name"] == "combine c1 (bwd)" for e in xs)
    assert to_chrome_trace([])["traceEvents"] == []


def test_format_report_is_short_and_readable():
    """Tier 1: the text names layers, directions and phases, in ms."""
    spans = [S(0, "compute", 0, 0.002), S(0, "comm", 0.001, 0.004), S(1, "compute", 0, 0.003, layer=1)]
    text = format_report(overlap_report(spans))
    assert "T_compute" in text and "dispatch" in text and "experts" in text and "rank 0" in text
    assert "50%" in text                                            # rank 0's layer 0: 1 / min(3, 2)
    assert len(text.splitlines()) < 30


def _three_steps():
    """Rank 0, layer 0: step 0 (warm-up, 10 s of compute), then two steps of fwd and bwd:
    step 1 fwd: compute [100,102], comm [101,104] -> T_compute 2, T_comm 3, hidden 1, T_step 4, wall 4;
           bwd: compute [105,106], comm [105.5,106.5] -> 1, 1, 0.5, 1.5, wall 1.5;
    step 2 fwd: compute [200,204], comm [201,202] -> 4, 1, 1, 4, wall 4;
           bwd: compute [205,207], comm [206,209] -> 2, 3, 1, 4, wall 4."""
    return [S(0, "compute", 0, 10, step=0), S(0, "comm", 0, 1, step=0),
            S(0, "compute", 100, 102, step=1), S(0, "comm", 101, 104, step=1),
            S(0, "compute", 105, 106, direction="bwd", step=1), S(0, "comm", 105.5, 106.5, direction="bwd", step=1),
            S(0, "compute", 200, 204, step=2), S(0, "comm", 201, 202, step=2),
            S(0, "compute", 205, 207, direction="bwd", step=2), S(0, "comm", 206, 209, direction="bwd", step=2)]


def test_report_is_per_step_without_the_warmup_step():
    """Tier 1: figures are means over the steps, not sums; step 0 (the timeline's first step: warm-up) is
    left out when later steps exist, and the report says so; fwd + bwd = all in every additive column."""
    rep = overlap_report(_three_steps())
    assert rep["steps"] == 2 and rep["step_ids"] == [1, 2] and rep["warmup"] == "excluded" and rep["per_step"]
    fwd, bwd = rep["directions"]
    assert (fwd["direction"], bwd["direction"]) == ("fwd", "bwd")
    want_fwd = {"T_compute": 3, "T_comm": 2, "hidden": 1, "exposed": 1, "T_step": 4, "wall": 4}
    want_bwd = {"T_compute": 1.5, "T_comm": 2, "hidden": 0.75, "exposed": 1.25, "T_step": 2.75, "wall": 2.75}
    for k in want_fwd:
        assert fwd[k] == approx(want_fwd[k]) and bwd[k] == approx(want_bwd[k]), k
    assert fwd["overlap_fraction"] == approx(0.5) and bwd["overlap_fraction"] == approx(0.5)
    o = rep["overall"]
    for k in ("T_compute", "T_comm", "hidden", "exposed", "T_step"):
        assert o[k] == approx(fwd[k] + bwd[k]), k                    # all = fwd + bwd
    assert o["wall"] == approx((6.5 + 9) / 2)                       # per step: first start to last end
    assert o["num_spans"] == 8 and o["per_rank"][0]["T_comm"] == approx(4)
    assert [(L["layer"], L["direction"]) for L in rep["layers"]] == [(0, "fwd"), (0, "bwd")]
    phases = {(p["phase"], p["kind"]): p for p in o["phases"]}
    assert phases[("dispatch", "comm")]["time"] == approx(4) and phases[("dispatch", "comm")]["count"] == 2

    sums = overlap_report(_three_steps(), per_step=False)            # the sums over the counted steps
    assert sums["overall"]["T_compute"] == approx(9) and sums["overall"]["wall"] == approx(15.5)
    assert sums["overall"]["phases"][0]["count"] == 4
    kept = overlap_report(_three_steps(), skip_warmup=False)
    assert kept["warmup"] == "included" and kept["step_ids"] == [0, 1, 2]
    assert kept["overall"]["T_compute"] == approx((10 + 9) / 3)
    only0 = overlap_report(_three_steps()[:2])                       # step 0 alone: kept, and flagged
    assert only0["warmup"] == "included" and only0["steps"] == 1 and only0["overall"]["T_compute"] == approx(10)
    after_reset = overlap_report(_three_steps()[2:])                 # no step 0: nothing left out
    assert after_reset["warmup"] == "none" and after_reset["step_ids"] == [1, 2]

    text = format_report(rep)
    assert "ms per step, mean over 2 steps (1-2) and 1 rank" in text and "step 0 left out" in text
    assert "fwd+bwd" in text and "fwd+bwd = fwd + bwd" in text       # the legend says what the rows are
    assert "step 0 counted" in format_report(only0) and "step 0" not in format_report(after_reset)
    assert "summed over steps" in format_report(sums)


def test_report_names_layers_and_sums_them():
    """Tier 1: rows are named by the spans' module paths; 'all' rows per direction appear with two layers
    and equal the layers' sum (the layers run one after the other)."""
    a, b = "layers.0.moe", "layers.1.moe"
    spans = [S(0, "compute", 0, 2, layer=0, name=a, step=1), S(0, "comm", 1, 4, layer=0, name=a, step=1),
             S(0, "compute", 5, 6, layer=1, name=b, step=1), S(0, "comm", 5, 5.5, layer=1, name=b, step=1),
             S(0, "compute", 7, 9, layer=1, name=b, direction="bwd", step=1),
             S(0, "compute", 10, 11, layer=0, name=a, direction="bwd", step=1),
             S(0, "comm", 10.5, 12, layer=0, name=a, direction="bwd", step=1)]
    rep = overlap_report(spans)
    assert [(L["name"], L["direction"]) for L in rep["layers"]] == [(a, "fwd"), (a, "bwd"), (b, "fwd"), (b, "bwd")]
    for d in rep["directions"]:
        rows = [L for L in rep["layers"] if L["direction"] == d["direction"]]
        for k in ("T_compute", "T_comm", "hidden", "exposed", "T_step"):
            assert d[k] == approx(sum(L[k] for L in rows)), (d["direction"], k)
    text = format_report(rep)
    assert a in text and b in text
    lines = [ln for ln in text.splitlines() if ln.startswith("│ all")]
    assert [ln.split("│")[2].strip() for ln in lines] == ["fwd", "bwd", "fwd+bwd"]


# ============================================================ tier 1: recording
def test_disabled_timeline_costs_nothing():
    """Tier 1: 100k disabled compute spans and 100k disabled comm spans each take < 0.2 s, allocate no
    context objects and record nothing."""
    tl = Timeline()
    assert tl.compute("experts") is tl.compute("dispatch", chunk=3)  # one shared no-op context
    assert tl.mark() is None

    def run_compute():
        t = time.perf_counter()
        for c in range(100_000):
            with tl.compute("experts", c):
                pass
        return time.perf_counter() - t

    def run_comm():
        t = time.perf_counter()
        for c in range(100_000):
            tl.comm("dispatch", None, c)
        return time.perf_counter() - t

    assert min(run_compute() for _ in range(3)) < 0.2              # best of 3: the CPUs are shared
    assert min(run_comm() for _ in range(3)) < 0.2
    assert tl.spans() == []


def test_compute_spans_and_profiler_labels():
    """Tier 1: enabled compute/region spans carry their fields and show as moe_comm.<phase> in a
    torch.profiler trace; a disabled timeline still labels while a profiler runs, but records nothing."""
    tl = Timeline(rank=3, layer=7, enabled=True)
    off = Timeline()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with tl.region("forward"):
            with tl.compute("experts", chunk=1, direction="bwd", layer=2):
                time.sleep(0.01)
            with off.compute("unpermute"):
                pass
    names = {e.key for e in prof.key_averages()}
    assert {"moe_comm.experts", "moe_comm.forward", "moe_comm.unpermute"} <= names
    assert off.spans() == []
    spans = tl.spans()
    assert [(s.phase, s.kind, s.track) for s in spans] == [("forward", "region", "region"),
                                                           ("experts", "compute", "compute")]
    ex = spans[1]
    assert (ex.rank, ex.layer, ex.chunk, ex.direction) == (3, 2, 1, "bwd") and ex.duration >= 0.009
    assert spans[0].layer == 7 and spans[0].start <= ex.start and ex.end <= spans[0].end
    with pytest.raises(ValueError, match="direction"):
        tl.compute("experts", direction="forward")
    tl.reset()
    assert tl.spans() == []


def test_bad_arguments_name_the_argument():
    """Tier 1: constructor and recording arguments are checked when given, naming the argument."""
    with pytest.raises(ValueError, match="rank must be >= 0, got -1"):
        Timeline(rank=-1)
    with pytest.raises(TypeError, match="layer must be an int, got 1.5"):
        Timeline(layer=1.5)
    tl = Timeline(enabled=True)
    with pytest.raises(ValueError, match=r"chunk \(-1: not chunked\) must be >= -1, got -2"):
        tl.compute("experts", chunk=-2)
    with pytest.raises(TypeError, match="layer must be an int"):
        tl.region("forward", layer="0")
    with pytest.raises(TypeError, match=r"start \(a perf_counter float from mark\(\).*got 'now'"):
        tl.comm("dispatch", None, start="now")
    assert tl.spans() == []


def test_timeline_numbers_steps():
    """Tier 1: a forward span after a backward one opens the next step; a forward span inside autograd's
    backward (a checkpoint recompute) stays in its step; next_step() and reset() open one."""
    tl = Timeline(enabled=True, name="layers.0.moe")

    def fwd():
        with tl.compute("router"):
            pass

    def bwd():
        with tl.compute("experts", direction="bwd"):
            pass

    class Recomputed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            fwd()                                                  # the recomputed forward, inside backward
            bwd()
            return g

    fwd(), bwd(), fwd()                                            # steps 0, 0, 1
    tl.next_step()
    fwd()                                                          # 2
    Recomputed.apply(torch.ones(1, requires_grad=True)).sum().backward()  # 2, 2
    fwd()                                                          # 3
    assert [s.step for s in tl.spans()] == [0, 0, 1, 2, 2, 2, 3]
    assert {s.name for s in tl.spans()} == {"layers.0.moe"}
    tl.reset()
    fwd()
    assert [s.step for s in tl.spans()] == [4]                     # after reset(): never step 0
    with pytest.raises(TypeError, match="name must be a str"):
        Timeline(name=3)


class _FakeWork:
    """Stands in for a dist.Work: its future is completed by hand."""

    def __init__(self):
        self.future = torch.futures.Future()

    def get_future(self):
        return self.future


def test_comm_span_ends_at_future_completion():
    """Tier 1: the comm span ends when the work's future completes (here from another thread after
    0.2 s), not when ``comm`` is called; ``work=None`` ends at once; pending spans are bounded."""
    tl = Timeline(enabled=True)
    work = _FakeWork()
    t0 = tl.mark()
    tl.comm("dispatch", work, chunk=0, start=t0)
    t_issue = time.perf_counter() - t0
    done_at = {}

    def complete():
        time.sleep(0.2)
        done_at["t"] = time.perf_counter()
        work.future.set_result(None)

    th = threading.Thread(target=complete)
    th.start()
    tl.comm("counts", None)                                        # synchronous: ends now
    spans = {s.phase: s for s in tl.spans(timeout=5.0)}
    th.join()
    assert t_issue < 0.05
    assert spans["dispatch"].start == t0
    assert spans["dispatch"].end >= done_at["t"] and spans["dispatch"].end - done_at["t"] < 0.05
    assert spans["counts"].duration < 0.05

    never = _FakeWork()
    tl.comm("combine", never)
    with pytest.warns(UserWarning, match="pending"):
        assert [s.phase for s in tl.spans(timeout=0.05)] == ["dispatch", "counts"]
    never.future.set_result(None)
    assert "combine" in [s.phase for s in tl.spans()]              # picked up once complete


def test_gather_without_process_group_is_local():
    """Tier 1: no process group -> gather returns this rank's spans."""
    tl = Timeline(rank=0, enabled=True)
    with tl.compute("router"):
        pass
    assert [s.phase for s in tl.gather()] == ["router"]


class _FakeCudaWork:
    """Stands in for an NCCL work: ``wait()`` makes the current stream wait on an event that fires when
    a side stream's kernel (the "collective") ends."""

    def __init__(self, done_event):
        self.done_event = done_event

    def wait(self):
        torch.cuda.current_stream().wait_event(self.done_event)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_comm_span_ends_when_the_side_stream_finishes():
    """Tier 3: CUDA event spans. The "collective" is a ~50 ms sleep kernel on a side stream; the comm
    span (probe stream) lasts that long, the issue does not block the host, and a compute span on the
    current stream runs inside it."""
    tl = Timeline(enabled=True, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    t_host = time.perf_counter()
    start = tl.mark()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)                             # ~50 ms at ~2 GHz
        done = torch.cuda.Event()
        done.record(side)
    tl.comm("dispatch", _FakeCudaWork(done), chunk=0, start=start)
    with tl.compute("experts", chunk=1):
        a = torch.randn(256, 256, device="cuda")
        (a @ a).sum()
    issue_s = time.perf_counter() - t_host
    spans = {s.phase: s for s in tl.spans(timeout=10.0)}
    assert issue_s < 0.02
    comm, comp = spans["dispatch"], spans["experts"]
    assert comm.duration >= 0.02 and comp.duration < comm.duration
    assert comm.start <= comp.start and comp.end <= comm.end
    st = overlap_report(list(spans.values()))["overall"]
    assert st["hidden"] == pytest.approx(comp.duration, rel=1e-6)


# ============================================================ tier 2: gloo, 2 ranks
def _completion_rank(rank, world_size):
    import torch.distributed as dist

    tl = Timeline(rank=rank, enabled=True)
    send = torch.arange(4 * world_size, dtype=torch.float32) + 100 * rank
    recv = torch.empty_like(send)
    dist.barrier()
    if rank == 1:
        time.sleep(0.5)                                            # rank 0 issues first and waits for us
    t0 = tl.mark()
    work = dist.all_to_all_single(recv, send, async_op=True)
    tl.comm("dispatch", work, chunk=0, start=t0)
    issue_s = time.perf_counter() - t0                             # the issue (and comm) returned here
    work.wait()
    t_wait = time.perf_counter()
    (span,) = tl.spans()
    assert recv.view(world_size, -1)[:, 0].tolist() == [100.0 * r + 4 * rank for r in range(world_size)]
    return issue_s, span.start, span.end, t_wait


@pytest.mark.multirank
def test_gloo_comm_span_ends_at_completion(ranks):
    """Tier 2: rank 0 issues an async all_to_all_single 0.5 s before rank 1 joins. Its issue returns
    at once, but its comm span lasts until the collective completes (>= 0.4 s) and ends no later than
    the moment work.wait() returned: the gloo future callback fires at completion."""
    (issue0, start0, end0, wait0), (issue1, start1, end1, _) = ranks(2).run(_completion_rank)
    assert issue0 < 0.1, f"issuing took {issue0:.3f} s"
    assert end0 - start0 >= 0.4, f"rank 0's span lasted {end0 - start0:.3f} s: ended at issue, not completion"
    assert end0 <= wait0 + 1e-3
    assert end1 - start1 < 0.3                                     # rank 1 arrived last: completes quickly


def _overlap_rank(rank, world_size):
    import torch.distributed as dist

    tl = Timeline(rank=rank, layer=3, enabled=True)
    send = torch.zeros(2 * world_size)
    recv = torch.empty_like(send)
    dist.barrier()
    if rank == 1:
        time.sleep(0.4)
    t0 = tl.mark()
    work = dist.all_to_all_single(recv, send, async_op=True)
    tl.comm("dispatch", work, chunk=0, start=t0)
    if rank == 0:
        with tl.compute("experts", chunk=0):                       # runs while the a2a is in flight
            time.sleep(0.2)
    work.wait()
    with tl.compute("unpermute"):
        time.sleep(0.05)
    return tl.gather()


@pytest.mark.multirank
def test_gloo_hidden_and_exposed_comm(ranks):
    """Tier 2: on rank 0 the a2a is in flight ~0.4 s, 0.2 s of it under compute: hidden ~0.2 s,
    exposed ~0.2 s. Every rank gathers every rank's spans."""
    gathered = ranks(2).run(_overlap_rank)
    assert gathered[0] == gathered[1]
    spans = gathered[0]
    assert {s.rank for s in spans} == {0, 1} and len(spans) == 5
    rep = overlap_report(spans)
    (layer,) = rep["layers"]
    assert (layer["layer"], layer["direction"]) == (3, "fwd")
    r0 = layer["per_rank"][0]
    assert 0.35 <= r0["T_comm"] < 0.7
    assert 0.18 <= r0["hidden"] <= 0.3 and r0["exposed"] >= 0.1
    assert r0["T_compute"] >= 0.24 and r0["overlap_fraction"] > 0.7
    r1 = layer["per_rank"][1]
    assert r1["hidden"] == approx(0) and r1["T_comm"] < 0.3
    assert "dispatch" in format_report(rep)


# ============================================================ tier 1: a model's layers, one process
def _two_layer_model(num_chunks=2):
    import moe_comm

    cfg = moe_comm.MoEConfig(hidden_size=16, ffn_hidden_size=16, num_experts=4, top_k=2, num_chunks=num_chunks)

    class Block(torch.nn.Module):
        def __init__(self, seed):
            super().__init__()
            self.moe = moe_comm.MoELayer(cfg, seed=seed)

        def forward(self, x):
            return x + self.moe(x)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Block(0), Block(1)])
    return model


def _train_steps(model, steps, seed=0):
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    for _ in range(steps):
        y = x
        for block in model.layers:
            y = block(y)
        y.square().mean().backward()


def test_two_layer_model_report_names_module_paths():
    """Tier 1: model_timelines names each MoELayer's timeline by its module path; three steps give a report
    of steps 1-2 (step 0, with the first call's lazy init, left out) whose rows are those paths; all = fwd +
    bwd; after reset() every step counts."""
    model = _two_layer_model()
    tls = model_timelines(model, enabled=True)
    assert list(tls) == ["layers.0.moe", "layers.1.moe"]
    assert [(tl.layer, tl.name) for tl in tls.values()] == [(0, "layers.0.moe"), (1, "layers.1.moe")]
    assert tls["layers.1.moe"] is model.layers[1].moe.timeline
    _train_steps(model, 3)
    rep = overlap_report(gather_spans(tls))
    assert rep["warmup"] == "excluded" and rep["step_ids"] == [1, 2]
    assert {(L["name"], L["direction"]) for L in rep["layers"]} == \
        {(n, d) for n in ("layers.0.moe", "layers.1.moe") for d in ("fwd", "bwd")}
    fwd, bwd = rep["directions"]
    for k in ("T_compute", "T_comm", "hidden", "exposed", "T_step"):
        assert rep["overall"][k] == pytest.approx(fwd[k] + bwd[k], rel=1e-9, abs=1e-12), k
    experts = {(p["phase"], p["kind"]): p for p in rep["overall"]["phases"]}[("experts", "compute")]
    assert experts["count"] == 2 * 2 * 2                           # per step: 2 layers x 2 chunks x fwd, bwd
    text = format_report(rep)
    assert "layers.0.moe" in text and "layers.1.moe" in text and "step 0 left out" in text

    for tl in tls.values():
        tl.reset()
    _train_steps(model, 1)
    rep = overlap_report(gather_spans(tls))
    assert rep["warmup"] == "none" and rep["steps"] == 1

    shared = _two_layer_model()
    shared.layers[1].moe.dispatcher.timeline = shared.layers[0].moe.timeline
    with pytest.raises(ValueError, match="'layers.0.moe' and 'layers.1.moe' share one Timeline"):
        model_timelines(shared)
    with pytest.raises(ValueError, match="holds no module with a Timeline"):
        model_timelines(torch.nn.Linear(2, 2))


# ============================================================ tier 2: a model's layers, 2 ranks
def _model_rank(rank, world_size):
    model = _two_layer_model(num_chunks=1)
    tls = model_timelines(model, enabled=True)
    _train_steps(model, 2, seed=rank)
    return overlap_report(gather_spans(tls))


@pytest.mark.multirank
def test_gather_spans_of_a_two_layer_model(ranks):
    """Tier 2: every rank gets both ranks' spans of both layers in one exchange; step 0 left out."""
    rep0, rep1 = ranks(2).run(_model_rank)
    for rep in (rep0, rep1):
        assert rep["warmup"] == "excluded" and rep["step_ids"] == [1]
        assert {L["name"] for L in rep["layers"]} == {"layers.0.moe", "layers.1.moe"}
        assert all(L["num_ranks"] == 2 for L in rep["layers"])
    assert rep0["overall"]["num_spans"] == rep1["overall"]["num_spans"]
