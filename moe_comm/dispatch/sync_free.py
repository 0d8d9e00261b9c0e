"""The sync-free mode of ``Dispatcher.__call__`` (``max_tokens_per_rank``): fixed-size exchanges, no host read
after the first call. See ``Dispatcher``'s ``max_tokens_per_rank`` for the contract.

Shapes legend: T tokens, H hidden, K top-k, W EP world size, e local experts, M max tokens per rank,
P = M * K rows per destination rank, N = W * P rows sent.
"""
from __future__ import annotations

import torch

from moe_comm import ops
from moe_comm.comm.wire import HEADER_WORDS, MESSAGE_WORDS, Failure, Phase
from moe_comm.dispatch.dispatcher import check_call_args
from moe_comm.dispatch.pipeline import run_pipeline
from moe_comm.dispatch.plan import (ChunkPlan, DispatchHandle, call_text, layout_device, padded_expert_major_index,
                                    to_device)
from moe_comm.dispatch.transport import AllToAll, Local
from moe_comm.kernels import select_backend

__all__ = ["call_sync_free", "placeholder_backward", "placeholder_like"]


def call_sync_free(d, x_TH, topk_idx_TK, topk_weight_TK, expert_fn, side_fn, local_error=None, summed_X=None):
    """``__call__`` with fixed-size exchanges (see ``max_tokens_per_rank``). Token path: make_layout ->
    control exchange issued (counts, header) -> pad_layout: rows for rank w at [w*P, w*P + count), P = M*K
    -> permute into W*P rows -> the pipeline (C = 1) moves all W*P rows each way; the receiver regroups them
    expert-major with the counts from the exchange, on the device -> unpermute over the padded layout."""
    W, e, M, agreed = d.world_size, d.num_local_experts, d.max_tokens_per_rank, d._agreed

    def extra_check():
        check_call_args(x_TH, topk_idx_TK, topk_weight_TK, expert_fn, side_fn)
        T, H = x_TH.shape
        if T > M:
            raise ValueError(f"x_TH has T = {T} tokens, more than max_tokens_per_rank = {M} (sync-free mode sizes "
                             "every exchange by it)")
        now_ = (H, x_TH.dtype, topk_idx_TK.shape[1])
        if agreed is not None and now_ != agreed:
            raise ValueError(f"sync-free mode: (H, dtype, top_k) must stay as in the first call, {agreed}, got "
                             f"{now_}; build another Dispatcher for another shape")

    pending, layout = d._open(Phase.FORWARD, x_TH, topk_idx_TK, 1, local_error=local_error, extra_check=extra_check,
                              summed_X=summed_X if d.summed_words else None)
    if layout is None and (W == 1 or agreed is None):
        d.channel.end(pending)  # raises on every rank
    if W > 1 and agreed is None:
        d.channel.end(pending)  # the first call reads once: every rank raises alike on a disagreement
    elif W > 1:
        d.channel.wait(pending)  # the counts below are used on the device (NCCL: a stream wait)
        d.channel.defer(pending)
    if d.summed_words:  # every rank's words, summed on the device: the statistics' one reduction
        d.last_sum = d.channel.sum_of(pending)
    if layout is not None:
        d._agreed = (x_TH.shape[1], x_TH.dtype, topk_idx_TK.shape[1])
        # agreed (read above on every rank): from the next call on, call numbers and checks stay on the device
        d.channel.start_device_calls(x_TH.device)
    H, dtype, K = d._agreed
    P = M * K  # rows per destination rank: >= T*K, so no routing can overflow it
    base = HEADER_WORDS + MESSAGE_WORDS
    # rows per (source, expert), on the rows' device (a gloo group's exchange is on the CPU)
    counts_We = layout.counts_CWe[0] if W == 1 else pending.recv_WX[:, base:base + e]
    if layout is not None:
        counts_We = to_device(counts_We, layout_device(layout))
    call = -1 if pending.call_dev is not None else pending.call  # device calls: the number is on the device
    plan = _padded_plan(W, e, P, call, counts_We.sum(0))
    # From here on no exception leaves this rank before the call's last exchange (W > 1): a failure moves zero
    # rows like a rejected input and travels in the end-of-forward exchange (read at check()).
    failed, lay, x_in = pending.local_error, None, None
    try:
        if W > 1 and layout is not None:
            plan.expert_index_R, plan.source_index_R = padded_expert_major_index(counts_We, P)
        lay = None if layout is None else ops.pad_layout(layout, P)
        with d.timeline.compute("permute"):
            if lay is not None:
                x_in, wire_NB = _send_rows(d, x_TH, lay)
    except Exception as err:  # noqa: BLE001
        if W == 1:
            raise
        failed, x_in = failed or err, None
        plan.expert_index_R = plan.source_index_R = None  # the rows stay as received: placeholders
    kind = Local if W == 1 else AllToAll  # equal splits: P rows to and from every rank
    d.last_transport = kind.name
    handle = DispatchHandle(layout=lay, chunks=[plan], call=call, hidden_size=H,
                            transport=d.transport(kind), owner=id(d), slots_sent=-1, call_dev=pending.call_dev)
    keep = isinstance(topk_weight_TK, torch.Tensor) and torch.is_grad_enabled() and topk_weight_TK.requires_grad
    with d.timeline.compute("permute"):
        if x_in is None:  # rejected or failed on this rank: zero rows of the agreed size keep every peer's exchange
            x_in = torch.empty(0, H, dtype=dtype, device=d.channel.device)
            width = H if d.dispatch_dtype is None else d._wire_width(H)
            like = x_in if d.dispatch_dtype is None else x_in.new_empty(0, dtype=torch.uint8)
            wire_NB = d.workspace.rows("send", W * P, width, like).zero_()
            if d.dispatch_dtype is None:
                x_in, wire_NB = wire_NB, None
    if lay is not None:
        d._record_bytes(handle, x_TH)
    y_NH, side_out, _ = run_pipeline(d, handle, x_in, expert_fn, side_fn, keep_output=keep, failed=failed,
                                     wire_NB=wire_NB)
    if lay is None:  # rejected or failed here: a zero attached to the call's graph; every rank raises at check()
        anchor = y_NH.narrow(0, 0, 0).sum()
        if expert_fn is None:  # from fail(): the caller shapes its own placeholder
            return anchor
        if not (isinstance(x_TH, torch.Tensor) and x_TH.dim() == 2 and x_TH.is_floating_point()):
            raise failed  # no placeholder of x's shape to return: raised here alone
        y_TH = placeholder_like(x_TH, anchor, x_TH.dtype, x_TH.device)
        return y_TH if side_fn is None else (y_TH, torch.zeros_like(y_TH))
    with d.timeline.compute("unpermute"):
        y_TH = d.last_step(f"the unpermute of {call_text(call)}", y_NH, x_TH.shape,
                           lambda: ops.unpermute(y_NH, lay, topk_weight_TK, backend=d.backend))
    return y_TH if side_fn is None else (y_TH, side_out)


class _ZeroGradTo(torch.autograd.Function):
    """A 0-dim zero of ``dtype`` on ``device`` whose backward gives ``x`` a zero gradient: it joins x's graph
    without reading x's values (x * 0 would turn NaN rows into NaN) or copying across devices."""

    @staticmethod
    def forward(ctx, x, dtype, device):
        ctx.shape, ctx.dtype, ctx.device = x.shape, x.dtype, x.device
        return torch.zeros((), dtype=dtype, device=device)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device), None, None


def placeholder_like(x: torch.Tensor, anchor: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros shaped like ``x`` for a call that failed on this rank (sync-free: deferred), attached to ``anchor``
    (the call's graph: its backward issues the peers' exchanges) and to x's graph with a zero gradient, so the
    backward also reaches what produced x - an upstream layer's backward runs here as on the peers (its own
    exchanges pair with theirs)."""
    out = torch.zeros(x.shape, dtype=dtype, device=device) + anchor.to(dtype)
    if x.requires_grad and (x.is_floating_point() or x.is_complex()):
        out = out + _ZeroGradTo.apply(x, dtype, device)
    return out


def _send_rows(d, x_TH: torch.Tensor, layout):
    """The permuted rows of a padded (sync-free) call: (the pipeline's differentiable input, FP8 packed rows
    or None). Plain: (x_NH, None); FP8: (x_TH, q_NB) - each token quantized once, its packed row copied."""
    W, N, H = d.world_size, layout.num_rows, x_TH.shape[1]
    if d.dispatch_dtype is None:
        out = None if W == 1 else d.workspace.rows("send", N, H, x_TH)
        return ops.permute(x_TH, layout, backend=d.backend, out=out), None
    q_TB = d._quantize(x_TH)
    q_NB = d.workspace.rows("send", N, q_TB.shape[1], q_TB)
    if layout.num_tokens == 0:  # only a padded layout has rows without tokens: all padding
        return x_TH, q_NB.zero_()
    select_backend(d.backend, x_TH.device).permute_rows(q_TB, layout.token_N, out=q_NB)
    if layout.valid_N is not None:  # padding rows: zero bytes decode to 0
        q_NB.masked_fill_(~layout.valid_N[:, None], 0)
    return x_TH, q_NB


def placeholder_backward(d) -> None:
    """The collectives of one backward of Dispatcher ``d`` with zero rows and a failure flag: issued by a rank that
    skipped a backward its peers ran (found at a read, ``Channel.resync``), so that its collectives pair with its
    peers' again. Each phase of the sync-free mode is four collectives of fixed sizes (control, rows each way,
    control), so one placeholder phase realigns them; the peers' reads of these rows raise (they see a
    backward where their forward was), and every rank continues from the next call."""
    if d._agreed is None or d.world_size == 1:
        return
    H, dtype, K = d._agreed
    W, e, P = d.world_size, d.num_local_experts, d.max_tokens_per_rank * K
    call = d.channel.call
    note = RuntimeError(f"EP rank {d.rank} skipped a backward its peers ran (sync-free mode); moe_comm issued a "
                        "placeholder backward to pair its collectives with theirs again")
    plan = _padded_plan(W, e, P, call, torch.zeros(e, dtype=torch.int64))
    transport = d.transport(AllToAll)
    rows = torch.zeros(W * P, H, dtype=dtype, device=d.timeline.device)
    d.channel.wait(d.channel.begin(Phase.BACKWARD, d._header(Phase.BACKWARD, call, 1), local_error=note,
                                   failed=Failure.RAISED))
    back = transport.to_experts(rows, plan, phase="combine", direction="bwd").wait()
    transport.to_tokens(back, plan, torch.empty_like(rows), phase="dispatch", direction="bwd").wait()
    d.channel.wait(d.channel.begin(Phase.BACKWARD_END, d._header(Phase.BACKWARD_END, call, 1), local_error=note,
                                   failed=Failure.RAISED))


def _padded_plan(W: int, e: int, P: int, call: int, tokens_per_expert_e: torch.Tensor) -> ChunkPlan:
    """The one chunk of a sync-free call: P rows to and from every rank (the regroup index is set by the caller)."""
    blocks_We = [[P] + [0] * (e - 1)] * W
    return ChunkPlan(chunk=0, call=call, send_We=blocks_We, recv_We=blocks_We, row_offset=0,
                     tokens_per_expert_e=tokens_per_expert_e, counts_e=None)
