"""One copy per (token, destination rank) (``Dispatcher(dedup=True)``).

Tier 1: ``make_rank_rows`` against a plain Python enumeration of (token, rank) pairs.
Tier 2 (gloo ranks): the same call with dedup on and off agrees with a dense float64 reference (outputs,
input, weight and expert gradients), for several chunk counts, dropped slots, ranks without tokens and
weights that need no gradient; the rows move in pieces, each permuted after the one before went; a failing
expert_fn on one rank raises on every rank; MoELayer with group-limited routing sends fewer rows and returns
the same values.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import moe_comm
from moe_comm import ops
from moe_comm.kernels import native

from tanh_oracle import H, data as _data, dense as _dense, experts as _experts  # tests/tanh_oracle.py


def _pairs(idx, E, W):
    """(token, rank) -> [(k, local expert)] in slot order, by brute force."""
    e, out = E // W, {}
    for t, row in enumerate(idx.tolist()):
        for k, g in enumerate(row):
            if 0 <= g < E:
                out.setdefault((t, g // e), []).append((k, g % e))
    return out


@pytest.mark.parametrize("T,K,E,W,C", [(0, 2, 4, 2, 1), (1, 1, 4, 4, 1), (9, 2, 8, 2, 1), (13, 4, 8, 2, 3),
                                       (20, 3, 12, 4, 4), (6, 4, 4, 1, 2)])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_rank_rows_one_row_per_token_and_rank(T, K, E, W, C, backend):
    if backend == "native" and not native.available():
        pytest.skip("C++ kernels not built")
    g = torch.Generator().manual_seed(T * 7 + K)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    if T:
        idx[torch.rand(T, K, generator=g) < 0.2] = -1
        idx[0, 0] = E + 3  # invalid: counted, treated as dropped
    rows = ops.make_rank_rows(idx, E, num_ranks=W, num_chunks=C, backend=backend)
    pairs = _pairs(idx, E, W)
    lay = rows.layout
    N = lay.num_rows
    assert N == len(pairs)
    assert int(rows.num_invalid) == (1 if T else 0)
    chunk_T = ops.layout.chunk_of_tokens(T, C)
    # rows in (chunk, rank, token) order, each with its slots' local experts on that rank
    keys = sorted((int(chunk_T[t]), w, t) for (t, w) in pairs)
    for n, (c, w, t) in enumerate(keys):
        assert int(lay.token_S[n]) == t
        expect = [-1] * K
        for k, j in pairs[(t, w)]:
            expect[k] = j
        assert rows.local_idx_SK[n].tolist() == expect
    for c in range(C):
        for w in range(W):
            assert int(lay.counts_CWe[c, w, 0]) == sum(1 for (ch, ww, _) in keys if (ch, ww) == (c, w))
    # slot counts per (chunk, rank, local expert) are those of make_layout
    ref = ops.make_layout(idx, E, num_ranks=W, num_chunks=C)
    assert torch.equal(rows.slot_counts_CWe, ref.counts_CWe)
    # the sender's plain unpermute sums each token's rank rows: every token appears once per rank
    ones = torch.ones(N, 1, dtype=torch.float64)
    per_token = ops.unpermute(ones, lay)
    for t in range(T):
        assert float(per_token[t]) == sum(1 for (tt, _) in pairs if tt == t)


@pytest.mark.parametrize("T,K,E,W,C", [(0, 3, 8, 2, 1), (1024, 8, 16, 2, 1), (777, 6, 32, 8, 5), (50, 8, 8, 8, 2)])
def test_rank_rows_native_equals_reference(T, K, E, W, C):
    """The C++ kernel against the torch ops, every output exactly, with dropped and invalid ids."""
    if not native.available():
        pytest.skip("C++ kernels not built")
    g = torch.Generator().manual_seed(T + K + E)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    if T:
        idx[torch.rand(T, K, generator=g) < 0.1] = -1
        idx[torch.rand(T, K, generator=g) < 0.02] = -5  # invalid
        idx[0, -1] = E  # invalid
    got = native.make_rank_rows(idx, E, W, C)
    want = ops.layout.rank_rows_reference(idx, E, W, C)
    assert len(got) == len(want) == 7
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.int64 and a.shape == b.shape and torch.equal(a, b)


def test_rank_rows_weights_are_differentiable():
    idx = torch.tensor([[0, 1], [3, 0]])
    w = torch.tensor([[0.5, 0.25], [0.125, 2.0]], requires_grad=True)
    rows = ops.make_rank_rows(idx, 4, num_ranks=2)
    w_NK = rows.slot_weights(w)[: rows.layout.num_rows]
    assert w_NK.tolist() == [[0.5, 0.25], [0.0, 2.0], [0.125, 0.0]]
    w_NK.sum().backward()
    assert w.grad.tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_dedup_argument_checks():
    with pytest.raises(TypeError, match="dedup"):
        moe_comm.Dispatcher(4, dedup="yes")
    with pytest.raises(ValueError, match="dedup"):
        moe_comm.Dispatcher(4, dedup=True, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="MoEConfig.dedup"):
        moe_comm.MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2, dedup=True,
                           max_tokens_per_rank=4)


def _runs(chunk_counts):
    """(dedup, C) pairs: the plain path once, one copy per rank at every chunk count."""
    return [(False, chunk_counts[0])] + [(True, C) for C in chunk_counts]


def _rank_dedup(rank, world_size, E, K, tokens, drop, chunk_counts, w_grad):
    T, e = tokens[rank], E // world_size
    x, idx, w = _data(rank, E, K, T, drop)
    W_full = _experts(E)
    # the dense reference of this rank's outputs and input/weight gradients (the experts' weight gradients sum
    # over every rank's tokens: those are compared between the two modes below)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(w_grad)
    yr = _dense(xr, idx, wr, W_full)
    (yr * torch.arange(1, H + 1, dtype=torch.float64)).sum().backward()
    out = {"ref": (yr.detach(), xr.grad, wr.grad)}
    for dedup, C in _runs(chunk_counts):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(w_grad)
        W_local = W_full[rank * e:(rank + 1) * e].clone().requires_grad_(True)

        def expert_fn(tokens_RH, tokens_per_expert_e):
            outs, start = [], 0
            for j, n in enumerate(tokens_per_expert_e.tolist()):
                outs.append(torch.tanh(tokens_RH[start:start + n] @ W_local[j]))
                start += n
            return torch.cat(outs) if outs else tokens_RH * 1.0

        d = moe_comm.Dispatcher(E, num_chunks=C, dedup=dedup)
        y = d(xi, idx, wi, expert_fn)
        (y * torch.arange(1, H + 1, dtype=torch.float64)).sum().backward()
        out[(dedup, C)] = (y.detach(), xi.grad, wi.grad, W_local.grad, d.last_bytes)
    return out


def _rel(a, b):
    if b is None:
        return 0.0 if a is None else float("inf")
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,E,K,tokens,drop,w_grad", [
    (2, 8, 4, [11, 6], True, True),
    (4, 8, 3, [6, 0, 13, 2], True, True),
    (2, 4, 2, [9, 0], False, False),
])
def test_dedup_matches_dense_reference(ranks, world_size, E, K, tokens, drop, w_grad):
    chunk_counts = [1, 3]
    per_rank = ranks(world_size).run(_rank_dedup, E, K, tokens, drop, chunk_counts, w_grad)
    for rank, res in enumerate(per_rank):
        y_ref, x_ref, w_ref = res["ref"]
        for dedup, C in _runs(chunk_counts):
            y, xg, wg, Wg, _ = res[(dedup, C)]
            assert _rel(y, y_ref) <= 1e-12, (rank, dedup, C)
            assert _rel(xg, x_ref) <= 1e-12, (rank, dedup, C)
            assert _rel(wg, w_ref) <= 1e-12, (rank, dedup, C)
            # expert gradients agree between the two modes (each a sum over all ranks' rows)
            assert _rel(Wg, res[(False, 1)][3]) <= 1e-12, (rank, dedup, C)
        wire, logical = res[(True, 1)][4], res[(False, 1)][4]
        assert wire["dispatch_logical"] == logical["dispatch_logical"] == logical["dispatch_wire"]
        # one copy per (token, rank) never sends more rows than one per slot (plus the [2K] metadata)
        rows_dedup = wire["combine_wire"] // (H * 8)
        rows_plain = logical["combine_wire"] // (H * 8)
        assert rows_dedup <= rows_plain
    # with K = 4 of 8 experts on 2 ranks, tokens share ranks: fewer rows travel
    if (world_size, K) == (2, 4):
        res = per_rank[0]
        assert res[(True, 1)][4]["combine_wire"] < res[(False, 1)][4]["combine_wire"]


def test_group_pieces_sums_the_pieces_and_places_their_rows():
    from moe_comm.dispatch.plan import build_chunk_plans, group_pieces
    # W = 2, 4 wire chunks; rows per (rank, chunk) sent and received (one column), slots per local expert (e = 2)
    send = [[[1], [2], [0], [3]], [[2], [0], [1], [1]]]
    recv = [[[1], [1], [2], [0]], [[3], [2], [0], [1]]]
    slots = torch.tensor([[[1, 1], [1, 0], [2, 1], [0, 0]], [[2, 2], [1, 1], [0, 0], [1, 0]]])
    plans = build_chunk_plans(send, recv, slots, regroup=False, recv_slots_WCe=slots.tolist())
    chunks = group_pieces(plans, 2)
    assert [c.chunk for c in chunks] == [0, 1]
    assert [c.num_rows for c in chunks] == [5, 5] and [c.num_recv for c in chunks] == [7, 3]
    assert [c.row_offset for c in chunks] == [0, 5]
    assert [[q.row_offset for q in c.parts] for c in chunks] == [[0, 3], [5, 6]]
    assert [[q.recv_offset for q in c.parts] for c in chunks] == [[0, 4], [0, 2]]
    assert [[q.label for q in c.parts] for c in chunks] == [["chunk 0 (piece 0)", "chunk 0 (piece 1)"],
                                                             ["chunk 1 (piece 0)", "chunk 1 (piece 1)"]]
    assert chunks[0].counts_e == [5, 4] and chunks[0].tokens_per_expert_e.tolist() == [5, 4]
    assert group_pieces(plans, 1) is plans and plans[0].parts == [plans[0]]


@contextlib.contextmanager
def _streaming(**values):
    """Set send_rows' constants (STREAM_PIECES=, STREAM_MIN_BYTES=) and put them back: the rank processes serve
    other tests too."""
    from moe_comm.dispatch import send_rows

    before = {k: getattr(send_rows, k) for k in values}
    for k, v in values.items():
        setattr(send_rows, k, v)
    try:
        yield send_rows
    finally:
        for k, v in before.items():
            setattr(send_rows, k, v)


def _rank_streamed(rank, world_size):
    E, K, T = 8, 4, 40
    x, idx, w = _data(rank, E, K, T, drop=True)
    e = E // world_size
    out = {}
    with _streaming(STREAM_MIN_BYTES=0) as send_rows:
        for pieces in (1, send_rows.STREAM_PIECES):
            with _streaming(STREAM_PIECES=pieces):
                d = moe_comm.Dispatcher(E, dedup=True)
                d.timeline.enabled = True
                for call in range(2):  # the first call decides from its control exchange whether the next streams
                    xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
                    W_local = _experts(E)[rank * e:(rank + 1) * e].clone().requires_grad_(True)

                    def expert_fn(tokens_RH, tokens_per_expert_e):
                        outs, start = [], 0
                        for j, n in enumerate(tokens_per_expert_e.tolist()):
                            outs.append(torch.tanh(tokens_RH[start:start + n] @ W_local[j]))
                            start += n
                        return torch.cat(outs)

                    d.timeline.reset()  # the backward of the call before records its spans too
                    y = d(xi, idx, wi, expert_fn)
                    spans = [s for s in d.timeline.spans() if s.direction == "fwd"]
                    (y * torch.arange(1, H + 1, dtype=torch.float64)).sum().backward()
                    out[pieces, call] = (y.detach(), xi.grad, wi.grad, W_local.grad)
                    sends = sorted(s.start for s in spans if s.kind == "comm" and s.phase == "dispatch")
                    permutes = sorted(s.start for s in spans if s.kind == "compute" and s.phase == "permute")
                    out[f"spans{pieces}", call] = (len(sends), len(permutes), sends[0] < permutes[-1])
    return out


@pytest.mark.multirank
def test_dedup_rows_move_in_pieces_each_permuted_after_the_one_before_went(ranks):
    """One copy per rank on CPU streams from the call after one whose largest sender moved STREAM_MIN_BYTES
    (0 here): P pieces (rows and metadata: 2 transfers each); every piece after the first is permuted once the
    first is on the wire; outputs and gradients are those of a single piece."""
    from moe_comm.dispatch import send_rows

    P = send_rows.STREAM_PIECES
    assert P > 1
    for res in ranks(2).run(_rank_streamed):
        for call in (0, 1):  # outputs, x, w and expert gradients
            assert all(_rel(a, b) <= 1e-12 for a, b in zip(res[P, call], res[1, 0])), call
            assert res["spans1", call] == (2, 1, False)  # rows and metadata once; the one permute before them
        assert res[f"spans{P}", 0] == (2, 1, False)  # the first call: nothing known yet
        assert res[f"spans{P}", 1] == (2 * P, P, True)


def _rank_streamed_checkpoint(rank, world_size):
    import torch.utils.checkpoint as torch_checkpoint

    cfg = moe_comm.MoEConfig(hidden_size=16, ffn_hidden_size=12, num_experts=8, top_k=4, dedup=True)
    out = []
    with _streaming(STREAM_MIN_BYTES=0):  # every call after the first would stream
        layers = [moe_comm.MoELayer(cfg, seed=4, dtype=torch.float64) for _ in range(2)]
        for step in range(3):
            grads = []
            for i, layer in enumerate(layers):
                layer.zero_grad(set_to_none=True)
                x = torch.randn(21, 16, generator=torch.Generator().manual_seed(10 * rank + step), dtype=torch.float64)
                x.requires_grad_(True)
                y = torch_checkpoint.checkpoint(layer, x, use_reentrant=False) if i else layer(x)
                y.square().sum().backward()
                grads.append([x.grad] + [p.grad for p in layer.parameters()])
            out.append(grads)
        out.append(layers[0].dispatcher._stream)
    return out


@pytest.mark.multirank
def test_streamed_layer_under_non_reentrant_checkpointing_keeps_its_gradients(ranks):
    """The recompute inside backward must lay rows out as the first pass did (non-reentrant checkpointing gives
    the first pass's backward the recomputed layout): calls under a checkpoint do not stream."""
    for res in ranks(2).run(_rank_streamed_checkpoint):
        assert res[-1] is True  # the plain layer's calls after the first streamed
        for ref, ckp in res[:-1]:
            for a, b in zip(ref, ckp):
                assert _rel(b, a) <= 1e-12


def _rank_dedup_failure(rank, world_size):
    d = moe_comm.Dispatcher(8, dedup=True, num_chunks=2)
    x, idx, w = _data(rank, 8, 3, 9, False)

    def expert_fn(t, c):
        if rank == 1:
            raise RuntimeError("expert blew up on rank 1")
        return t * 2.0

    try:
        d(x, idx, w, expert_fn)
    except Exception as err:  # noqa: BLE001
        first = f"{type(err).__name__}: {err}"
    else:
        first = "returned"
    y = d(x, idx, w, lambda t, c: t * 2.0)  # the group is usable after the failure
    torch.testing.assert_close(y, 2 * w.sum(1, keepdim=True) * x)
    return first


@pytest.mark.multirank
def test_dedup_failure_on_one_rank_raises_everywhere(ranks):
    first = ranks(2).run(_rank_dedup_failure)
    assert "expert blew up on rank 1" in first[1]
    assert "PeerFailed" in first[0] and "rank 1" in first[0]


def _rank_layer(rank, world_size):
    cfg = moe_comm.MoEConfig(hidden_size=16, ffn_hidden_size=12, num_experts=8, top_k=4, num_groups=4,
                             topk_groups=2, num_chunks=2, num_shared_experts=1)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(21, 16, generator=g, dtype=torch.float64)
    out = {}
    for dedup in (False, True):
        layer = moe_comm.MoELayer(cfg.replace(dedup=dedup), seed=4, dtype=torch.float64)
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.square().sum().backward()
        out[dedup] = [y.detach(), xi.grad] + [p.grad for p in layer.parameters()] + [layer.dispatcher.last_bytes]
    return out


@pytest.mark.multirank
def test_layer_dedup_same_values_fewer_rows(ranks):
    for r in ranks(2).run(_rank_layer):
        for got, ref in zip(r[True][:-1], r[False][:-1]):
            assert _rel(got, ref) <= 1e-12
        # group-limited routing: 4 experts in 2 groups of 2, 2 groups per token -> at most 2 ranks of 2
        assert r[True][-1]["combine_wire"] < r[False][-1]["combine_wire"]
