"""Per-call plans: who sends how many rows to whom, per chunk, read from the control exchange; and whether the
experts take the received rows as they arrive (``rank_major_pays``).

Shapes legend: W EP world size, e local experts, C chunks, R rows received (per chunk), N rows sent.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np
import torch
from einops import rearrange

from moe_comm.ops.layout import Layout, RankRows

__all__ = ["ChunkPlan", "DispatchHandle", "DispatchOutput", "build_chunk_plans", "group_pieces", "expert_major_index",
           "chunk_expert_major_index", "padded_expert_major_index", "rank_major_pays", "to_device", "layout_device",
           "call_text"]


@dataclass
class ChunkPlan:
    """Host-side split sizes and the regroup permutation of one chunk.

    send_We / recv_We: rows per (rank, local expert) sent to / received from each rank (host ints).
    row_offset, num_rows: this chunk's slice of the permuted rows (sent side).
    expert_index_R: received row of each expert-major row; source_index_R its inverse (None when no
        regroup is needed: e = 1, one rank, the point-to-point transport, or ``rank_major``).
    tokens_per_expert_e: [e] int64 device tensor; counts_e the same on the host (None in sync-free mode:
        then the rows are padded to fixed sizes and only the device knows the counts).
    pieces: the plans of the consecutive token ranges whose rows move one after another, each in its own
        transfer, so the first moves while the next is permuted (``group_pieces``); None: one transfer.
        A piece's rows arrive at ``recv_offset`` of the chunk's received rows (piece-major, then source rank).
    rank_major: the received rows stay in (source rank, local expert) blocks, as the all-to-all delivers
        them (no regroup): for an expert_fn that takes ``segments`` (see ``segments``).
    send_W / recv_W: rows to / from each rank (the sums of send_We / recv_We rows; computed when not given).
    """

    chunk: int
    call: int
    send_We: List[List[int]]
    recv_We: List[List[int]]
    row_offset: int
    tokens_per_expert_e: torch.Tensor
    counts_e: Optional[List[int]]
    expert_index_R: Optional[torch.Tensor] = None
    source_index_R: Optional[torch.Tensor] = None
    pieces: Optional[List["ChunkPlan"]] = None
    piece: Optional[int] = None  # index among its chunk's pieces
    recv_offset: int = 0
    rank_major: bool = False
    send_W: Optional[List[int]] = None
    recv_W: Optional[List[int]] = None

    def __post_init__(self):
        if self.send_W is None:
            self.send_W = [sum(r) for r in self.send_We]
        if self.recv_W is None:
            self.recv_W = [sum(r) for r in self.recv_We]

    @property
    def segments(self) -> List[Tuple[int, int, int]]:
        """(local expert, first row, rows) of every non-empty (source rank, local expert) block of the received
        rows, in row order: where each expert's rows sit when ``rank_major``. Host ints."""
        return segments_of((j, n) for row in self.recv_We for j, n in enumerate(row))

    @property
    def parts(self) -> List["ChunkPlan"]:
        """The plans of this chunk's transfers, in issue order."""
        return self.pieces if self.pieces is not None else [self]

    @property
    def label(self) -> str:
        """How errors and arrival records name this transfer."""
        return f"chunk {self.chunk}" + (f" (piece {self.piece})" if self.piece is not None else "")

    @property
    def send_splits_W(self) -> List[int]:
        return self.send_W

    @property
    def recv_splits_W(self) -> List[int]:
        return self.recv_W

    @property
    def num_rows(self) -> int:
        return sum(self.send_W)

    @property
    def num_recv(self) -> int:
        return sum(self.recv_W)


@dataclass
class DispatchHandle:
    """What the rest of a call (combine, the backward) needs; opaque to users."""

    layout: Layout
    chunks: List[ChunkPlan]
    call: int
    hidden_size: int
    transport: object  # the Transport every phase of this call uses (the same on every rank)
    owner: int = 0  # id() of the Dispatcher that made it
    combined: bool = False  # combine() ran for this handle (a second combine raises)
    rank_rows: Optional[RankRows] = None  # one copy per (token, rank): layout is rank_rows.layout
    slots_sent: int = 0  # routed slots this rank sent (= layout.num_rows unless one copy per rank)
    call_dev: Optional[torch.Tensor] = None  # the call number on the device (sync-free device calls)
    carry: bool = False  # a pipelined call's phases close inside their last transfer (``Dispatcher.carry_max_bytes``)

    @property
    def direct(self) -> bool:
        """Rows of this call move point-to-point straight into expert-major order (no regroup)."""
        return getattr(self.transport, "name", "") == "point_to_point"


@dataclass
class DispatchOutput:
    """tokens: [R, H] received rows, expert-major (local expert 0's rows first, each expert's rows
    by source rank then source token order); tokens_per_expert: [e] int64; handle: for combine."""

    tokens: torch.Tensor
    tokens_per_expert: torch.Tensor
    handle: DispatchHandle = field(repr=False)

    @property
    def counts(self) -> List[int]:
        """Host copy of tokens_per_expert (already known: no extra sync)."""
        return self.handle.chunks[0].counts_e


def call_text(call: int) -> str:
    """How messages name a call: its number, or (sync-free device calls, ``call`` -1) where it lives."""
    return f"call {call}" if call >= 0 else "this sync-free call (numbered on the device)"


def segments_of(blocks) -> List[Tuple[int, int, int]]:
    """(local expert, rows) blocks in row order -> (local expert, first row, rows) of the non-empty ones."""
    out, start = [], 0
    for j, n in blocks:
        if n:
            out.append((j, start, int(n)))
        start += n
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (the rows' device), without a blocking copy: a CPU tensor goes to CUDA from pinned
    memory, asynchronously. A no-op when it is there already."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def layout_device(layout) -> torch.device:
    """The device of a call's rows (its layout's tensors)."""
    lay = layout.layout if isinstance(layout, RankRows) else layout
    return lay.dest_row_TK.device


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def expert_major_index(counts_We: torch.Tensor, total: int):
    """Permutation from received (source rank, expert) blocks to expert-major (expert, source rank).

    Example: W=2, e=2, counts_We = [[1, 2], [1, 0]] (rows r0 | r1 r2 | r3)
        expert-major order: expert 0 from rank 0, rank 1, then expert 1 -> index [0, 3, 1, 2]
    """
    (index_R,), (inverse_R,) = chunk_expert_major_index(counts_We[None], [total])
    return index_R, inverse_R


def chunk_expert_major_index(counts_CWe: torch.Tensor, totals_C: List[int]):
    """``expert_major_index`` of C chunks at once (a fixed number of device ops whatever C, W and e): chunk c
    received ``totals_C[c]`` rows in (source rank, expert) blocks of counts_CWe[c]. Returns (index per chunk,
    inverse per chunk), each chunk's positions counted from its own first row.

    Example: C=2, W=1, e=2, counts_CWe = [[[1, 1]], [[0, 2]]] -> index ([0, 1], [0, 1])"""
    C, W, e = counts_CWe.shape
    dev, total = counts_CWe.device, sum(totals_C)
    src_start_CWe = _exclusive_cumsum(counts_CWe.reshape(-1)).reshape(C, W, e)  # over all chunks' rows
    counts_B = rearrange(counts_CWe, "c w e -> (c e w)")  # destination blocks, chunk-major
    block_R = torch.repeat_interleave(torch.arange(C * e * W, device=dev), counts_B, output_size=total)
    pos_R = torch.arange(total, device=dev) - _exclusive_cumsum(counts_B)[block_R]
    index_R = rearrange(src_start_CWe, "c w e -> (c e w)")[block_R] + pos_R
    inverse_R = torch.empty_like(index_R)
    inverse_R[index_R] = torch.arange(total, device=dev)
    # a row's chunk is the same in both orders: count its positions from its chunk's first row
    first_R = src_start_CWe.reshape(C, -1)[:, 0][block_R // (e * W)]
    return torch.split(index_R - first_R, totals_C), torch.split(inverse_R - first_R, totals_C)


def _host_expert_major_index(counts_CWe: np.ndarray, totals_C: List[int]):
    """``chunk_expert_major_index`` on host counts, for rows on the CPU (the same steps in numpy)."""
    C, W, e = counts_CWe.shape
    flat = counts_CWe.reshape(-1)
    src_start_CWe = (np.cumsum(flat) - flat).reshape(C, W, e)
    counts_B = counts_CWe.transpose(0, 2, 1).reshape(-1)
    block_R = np.repeat(np.arange(C * e * W), counts_B)
    pos_R = np.arange(block_R.size) - (np.cumsum(counts_B) - counts_B)[block_R]
    index_R = src_start_CWe.transpose(0, 2, 1).reshape(-1)[block_R] + pos_R
    inverse_R = np.empty_like(index_R)
    inverse_R[index_R] = np.arange(index_R.size)
    first_R = src_start_CWe.reshape(C, -1)[:, 0][block_R // (e * W)]
    cuts = np.cumsum(totals_C)[:-1]
    return ([torch.from_numpy(i) for i in np.split(index_R - first_R, cuts)],
            [torch.from_numpy(i) for i in np.split(inverse_R - first_R, cuts)])


def padded_expert_major_index(counts_We: torch.Tensor, rows_per_rank: int):
    """``expert_major_index`` for fixed-size blocks: received block w holds its counts_We[w] rows (by local
    expert) then padding up to rows_per_rank (P). Returns a permutation of the W*P rows: every expert's rows
    (by source rank) first, then all padding, and its inverse. Device ops only (a sort): no host sync.

    Example: W=2, e=2, P=3, counts_We = [[1, 2], [1, 0]] (rows r0 r1 r2 | r3 p p)
        -> index [0, 3, 1, 2, 4, 5]
    """
    W, e = counts_We.shape
    P, dev = rows_per_rank, counts_We.device
    r_R = torch.arange(W * P, device=dev)
    w_R, i_R = r_R // P, r_R % P
    end_We = torch.cumsum(counts_We, 1)
    valid_R = i_R < end_We[w_R, -1]
    expert_R = (end_We[w_R] <= i_R[:, None]).sum(1)  # local expert of each received row
    block_R = torch.where(valid_R, expert_R * W + w_R, e * W)  # padding sorts last
    index_R = torch.sort(block_R * (W * P) + r_R).indices  # unique keys: the order is exact
    inverse_R = torch.empty_like(index_R)
    inverse_R[index_R] = r_R
    return index_R, inverse_R


# Rows on the CPU up to this many received rows get their regroup index from numpy; more, from torch (threaded).
# Measured (W = 64, e = 32, one call's plans): 9K rows numpy 0.14 ms vs torch 0.27; 37K rows numpy 1.0 vs torch 0.76.
HOST_INDEX_MAX_ROWS = 16384


def build_chunk_plans(send_WCe: np.ndarray, recv_WCe: np.ndarray, recv_counts_WCe: torch.Tensor, regroup: bool,
                      call: int = 0, recv_slots_WCe: Optional[np.ndarray] = None,
                      rank_major: bool = False) -> List[ChunkPlan]:
    """Chunk plans from the host counts (sent and received, per rank, chunk, local expert: int64 arrays read from
    the control exchange) and the received slots per (rank, chunk, local expert) on the device (for
    tokens_per_expert and the regroup index without another sync). Array ops: the host work does not grow with
    W x e. regroup: build the expert-major permutation (the all-to-all transport with W > 1 and e > 1).
    recv_slots_WCe: the same slots on the host when rows are not one per slot (one copy per rank: send/recv_WCe
    then hold rows per (rank, chunk), one column). rank_major: the experts take the rows in (source rank, local
    expert) blocks (``ChunkPlan.segments``; then no regroup)."""
    W, C, e = recv_counts_WCe.shape
    send_WCe, recv_WCe = np.asarray(send_WCe), np.asarray(recv_WCe)  # also nested lists
    slots_WCe = recv_WCe if recv_slots_WCe is None else np.asarray(recv_slots_WCe)
    send_CW, recv_CW = send_WCe.sum(2).T, recv_WCe.sum(2).T
    offsets_C = np.cumsum(send_CW.sum(1)) - send_CW.sum(1)
    recv_C = recv_CW.sum(1).tolist()  # host sync: none, numpy host arrays here and below
    if recv_counts_WCe.device.type == "cpu" and sum(recv_C) <= HOST_INDEX_MAX_ROWS:
        # the host counts are the same numbers: numpy, without torch's per-op overhead
        tokens_Ce = torch.from_numpy(slots_WCe.sum(0))
        index = _host_expert_major_index(recv_WCe.transpose(1, 0, 2), recv_C) if regroup else ([None] * C,) * 2
    else:
        tokens_Ce = recv_counts_WCe.sum(0)  # one device op for every chunk
        index = chunk_expert_major_index(recv_counts_WCe.transpose(0, 1), recv_C) if regroup else ([None] * C,) * 2
    send_CWe, recv_CWe = send_WCe.transpose(1, 0, 2).tolist(), recv_WCe.transpose(1, 0, 2).tolist()  # host sync: none
    counts_Ce, send_CW, recv_CW = slots_WCe.sum(0).tolist(), send_CW.tolist(), recv_CW.tolist()  # host sync: none
    return [ChunkPlan(chunk=c, call=call, send_We=send_CWe[c], recv_We=recv_CWe[c], row_offset=int(offsets_C[c]),
                      tokens_per_expert_e=tokens_Ce[c], counts_e=counts_Ce[c], expert_index_R=index[0][c],
                      source_index_R=index[1][c], rank_major=rank_major, send_W=send_CW[c], recv_W=recv_CW[c])
            for c in range(C)]


def group_pieces(plans: List[ChunkPlan], pieces: int) -> List[ChunkPlan]:
    """C x P plans (consecutive token ranges, no regroup) -> C chunk plans of P pieces each: the experts run
    once per chunk on the rows of all its pieces (piece-major, then source rank), which arrive each in its
    own transfer. Only for rows that carry what the experts' ranks need to place them (one copy per rank:
    the [2K] metadata), since the received order is not (source rank, expert).

    Example: 4 plans sending rows [3], [2], [1], [4], pieces=2 -> 2 chunks sending 5 and 5 rows, chunk 1's
    pieces at row offsets 5 and 6."""
    if pieces == 1:
        return plans
    chunks = []
    for c in range(len(plans) // pieces):
        parts = plans[c * pieces:(c + 1) * pieces]
        recv_offset = 0
        for i, q in enumerate(parts):
            q.chunk, q.piece, q.recv_offset = c, i, recv_offset
            recv_offset += q.num_recv
        def summed(lists):  # element-wise sum of equally shaped lists of ints
            return [sum(col) for col in zip(*lists)]

        chunks.append(ChunkPlan(
            chunk=c, call=parts[0].call, row_offset=parts[0].row_offset,
            send_We=[summed(rows) for rows in zip(*(q.send_We for q in parts))],
            recv_We=[summed(rows) for rows in zip(*(q.recv_We for q in parts))],
            tokens_per_expert_e=sum(q.tokens_per_expert_e for q in parts),
            counts_e=summed(q.counts_e for q in parts), pieces=parts))
    return chunks


def rank_major_pays(expert_fn, block_rows: float, device: torch.device) -> bool:
    """The experts take this call's rows in (source rank, local expert) blocks of ``block_rows`` mean rows,
    without the regroup pass each way (forward and backward): asked of an expert_fn with a
    ``prefers_segments(block_rows, device)`` method (GroupedExperts), which knows its GEMMs' shapes, and whose
    call takes ``segments=`` (a subclass that overrides ``forward`` without it keeps expert-major rows)."""
    pick = getattr(expert_fn, "prefers_segments", None)
    return callable(pick) and _takes_segments(expert_fn) and pick(block_rows, device) is True


def _takes_segments(expert_fn) -> bool:
    call = expert_fn.forward if isinstance(expert_fn, torch.nn.Module) else expert_fn
    fn = getattr(call, "__func__", call)
    try:
        return _cached_takes_segments(fn)
    except TypeError:  # an unhashable callable object: read its signature each time
        return _signature_takes_segments(fn)


def _signature_takes_segments(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read: do not guess
        return False
    return any(p.name == "segments" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


_cached_takes_segments = functools.lru_cache(maxsize=64)(_signature_takes_segments)  # once per forward function
