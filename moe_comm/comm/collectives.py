"""Collectives: all-to-all with uneven splits and autograd, the counts exchange, point-to-point row
segments, group helpers.

Shapes legend: R rows, H hidden size, W EP world size.
Rows travel as raw bytes (a uint8 view), so every dtype works on every backend (gloo has no
bfloat16 reductions, but an all-to-all needs no arithmetic).
"""
from __future__ import annotations

import datetime
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["resolve_group", "group_size", "group_rank", "all_to_all_v", "all_to_all_v_async", "exchange_counts",
           "exchange_counts_async", "exchange_segments", "CollectiveError", "wait_work"]


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a dead or stuck peer); names the phase and chunk."""


def wait_work(work, phase: str, chunk: int = -1, *, timeout: Optional[float] = None, rank: int = 0,
              direction: str = "fwd", what: str = "all-to-all") -> None:
    """``work.wait()`` that turns a failure or timeout into a CollectiveError naming where it happened.

    timeout: seconds (None: the process group's own timeout). what: the kind of transfer, for the message.
    """
    if work is None:
        return
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        where = phase if chunk < 0 else f"{phase} of chunk {chunk}"
        raise CollectiveError(f"moe_comm: EP rank {rank}: the {where} {what} ({direction}) failed or timed "
                              f"out; a peer rank may have died or stalled: {e}") from e


def resolve_group(ep_group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """None -> the WORLD group when torch.distributed is initialised, else None (W = 1)."""
    if ep_group is not None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("ep_group was given but torch.distributed is not initialised")
        return ep_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return 0 if group is None else dist.get_rank(group)


def _as_bytes(x_RH: torch.Tensor) -> torch.Tensor:
    row_bytes = x_RH.shape[1:].numel() * x_RH.element_size()
    return x_RH.contiguous().view(torch.uint8).reshape(x_RH.shape[0], row_bytes)


def _a2a_raw(x_RH: torch.Tensor, out_splits: List[int], in_splits: List[int], group,
             out_RH: Optional[torch.Tensor] = None) -> torch.Tensor:
    if out_RH is None:
        out_RH = x_RH.new_empty((sum(out_splits),) + tuple(x_RH.shape[1:]))
    if x_RH.shape[1:].numel() == 0:
        return out_RH  # zero-width rows: nothing to move, every rank skips alike (H is shared)
    dist.all_to_all_single(_as_bytes(out_RH), _as_bytes(x_RH), out_splits, in_splits, group=group)
    return out_RH


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RH, out_splits, in_splits, group, out_RH):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _a2a_raw(x_RH, out_splits, in_splits, group, out_RH)

    @staticmethod
    def backward(ctx, grad_RH):
        out_splits, in_splits = ctx.splits
        # The gradient flows back along the reverse route: swap the split lists.
        return _a2a_raw(grad_RH, in_splits, out_splits, ctx.group), None, None, None, None


def all_to_all_v(x_RH: torch.Tensor, out_splits: List[int], in_splits: List[int],
                 group: Optional[dist.ProcessGroup], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Differentiable all-to-all with uneven splits.

    Args:
        x_RH: [sum(in_splits), ...] rows; the first in_splits[0] go to rank 0, and so on.
        out_splits: rows received from each rank (host ints, length W).
        in_splits: rows sent to each rank (host ints, length W).
        group: process group; None means W = 1 (the input is returned as is).
        out: optional contiguous [sum(out_splits), ...] buffer to receive into (a workspace).
    Returns: [sum(out_splits), ...] rows ordered by source rank.
    """
    if group is None or group_size(group) == 1:
        return x_RH
    return _AllToAllV.apply(x_RH, list(out_splits), list(in_splits), group, out)


def exchange_counts_async(send_WX: torch.Tensor, group: Optional[dist.ProcessGroup]):
    """Issue the counts exchange: row w of ``send_WX`` goes to rank w. Returns (recv_WX, Work):
    row w of recv_WX comes from rank w once the Work completed (Work None with one rank)."""
    if group is None or group_size(group) == 1:
        return send_WX, None
    recv_WX = torch.empty_like(send_WX)
    return recv_WX, dist.all_to_all_single(recv_WX, send_WX.contiguous(), group=group, async_op=True)


def exchange_counts(send_WX: torch.Tensor, group: Optional[dist.ProcessGroup], *,
                    timeout: Optional[float] = None) -> torch.Tensor:
    """Row w of ``send_WX`` goes to rank w; returns [W, X] with row w received from rank w.

    One ``all_to_all_single`` of int64 counts; no host sync here (the caller reads the result once).
    """
    recv_WX, work = exchange_counts_async(send_WX, group)
    wait_work(work, "counts exchange", timeout=timeout, rank=group_rank(group))
    return recv_WX


def exchange_segments(out_RH: torch.Tensor, x_NH: torch.Tensor, sends: List[Tuple[int, int, int, int]],
                      recvs: List[Tuple[int, int, int, int]], group: Optional[dist.ProcessGroup], *,
                      phase: str, direction: str = "fwd", timeout: Optional[float] = None) -> None:
    """Move row segments between ranks with point-to-point sends, straight into their final rows.

    sends / recvs: (peer rank in group, tag, first row, rows) of ``x_NH`` / ``out_RH``. Between two
    ranks, the k-th send with a tag meets the k-th receive with that tag, so both sides list a
    pair's segments in the same order; empty segments are skipped on both sides alike. Segments a
    rank sends to itself are copied, the i-th self send into the i-th self receive. Waits for all,
    ``timeout`` seconds for the whole exchange. Both tensors contiguous, same row width and dtype.
    """
    me = group_rank(group)
    if x_NH.shape[1:].numel() == 0:
        return  # zero-width rows: nothing to move (H is shared, every rank skips alike)
    xb, ob = _as_bytes(x_NH), _as_bytes(out_RH)
    world = group is None or group is dist.group.WORLD

    def peer_of(r: int) -> int:
        return r if world else dist.get_global_rank(group, r)

    ops = [dist.P2POp(dist.irecv, ob[s:s + n], peer_of(p), group, tag) for p, tag, s, n in recvs if p != me and n]
    ops += [dist.P2POp(dist.isend, xb[s:s + n], peer_of(p), group, tag) for p, tag, s, n in sends if p != me and n]
    works = dist.batch_isend_irecv(ops) if ops else []
    own_sends = [(s, n) for p, _, s, n in sends if p == me and n]
    own_recvs = [(s, n) for p, _, s, n in recvs if p == me and n]
    for (s, n), (r, m) in zip(own_sends, own_recvs, strict=True):  # while the peers' rows travel
        ob[r:r + m].copy_(xb[s:s + n])
    deadline = None if timeout is None else time.monotonic() + timeout
    for w in works:
        left = None if deadline is None else max(deadline - time.monotonic(), 1e-3)
        wait_work(w, phase, timeout=left, rank=me, direction=direction, what="point-to-point transfer")


def all_to_all_v_async(out_RH: torch.Tensor, x_RH: torch.Tensor, out_splits: List[int], in_splits: List[int],
                       group: Optional[dist.ProcessGroup]):
    """Issue an all-to-all into ``out_RH`` without waiting; returns the Work (None when W = 1 or when
    there is nothing to move: then ``out_RH`` is already filled). ``out_RH`` and ``x_RH`` must be
    contiguous (row slices of a contiguous buffer are)."""
    if group is None or group_size(group) == 1:
        if out_RH.data_ptr() != x_RH.data_ptr() or out_RH.numel() != x_RH.numel():
            out_RH.copy_(x_RH)
        return None
    if x_RH.shape[1:].numel() == 0:
        return None
    return dist.all_to_all_single(_as_bytes(out_RH), _as_bytes(x_RH), out_splits, in_splits, group=group,
                                  async_op=True)
