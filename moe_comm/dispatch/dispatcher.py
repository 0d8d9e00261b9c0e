"""Dispatcher: tokens -> their experts' ranks (dispatch) and back (combine), with autograd.

Shapes legend: T tokens, H hidden, K top-k, E experts (global), e = E / W local experts,
W EP world size, C chunks, N routed rows sent, R rows received.

One token's path: make_layout -> counts exchange issued -> permute (rows grouped by chunk, dest
rank, local expert) while the counts travel -> counts read (the only host sync) -> per chunk:
all-to-all -> regroup expert-major -> experts -> regroup back -> reverse all-to-all -> unpermute
with the routing weights. ``dispatch``/``combine`` with large segments (``direct_min_bytes``) skip
both regroups: point-to-point sends put every (source rank, expert) segment straight into its
expert-major rows, and back.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from moe_comm import ops
from moe_comm.comm.collectives import (all_to_all_v_async, exchange_counts_async, exchange_segments, group_rank, group_size,
                   resolve_group, wait_work)
from moe_comm.dispatch.autotune import PipelinePlan, choose_num_chunks, measure_alpha_beta, measure_overlap
from moe_comm.kernels import select_backend
from moe_comm.ops.layout import Layout
from moe_comm.dispatch.pipeline import _now
from moe_comm.profiling.timeline import Timeline
from moe_comm.dispatch.workspace import Workspace

__all__ = ["Dispatcher", "DispatchOutput", "DispatchHandle", "ChunkPlan"]

_call_ids = itertools.count()
# Status words after the counts: invalid expert ids, non-finite rows (strict), input rejected,
# row bytes, dtype code, num_experts (-1: unknown on a rank that rejected its input), routed rows N and
# direct_min_bytes (every rank learns every rank's N and threshold, so all take the same direct /
# regroup decision, or all raise when the thresholds differ).
_STATUS = 8
_INT64_MAX = 2 ** 63 - 1
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_DTYPE_CODES = {dt: i + 1 for i, dt in enumerate(_DTYPES)}
_DTYPE_NAMES = {i + 1: str(dt).replace("torch.", "") for i, dt in enumerate(_DTYPES)}


@dataclass
class ChunkPlan:
    """Host-side split sizes and the regroup permutation of one chunk.

    send_splits_W / recv_splits_W: rows sent to / received from each rank.
    row_offset, num_rows: this chunk's slice of the permuted rows (sent side).
    expert_index_R: received row of each expert-major row; source_index_R its inverse (None when
        no regroup is needed: e = 1, one rank, or direct).
    tokens_per_expert_e: [e] int64 device tensor; counts_e the same on the host.
    send_We / recv_We: host rows per (rank, local expert) sent to / received from each rank.
    direct: rows move by point-to-point straight into expert-major order (no regroup).
    """

    send_splits_W: List[int]
    recv_splits_W: List[int]
    row_offset: int
    num_rows: int
    expert_index_R: Optional[torch.Tensor]
    source_index_R: Optional[torch.Tensor]
    tokens_per_expert_e: torch.Tensor
    counts_e: List[int]
    send_We: List[List[int]] = dataclasses.field(default_factory=list)
    recv_We: List[List[int]] = dataclasses.field(default_factory=list)
    direct: bool = False

    @property
    def num_recv(self) -> int:
        return sum(self.recv_splits_W)


@dataclass
class DispatchHandle:
    """What ``combine`` needs to undo a ``dispatch``; opaque to users."""

    layout: Layout
    chunks: List[ChunkPlan]
    call_id: int
    hidden_size: int
    owner: int = 0  # id() of the Dispatcher that made it


@dataclass
class DispatchOutput:
    """tokens: [R, H] received rows, expert-major (local expert 0's rows first, each expert's rows
    by source rank then source token order); tokens_per_expert: [e] int64; handle: for combine."""

    tokens: torch.Tensor
    tokens_per_expert: torch.Tensor
    handle: DispatchHandle

    @property
    def counts(self) -> List[int]:
        """Host copy of tokens_per_expert (already known: no extra sync)."""
        return self.handle.chunks[0].counts_e


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _expert_major_index(counts_We: torch.Tensor, total: int):
    """Permutation from received (source rank, expert) blocks to expert-major (expert, source rank).

    Example: W=2, e=2, counts_We = [[1, 2], [1, 0]] (rows r0 | r1 r2 | r3)
        expert-major order: expert 0 from rank 0, rank 1, then expert 1 -> index [0, 3, 1, 2]
    """
    W, e = counts_We.shape
    dev = counts_We.device
    src_start_We = _exclusive_cumsum(counts_We.reshape(-1)).reshape(W, e)
    counts_eW = counts_We.t().reshape(-1)
    dst_start_eW = _exclusive_cumsum(counts_eW)
    block_R = torch.repeat_interleave(torch.arange(e * W, device=dev), counts_eW, output_size=total)
    pos_R = torch.arange(total, device=dev) - dst_start_eW[block_R]
    index_R = src_start_We.t().reshape(-1)[block_R] + pos_R
    inverse_R = torch.empty_like(index_R)
    inverse_R[index_R] = torch.arange(total, device=dev)
    return index_R, inverse_R


@dataclass
class _PendingPlan:
    """A plan whose counts exchange is in flight (between ``_plan_begin`` and ``_plan_end``)."""

    layout: Optional[Layout]
    send_WX: torch.Tensor
    recv_WX: torch.Tensor
    work: object
    local_error: Optional[Exception]
    t0: object
    num_chunks: int
    hidden_size: int


class _DispatchRows(torch.autograd.Function):
    """Permuted rows [N, H] -> expert-major rows [R, H]; backward sends the gradient back and sums
    each token's K slots (an unweighted unpermute)."""

    @staticmethod
    def forward(ctx, x_TH, x_NH, d: "Dispatcher", handle: DispatchHandle):
        ctx.d, ctx.handle = d, handle
        return d._to_experts(x_NH, handle.chunks[0], "dispatch", "fwd")

    @staticmethod
    def backward(ctx, grad_RH):
        d, handle = ctx.d, ctx.handle
        plan = handle.chunks[0]
        grad_NH = d._to_tokens(grad_RH.contiguous(), plan, "dispatch", "bwd",
                               out=d.workspace.rows("grad_rows", plan.num_rows, grad_RH.shape[1], grad_RH))
        impl = select_backend(d.backend, grad_RH.device)
        return impl.unpermute_rows(grad_NH, handle.layout.dest_row_TK), None, None, None


class _CombineRows(torch.autograd.Function):
    """Expert-major rows [R, H] -> rows in sent order [N, H] back on their tokens' ranks."""

    @staticmethod
    def forward(ctx, y_RH, d: "Dispatcher", handle: DispatchHandle, keep: bool):
        ctx.d, ctx.handle = d, handle
        plan = handle.chunks[0]
        out = None if keep else d.workspace.rows("combined", plan.num_rows, y_RH.shape[1], y_RH)
        return d._to_tokens(y_RH.contiguous(), plan, "combine", "fwd", out=out)

    @staticmethod
    def backward(ctx, grad_NH):
        return ctx.d._to_experts(grad_NH.contiguous(), ctx.handle.chunks[0], "combine", "bwd"), None, None, None


class Dispatcher:
    """Moves token rows to the ranks holding their experts and back.

    Args:
        num_experts: E, global experts; expert g lives on EP rank g // (E / W) as local expert g % (E / W).
        ep_group: process group of the EP ranks (any backend: NCCL, gloo, ...). None: WORLD when
            torch.distributed is initialised, else a single process (W = 1, no collectives).
        num_chunks: C, micro-chunks for ``__call__`` (tokens split into C contiguous ranges).
        backend: permutation kernels, "auto" | "triton" | "native" | "torch".
        strict: also reject non-finite (NaN/Inf) rows of x: every rank raises, naming the rank that
            holds them (checked on the device and folded into the counts exchange: no extra sync).
            Default False: a NaN token poisons only its own output rows.
        timeout: seconds to wait for any one all-to-all before raising CollectiveError naming the
            phase and chunk (None: the process group's timeout).
        direct_min_bytes: ``dispatch``/``combine`` move rows point-to-point straight into expert-major
            order (no regroup copy) when the mean (rank pair, local expert) segment is at least this
            large; smaller ones go in one all-to-all plus a regroup, which costs fewer round trips.
            Measured on gloo, 4 ranks on 2 cores (benchmarks: ``moe-comm bench``): point-to-point is
            slower at 256 KiB segments, even at 1 MiB and faster at 4 MiB. 0: always when e > 1.

    Every rank of the group must call the same methods in the same order (they are collective),
    and must backpropagate through their outputs (the backward is collective too).
    """

    def __init__(self, num_experts: int, ep_group: Optional[dist.ProcessGroup] = None, num_chunks: int = 1,
                 *, backend: str = "auto", strict: bool = False, timeout: Optional[float] = None,
                 direct_min_bytes: int = 1 << 20):
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
        if num_chunks != "auto" and (isinstance(num_chunks, bool) or not isinstance(num_chunks, int)
                                     or num_chunks < 1):
            raise ValueError(f"num_chunks must be an int >= 1 or 'auto', got {num_chunks!r}")
        self.group = resolve_group(ep_group)
        self.world_size = group_size(self.group)
        self.rank = group_rank(self.group)
        if num_experts % self.world_size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the EP world size, "
                             f"got world size {self.world_size}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.world_size
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be None or seconds > 0, got {timeout!r}")
        if isinstance(direct_min_bytes, bool) or not isinstance(direct_min_bytes, int) or direct_min_bytes < 0:
            raise ValueError(f"direct_min_bytes must be an int >= 0, got {direct_min_bytes!r}")
        self.direct_min_bytes = direct_min_bytes
        self.num_chunks = num_chunks
        self.backend = backend
        self.strict = bool(strict)
        self.timeout = timeout
        self.timeline = Timeline(rank=self.rank)  # disabled: records nothing until enabled
        self.workspace = Workspace()  # persistent buffers for the dispatch path's temporaries
        self.plans: Dict[str, PipelinePlan] = {}  # num_chunks="auto": the plan, chosen once per Dispatcher
        self._auto: Dict[str, dict] = {}  # num_chunks="auto" in progress: calls, trial order, times
        self._last_auto_C = 1

    # ---------------------------------------------------------------- planning
    def _check_inputs(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor) -> None:
        if not isinstance(x_TH, torch.Tensor):
            raise TypeError(f"x_TH must be a torch.Tensor, got {type(x_TH).__name__}")
        if x_TH.dim() != 2:
            raise ValueError(f"x_TH must be 2-D [T, H], got shape {tuple(x_TH.shape)}")
        if not x_TH.is_floating_point():
            raise TypeError(f"x_TH must be a floating-point tensor, got {x_TH.dtype}")
        if not isinstance(topk_idx_TK, torch.Tensor):
            raise TypeError(f"topk_idx_TK must be a torch.Tensor, got {type(topk_idx_TK).__name__}")
        if topk_idx_TK.dim() != 2 or topk_idx_TK.shape[0] != x_TH.shape[0]:
            raise ValueError(f"topk_idx_TK must be [T, K] with T = {x_TH.shape[0]} (x_TH rows), "
                             f"got shape {tuple(topk_idx_TK.shape)}")
        if topk_idx_TK.device != x_TH.device:
            raise ValueError(f"topk_idx_TK must be on x_TH's device {x_TH.device}, got {topk_idx_TK.device}")

    def _plan_begin(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, num_chunks: int,
                    local_error: Optional[Exception] = None) -> "_PendingPlan":
        """Layout and status words, and issue the counts exchange; ``_plan_end`` waits for it."""
        W, e, C = self.world_size, self.num_local_experts, num_chunks
        tl = self.timeline
        # A rank whose input is rejected still joins the counts exchange (with zero counts and an
        # error flag): every rank then raises, instead of the others hanging in the all-to-all.
        layout = None
        if local_error is None:
            try:
                self._check_inputs(x_TH, topk_idx_TK)
                with tl.compute("layout"):
                    layout = ops.make_layout(topk_idx_TK, self.num_experts, num_ranks=W, num_chunks=C,
                                             backend=self.backend)
            except (TypeError, ValueError) as err:
                local_error = err
        device = x_TH.device if isinstance(x_TH, torch.Tensor) else torch.device("cpu")
        if layout is None:
            counts_CWe = torch.zeros(C, W, e, dtype=torch.int64, device=device)
            status = torch.tensor([0, 0, 1, -1, -1, self.num_experts, 0, min(self.direct_min_bytes, _INT64_MAX)],
                                  dtype=torch.int64, device=device)
        else:
            counts_CWe = layout.counts_CWe
            nonfinite = (~torch.isfinite(x_TH)).any(1).sum() if self.strict else torch.zeros_like(layout.num_invalid)
            row = torch.tensor([x_TH.shape[1] * x_TH.element_size(), _DTYPE_CODES.get(x_TH.dtype, 0),
                                self.num_experts], dtype=torch.int64, device=device)
            threshold = torch.tensor([min(self.direct_min_bytes, _INT64_MAX)], dtype=torch.int64, device=device)
            status = torch.cat([torch.stack([layout.num_invalid, nonfinite, torch.zeros_like(nonfinite)]).to(torch.int64),
                                row, counts_CWe.sum().reshape(1), threshold])
        # Row w of send goes to rank w: its counts for every chunk, then this rank's status words
        # (invalid expert ids, non-finite rows in strict mode, input rejected, ...), so every rank
        # learns of a bad input in the exchange that happens anyway, and all raise the same error.
        send_WX = torch.cat([counts_CWe.permute(1, 0, 2).reshape(W, C * e),
                             status.reshape(1, _STATUS).expand(W, _STATUS)], dim=1)
        t0 = tl.mark()
        recv_WX, work = exchange_counts_async(send_WX, self.group)
        return _PendingPlan(layout, send_WX, recv_WX, work, local_error, t0, C,
                            x_TH.shape[1] if isinstance(x_TH, torch.Tensor) and x_TH.dim() == 2 else 0)

    def _plan_end(self, pending: "_PendingPlan", allow_direct: bool = False) -> DispatchHandle:
        """Wait for the counts, raise on any rank's bad input (on every rank alike), build the chunk plans.
        allow_direct: the caller can move rows point-to-point (``dispatch``/``combine``)."""
        W, e, C = self.world_size, self.num_local_experts, pending.num_chunks
        layout, local_error, recv_WX = pending.layout, pending.local_error, pending.recv_WX
        wait_work(pending.work, "counts exchange", timeout=self.timeout, rank=self.rank)
        host = torch.cat([pending.send_WX.reshape(-1), recv_WX.reshape(-1)]).tolist()  # host sync: split sizes
        self.timeline.comm("counts", None, start=pending.t0)
        X = C * e + _STATUS
        send = [host[w * X:(w + 1) * X - _STATUS] for w in range(W)]
        recv = [host[(W + w) * X:(W + w + 1) * X - _STATUS] for w in range(W)]
        status_W = [host[(W + w + 1) * X - _STATUS:(W + w + 1) * X] for w in range(W)]
        bad = [w for w in range(W) if status_W[w][2] > 0]
        if bad:
            if local_error is not None:
                raise type(local_error)(f"{local_error} [EP rank {self.rank}; ranks {bad} rejected their "
                                        "input, every rank raised, no tokens were sent]") from local_error
            raise ValueError(f"EP rank(s) {bad} rejected their input (their error says why); every rank "
                             "raised, no tokens were sent")
        for col, what in ((3, "row bytes (H x element size)"), (4, "dtype"), (5, "num_experts"),
                          (7, "direct_min_bytes")):
            seen = {status_W[w][col] for w in range(W) if status_W[w][col] >= 0}
            if len(seen) > 1:  # rows travel as bytes: a mismatch would be garbage or a gloo abort
                by = {v: [w for w in range(W) if status_W[w][col] == v] for v in sorted(seen)}
                names = {v: _DTYPE_NAMES.get(v, v) for v in by} if col == 4 else {v: v for v in by}
                raise ValueError(f"EP ranks disagree on the {what}: " + ", ".join(
                    f"{names[v]} on ranks {rs}" for v, rs in by.items()) + "; no tokens were sent")
        bad = [w for w in range(W) if status_W[w][0] > 0]
        if bad:
            raise ValueError(
                f"topk_idx_TK holds expert ids outside [-1, {self.num_experts}) on EP rank(s) {bad} "
                f"({', '.join(str(status_W[w][0]) for w in bad)} values); no tokens were sent")
        bad = [w for w in range(W) if status_W[w][1] > 0]
        if bad:
            raise ValueError(
                f"x_TH holds non-finite (NaN/Inf) rows on EP rank(s) {bad} "
                f"({', '.join(str(status_W[w][1]) for w in bad)} rows; strict=True); no tokens were sent")
        layout.set_num_rows(sum(sum(s) for s in send))
        # Same inputs on every rank (every rank's N and row bytes), so every rank decides alike.
        mean_segment_bytes = sum(st[6] for st in status_W) * status_W[0][3] / (W * W * e)
        direct = allow_direct and C == 1 and W > 1 and e > 1 and mean_segment_bytes >= self.direct_min_bytes
        recv_counts_WCe = recv_WX[:, :-_STATUS].reshape(W, C, e)
        chunks, offset = [], 0
        for c in range(C):
            send_We = [send[w][c * e:(c + 1) * e] for w in range(W)]
            recv_We = [recv[w][c * e:(c + 1) * e] for w in range(W)]
            send_W, recv_W = [sum(r) for r in send_We], [sum(r) for r in recv_We]
            counts_e = [sum(recv_We[w][j] for w in range(W)) for j in range(e)]
            R = sum(recv_W)
            counts_We = recv_counts_WCe[:, c, :]
            index = inverse = None
            if W > 1 and e > 1 and not direct:
                index, inverse = _expert_major_index(counts_We, R)
            chunks.append(ChunkPlan(send_splits_W=send_W, recv_splits_W=recv_W, row_offset=offset,
                                    num_rows=sum(send_W), expert_index_R=index, source_index_R=inverse,
                                    tokens_per_expert_e=counts_We.sum(0), counts_e=counts_e,
                                    send_We=send_We, recv_We=recv_We, direct=direct))
            offset += sum(send_W)
        return DispatchHandle(layout=layout, chunks=chunks, call_id=next(_call_ids), hidden_size=pending.hidden_size,
                              owner=id(self))

    def _plan(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, num_chunks: int,
              local_error: Optional[Exception] = None) -> DispatchHandle:
        """Layout + counts exchange (collective; the one host sync), without overlap."""
        return self._plan_end(self._plan_begin(x_TH, topk_idx_TK, num_chunks, local_error))

    def _send_buffer(self, x_TH: torch.Tensor, handle: DispatchHandle) -> Optional[torch.Tensor]:
        """Workspace rows for the permuted send buffer (W > 1: the all-to-all consumes it at once)."""
        if self.world_size == 1:
            return None  # with one rank the permuted rows are the experts' input: keep them fresh
        return self.workspace.rows("send", handle.layout.num_rows, x_TH.shape[1], x_TH)

    # ---------------------------------------------------------------- moving rows (no autograd)
    def _segments(self, plan: ChunkPlan):
        """(sent-order side, expert-major side) segment lists for ``exchange_segments``:
        (peer, tag = local expert, first row, rows); a pair's segments in expert order on both ranks."""
        W, e = self.world_size, self.num_local_experts
        by_dest, start = [], 0
        for d in range(W):  # sent rows: (dest rank, local expert)
            for j in range(e):
                by_dest.append((d, j, start, plan.send_We[d][j]))
                start += plan.send_We[d][j]
        by_expert, start = [], 0
        for j in range(e):  # received rows: (local expert, source rank)
            for s in range(W):
                by_expert.append((s, j, start, plan.recv_We[s][j]))
                start += plan.recv_We[s][j]
        return by_dest, by_expert

    def _to_experts(self, x_NH: torch.Tensor, plan: ChunkPlan, phase: str, direction: str,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows in sent order [N, H] -> this rank's expert-major rows [R, H] (``out`` or fresh)."""
        out = x_NH.new_empty(plan.num_recv, x_NH.shape[1]) if out is None else out
        t0 = self.timeline.mark()
        if plan.direct:
            by_dest, by_expert = self._segments(plan)
            with self.workspace.dropped_on_error():
                exchange_segments(out, x_NH, by_dest, by_expert, self.group, phase=phase, direction=direction,
                                  timeout=self.timeout)
        else:
            recv = out if plan.expert_index_R is None else self.workspace.rows("recv", plan.num_recv, x_NH.shape[1], x_NH)
            with self.workspace.dropped_on_error():
                wait_work(all_to_all_v_async(recv, x_NH, plan.recv_splits_W, plan.send_splits_W, self.group), phase,
                          timeout=self.timeout, rank=self.rank, direction=direction)
        self.timeline.comm(phase, None, start=t0, direction=direction)
        if not plan.direct and plan.expert_index_R is not None:
            with self.timeline.compute("regroup", direction=direction):
                select_backend(self.backend, x_NH.device).permute_rows(recv, plan.expert_index_R, out=out)
        return out

    def _to_tokens(self, y_RH: torch.Tensor, plan: ChunkPlan, phase: str, direction: str,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Expert-major rows [R, H] -> rows in sent order [N, H] on their tokens' ranks (``out`` or fresh)."""
        out = y_RH.new_empty(plan.num_rows, y_RH.shape[1]) if out is None else out
        if not plan.direct and plan.expert_index_R is not None:
            with self.timeline.compute("regroup", direction=direction):
                y_RH = select_backend(self.backend, y_RH.device).permute_rows(
                    y_RH, plan.source_index_R, out=self.workspace.rows("back", plan.num_recv, y_RH.shape[1], y_RH))
        t0 = self.timeline.mark()
        if plan.direct:
            by_dest, by_expert = self._segments(plan)
            with self.workspace.dropped_on_error():
                exchange_segments(out, y_RH, by_expert, by_dest, self.group, phase=phase, direction=direction,
                                  timeout=self.timeout)
        else:
            with self.workspace.dropped_on_error():
                wait_work(all_to_all_v_async(out, y_RH, plan.send_splits_W, plan.recv_splits_W, self.group), phase,
                          timeout=self.timeout, rank=self.rank, direction=direction)
        self.timeline.comm(phase, None, start=t0, direction=direction)
        return out

    # ---------------------------------------------------------------- public API
    def dispatch(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor) -> DispatchOutput:
        """Send every routed row to its expert's rank.

        Args:
            x_TH: [T, H] float tokens of this rank (T may be 0 and may differ between ranks).
            topk_idx_TK: [T, K] int64 global expert ids, -1 = dropped (no row is sent).
        Returns: DispatchOutput with tokens [R, H] expert-major, tokens_per_expert [e] int64 and
            the handle for ``combine``. Differentiable w.r.t. x_TH.
        """
        pending = self._plan_begin(x_TH, topk_idx_TK, num_chunks=1)
        layout, send_SH = pending.layout, None
        if layout is not None and self.world_size > 1:
            # Permute while the counts travel. On CPU, N is read now (no device to wait for); on an
            # accelerator that would be a second host sync, so every slot (dropped ones last) is copied
            # into a [T*K, H] workspace and the first N rows are the send buffer. The gradient reaches
            # x_TH through _DispatchRows, so this copy is made without autograd.
            with self.timeline.compute("permute"):
                rows = layout.num_rows if x_TH.device.type == "cpu" else layout.num_tokens * layout.top_k
                send_SH = select_backend(self.backend, x_TH.device).permute_rows(
                    x_TH.detach().contiguous(), layout.token_S[:rows],
                    out=self.workspace.rows("send", rows, x_TH.shape[1], x_TH))
        handle = self._plan_end(pending, allow_direct=True)
        plan = handle.chunks[0]
        if self.world_size == 1:  # the permuted rows are the result
            tokens_RH = ops.permute(x_TH, handle.layout, backend=self.backend)
        else:
            tokens_RH = _DispatchRows.apply(x_TH, send_SH.narrow(0, 0, plan.num_rows), self, handle)
        return DispatchOutput(tokens=tokens_RH, tokens_per_expert=plan.tokens_per_expert_e, handle=handle)

    def combine(self, expert_out_RH: torch.Tensor, topk_weight_TK: torch.Tensor,
                handle: DispatchHandle) -> torch.Tensor:
        """Send expert outputs back and sum each token's K slots with their weights.

        Args:
            expert_out_RH: [R, H] rows in the order ``dispatch`` returned them.
            topk_weight_TK: [T, K] float32/float64 routing weights (ignored for dropped slots).
            handle: ``DispatchOutput.handle`` of the matching dispatch.
        Returns: y_TH [T, H] in expert_out's dtype. Differentiable w.r.t. both inputs.
        """
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be the DispatchHandle from dispatch(), got {type(handle).__name__}")
        if handle.owner != id(self):
            raise ValueError("handle comes from another Dispatcher's dispatch(); combine it with that Dispatcher")
        if len(handle.chunks) != 1:
            raise ValueError("handle comes from a pipelined call, not from dispatch()")
        plan = handle.chunks[0]
        if not isinstance(expert_out_RH, torch.Tensor) or expert_out_RH.dim() != 2 \
                or tuple(expert_out_RH.shape) != (plan.num_recv, handle.hidden_size):
            got = tuple(expert_out_RH.shape) if isinstance(expert_out_RH, torch.Tensor) else type(expert_out_RH).__name__
            raise ValueError(f"expert_out_RH must be [R, H] = [{plan.num_recv}, {handle.hidden_size}] "
                             f"(the rows this handle's dispatch returned), got {got}")
        y_NH = expert_out_RH
        if self.world_size > 1:
            # y_NH is saved for backward only when the weights need grad: then fresh memory, else a workspace.
            keep = torch.is_grad_enabled() and isinstance(topk_weight_TK, torch.Tensor) and topk_weight_TK.requires_grad
            y_NH = _CombineRows.apply(expert_out_RH, self, handle, keep)
        with self.timeline.compute("unpermute"):
            return ops.unpermute(y_NH, handle.layout, topk_weight_TK, backend=self.backend)

    def _call_expert_fn(self, expert_fn: Callable, tokens_RH: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
        if getattr(expert_fn, "wants_host_counts", False):
            out_RH = expert_fn(tokens_RH, plan.tokens_per_expert_e, counts=plan.counts_e)
        else:
            out_RH = expert_fn(tokens_RH, plan.tokens_per_expert_e)
        if not isinstance(out_RH, torch.Tensor) or tuple(out_RH.shape) != tuple(tokens_RH.shape):
            got = tuple(out_RH.shape) if isinstance(out_RH, torch.Tensor) else type(out_RH).__name__
            raise ValueError(f"expert_fn must return [R, H] = {list(tokens_RH.shape)}, got {got}")
        return out_RH

    def __call__(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor,
                 expert_fn: Callable[..., torch.Tensor], *, num_chunks: Optional[int] = None,
                 side_fn: Optional[Callable[[], torch.Tensor]] = None):
        """dispatch -> expert_fn -> combine, pipelined over C chunks (see ``moe_comm.dispatch.pipeline``).

        Args:
            x_TH, topk_idx_TK, topk_weight_TK: as in ``dispatch`` and ``combine``.
            expert_fn: ``expert_fn(tokens_RH, tokens_per_expert_e) -> [R, H]`` on expert-major rows;
                any differentiable function. If it has ``wants_host_counts = True`` it is also given
                ``counts=`` (the host list of tokens_per_expert, already known: no extra sync).
            num_chunks: overrides the Dispatcher's C for this call (every rank must pass the same).
            side_fn: optional work run while the first dispatch is in flight (shared experts); when
                given, the call returns ``(y_TH, side_fn())``.
        Returns: y_TH [T, H], equal for every C (chunking only changes when rows move).
        """
        from moe_comm.dispatch.pipeline import run_pipeline

        C, measure, trial, key = self.num_chunks if num_chunks is None else num_chunks, False, False, "auto"
        if C == "auto":
            C, measure, trial = self._auto_step(key)
        elif isinstance(C, bool) or not isinstance(C, int) or C < 1:
            raise ValueError(f"num_chunks must be an int >= 1 (the same on every rank), got {C!r}")
        t_start = _now(x_TH.device) if trial else 0.0
        tl = self.timeline
        handle = self._plan(x_TH, topk_idx_TK, num_chunks=C)
        with tl.compute("permute"):
            x_NH = ops.permute(x_TH, handle.layout, backend=self.backend, out=self._send_buffer(x_TH, handle))
        keep = torch.is_grad_enabled() and isinstance(topk_weight_TK, torch.Tensor) and topk_weight_TK.requires_grad
        y_NH, side_out, expert_s = run_pipeline(self, handle, x_NH, expert_fn, side_fn, measure=measure,
                                                keep_output=keep)
        if measure:
            self._make_plan(x_TH, handle, expert_s, expert_fn)
        with tl.compute("unpermute"):
            y_TH = ops.unpermute(y_NH, handle.layout, topk_weight_TK, backend=self.backend)
        if trial:
            self._record_trial(key, _now(x_TH.device) - t_start)
        return y_TH if side_fn is None else (y_TH, side_out)

    def fail(self, error: Exception, num_chunks: Optional[int] = None, device=None):
        """Reject this rank's input collectively: join the counts exchange with an error flag so every
        rank raises (naming this one) instead of waiting in the all-to-all. Always raises.
        device: where the counts live (the group's device: CUDA for NCCL)."""
        C = self.num_chunks if num_chunks is None else num_chunks
        if C == "auto":
            C = self._auto_step("auto")[0]
        self._plan(torch.empty(0, device=device) if device is not None else None, None, num_chunks=C,
                   local_error=error)
        raise error  # not reached: _plan raises on every rank

    # ---------------------------------------------------------------- num_chunks="auto"
    # Call 1 runs unchunked as a warm-up (lazy inits, kernel builds); call 2 unchunked with the
    # experts timed, after which the model (autochunk.py) shortlists C = 1, its choice with the
    # measured overlap efficiency and its choice with perfect overlap; the next calls try each
    # shortlisted C twice, interleaved, and the fastest (slowest rank, best of two) is kept for
    # good, per (H, dtype). Every rank takes the same steps, so all agree on C.
    def _auto_step(self, key):
        """(C, measure_experts, timed_trial) for this auto call."""
        if key in self.plans:
            return self.plans[key].num_chunks, False, False
        if torch._C._current_graph_task_id() != -1:
            # Inside backward (activation checkpointing recomputes the forward): repeat the C of the
            # forward being recomputed and leave the tuning state alone, identically on every rank.
            return self._last_auto_C, False, False
        st = self._auto.setdefault(key, {"calls": 0, "order": None, "times": [], "model": None})
        st["calls"] += 1
        if st["order"] is None:
            self._last_auto_C = 1
            return 1, st["calls"] >= 2, False
        self._last_auto_C = st["order"][len(st["times"])]
        return self._last_auto_C, False, True

    def _record_trial(self, key, seconds: float) -> None:
        st = self._auto[key]
        st["times"].append(seconds)
        if len(st["times"]) < len(st["order"]):
            return
        t = torch.tensor(st["times"], dtype=torch.float64)
        if self.group is not None and self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        best_of = {}
        for C, sec in zip(st["order"], t.tolist()):  # host sync: none, a CPU tensor
            best_of[C] = min(best_of.get(C, float("inf")), sec)
        chosen = min(best_of, key=lambda C: (best_of[C], C))
        model: PipelinePlan = st["model"]
        tried = ", ".join(f"C={C} {sec * 1e3:.1f} ms" for C, sec in sorted(best_of.items()))
        self.plans[key] = dataclasses.replace(
            model, num_chunks=chosen, measured_s=best_of,
            reason=f"C={chosen}: fastest forward of the shortlist ({tried}); model: {model.reason}")
        del self._auto[key]

    @property
    def plan(self) -> Optional[PipelinePlan]:
        """The most recent final num_chunks="auto" plan (None until the trials are done)."""
        return next(reversed(self.plans.values()), None)

    def _make_plan(self, x_TH: torch.Tensor, handle: DispatchHandle, expert_s: float, expert_fn: Callable) -> None:
        """After the first auto call (run unchunked, experts timed): fit the link and choose C.

        Collective: all ranks agree on the slowest rank's expert time and largest message, so every
        rank picks the same C.
        """
        nbytes = handle.layout.num_rows * x_TH.shape[1] * x_TH.element_size()
        alpha, beta = measure_alpha_beta(self.group, x_TH.device)
        kappa = self._chunk_overhead(x_TH, handle, expert_fn)
        stats = torch.tensor([expert_s, float(nbytes), kappa], dtype=torch.float64)
        if self.group is not None and self.world_size > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=self.group)
        expert_max, bytes_max, kappa_max = stats.tolist()  # host sync: none, a CPU tensor
        # eta: probed with a message of one chunk of a 4-deep pipeline (what overlap would move).
        eta = measure_overlap(self.group, x_TH.device, int(bytes_max // 4))
        model = choose_num_chunks(expert_max, bytes_max, alpha, beta, kappa_max, overlap=eta)
        ideal = choose_num_chunks(expert_max, bytes_max, alpha, beta, kappa_max, overlap=1.0)
        shortlist = sorted({1, model.num_chunks, ideal.num_chunks})
        if len(shortlist) == 1:  # nothing to try: the model says C = 1 either way
            self.plans["auto"] = model
            del self._auto["auto"]
            return
        st = self._auto["auto"]
        st["order"], st["model"] = shortlist * 2, model

    def _chunk_overhead(self, x_TH: torch.Tensor, handle: DispatchHandle, expert_fn: Callable) -> float:
        """Seconds one more chunk costs beyond its rows: experts on one row each plus a regroup."""
        from moe_comm.dispatch.pipeline import _now

        plan = handle.chunks[0]
        e = self.num_local_experts
        rows = x_TH.new_zeros(e, x_TH.shape[1])
        small = ChunkPlan(send_splits_W=plan.send_splits_W, recv_splits_W=plan.recv_splits_W, row_offset=0,
                          num_rows=e, expert_index_R=None, source_index_R=None,
                          tokens_per_expert_e=torch.ones(e, dtype=torch.int64, device=x_TH.device),
                          counts_e=[1] * e)
        samples = []
        for _ in range(5):
            t0 = _now(x_TH.device)
            with torch.enable_grad():
                t_in = rows.requires_grad_(True)
                out = self._call_expert_fn(expert_fn, t_in, small)
                if out.requires_grad:  # input gradient only: nothing accumulates into .grad
                    torch.autograd.grad(out.sum(), [t_in], allow_unused=True)
            samples.append(_now(x_TH.device) - t0)
            rows = rows.detach()
        return sorted(samples)[len(samples) // 2] / 3.0  # forward share of forward + backward
