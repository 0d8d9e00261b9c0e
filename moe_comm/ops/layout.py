"""make_layout: where every routed (token, slot) goes, as counts and a permutation map.

Shapes legend: T tokens, K top-k slots, S = T*K slots, N routed rows (S minus dropped),
E experts (global), W EP ranks, e = E / W local experts, C chunks.

Permuted row order is (chunk, destination rank, local expert), stable in slot order
(slot s = t*K + k). Global expert g lives on rank g // e as local expert g % e, so sorting by
(chunk, g) is exactly that order. Token t belongs to chunk min(C - 1, (2t(C - 1) + T) // 2T): contiguous
token ranges, independent of the routing, with the first and last chunk half as long as the others
(C >= 3). The pipeline cannot hide the first dispatch nor the last combine; halving those chunks
halves that fill/drain time (benchmarks/overlap.py, 1 Gbit/s link, 2 ranks, C = 4: step 1.22x -> 1.12x
of max(T_compute, T_comm) against equal chunks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from einops import rearrange, reduce, repeat

from moe_comm._checks import check_int, check_tensor

__all__ = ["Layout", "make_layout", "layout_reference", "chunk_of_tokens", "pad_layout", "RankRows", "make_rank_rows",
           "rank_rows_reference"]


@dataclass
class Layout:
    """The permutation map and counts of one routing decision.

    Attributes:
        num_tokens, top_k, num_experts, num_ranks, num_chunks: T, K, E, W, C.
        dest_row_TK: [T, K] int64, permuted row of slot (t, k); -1 = dropped.
        src_slot_S: [T*K] int64, slot index t*K+k of permuted row n; the N routed rows come first,
            then the dropped slots (ascending), which no kernel reads.
        token_S: [T*K] int64, ``src_slot_S // K``: the token of each permuted row.
        counts_CWe: [C, W, e] int64 rows per (chunk, destination rank, local expert).
        num_invalid: [] int64 count of topk_idx values outside [-1, E) (treated as dropped); the
            Dispatcher folds it into the counts exchange so every rank raises together.
        valid_N: None, or [N] bool for a padded layout (``pad_layout``): rows where it is False are padding,
            written as zeros by ``permute`` and given zero gradient by ``unpermute``.
    """

    num_tokens: int
    top_k: int
    num_experts: int
    num_ranks: int
    num_chunks: int
    dest_row_TK: torch.Tensor
    src_slot_S: torch.Tensor
    token_S: torch.Tensor
    counts_CWe: torch.Tensor
    num_invalid: torch.Tensor
    _num_rows: Optional[int] = field(default=None, repr=False)
    valid_N: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def tokens_per_expert_E(self) -> torch.Tensor:
        """[E] int64 routed rows per global expert (device tensor, no sync)."""
        return reduce(self.counts_CWe, "c w e -> (w e)", "sum")  # global expert g = w * e + local

    @property
    def num_rows(self) -> int:
        """N, the routed rows. Known without a sync once the Dispatcher's counts exchange ran."""
        if self._num_rows is None:
            self._num_rows = int(self.counts_CWe.sum().item())  # host sync: N sizes the permuted buffer
        return self._num_rows

    def set_num_rows(self, n: int) -> None:
        """Record N from host counts the caller already has (saves the sync in ``num_rows``)."""
        self._num_rows = int(n)

    @property
    def token_N(self) -> torch.Tensor:
        """[N] int64 token index of each routed row."""
        return self.token_S[: self.num_rows]

    @property
    def src_slot_N(self) -> torch.Tensor:
        """[N] int64 slot index of each routed row."""
        return self.src_slot_S[: self.num_rows]


def chunk_of_tokens(num_tokens: int, num_chunks: int, device=None) -> torch.Tensor:
    """[T] int64 chunk of every token: min(C - 1, (2t(C - 1) + T) // 2T).

    Example: T = 8, C = 3 -> [0, 0, 1, 1, 1, 1, 2, 2] (sizes 2, 4, 2); C = 2 -> halves; C = 1 -> all 0.
    """
    T, C = num_tokens, num_chunks
    t = torch.arange(T, device=device, dtype=torch.int64)
    return torch.clamp((2 * t * (C - 1) + T) // (2 * max(T, 1)), max=C - 1)


def layout_reference(topk_idx_TK: torch.Tensor, num_experts: int, num_chunks: int = 1):
    """Pure-torch layout: (dest_row_TK, src_slot_S, counts_CE, num_invalid).

    Example (E=2, C=1): topk_idx_TK = [[1, 0], [0, -1]]
        slots 0..3 have keys [1, 0, 0, drop] -> src_slot_S = [1, 2, 0, 3]
        dest_row_TK = [[2, 0], [1, -1]], counts_CE = [[2, 1]]
    """
    T, K = topk_idx_TK.shape
    E, C = num_experts, num_chunks
    dev = topk_idx_TK.device
    flat_S = rearrange(topk_idx_TK, "t k -> (t k)")  # slot s = t*K + k
    valid_S = (flat_S >= 0) & (flat_S < E)
    num_invalid = ((flat_S < -1) | (flat_S >= E)).sum()
    chunk_S = repeat(chunk_of_tokens(T, C, dev), "t -> (t k)", k=K)
    key_S = torch.where(valid_S, chunk_S * E + flat_S, torch.full_like(flat_S, C * E))  # C*E: dropped, sorts last
    src_slot_S = torch.sort(key_S, stable=True).indices
    # scatter_add into fixed C*E + 1 bins, not bincount: bincount reads max(key) on the host (a CUDA sync).
    bins = torch.zeros(C * E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key_S, torch.ones_like(key_S))
    counts_CE = rearrange(bins[: C * E], "(c e) -> c e", c=C, e=E)
    dest_S = torch.empty_like(flat_S)
    dest_S[src_slot_S] = torch.arange(T * K, device=dev, dtype=torch.int64)
    dest_S = torch.where(valid_S, dest_S, torch.full_like(dest_S, -1))
    return rearrange(dest_S, "(t k) -> t k", t=T, k=K), src_slot_S, counts_CE, num_invalid


def _checked_args(topk_idx_TK, num_experts, num_ranks: int, num_chunks: int) -> torch.Tensor:
    """The checks of ``make_layout`` / ``make_rank_rows``; returns the ids as contiguous int64."""
    check_tensor("topk_idx_TK", topk_idx_TK, dim=2, integer=True)
    check_int("num_experts", num_experts, 1)
    check_int("num_ranks", num_ranks, 1)
    check_int("num_chunks", num_chunks, 1)
    if num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by num_ranks, got num_ranks={num_ranks}")
    return topk_idx_TK.to(torch.int64).contiguous()


def make_layout(topk_idx_TK: torch.Tensor, num_experts: int, *, num_ranks: int = 1, num_chunks: int = 1,
                backend: str = "auto") -> Layout:
    """Counts and permutation map for ``topk_idx_TK``; no host sync.

    Args:
        topk_idx_TK: [T, K] integer (int64 preferred) global expert ids; -1 means dropped.
            Values outside [-1, E) are counted in ``Layout.num_invalid`` and treated as dropped.
        num_experts: E, global experts; must divide by ``num_ranks``.
        num_ranks: W, EP ranks the experts are spread over (expert g on rank g // (E/W)).
        num_chunks: C, pipeline chunks (``chunk_of_tokens``: contiguous, first and last half-size).
        backend: "auto" | "native" | "torch" ("triton" uses the torch layout: the sort is not
            the bottleneck on GPU).
    Example:
        make_layout([[1, 0], [0, -1]], num_experts=2)
        -> dest_row_TK [[2, 0], [1, -1]], counts_CWe [[[2, 1]]], 3 routed rows
    """
    topk_idx_TK = _checked_args(topk_idx_TK, num_experts, num_ranks, num_chunks)
    from moe_comm.kernels import select_backend
    impl = select_backend(backend, topk_idx_TK.device)
    layout_fn = getattr(impl, "make_layout", None) or layout_reference
    dest_row_TK, src_slot_S, counts_CE, num_invalid = layout_fn(topk_idx_TK, num_experts, num_chunks)
    T, K = topk_idx_TK.shape
    # per call, on the host path: a view and a C call ("c (w e) -> c w e"; slot // K) instead of einops / __floordiv__
    return Layout(num_tokens=T, top_k=K, num_experts=num_experts, num_ranks=num_ranks, num_chunks=num_chunks,
                  dest_row_TK=dest_row_TK, src_slot_S=src_slot_S,
                  token_S=src_slot_S.div(K, rounding_mode="floor") if K else src_slot_S,
                  counts_CWe=counts_CE.reshape(num_chunks, num_ranks, num_experts // num_ranks),  # g = w * e + local
                  num_invalid=num_invalid)


def pad_layout(layout: Layout, rows_per_rank: int) -> Layout:
    """The layout of a fixed-size exchange: destination rank w's rows at [w*P, w*P + its rows), zeros up to
    (w + 1)*P, for N = W*P rows in all whatever the routing. Device ops only: no host sync.

    Args:
        layout: a one-chunk layout from ``make_layout``.
        rows_per_rank: P >= the rows any destination rank can get (the sync-free Dispatcher uses
            max_tokens_per_rank x K >= T x K); rows past P would be dropped.
    Example: W = 2, P = 3, rows per destination [2, 1] (rows r0 r1 | r2)
        -> padded rows [r0, r1, 0 | r2, 0, 0], valid_N = [1, 1, 0, 1, 0, 0]
    """
    if layout.num_chunks != 1:
        raise ValueError(f"pad_layout: the layout must have one chunk, got num_chunks={layout.num_chunks}")
    check_int("rows_per_rank", rows_per_rank, 1)
    W, P, S = layout.num_ranks, rows_per_rank, layout.num_tokens * layout.top_k
    dev = layout.dest_row_TK.device
    rows_W = layout.counts_CWe.sum((0, 2))
    end_W = torch.cumsum(rows_W, 0)
    start_W = end_W - rows_W
    # sorted row n -> padded row: its destination's block, then its place in it (dropped rows: -1)
    n_S = torch.arange(S, device=dev)
    dst_S = torch.bucketize(n_S, end_W, right=True)  # W for the dropped rows (n >= N)
    place_S = n_S - start_W[dst_S.clamp(max=W - 1)]
    pos_S = torch.where((dst_S < W) & (place_S < P), dst_S * P + place_S, -1)
    dest = layout.dest_row_TK
    dest_row_TK = torch.where(dest >= 0, pos_S[dest.clamp(min=0)], -1) if S else dest
    # padded row p -> sorted row (padding rows point at row 0, masked by valid_N)
    p_N = torch.arange(W * P, device=dev)
    w_N, i_N = p_N // P, p_N % P
    valid_N = i_N < rows_W[w_N]
    row_N = (start_W[w_N] + i_N).clamp(max=max(S - 1, 0))
    if S:
        token_N = torch.where(valid_N, layout.token_S[row_N], 0)
        slot_N = torch.where(valid_N, layout.src_slot_S[row_N], 0)
    else:
        token_N = slot_N = torch.zeros(W * P, dtype=torch.int64, device=dev)
    return Layout(num_tokens=layout.num_tokens, top_k=layout.top_k, num_experts=layout.num_experts, num_ranks=W,
                  num_chunks=1, dest_row_TK=dest_row_TK, src_slot_S=slot_N, token_S=token_N,
                  counts_CWe=layout.counts_CWe, num_invalid=layout.num_invalid, _num_rows=W * P, valid_N=valid_N)


@dataclass
class RankRows:
    """One row per (token, destination rank): the sent side of a dispatch with one copy per rank.

    Attributes:
        layout: a Layout whose "experts" are the W ranks (num_experts = num_ranks = W, counts_CWe [C, W, 1]):
            the first slot of each (token, rank) pair holds its row, the token's other slots on that rank -1.
            ``permute`` / ``unpermute`` (no weights) with it send and sum the rows.
        local_idx_SK: [T*K, K] int64, for sent row n (the first N' rows are routed): the local expert
            (0..e-1) of each of its token's K slots that go to the row's rank, -1 for the others.
        slot_pos_TK: [T, K] int64, where slot (t, k) sits in ``local_idx_SK`` flattened (row * K + k);
            T*K*K for dropped slots.
        slot_counts_CWe: [C, W, e] int64 routed slots per (chunk, rank, local expert): what the experts get.
        num_invalid: [] int64 ids outside [-1, E) (treated as dropped, as in ``make_layout``).
    """

    layout: Layout
    local_idx_SK: torch.Tensor
    slot_pos_TK: torch.Tensor
    slot_counts_CWe: torch.Tensor
    num_invalid: torch.Tensor

    def slot_weights(self, topk_weight_TK: torch.Tensor) -> torch.Tensor:
        """[T*K, K] weights of each row's slots (0 where local_idx_SK is -1); differentiable w.r.t. the weights."""
        S, K = self.local_idx_SK.shape
        flat = topk_weight_TK.new_zeros(S * K + 1).scatter(0, self.slot_pos_TK.reshape(-1),
                                                           topk_weight_TK.reshape(-1))
        return flat[: S * K].view(S, K)


def rank_rows_reference(idx_TK: torch.Tensor, num_experts: int, num_ranks: int, num_chunks: int = 1):
    """Pure-torch ``make_rank_rows``: (dest_row_TK, src_slot_S, counts_CW, local_idx_SK, slot_pos_TK,
    slot_counts_CE, num_invalid), the first three those of a layout whose "experts" are the W ranks."""
    T, K = idx_TK.shape
    E, W, C, e = num_experts, num_ranks, num_chunks, num_experts // num_ranks
    S, dev = T * K, idx_TK.device
    valid_TK = (idx_TK >= 0) & (idx_TK < E)
    rank_TK = torch.where(valid_TK, idx_TK // e, -1)
    # the first slot of each slot's (token, rank) pair: argmax returns the first True
    first_k_TK = (rank_TK[:, :, None] == rank_TK[:, None, :]).to(torch.uint8).argmax(2) if S else rank_TK
    k_K = torch.arange(K, device=dev)
    first_TK = valid_TK & (first_k_TK == k_K)
    dest_row_TK, src_slot_S, counts_CW, _ = layout_reference(torch.where(first_TK, rank_TK, -1), W, C)
    # every routed slot writes its local expert into its pair's row; dropped slots into a spare last word
    row_TK = dest_row_TK.gather(1, first_k_TK)
    pos_TK = torch.where(valid_TK, row_TK * K + k_K, S * K)
    local = torch.full((S * K + 1,), -1, dtype=torch.int64, device=dev)
    local.scatter_(0, pos_TK.reshape(-1), torch.where(valid_TK, idx_TK % e, -1).reshape(-1))
    chunk_S = repeat(chunk_of_tokens(T, C, dev), "t -> (t k)", k=K)
    key_S = torch.where(valid_TK.reshape(-1), chunk_S * E + idx_TK.reshape(-1), C * E)
    bins = torch.zeros(C * E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key_S, torch.ones_like(key_S))
    return (dest_row_TK, src_slot_S, counts_CW, local[: S * K].view(S, K), pos_TK, bins[: C * E].view(C, E),
            ((idx_TK < -1) | (idx_TK >= E)).sum())


def make_rank_rows(topk_idx_TK: torch.Tensor, num_experts: int, *, num_ranks: int, num_chunks: int = 1,
                   backend: str = "auto") -> RankRows:
    """The rows of a dispatch that sends each token once to each rank holding any of its experts; no host sync.

    Rows are ordered (chunk, destination rank, token). The receiver expands a row to its local experts
    (``local_idx_SK``) and sends back one row: the weighted sum of its experts' outputs. ``backend`` as in
    ``make_layout`` (the C++ kernel on CPU, one pass: ~10x the torch ops at T = 1024, K = 8).
    Example: E = 4, W = 2 (e = 2), topk_idx_TK = [[0, 1], [3, 0]]
        token 0: experts 0, 1 both on rank 0 -> one row; token 1: ranks 1 and 0 -> two rows
        rows (rank 0: token 0, token 1 | rank 1: token 1), local_idx = [[0, 1], [-1, 0] | [1, -1]]
    """
    idx_TK = _checked_args(topk_idx_TK, num_experts, num_ranks, num_chunks)
    from moe_comm.kernels import select_backend
    impl = select_backend(backend, idx_TK.device)
    fn = getattr(impl, "make_rank_rows", None) or rank_rows_reference
    dest_row_TK, src_slot_S, counts_CW, local_idx_SK, slot_pos_TK, slot_counts_CE, num_invalid = fn(
        idx_TK, num_experts, num_ranks, num_chunks)
    T, K = idx_TK.shape
    W, C = num_ranks, num_chunks
    layout = Layout(num_tokens=T, top_k=K, num_experts=W, num_ranks=W, num_chunks=C, dest_row_TK=dest_row_TK,
                    src_slot_S=src_slot_S, token_S=src_slot_S // K if K else src_slot_S,
                    counts_CWe=counts_CW.view(C, W, 1), num_invalid=torch.zeros_like(num_invalid))
    return RankRows(layout=layout, local_idx_SK=local_idx_SK, slot_pos_TK=slot_pos_TK,
                    slot_counts_CWe=slot_counts_CE.view(C, W, num_experts // W), num_invalid=num_invalid)
