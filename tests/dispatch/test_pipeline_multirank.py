"""Tier 2: the chunked pipeline on 2 and 4 gloo ranks equals the unchunked path, forward and backward.

Covers many chunk counts (including C > T), skewed routing (every token of a rank on one expert),
dropped slots, ranks with zero tokens (so some chunks are empty on some or all ranks), a custom
differentiable expert_fn that captures its weights in a closure, and inputs that need no gradient.
"""
import pytest
import torch

import moe_comm

H = 10


def _data(rank, world_size, seed, E, K, T, skew_rank, drop):
    g = torch.Generator().manual_seed(seed * 31 + rank)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    if rank == skew_rank:
        idx[:, 0] = 0
        idx[:, 1:] = torch.arange(1, K)
    if drop:
        idx[torch.rand(T, K, generator=g) < 0.25] = -1
    w = torch.rand(T, K, generator=g, dtype=torch.float64)
    return x, idx, w


def _expert_weights(E, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, H, H, generator=g, dtype=torch.float64) * H ** -0.5


def _rank_chunks(rank, world_size, seed, E, K, tokens, skew_rank, drop, chunk_counts, x_grad):
    T = tokens[rank]
    e = E // world_size
    results = {}
    for C in chunk_counts:
        x, idx, w = _data(rank, world_size, seed, E, K, T, skew_rank, drop)
        x.requires_grad_(x_grad)
        w.requires_grad_(True)
        W_full = _expert_weights(E, seed)
        W_local = W_full[rank * e:(rank + 1) * e].clone().requires_grad_(True)
        scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)  # a captured non-parameter

        def expert_fn(tokens_RH, tokens_per_expert_e):
            outs, start = [], 0
            for j, n in enumerate(tokens_per_expert_e.tolist()):
                outs.append(torch.tanh(tokens_RH[start:start + n] @ W_local[j]) * scale)
                start += n
            return torch.cat(outs) if outs else tokens_RH * scale

        d = moe_comm.Dispatcher(num_experts=E, num_chunks=C)
        y = d(x, idx, w, expert_fn)
        (y * torch.arange(1, H + 1, dtype=torch.float64)).sum().backward()
        results[C] = (y.detach(), None if x.grad is None else x.grad, w.grad, W_local.grad, scale.grad)
    return results


def _max_rel(a, b):
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,E,K,tokens,skew_rank,drop,x_grad", [
    (2, 4, 2, [9, 14], None, False, True),
    (2, 2, 2, [7, 0], 0, True, True),
    (4, 8, 3, [6, 0, 13, 2], 2, True, True),
    (4, 4, 1, [5, 5, 0, 1], None, False, False),
])
def test_pipeline_equals_unchunked(ranks, world_size, E, K, tokens, skew_rank, drop, x_grad):
    chunk_counts = [1, 2, 3, 4, 8, max(tokens) + 3]
    per_rank = ranks(world_size).run(_rank_chunks, 5, E, K, tokens, skew_rank, drop, chunk_counts, x_grad)
    scale_ref = sum(float(r[1][4]) for r in per_rank)
    for C in chunk_counts[1:]:
        scale_c = sum(float(r[C][4]) for r in per_rank)
        assert abs(scale_c - scale_ref) <= 1e-6 * abs(scale_ref), C
        for rank, r in enumerate(per_rank):
            for name, got, ref in zip(("y", "x.grad", "w.grad", "W.grad"), r[C][:4], r[1][:4]):
                if ref is None:
                    assert got is None, (C, rank, name)
                    continue
                assert got.shape == ref.shape, (C, rank, name)
                assert _max_rel(got, ref) <= 1e-6, (C, rank, name)
    # The experts received gradient even where x needs none (first-layer inputs).
    assert any(float(r[1][3].abs().sum()) > 0 for r in per_rank)


def _rank_layer_chunks(rank, world_size):
    cfg = moe_comm.MoEConfig(hidden_size=16, ffn_hidden_size=24, num_experts=4, top_k=2, num_shared_experts=1)
    torch.manual_seed(0)
    out = {}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3 + 4 * rank, 16, generator=g)
    for C in (1, 2, 5):
        layer = moe_comm.MoELayer(cfg.replace(num_chunks=C), seed=9)
        xi = x.clone().requires_grad_(True)
        layer(xi).square().sum().backward()
        out[C] = [xi.grad] + [p.grad for p in layer.parameters()]
    return out


@pytest.mark.multirank
def test_layer_with_shared_experts_same_for_every_chunk_count(ranks):
    for r in ranks(2).run(_rank_layer_chunks):
        for C in (2, 5):
            for got, ref in zip(r[C], r[1]):
                assert _max_rel(got, ref) <= 1e-5


class _Experts(moe_comm.GroupedExperts):
    """GroupedExperts that takes the all-to-all's rows in (source rank, expert) blocks when told to, and
    records what each call got."""

    def __init__(self, *args, rank_major, **kwargs):
        super().__init__(*args, **kwargs)
        self.rank_major, self.calls = rank_major, []

    def prefers_segments(self, block_rows, device):
        return self.rank_major

    def forward(self, tokens_RH, tokens_per_expert_e, counts=None, padded=False, segments=None):
        self.calls.append("segments" if segments is not None else "counts")
        return super().forward(tokens_RH, tokens_per_expert_e, counts=counts, padded=padded, segments=segments)


def _rank_rank_major(rank, world_size, E, K, T, skew, C, fp8):
    from moe_comm.profiling import Timeline

    out = {}
    for rank_major in (False, True):
        x, idx, w = _data(rank, world_size, 7, E, K, T, 0 if skew else None, True)
        x.requires_grad_(True)
        w.requires_grad_(True)
        ex = _Experts(E // world_size, H, 6, first_expert=rank * E // world_size, seed=3,
                      rank_major=rank_major).double()
        d = moe_comm.Dispatcher(num_experts=E, num_chunks=C, direct_min_bytes=1 << 40,  # the all-to-all
                                dispatch_dtype=torch.float8_e4m3fn if fp8 else None)
        d.timeline = Timeline(rank=rank, enabled=True)
        y = d(x, idx, w, ex)
        (y * torch.arange(1, H + 1, dtype=torch.float64)).sum().backward()
        regroups = sum(s.phase == "regroup" for s in d.timeline.spans())
        out[rank_major] = (y.detach(), x.grad, w.grad, ex.w1.grad, ex.w3.grad, ex.w2.grad, set(ex.calls), regroups,
                           d.last_transport)
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,E,K,T,skew,C,fp8", [(2, 4, 2, 37, False, 1, False), (2, 4, 3, 37, True, 3, False),
                                                          (4, 8, 2, 23, True, 2, False), (2, 4, 2, 37, False, 2, True)])
def test_experts_on_rank_major_rows_equal_the_regroup_path(ranks, world_size, E, K, T, skew, C, fp8):
    """An expert_fn whose prefers_segments says yes gets the all-to-all's rows as they arrive, in (source
    rank, expert) blocks with segments= (no regroup span, forward or backward); outputs, x, w and expert
    gradients equal the regroup path's (float64; rows are independent, weight gradients summed per block); with
    FP8 dispatch too (rows dequantized as they arrived)."""
    for rank, r in enumerate(ranks(world_size).run(_rank_rank_major, E, K, T, skew, C, fp8)):
        ref, got = r[False], r[True]
        assert ref[6] == {"counts"} and got[6] == {"segments"}, (rank, ref[6], got[6])
        assert ref[7] > 0 and got[7] == 0, (rank, ref[7], got[7])
        assert ref[8] == got[8] == "all_to_all"
        for name, a, b in zip(("y", "x.grad", "w.grad", "w1.grad", "w3.grad", "w2.grad"), got[:6], ref[:6]):
            assert a.shape == b.shape, (rank, name)
            assert _max_rel(a, b) <= 1e-12, (rank, name, _max_rel(a, b))
        assert float(got[3].abs().sum()) > 0
