"""Self-checking dispatch payloads: rows that say where they came from, and the oracle that checks them.

Shapes legend: T tokens, H hidden, K top-k, W EP world size, e local experts.
Each row of ``payload`` carries its source rank (column 0) and token id (column 1), so a misrouted row
names where it came from (shared/STYLE.md 7). Used by the multi-rank tests and ``moe-comm demo``.
"""
from __future__ import annotations

from typing import Callable

import torch

from moe_comm.dispatch import Dispatcher

__all__ = ["payload", "self_check_dispatch"]


def payload(rank: int, num_tokens: int, hidden: int, dtype=torch.float32) -> torch.Tensor:
    """Self-describing rows [T, H]: column 0 = source rank, column 1 = token id, the rest a function of
    both (exact in bf16 for small values), so any misrouted row names where it came from."""
    t = torch.arange(num_tokens, dtype=torch.float64)[:, None]
    h = torch.arange(hidden, dtype=torch.float64)[None, :]
    x = (rank * 7 + t * 3 + h) % 61
    x[:, 0] = rank
    if hidden > 1:
        x[:, 1] = t[:, 0]
    return x.to(dtype)


def self_check_dispatch(dispatcher: Dispatcher, routing_of: Callable[[int], torch.Tensor],
                        tokens_of: Callable[[int], int], hidden: int, dtype=torch.float32) -> int:
    """Dispatch ``payload`` rows and check every received row against all ranks' routing.

    routing_of(r) / tokens_of(r): rank r's topk_idx_TK and token count (known on every rank).
    Checks that each local expert receives exactly the (source rank, token) pairs that chose it,
    ordered by source rank then token, with the full row intact; then that combine with an
    identity expert returns the weighted sum of the token's rows. Returns the rows received.
    Raises AssertionError naming the first wrong row.
    """
    rank, W, e = dispatcher.rank, dispatcher.world_size, dispatcher.num_local_experts
    x_TH = payload(rank, tokens_of(rank), hidden, dtype)
    topk_idx_TK = routing_of(rank)
    out = dispatcher.dispatch(x_TH, topk_idx_TK)
    start = 0
    for j, n in enumerate(out.counts):
        g = rank * e + j
        holders = [(s, (routing_of(s) == g).any(1).nonzero().flatten()) for s in range(W)]
        expected = [(s, t) for s, tokens in holders for t in tokens.tolist()]  # host sync: self-check, off the hot path
        rows = out.tokens[start:start + n]
        got = [(int(a), int(b)) for a, b in rows[:, :2].tolist()]  # host sync: self-check, off the hot path
        if got != expected:
            raise AssertionError(f"rank {rank} expert {g}: received (rank, token) {got[:8]}..., "
                                 f"expected {expected[:8]}...")
        for (s, t), row in zip(expected, rows):
            if not torch.equal(row, payload(s, t + 1, hidden, dtype)[t]):
                raise AssertionError(f"rank {rank} expert {g}: row of (rank {s}, token {t}) corrupted")
        start += n
    weight_TK = torch.rand(topk_idx_TK.shape, generator=torch.Generator().manual_seed(rank))
    y_TH = dispatcher.combine(out.tokens, weight_TK, out.handle)
    valid = (topk_idx_TK >= 0).to(weight_TK.dtype)
    expected_y = x_TH.double() * (weight_TK * valid).sum(1, keepdim=True).double()
    if not torch.allclose(y_TH.double(), expected_y, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-5):
        raise AssertionError(f"rank {rank}: combine of identity experts is not the weighted sum of the token")
    return out.tokens.shape[0]
