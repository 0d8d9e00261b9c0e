"""The chunked dispatch -> experts -> combine schedule, forward and backward.

Shapes legend: N routed rows sent, R rows received (per chunk), H hidden, e local experts, C chunks.

Forward, per rank (D = dispatch all-to-all, X = experts, B = combine all-to-all):
    issue D0 | issue D1, wait D0, X0, issue B0 | issue D2, wait D1, X1, issue B1 | ... | wait all B
so D(c+1) and B(c-1) are in flight while X(c) computes. Backward mirrors it with the gradient
all-to-alls: the combine gradient travels in the dispatch direction and vice versa, and chunk c+1's
gradient exchange is in flight while chunk c's expert backward runs. Every rank issues its
collectives in the same order (chunk-major), so the schedule cannot deadlock whatever the routing.

The experts' own backward runs as a nested ``torch.autograd.backward`` per chunk (as reentrant
activation checkpointing does): any differentiable ``expert_fn`` gets correct gradients, which are
accumulated into ``.grad`` of the leaves it uses. Consequently ``torch.autograd.grad(loss, params)``
does not return expert-parameter gradients (and ``torch.autograd.grad(loss, [x])`` still accumulates
them into ``.grad``); use ``loss.backward()``. Double backward (``create_graph=True``) and a second
backward through the same forward raise a RuntimeError instead of returning wrong gradients.

Determinism: the same inputs give bit-identical outputs and gradients run to run (fixed collective
order, fixed-order slot sums, no atomics on CPU). Different chunk counts agree only to rounding: each
expert's GEMM sees another row count M per chunk, BLAS picks M-dependent kernels that round a row
differently (measured on the CPU build: 2 of 40 values of M), and weight gradients are summed chunk
by chunk. cuBLAS behaves the same way.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from moe_comm.comm.collectives import all_to_all_v_async, wait_work
from moe_comm.kernels import select_backend

__all__ = ["run_pipeline"]


@dataclass
class _Run:
    """Everything one pipelined call needs, handed to the autograd Function."""

    dispatcher: "object"
    handle: "object"
    expert_fn: Callable
    side_fn: Optional[Callable[[], torch.Tensor]]
    grad_enabled: bool
    keep_output: bool = True  # y_NH is saved for backward (the weights need grad): fresh memory
    measure: bool = False  # time the experts (num_chunks="auto" planning; syncs CUDA once)
    expert_s: float = 0.0
    side_out: Optional[torch.Tensor] = None
    expert_io: List = field(default_factory=list)  # per chunk: (tokens_in_RH leaf, out_RH)


def _chunk_regions(d, chunks, like: torch.Tensor, name: str) -> list:
    """Disjoint [R_c, H] workspace views, one per chunk (None for W = 1: nothing is received)."""
    if d.world_size == 1:
        return [None] * len(chunks)
    total = sum(p.num_recv for p in chunks)
    buf = d.workspace.rows(name, total, like.shape[1], like)
    regions, start = [], 0
    for p in chunks:
        regions.append(buf.narrow(0, start, p.num_recv))
        start += p.num_recv
    return regions


def _issue(d, dst: torch.Tensor, src: torch.Tensor, p, to_experts: bool, phase: str, c: int, direction: str):
    """Start moving chunk c's rows towards the experts' ranks (``to_experts``) or back to their
    tokens' ranks; returns the Work (None with one rank: a local copy). Recorded in the timeline."""
    if d.world_size == 1:
        dst.copy_(src)
        return None
    out_splits, in_splits = (p.recv_splits_W, p.send_splits_W) if to_experts else (p.send_splits_W, p.recv_splits_W)
    t0 = d.timeline.mark()
    work = all_to_all_v_async(dst, src.contiguous(), out_splits, in_splits, d.group)
    d.timeline.comm(phase, work, chunk=c, direction=direction, start=t0)
    return work


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: only while measuring for num_chunks="auto"
    return time.perf_counter()




class _PipelinedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NH: torch.Tensor, anchor: Optional[torch.Tensor], run: _Run) -> torch.Tensor:
        with run.dispatcher.workspace.dropped_on_error():
            return _PipelinedExperts._forward(ctx, x_NH, run)

    @staticmethod
    def backward(ctx, grad_y_NH: torch.Tensor):
        with ctx.run.dispatcher.workspace.dropped_on_error():
            return _PipelinedExperts._backward(ctx, grad_y_NH)

    @staticmethod
    def _forward(ctx, x_NH: torch.Tensor, run: _Run) -> torch.Tensor:
        d, handle = run.dispatcher, run.handle
        tl = d.timeline
        chunks = handle.chunks
        impl = select_backend(d.backend, x_NH.device)
        x_NH = x_NH.contiguous()
        y_NH = torch.empty_like(x_NH) if run.keep_output or d.world_size == 1 else \
            d.workspace.rows("combined", x_NH.shape[0], x_NH.shape[1], x_NH)
        recv, work_d, work_b = [None] * len(chunks), [None] * len(chunks), []
        # Rows that are only regrouped (received, sent back) live in the workspace, one region per
        # chunk since several chunks are in flight at once.
        recv_ws, back_ws = _chunk_regions(d, chunks, x_NH, "recv"), _chunk_regions(d, chunks, x_NH, "back")

        def issue_dispatch(c: int) -> None:
            p = chunks[c]
            src = x_NH.narrow(0, p.row_offset, p.num_rows)
            if d.world_size == 1:
                recv[c] = src  # single rank: the rows are already here
                return
            recv[c] = x_NH.new_empty(p.num_recv, x_NH.shape[1]) if p.expert_index_R is None else recv_ws[c]
            work_d[c] = _issue(d, recv[c], src, p, True, "dispatch", c, "fwd")

        issue_dispatch(0)
        if run.side_fn is not None:  # e.g. shared experts, while the first dispatch is in flight
            with torch.set_grad_enabled(run.grad_enabled), tl.compute("shared"):
                run.side_out = run.side_fn()
        for c, p in enumerate(chunks):
            if c + 1 < len(chunks):
                issue_dispatch(c + 1)
            wait_work(work_d[c], "dispatch", c, timeout=d.timeout, rank=d.rank)
            with tl.compute("experts", chunk=c):
                tokens_RH = recv[c] if p.expert_index_R is None else impl.permute_rows(recv[c], p.expert_index_R)
                t0 = _now(x_NH.device) if run.measure else 0.0
                with torch.set_grad_enabled(run.grad_enabled):
                    t_in = tokens_RH.detach().requires_grad_(run.grad_enabled)
                    out_RH = d._call_expert_fn(run.expert_fn, t_in, p)
                if run.measure:
                    run.expert_s += _now(x_NH.device) - t0
                if run.grad_enabled:
                    run.expert_io.append((t_in, out_RH))
                back_RH = out_RH.detach()
                if p.expert_index_R is not None:
                    back_RH = impl.permute_rows(back_RH.contiguous(), p.source_index_R, out=back_ws[c])
            work_b.append(_issue(d, y_NH.narrow(0, p.row_offset, p.num_rows), back_RH, p, False, "combine", c, "fwd"))
        for c, w in enumerate(work_b):
            wait_work(w, "combine", c, timeout=d.timeout, rank=d.rank)
        ctx.run = run
        return y_NH

    @staticmethod
    def _backward(ctx, grad_y_NH: torch.Tensor):
        run: _Run = ctx.run
        d, chunks = run.dispatcher, run.handle.chunks
        tl = d.timeline
        if not run.expert_io or any(io is None for io in run.expert_io):
            raise RuntimeError("moe_comm pipeline: backward ran twice through the same forward (retain_graph), or "
                               "the forward ran without grad; neither is supported: run the forward again")
        if torch.is_grad_enabled():
            raise RuntimeError("moe_comm pipeline: double backward (create_graph=True) is not supported: the "
                               "experts' gradient is computed by a nested backward")
        impl = select_backend(d.backend, grad_y_NH.device)
        grad_y_NH = grad_y_NH.contiguous()
        grad_x_NH = torch.empty_like(grad_y_NH)
        recv, work_g, work_x = [None] * len(chunks), [None] * len(chunks), []
        recv_ws = _chunk_regions(d, chunks, grad_y_NH, "grad_recv")
        back_ws = _chunk_regions(d, chunks, grad_y_NH, "grad_back")

        def issue_grad_combine(c: int) -> None:
            # The gradient of combine goes the dispatch way: to the ranks that hold the experts.
            p = chunks[c]
            src = grad_y_NH.narrow(0, p.row_offset, p.num_rows)
            if d.world_size == 1:
                recv[c] = src
                return
            recv[c] = recv_ws[c]  # regrouped below (or, unregrouped, read by the expert backward only)
            work_g[c] = _issue(d, recv[c], src, p, True, "combine", c, "bwd")

        issue_grad_combine(0)
        for c, p in enumerate(chunks):
            if c + 1 < len(chunks):
                issue_grad_combine(c + 1)
            wait_work(work_g[c], "combine", c, timeout=d.timeout, rank=d.rank, direction="bwd")
            with tl.compute("experts", chunk=c, direction="bwd"):
                g_RH = recv[c] if p.expert_index_R is None else impl.permute_rows(recv[c], p.expert_index_R)
                t_in, out_RH = run.expert_io[c]
                if out_RH.requires_grad:
                    torch.autograd.backward([out_RH], [g_RH.to(out_RH.dtype)])
                g_in = t_in.grad if t_in.grad is not None else torch.zeros_like(t_in)
                if p.expert_index_R is not None:
                    g_in = impl.permute_rows(g_in.contiguous(), p.source_index_R, out=back_ws[c])
                run.expert_io[c] = None  # free the chunk's activations
            work_x.append(_issue(d, grad_x_NH.narrow(0, p.row_offset, p.num_rows), g_in, p, False, "dispatch", c,
                                 "bwd"))
        for c, w in enumerate(work_x):
            wait_work(w, "dispatch", c, timeout=d.timeout, rank=d.rank, direction="bwd")
        return grad_x_NH, None, None


def run_pipeline(dispatcher, handle, x_NH: torch.Tensor, expert_fn: Callable,
                 side_fn: Optional[Callable[[], torch.Tensor]] = None, measure: bool = False,
                 keep_output: bool = True):
    """Pipelined dispatch -> expert_fn -> combine of the permuted rows ``x_NH`` [N, H].

    Returns (y_NH [N, H] combined rows in x_NH's order, side_fn's result or None, expert seconds
    when ``measure`` else 0).
    """
    run = _Run(dispatcher=dispatcher, handle=handle, expert_fn=expert_fn, side_fn=side_fn,
               grad_enabled=torch.is_grad_enabled(), measure=measure, keep_output=keep_output)
    # The anchor makes the output require grad whenever grad mode is on, so backward runs (and the
    # experts get their gradients) even when x itself needs none, e.g. the first layer's input.
    anchor = torch.empty(0, device=x_NH.device, requires_grad=True) if run.grad_enabled else None
    y_NH = _PipelinedExperts.apply(x_NH, anchor, run)
    return y_NH, run.side_out, run.expert_s
