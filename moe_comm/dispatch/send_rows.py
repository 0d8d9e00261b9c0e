"""The rows a call sends: permuted while the control exchange travels, or streamed in pieces.

Shapes legend: T tokens, K top-k, N rows sent, B bytes or elements of one sent row (H, or the FP8 packed width).

Streaming (one copy per rank on CPU, C = 1): the layout is made with ``pieces`` chunks (token ranges, the
layout's tapered chunks), the first piece's rows are permuted while the control exchange travels, and every
later piece just before its own transfer (``fill``), so only the first piece's permute precedes the first
byte on the wire. The experts' rank gets one copy per rank's rows with their [2K] placement, so the pieces
need no regroup (``plan.group_pieces``).

Measured (dispatch / raw all-to-all, ``benchmarks/wire.py``, 1 Gbit/s link, 2 shared cores): 32 MiB per rank
at W = 2 1.036 -> 1.005-1.026, 61 MiB at W = 4 1.012 -> 0.994-1.004, 15 MiB at W = 4 1.06 -> 1.02; at 8 MiB
(W = 2) 1.046-1.056 -> 1.058-1.078: there the whole permute fits in the control exchange's round trip and the
pieces' extra transfers cost more than they hide, hence STREAM_MIN_BYTES.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from moe_comm import ops
from moe_comm._recompute import checkpoint_mode, in_backward
from moe_comm.dispatch.plan import ChunkPlan
from moe_comm.kernels import select_backend

__all__ = ["STREAM_PIECES", "STREAM_MIN_BYTES", "pieces", "streams", "presend"]

STREAM_PIECES = 4  # pieces of a streamed call
STREAM_MIN_BYTES = 12 << 20  # a call streams after one whose largest sender moved this many bytes of rows


def streams(max_rows_bytes: int) -> bool:
    """Whether the next call streams, from the largest rank's row bytes of this one (read by every rank alike
    from the control exchange)."""
    return max_rows_bytes >= STREAM_MIN_BYTES


def pieces(d, C, x_TH: torch.Tensor, rank_rows: bool) -> int:
    """Pieces of the one chunk: one copy per rank on CPU with C = 1, after a call that ``streams``, and not
    under activation checkpointing (a recompute must lay its rows out as the first pass did: non-reentrant
    checkpointing hands the first pass's backward the recomputed layout). The same on every rank: max_chunks
    and dedup are agreed at construction, the device type by the group's backend, ``d._stream`` comes from the
    last control exchange every rank read alike, and the header carries C x pieces (checked)."""
    if not (rank_rows and d._stream) or C != 1 or x_TH.device.type != "cpu":
        return 1
    if in_backward() or checkpoint_mode() is not None:
        return 1
    return min(STREAM_PIECES, d.max_chunks)


def presend(d, x_TH: torch.Tensor, layout, fresh: bool,
            pieces: int = 1) -> Tuple[torch.Tensor, Optional[Callable[[ChunkPlan], None]]]:
    """The rows Dispatcher ``d`` sends for this call [N, B], made without autograd (the gradient reaches x_TH
    through the transfer's backward). FP8: the packed rows, each token quantized once. On CPU exactly the N
    routed rows (the counts are host memory: nothing to wait for); on an accelerator N is unknown until the
    exchange is read, so every slot that can hold a row is copied (the routed ones first) and the caller
    narrows to N. fresh: a new tensor (the experts may keep the rows: W = 1), else the workspace's send buffer.

    Returns (rows, None) with every row permuted, or with pieces > 1 (CPU) (rows, fill): only the first
    piece's rows are permuted, and ``fill(piece_plan)`` permutes a later piece's rows just before it goes."""
    lay = layout.layout if isinstance(layout, ops.RankRows) else layout
    T, K = lay.num_tokens, lay.top_k
    if x_TH.device.type == "cpu":
        rows = int(lay.counts_CWe.sum())  # host sync: none, CPU tensors (nothing to wait for)
    else:
        rows = T * min(K, d.world_size) if lay is not layout else T * K
    src = x_TH.detach().contiguous()
    if d.dispatch_dtype is not None:
        src = d._quantize(src)
    out = src.new_empty(rows, src.shape[1]) if fresh else d.workspace.rows("send", rows, src.shape[1], src)
    impl = select_backend(d.backend, x_TH.device)
    if pieces == 1:
        return impl.permute_rows(src, lay.token_S[:rows], out=out), None
    done = [int(lay.counts_CWe[0].sum())]  # host sync: none, CPU tensors. Rows permuted so far (sent order)

    def fill(piece: ChunkPlan) -> None:
        end = piece.row_offset + piece.num_rows
        if end > done[0]:
            with d.timeline.compute("permute", chunk=piece.chunk):
                impl.permute_rows(src, lay.token_S[done[0]:end], out=out[done[0]:end])
            done[0] = end

    impl.permute_rows(src, lay.token_S[:done[0]], out=out[:done[0]])
    return out, fill
