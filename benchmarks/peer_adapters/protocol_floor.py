"""The plain layer (``plain_torch``) plus the collectives and host reads of moe_comm's failure protocol for a small
eager call, and nothing else: the lowest overhead a layer with moe_comm's guarantees could reach on this machine
(always run beside the plain layer; no verdict). Measures the limit that issue #29's goal 1 is judged against.

What it adds to the plain layer, as moe_comm's C = 1 call with its status carried (``Dispatcher.carry_max_bytes``):
- forward: the counts all-to-all becomes the [W, X] int64 control exchange (moe_comm's width X: a header, a
  message area, the per-expert counts), read on the host and its headers checked (magic, call number, settings,
  failure word) before any row moves; the rows back to the tokens carry each rank's status rows after its rows
  (``s`` rows of the row width per destination), unpacked into the output and checked;
- backward: a [W, X] check-in exchange, read and checked, before any gradient row moves; the gradients back to
  the tokens carry the status rows the same way.
Left out: moe_comm's input checks, the load monitor, the timeline, workspaces, error messages (nothing fails here),
and everything the generic schedule does for C > 1, dedup, FP8 or the sync-free mode.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from moe_comm.comm.wire import HEADER_WORDS, MAGIC, MESSAGE_WORDS, Phase, Word
from moe_comm.dispatch.plan import segments_of
from peer_adapters import plain_torch

NAME = "plain + moe_comm's protocol"
INSTALL = "(nothing: PyTorch only)"
STATUS_WORDS = HEADER_WORDS + MESSAGE_WORDS  # what a carried status holds per destination


def missing():
    return None


def _header_rows(W: int, X: int, call: int, phase: Phase, settings: int) -> np.ndarray:
    rows = np.zeros((W, X), dtype=np.int64)
    rows[:, Word.MAGIC], rows[:, Word.CALL], rows[:, Word.PHASE], rows[:, Word.CONFIG] = MAGIC, call, phase, settings
    return rows


def _check(got: np.ndarray, call: int, phase: Phase, settings: int) -> None:
    """Every rank's header: a moe_comm row of this call and phase, the same settings, no failure."""
    want = np.array([MAGIC, call, phase, settings, 0], dtype=np.int64)
    cols = [Word.MAGIC, Word.CALL, Word.PHASE, Word.CONFIG, Word.FAILED]
    if not (got[:, cols] == want).all():
        raise RuntimeError(f"protocol floor: headers disagree in {phase.name} of call {call}: {got[:, cols]}")


def _exchange(layer, phase: Phase) -> np.ndarray:
    """A control exchange with headers only (the backward's check-in), read and checked."""
    send = torch.from_numpy(_header_rows(layer.W, layer.X, layer.call, phase, layer.settings))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=layer.group)
    got = recv.numpy()  # host sync: none, CPU rows
    _check(got, layer.call, phase, layer.settings)
    return got


def _carrying(layer, rows_RH: torch.Tensor, out_splits, in_splits, phase: Phase) -> torch.Tensor:
    """rows_RH to the other ranks with this rank's status rows after each destination's rows, in one all-to-all;
    returns the received rows (status rows removed) after checking every rank's status."""
    W, row_bytes = layer.W, rows_RH.shape[1] * rows_RH.element_size()
    s = -(-STATUS_WORDS * 8 // row_bytes)
    status = torch.zeros(W, s * row_bytes // 8 + 1, dtype=torch.int64)
    status[:, :STATUS_WORDS] = torch.from_numpy(_header_rows(W, STATUS_WORDS, layer.call, phase, layer.settings))
    status_WSB = status.view(torch.uint8)[:, :s * row_bytes].reshape(W, s, row_bytes)
    parts = rows_RH.contiguous().view(torch.uint8).split_with_sizes(in_splits)
    send = torch.cat([t for w in range(W) for t in (parts[w], status_WSB[w])])
    recv = send.new_empty(sum(out_splits) + W * s, row_bytes)
    dist.all_to_all_single(recv, send, [m + s for m in out_splits], [m + s for m in in_splits], group=layer.group)
    got = recv.split_with_sizes([n for m in out_splits for n in (m, s)])
    out = torch.cat(got[0::2]).view(rows_RH.dtype)
    status_W = torch.stack(got[1::2]).reshape(W, s * row_bytes)[:, :STATUS_WORDS * 8].contiguous()
    _check(status_W.view(torch.int64).numpy(), layer.call, phase, layer.settings)  # host sync: none, CPU rows
    return out


class _ToTokens(torch.autograd.Function):
    """Forward: the experts' rows back, the forward's status carried. Backward: the check-in, then the
    gradients to the experts."""

    @staticmethod
    def forward(ctx, out_RH, layer, send_W, recv_W):
        ctx.layer, ctx.splits = layer, (send_W, recv_W)
        return _carrying(layer, out_RH, send_W, recv_W, Phase.FORWARD_END)

    @staticmethod
    def backward(ctx, grad_NH):
        send_W, recv_W = ctx.splits
        _exchange(ctx.layer, Phase.BACKWARD)
        out = grad_NH.new_empty(sum(recv_W), grad_NH.shape[1])
        dist.all_to_all_single(out, grad_NH.contiguous(), recv_W, send_W, group=ctx.layer.group)
        return out, None, None, None


class _ToExperts(torch.autograd.Function):
    """Forward: the rows to the experts. Backward: their gradients back, the backward's status carried."""

    @staticmethod
    def forward(ctx, x_NH, layer, send_W, recv_W):
        ctx.layer, ctx.splits = layer, (send_W, recv_W)
        out = x_NH.new_empty(sum(recv_W), x_NH.shape[1])
        dist.all_to_all_single(out, x_NH.contiguous(), recv_W, send_W, group=layer.group)
        return out

    @staticmethod
    def backward(ctx, grad_RH):
        send_W, recv_W = ctx.splits
        return _carrying(ctx.layer, grad_RH, send_W, recv_W, Phase.BACKWARD_END), None, None, None


class _Layer(plain_torch._Layer):
    """The plain layer's router and experts; its collectives replaced by the protocol's."""

    def __init__(self, ref, group):
        super().__init__(ref, group)
        self.X = ref.dispatcher.channel.width  # moe_comm's control row: header, message, counts
        self.settings = ref.dispatcher.config_hash
        self.call = 0

    def forward(self, x_TH):
        T, H = x_TH.shape
        E, K, W = self.E, self.K, self.W
        e = E // W
        self.call += 1
        w_TK, idx_TK, order_N, counts_E = self.route(x_TH)
        counts_We = counts_E.view(W, e)
        base = HEADER_WORDS + MESSAGE_WORDS
        send = torch.from_numpy(_header_rows(W, self.X, self.call, Phase.FORWARD, self.settings))
        send[:, base:base + e] = counts_We
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # the control exchange, carrying the counts
        got = recv.numpy()  # host sync: the forward's one read (CPU rows)
        _check(got, self.call, Phase.FORWARD, self.settings)
        recv_We = got[:, base:base + e].tolist()
        send_W, recv_W = counts_We.sum(1).tolist(), [sum(r) for r in recv_We]
        token_N = order_N // K
        rows = _ToExperts.apply(x_TH.index_select(0, token_N), self, send_W, recv_W)
        segments = segments_of((i, n) for r in recv_We for i, n in enumerate(r))  # (source rank, expert) blocks
        out = self.experts(rows, torch.tensor([sum(c) for c in zip(*recv_We)]), segments=segments)
        back = _ToTokens.apply(out, self, send_W, recv_W)
        weighted = back * w_TK.reshape(-1).index_select(0, order_N)[:, None]
        return x_TH.new_zeros(T, H).index_add(0, token_N, weighted)


def build(ref, group):
    return _Layer(ref, group)

