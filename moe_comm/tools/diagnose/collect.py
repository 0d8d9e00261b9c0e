"""Run an MoE layer with the timeline on and measure what the diagnosis needs (collective).

Shapes legend: T tokens per rank, H hidden, F expert FFN size, E experts (global), e = E / W local
experts, K top-k, W EP world size, C chunks, R rows received by a rank.

``profile_rank`` is called on every rank (through ``launch.run_ranks``). It only uses the public
surface of the layer and the dispatcher (``layer.dispatcher.dispatch``) and the measurements of
``moe_comm.dispatch.autotune`` that ``num_chunks="auto"`` itself runs, so the findings reason with the
same numbers the library chooses by. Every collective here uses tensors on the group's device.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from moe_comm.dispatch.autotune import chunk_overhead, measure_alpha_beta, measure_overlap
from moe_comm.tools.diagnose.options import DTYPES, FP8, normalize_opts

__all__ = ["profile_rank", "distinct_rows_W", "OVERLAP_PROBE_CHUNKS"]

# eta is probed with one chunk of a 4-deep pipeline, the message num_chunks="auto" probes with
# (dispatch.autotune: measure_overlap(group, device, bytes_max // 4), bytes_max the largest dispatch).
OVERLAP_PROBE_CHUNKS = 4


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: timing only, outside the profiled steps


def _median_s(fn: Callable[[], Any], device: torch.device, repeats: int = 5) -> float:
    """Median seconds of ``fn()`` after one warm-up call, every rank timing at the same time (the ranks
    share the machine during a step too, so they should share it while measured). Collective."""
    fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _inputs(opts: Dict[str, Any], rank: int, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """x_TH of one step. With a workload, the first E columns are router logits whose top-K is exactly
    that workload's routing (the router weight is pinned to [I_E | 0], see ``_pin_router``)."""
    from moe_comm.testing.workloads import make_workload, routing_logits

    T, H, E, K = opts["tokens"], opts["hidden"], opts["experts"], opts["top_k"]
    g = torch.Generator().manual_seed(opts["seed"] * 1_000_003 + rank * 1009 + step)
    x_TH = torch.randn(T, H, generator=g)
    if opts["workload"] != "router":
        wl = make_workload(opts["workload"], **opts["workload_params"])
        topk_idx_TK = wl(T, E, K, seed=opts["seed"] * 1000 + rank, step=step)
        x_TH[:, :E] = routing_logits(topk_idx_TK, E, seed=step, dtype=torch.float64).float()
    return x_TH.to(device=device, dtype=dtype)


@torch.no_grad()
def _pin_router(layer) -> None:
    """Router weight [E, H] := [I_E | 0]: logits = x[:, :E], so ``_inputs`` decides the routing."""
    w_EH = torch.zeros_like(layer.router.weight)
    w_EH[:, :w_EH.shape[0]] = torch.eye(w_EH.shape[0], dtype=w_EH.dtype, device=w_EH.device)
    layer.router.weight.copy_(w_EH)


def _timed_steps(layer, opts: Dict[str, Any], rank: int, dtype: torch.dtype, device: torch.device):
    """Warm-up steps, then ``steps`` forward+backward steps with the timeline on. Collective.
    Returns (host wall seconds of each timed step, the inputs x_TH of the timed steps, detached)."""
    tl = layer.timeline

    def step(s: int) -> torch.Tensor:
        x_TH = _inputs(opts, rank, s, dtype, device).requires_grad_(True)
        with tl.region("forward"):
            y_TH = layer(x_TH)
            loss = y_TH.float().sum()
        with tl.region("backward", direction="bwd"):
            loss.backward()
        return x_TH.detach()

    for s in range(opts["warmup"]):
        step(s)
    layer.zero_grad(set_to_none=True)
    tl.reset()
    tl.enabled = True
    step_s, xs = [], []
    for s in range(opts["warmup"], opts["warmup"] + opts["steps"]):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        xs.append(step(s))
        _sync(device)
        step_s.append(time.perf_counter() - t0)
    tl.enabled = False
    return step_s, xs


def _measure_experts(layer, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, device: torch.device) -> Dict[str, Any]:
    """Dispatch one step's routing (collective) and time the bare experts on the R rows this rank
    received, forward and forward+backward, then a plain [max(R, 1), H] x [H, F] GEMM. Collective."""
    H, F = layer.cfg.hidden_size, layer.cfg.ffn_hidden_size
    with torch.no_grad():
        out = layer.dispatcher.dispatch(x_TH, topk_idx_TK)  # collective: counts exchange + all-to-all
    R = out.tokens.shape[0]
    tokens_per_expert_e, counts_e = out.tokens_per_expert, list(out.counts)
    x_RH = out.tokens.detach().clone()
    with torch.no_grad():
        expert_fwd_s = _median_s(lambda: layer.experts(x_RH, tokens_per_expert_e, counts=counts_e), device)
    x_in = x_RH.requires_grad_(True)
    params = [x_in] + list(layer.experts.parameters())

    def fwd_bwd():
        out_RH = layer.experts(x_in, tokens_per_expert_e, counts=counts_e)
        torch.autograd.grad(out_RH, params, grad_outputs=torch.ones_like(out_RH), allow_unused=True)

    expert_fwdbwd_s = _median_s(fwd_bwd, device)
    M = max(R, 1)
    g = torch.Generator().manual_seed(R + 17)
    a_MH = torch.randn(M, H, generator=g).to(device=device, dtype=x_TH.dtype)
    b_HF = torch.randn(H, F, generator=g).to(device=device, dtype=x_TH.dtype)
    gemm_s = _median_s(lambda: a_MH @ b_HF, device)
    return {"expert_rows": R, "expert_fwd_s": expert_fwd_s, "expert_fwdbwd_s": expert_fwdbwd_s,
            "expert_flops": 6.0 * R * H * F, "gemm_s": gemm_s, "gemm_flops": 2.0 * M * H * F}


def distinct_rows_W(topk_idx_TK: torch.Tensor, num_local_experts: int, world_size: int) -> torch.Tensor:
    """[W] int64: tokens of this rank with at least one expert on rank w, i.e. the rows a dispatch with one
    copy per (token, rank) sends there. topk_idx_TK: [T, K] int64 global expert ids, -1 = dropped.
    Example: e = 2, W = 2, topk_idx_TK = [[0, 1], [3, 0], [-1, 2]] -> [2, 2] (routed slots: [3, 2])."""
    valid_TK = topk_idx_TK >= 0
    rank_TK = torch.where(valid_TK, topk_idx_TK // num_local_experts, 0)
    hits_TW = torch.zeros(topk_idx_TK.shape[0], world_size, dtype=torch.int64, device=topk_idx_TK.device)
    hits_TW.scatter_add_(1, rank_TK, valid_TK.to(torch.int64))
    return (hits_TW > 0).sum(0)


def profile_rank(rank: int, world_size: int, opts: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Profile one MoELayer on the default process group; call it on every rank (``run_ranks``).

    Args:
        rank, world_size: this rank and W (the default group's).
        opts: see ``DEFAULT_OPTS`` (``normalize_opts`` is applied).
    Returns (rank 0; None elsewhere) a JSON-serialisable dict: "opts", "world_size", "steps",
        "num_chunks", "element_size", "spans" (every rank's spans as dicts, seconds), "step_s" (host
        wall of each timed step, rank 0, between barriers), "alpha_s", "beta_bytes_per_s" (the
        all-to-all fit), "overlap_efficiency" (eta of ``autotune.measure_overlap``, the smallest over
        the ranks) with "overlap_probe_bytes" (its message), and "ranks": one dict per rank with
        "rows_sent", "rows_recv" (mean per step), "rows_recv_per_expert" [e], "bytes_sent",
        "bytes_recv" (per step, dispatch direction, logical: rows x H x element size), "rows_sent_dedup",
        "rows_recv_dedup" (distinct (token, destination rank) rows of the same routing, mean per step: what
        one copy per rank would move), "last_bytes" (``Dispatcher.last_bytes`` of the last timed step's
        layer call), "expert_rows" (R of the bare expert measurement:
        the rows the last timed step's routing sends this rank), "expert_fwd_s", "expert_fwdbwd_s" (bare
        experts on those rows with their per-expert counts), "expert_flops" (forward: 6 R H F),
        "gemm_s", "gemm_flops" (plain [max(R,1), H] x [H, F]), "kappa_s" (``autotune.chunk_overhead``:
        one more chunk's fixed cost, as num_chunks="auto" measures it). Also "dispatch_dtype" (None or
        "float8_e4m3fn"), "dispatch_scales", "dedup" (what the layer ran with), "fp8_row_bytes"
        (``ops.packed_width(H)`` with those scales) and "weight_element_size" (of the routing weights).
    """
    from moe_comm import ops
    from moe_comm.config import MoEConfig
    from moe_comm.modules.layer import MoELayer
    from moe_comm.routing import count_tokens

    opts = normalize_opts(opts)
    T, H, F, E, K, C = (opts[k] for k in ("tokens", "hidden", "ffn", "experts", "top_k", "num_chunks"))
    W, e = world_size, opts["experts"] // world_size
    dtype = DTYPES[opts["dtype"]]
    group = dist.group.WORLD
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    elsize = torch.empty((), dtype=dtype).element_size()

    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, num_chunks=C, dedup=opts["dedup"],
                    dispatch_dtype=torch.float8_e4m3fn if opts["dispatch_dtype"] == FP8 else None,
                    dispatch_scales=opts["dispatch_scales"], ranks_per_node=opts.get("ranks_per_node"))
    layer = MoELayer(cfg, seed=opts["seed"], device=device, dtype=dtype)
    if opts["workload"] != "router":
        _pin_router(layer)
    layer.timeline.device = device
    step_s, xs = _timed_steps(layer, opts, rank, dtype, device)
    spans = layer.timeline.gather()

    last_bytes = dict(layer.dispatcher.last_bytes)
    # Expert load of the timed steps: rows every expert received (summed over sources), mean per step; and the
    # distinct (token, rank) rows per destination (what one copy per rank moves), summed over sources.
    with torch.no_grad():
        routing = [layer.router(x_TH) for x_TH in xs]
    routes = [r.topk_idx_TK for r in routing]
    weight_es = routing[0].topk_weight_TK.element_size()
    counts_E = torch.zeros(E, dtype=torch.int64, device=device)
    distinct_W = torch.zeros(W, dtype=torch.int64, device=device)
    sent = torch.zeros((), dtype=torch.int64, device=device)
    for topk_idx_TK in routes:
        c_E, dropped = count_tokens(topk_idx_TK, E)
        counts_E += c_E
        sent += topk_idx_TK.numel() - dropped
        distinct_W += distinct_rows_W(topk_idx_TK, e, W)
    sent_rows = torch.stack([sent, distinct_W.sum()])  # this rank's routed and distinct rows
    load = torch.cat([counts_E, distinct_W])
    dist.all_reduce(load, group=group)
    n = len(routes)
    per_step = (torch.cat([load, sent_rows]).double() / n).tolist()  # host sync: after the timed steps
    load_We = torch.tensor(per_step[:E], dtype=torch.float64).reshape(W, e)
    recv_dedup, (rows_sent, sent_dedup) = per_step[E + rank], per_step[E + W:]

    # eta probed as num_chunks="auto" probes it: the largest rank's dispatch bytes / OVERLAP_PROBE_CHUNKS.
    bytes_max = torch.tensor([rows_sent * H * elsize], dtype=torch.float64, device=device)
    dist.all_reduce(bytes_max, op=dist.ReduceOp.MAX, group=group)
    probe = int(bytes_max.item()) // OVERLAP_PROBE_CHUNKS  # host sync: the probe size, outside the steps

    measured = _measure_experts(layer, xs[-1], routes[-1], device)
    kappa_s = chunk_overhead(layer.experts, xs[-1], e)
    alpha, beta = measure_alpha_beta(group, device)
    eta = measure_overlap(group, device, probe)

    per_expert = load_We[rank].tolist()  # host sync: profiling, after the timed steps
    mine = {"rank": rank, "rows_sent": rows_sent, "rows_recv": float(load_We[rank].sum()),
            "rows_recv_per_expert": per_expert, "bytes_sent": rows_sent * H * elsize,
            "bytes_recv": float(load_We[rank].sum()) * H * elsize, "rows_sent_dedup": sent_dedup,
            "rows_recv_dedup": recv_dedup, "last_bytes": last_bytes, **measured, "kappa_s": kappa_s}
    every: List[Optional[Dict[str, Any]]] = [None] * W
    dist.all_gather_object(every, mine, group=group)  # NCCL: pickled into tensors on the current CUDA device
    if rank != 0:
        return None
    return {
        "opts": opts, "world_size": W, "steps": opts["steps"], "num_chunks": C, "element_size": elsize,
        "hidden": H, "ffn": F, "experts": E, "top_k": K, "tokens": T, "device": str(device),
        "backend": dist.get_backend(group), "dispatch_dtype": opts["dispatch_dtype"],
        "dispatch_scales": opts["dispatch_scales"], "dedup": opts["dedup"],
        "fp8_row_bytes": ops.packed_width(H, ue8m0=opts["dispatch_scales"] == "ue8m0"),
        "weight_element_size": weight_es,
        "spans": [dataclasses.asdict(s) for s in spans], "step_s": step_s,
        "alpha_s": alpha, "beta_bytes_per_s": beta, "overlap_efficiency": eta, "overlap_probe_bytes": probe,
        "ranks": every,
    }
