"""Dispatch throughput measurement on the ranks of a group: ours vs the raw all-to-all of the same bytes.

Shapes legend: T tokens per rank, H hidden, E experts, K top-k, N routed rows sent, R received, B bytes of a
packed FP8 row (``ops.packed_width(H)``).
Timing: every measured call is bracketed by barriers; a point's time is the slowest rank's
median over repeats (the all-to-all finishes when its slowest participant does). Every figure
therefore includes one barrier; the "barrier" phase (an empty call) is that floor.

The minimal pair ("min dispatch", "min combine"): what any dispatch + combine over this transport
must do, timed as one call each: layout, the counts exchange issued and the rows permuted while it
travels, then the raw all-to-all into a buffer already touched (no regroup, no fresh output); and back:
the raw all-to-all, then the weighted unpermute. limit = 2 raw / (min dispatch + min combine) is the
best end-to-end ratio when none of those passes overlaps a transfer. Where the CPU that moves the
bytes also runs the passes (gloo on loopback) the transfer cannot hide them and this is the ceiling;
on a link slower than memory, overlap could beat it.

Bytes, logical and wire (``Dispatcher(dispatch_dtype=, dispatch_scales=, dedup=)``): each point keeps rank 0's
``Dispatcher.last_bytes`` per direction: logical = routed slots x H x element size (how DeepEP and the field
count), wire = what the all-to-alls moved (FP8: packed rows of ``ops.packed_width(H)`` bytes, payload and scales;
rows to itself included). GB/s is given on both: logical GB/s is the rate a caller sees (with FP8 it can pass the
link's), wire GB/s what the link carried. The raw all-to-all moves the dispatch's wire bytes and splits (FP8:
uint8 packed rows), so dispatch_vs_raw stays like for like. With FP8 the combine direction (x's dtype) gets its own
raw all-to-all ("a2a_back" phase); without it the dispatch's raw stands for both (the same bytes, reversed). FP8's
minimal dispatch includes the quantize and the receiver's dequantize, which any FP8 dispatch must run.

Dedup (one copy per (token, rank)) exists only in the pipelined ``Dispatcher.__call__`` and the layer, not in
``dispatch()``/``combine()``. So with dedup the point also times that call, forward only under no_grad, with an
identity expert_fn and one chunk, plain and with dedup, interleaved ("call_s", "call_dedup_s"; their last_bytes
in "call_bytes", "call_dedup_bytes"). Both calls do all but the experts (permute, transfers, regroup or the dedup
expansion, weighted sum) and the experts would see the same rows either way, so the difference is what dedup
saves (or costs) in transfers and bookkeeping for this routing. It is not a training step: the layer step (which
runs with dedup) is.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from moe_comm.comm.collectives import group_device
from moe_comm.dispatch.dispatcher import Dispatcher

__all__ = ["timed", "slowest_median", "BenchPoint", "measure_dispatch", "measure_calls", "bench_rank",
           "grid_points"]


@dataclass
class BenchPoint:
    world_size: int
    tokens: int
    hidden: int
    experts: int
    top_k: int
    dtype: str
    dispatch_bytes: int       # routed rows leaving this rank (rank 0) * H * element size (logical)
    dispatch_s: float
    combine_s: float
    raw_a2a_s: float          # all_to_all_single of exactly the dispatch's wire bytes and splits
    dispatch_gbps: float
    combine_gbps: float
    raw_gbps: float           # raw_bytes / raw_a2a_s
    dispatch_vs_raw: float    # raw time / dispatch time (1.0 = as fast as the transport)
    #                           combine_vs_raw: raw_combine_a2a_s / combine time
    combine_vs_raw: float
    tokens_per_s: float       # tokens through dispatch + combine per second, per rank
    end_to_end_vs_raw: float = 0.0   # (raw + raw combine) / (dispatch + combine)
    bytes_per_pair: int = 0          # dispatch_bytes / W: the mean message per rank pair
    num_chunks: int = 1
    workload: str = "uniform"
    layer_step_s: float = 0.0        # pipelined layer forward + backward with num_chunks (0: not measured)
    layer_transport: str = ""        # the transport the layer chose by itself for this point
    layer_step_by_transport_s: Dict[str, float] = None  # the same step with each transport forced (and
    # "all_to_all_regroup": the all-to-all with the experts always on expert-major rows)
    phases_s: Dict[str, float] = None  # layout, permute, counts, a2a, regroup, unpermute, barrier, min_dispatch,
    #                                    min_combine (slowest rank); with FP8 also quantize, dequantize, a2a_back
    direct: bool = False             # dispatch/combine moved rows point-to-point (no regroup)
    serial_limit_vs_raw: float = 0.0  # (raw + raw combine) / (min dispatch + min combine): module docstring
    cached_freed_memory: bool = False  # moe_comm.tools.launch.cache_freed_memory took effect in the ranks
    dispatch_dtype: str = ""         # "" (rows travel in dtype) or "float8_e4m3fn"
    dispatch_scales: str = ""        # FP8 block scales: "fp32" or "ue8m0" ("" without FP8)
    dedup: bool = False              # the layer step and call_dedup_s ran with one copy per (token, rank)
    # rank 0's Dispatcher.last_bytes of dispatch(): logical = routed slots x H x element size, wire = what moved
    dispatch_logical_bytes: int = 0
    dispatch_wire_bytes: int = 0
    combine_logical_bytes: int = 0
    combine_wire_bytes: int = 0
    dispatch_logical_gbps: float = 0.0  # bytes / dispatch_s (combine_*: / combine_s)
    dispatch_wire_gbps: float = 0.0
    combine_logical_gbps: float = 0.0
    combine_wire_gbps: float = 0.0
    raw_bytes: int = 0               # what the raw all-to-all moved (rank 0, dispatch direction): the wire bytes
    raw_combine_a2a_s: float = 0.0   # the raw all-to-all of the combine's bytes (= raw_a2a_s without FP8)
    call_s: float = 0.0              # pipelined __call__, identity experts, no_grad, C=1 (0: not measured)
    call_dedup_s: float = 0.0        # the same with dedup=True
    call_bytes: Dict[str, int] = None        # rank 0's last_bytes of that call
    call_dedup_bytes: Dict[str, int] = None  # and of the dedup call
    ranks_per_node: Optional[int] = None     # the layer's two-level dispatch (None: flat)
    layer_bytes: Dict[str, int] = None       # rank 0's last_bytes of the layer's last forward (two-level: by link)
    layer_comm_s: Dict[str, float] = None    # two-level: rank 0's comm seconds of one layer step per timeline track

    def as_dict(self) -> Dict:
        return asdict(self)


def timed(fn, group) -> float:
    """Seconds ``fn`` takes on this rank, bracketed by barriers (collective)."""
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    dist.barrier(group=group)
    return time.perf_counter() - t0


def slowest_median(samples: List[float], group) -> float:
    """The slowest rank's median of ``samples`` (collective: one all_reduce MAX)."""
    t = torch.tensor([statistics.median(samples)], dtype=torch.float64).to(group_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)  # host sync: benchmark bookkeeping, between timed calls


def measure_dispatch(x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor,
                     dispatcher: Dispatcher, repeats: int = 10, warmup: int = 2) -> BenchPoint:
    """Time dispatch, combine, the raw all-to-all of the same wire bytes, and each phase on its own
    (collective over the group; every rank must call it with its own inputs).

    x_TH [T, H] float, topk_idx_TK [T, K] int64 (-1 = dropped), topk_weight_TK [T, K] float32: this rank's
    tokens and routing. The dispatcher's dispatch_dtype / dispatch_scales set what travels (module docstring).
    """
    from moe_comm import ops
    from moe_comm.comm.collectives import exchange_counts, exchange_counts_async, wait_work
    from moe_comm.kernels import select_backend

    group = dispatcher.group
    out = dispatcher.dispatch(x_TH, topk_idx_TK)
    last = dict(dispatcher.last_bytes)  # this call's bytes per direction, host ints
    handle = out.handle
    plan = handle.chunks[0]
    T, H = x_TH.shape
    fp8 = dispatcher.dispatch_dtype is not None
    ue8m0 = dispatcher.dispatch_scales == "ue8m0"
    backend = select_backend("auto", x_TH.device)
    x_NH = ops.permute(x_TH, handle.layout)
    # the rows the dispatch put on the wire: x_NH, or FP8 packed rows [N, B] uint8 in the same order
    wire_NB = (backend.permute_rows(ops.quantize_rows(x_TH, ue8m0=ue8m0), handle.layout.token_S[:plan.num_rows])
               if fp8 else x_NH)
    raw_out = wire_NB.new_empty(plan.num_recv, wire_NB.shape[1])  # the transport's best case: a buffer already touched
    W = dist.get_world_size(group) if group is not None else 1
    counts = torch.zeros(W, dispatcher.num_local_experts + 3, dtype=torch.int64, device=group_device(group))
    y_RH = out.tokens.clone()  # the combine direction's rows, in x's dtype
    back_NH = torch.empty_like(x_NH)
    send_NB = torch.empty_like(wire_NB)

    def min_dispatch():
        layout = ops.make_layout(topk_idx_TK, dispatcher.num_experts, num_ranks=W)
        send_WX = torch.cat([layout.counts_CWe[0], counts[:, dispatcher.num_local_experts:]], dim=1)
        recv_WX, work = exchange_counts_async(send_WX, group)
        src_TB = ops.quantize_rows(x_TH, ue8m0=ue8m0) if fp8 else x_TH
        backend.permute_rows(src_TB, layout.token_S[:plan.num_rows], out=send_NB)
        wait_work(work, "counts exchange")
        recv_WX.tolist()  # host sync: the split sizes, as any dispatch needs
        _raw(send_NB, raw_out, plan, group)
        if fp8:
            ops.dequantize_rows(raw_out, H, x_TH.dtype, ue8m0=ue8m0)

    def min_combine():
        _raw(y_RH, back_NH, plan, group, back=True)
        ops.unpermute(back_NH, handle.layout, topk_weight_TK)

    phases = {
        "layout": lambda: ops.make_layout(topk_idx_TK, dispatcher.num_experts, num_ranks=W),
        "permute": lambda: ops.permute(x_TH, handle.layout,
                                       out=dispatcher.workspace.rows("send", plan.num_rows, H, x_TH)),
        "counts": lambda: exchange_counts(counts, group),
        "a2a": lambda: _raw(wire_NB, raw_out, plan, group),
        "regroup": lambda: (ops.gather_rows(y_RH, plan.expert_index_R, plan.source_index_R)
                            if plan.expert_index_R is not None else None),
        "unpermute": lambda: ops.unpermute(x_NH, handle.layout, topk_weight_TK),
        "barrier": lambda: None,  # the floor every timed figure includes
        "min_dispatch": min_dispatch,
        "min_combine": min_combine,
    }
    if fp8:
        phases.update({"quantize": lambda: ops.quantize_rows(x_TH, ue8m0=ue8m0),
                       "dequantize": lambda: ops.dequantize_rows(raw_out, H, x_TH.dtype, ue8m0=ue8m0),
                       "a2a_back": lambda: _raw(y_RH, back_NH, plan, group, back=True)})
    samples = {k: [] for k in ("dispatch", "combine", *phases)}
    for i in range(warmup + repeats):
        holder = {}
        td = timed(lambda: holder.setdefault("out", dispatcher.dispatch(x_TH, topk_idx_TK)), group)
        tc = timed(lambda: dispatcher.combine(y_RH, topk_weight_TK, holder["out"].handle), group)
        holder.clear()  # the dispatch output dies here, as in a layer: the next one can reuse its memory
        times = {"dispatch": td, "combine": tc}
        for name, fn in phases.items():
            times[name] = timed(fn, group)
        if i >= warmup:
            for k, v in times.items():
                samples[k].append(v)
    med = {k: slowest_median(v, group) for k, v in samples.items()}
    if handle.direct:
        med["regroup"] = 0.0  # rows arrive in expert-major order: no regroup pass
    d, c, r = med["dispatch"], med["combine"], med["a2a"]
    rc = med.get("a2a_back", r)  # without FP8 both directions move the same bytes
    nbytes = plan.num_rows * H * x_TH.element_size()
    raw_bytes = plan.num_rows * wire_NB.shape[1] * wire_NB.element_size()
    dl, dw, cl, cw = (last[k] for k in ("dispatch_logical", "dispatch_wire", "combine_logical", "combine_wire"))
    return BenchPoint(world_size=W, tokens=T, hidden=H, experts=dispatcher.num_experts,
                      top_k=topk_idx_TK.shape[1], dtype=str(x_TH.dtype).replace("torch.", ""),
                      dispatch_bytes=nbytes, dispatch_s=d, combine_s=c, raw_a2a_s=r,
                      dispatch_gbps=nbytes / d / 1e9, combine_gbps=nbytes / c / 1e9, raw_gbps=raw_bytes / r / 1e9,
                      dispatch_vs_raw=r / d, combine_vs_raw=rc / c, tokens_per_s=T / (d + c),
                      end_to_end_vs_raw=(r + rc) / (d + c), bytes_per_pair=nbytes // max(W, 1),
                      phases_s={k: med[k] for k in phases}, direct=handle.direct,
                      serial_limit_vs_raw=(r + rc) / (med["min_dispatch"] + med["min_combine"]),
                      dispatch_dtype=str(dispatcher.dispatch_dtype).replace("torch.", "") if fp8 else "",
                      dispatch_scales=dispatcher.dispatch_scales if fp8 else "",
                      dispatch_logical_bytes=dl, dispatch_wire_bytes=dw, combine_logical_bytes=cl,
                      combine_wire_bytes=cw, dispatch_logical_gbps=dl / d / 1e9, dispatch_wire_gbps=dw / d / 1e9,
                      combine_logical_gbps=cl / c / 1e9, combine_wire_gbps=cw / c / 1e9, raw_bytes=raw_bytes,
                      raw_combine_a2a_s=rc)


def measure_calls(x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor, plain: Dispatcher,
                  dedup: Dispatcher, repeats: int = 10, warmup: int = 2):
    """The pipelined ``__call__`` (one chunk, identity expert_fn, forward only under no_grad) with ``plain``
    and with ``dedup`` (a Dispatcher with dedup=True and otherwise the same settings), interleaved; collective.

    Inputs as in ``measure_dispatch``. Returns (plain seconds, dedup seconds: each the slowest rank's median,
    plain.last_bytes, dedup.last_bytes: this rank's dicts of the last call).
    """
    def identity(tokens_RH, tokens_per_expert_e):
        return tokens_RH

    calls = {"plain": plain, "dedup": dedup}
    samples = {name: [] for name in calls}
    with torch.no_grad():
        for i in range(warmup + repeats):
            for name, d in calls.items():
                t = timed(lambda: d(x_TH, topk_idx_TK, topk_weight_TK, identity, num_chunks=1), plain.group)
                if i >= warmup:
                    samples[name].append(t)
    med = {name: slowest_median(v, plain.group) for name, v in samples.items()}
    return med["plain"], med["dedup"], dict(plain.last_bytes), dict(dedup.last_bytes)


def _raw(x, out, plan, group, back: bool = False):
    """The raw all-to-all of the dispatch's bytes and splits (``back``: the combine's direction)."""
    from moe_comm.comm.collectives import all_to_all_v_async, wait_work

    out_splits, in_splits = ((plan.send_splits_W, plan.recv_splits_W) if back
                             else (plan.recv_splits_W, plan.send_splits_W))
    wait_work(all_to_all_v_async(out, x, out_splits, in_splits, group), "raw a2a")


def _never(block_rows, device) -> bool:
    return False


def _comm_by_track(layer, xs: torch.Tensor, group) -> Dict[str, float]:
    """One more layer step (forward + backward) with the timeline on: rank 0's comm seconds per track (two-level:
    "comm inter-node", "comm intra-node", and "comm" for the whole group's exchanges), each the sum of its spans
    (spans in flight at once overlap: a sum, not a wall time). Collective (the spans are gathered)."""
    tl = layer.timeline
    was, tl.enabled = tl.enabled, True
    tl.reset()
    try:
        layer(xs).float().square().mean().backward()
    finally:
        tl.enabled = was
    out: Dict[str, float] = {}
    for s in tl.gather(group):
        if s.rank == 0 and s.kind == "comm":
            out[s.track] = out.get(s.track, 0.0) + (s.end - s.start)
    tl.reset()
    return out


def _layer_steps(layer, xs: torch.Tensor, group, repeats: int):
    """Layer forward + backward: with the transport it chooses itself, and with each transport forced (the
    same threshold on every rank, so every rank takes the same one); "all_to_all_regroup": the all-to-all with
    the experts always on expert-major rows after a regroup (never the rank-major rows, which the layer takes
    by itself where ``GroupedExperts.prefers_segments`` says so). Interleaved; slowest rank's median."""
    d, experts = layer.dispatcher, layer.experts
    default, force = d.direct_min_bytes, {"all_to_all": (1 << 62, True)}
    if getattr(d, "ranks_per_node", None):  # two levels: each picks its own transport; nothing to force here
        force = {}
    elif d.num_local_experts > 1 and d.world_size > 1 and not d.dedup:  # one copy per rank: one all-to-all only
        force["point_to_point"] = (0, True)
        force["all_to_all_regroup"] = (1 << 62, False)

    def step():
        y = layer(xs)
        y.float().square().mean().backward()

    samples = {name: [] for name in ["default", *force]}
    for i in range(repeats + 1):
        for name in samples:
            d.direct_min_bytes, rank_major = (default, True) if name == "default" else force[name]
            if rank_major:
                experts.__dict__.pop("prefers_segments", None)  # the class's own rule
            else:
                experts.prefers_segments = _never
            t = timed(step, group)
            if i:  # the first round warms up every path
                samples[name].append(t)
    d.direct_min_bytes = default
    experts.__dict__.pop("prefers_segments", None)
    layer(xs)  # which transport the layer takes by itself (every rank takes the same)
    chosen = d.last_transport
    med = {name: slowest_median(v, group) for name, v in samples.items()}
    return med.pop("default"), chosen, med


def grid_points(opts: Dict) -> List[Dict]:
    """Cartesian product of the list-valued options (tokens, hidden, top_k, experts, chunks, dtype, workload)."""
    import itertools

    keys = ("tokens", "hidden", "top_k", "experts", "chunks", "dtype", "workload")
    return [dict(zip(keys, combo)) for combo in itertools.product(*(opts[k] for k in keys))]


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bench_rank(rank: int, world_size: int, opts: Dict) -> List[Dict]:
    """Run every grid point on this rank (collective); returns the points (rank 0's view). opts: the grid
    (``grid_points``), repeats, ffn, layer, seed, progress, and what travels: dispatch_dtype ("none" | "fp8"),
    dispatch_scales ("fp32" | "ue8m0"), dedup (bool)."""
    from moe_comm.config import MoEConfig
    from moe_comm.tools.launch import freed_memory_cached
    from moe_comm.modules.layer import MoELayer
    from moe_comm.testing.workloads import make_workload

    points = grid_points(opts)
    # what travels: opts["dispatch_dtype"] "none" | "fp8", opts["dispatch_scales"] "fp32" | "ue8m0", opts["dedup"]
    fp8 = opts.get("dispatch_dtype", "none") == "fp8"
    wire = {"dispatch_dtype": torch.float8_e4m3fn if fp8 else None,
            "dispatch_scales": opts.get("dispatch_scales", "fp32")}
    dedup = bool(opts.get("dedup", False))
    progress = None
    if rank == 0 and opts.get("progress", True):
        from rich.progress import Progress
        progress = Progress(transient=True)
        progress.start()
        task = progress.add_task(f"moe-comm bench, {world_size} ranks", total=len(points))
    results = []
    try:
        for pt in points:
            T, H, K, E = pt["tokens"], pt["hidden"], pt["top_k"], pt["experts"]
            dtype = _DTYPES[pt["dtype"]]
            g = torch.Generator().manual_seed(1000 * rank + 7)
            x = torch.randn(T, H, generator=g).to(dtype)
            idx = make_workload(pt["workload"])(T, E, K, seed=opts.get("seed", 0) * 1000 + rank)
            w = torch.rand(T, K, generator=g)
            d = Dispatcher(num_experts=E, **wire)
            point = measure_dispatch(x, idx, w, d, repeats=opts.get("repeats", 10))
            if dedup:  # dispatch()/combine() have no dedup: the pipelined call, plain vs dedup
                point.dedup = True
                point.call_s, point.call_dedup_s, point.call_bytes, point.call_dedup_bytes = measure_calls(
                    x, idx, w, d, Dispatcher(num_experts=E, dedup=True, **wire), repeats=opts.get("repeats", 10))
            point.num_chunks = pt["chunks"]
            point.cached_freed_memory = freed_memory_cached()
            point.workload = pt["workload"]
            if opts.get("layer", True):
                cfg = MoEConfig(hidden_size=H, ffn_hidden_size=opts.get("ffn", 256), num_experts=E, top_k=K,
                                num_chunks=pt["chunks"], dedup=dedup, ranks_per_node=opts.get("ranks_per_node"),
                                **wire)
                layer = MoELayer(cfg, seed=1, dtype=dtype)
                xs = x[: min(T, opts.get("layer_tokens", 1024))].clone().requires_grad_(True)
                point.layer_step_s, point.layer_transport, point.layer_step_by_transport_s = \
                    _layer_steps(layer, xs, d.group, opts.get("layer_repeats", 3))
                point.ranks_per_node = layer.dispatcher.ranks_per_node
                point.layer_bytes = dict(layer.dispatcher.last_bytes)
                if point.ranks_per_node:
                    point.layer_comm_s = _comm_by_track(layer, xs, d.group)
            results.append(point.as_dict())
            if progress is not None:
                progress.advance(task)
    finally:
        if progress is not None:
            progress.stop()
    return results
