"""Tier 1-2: a call's plans from its control exchange: the host reads only the counts the call used, the plans
are array ops (the host work does not grow with W x e), and the batched regroup index equals the per-chunk one.
"""
import sys
from types import SimpleNamespace

import pytest
import torch
from einops import rearrange

import moe_comm
from moe_comm import ops
from moe_comm.comm.wire import HEADER_WORDS, MESSAGE_WORDS, Word
from moe_comm.dispatch.dispatcher import Dispatcher
from moe_comm.dispatch import plan as plan_module
from moe_comm.dispatch.plan import build_chunk_plans, chunk_expert_major_index, expert_major_index

BASE = HEADER_WORDS + MESSAGE_WORDS


def _rank_read_words(rank, world_size, E, C, dedup):
    d = moe_comm.Dispatcher(num_experts=E, dedup=dedup, max_chunks=16)
    words = []
    end = d.channel.end

    def spy(pending):
        out = end(pending)
        words.append((pending.phase if pending is not None else None, d.channel.last_read_words))
        return out

    d.channel.end = spy
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(16, 8, generator=g)
    idx = torch.rand(16, E, generator=g).argsort(1)[:, :2]
    d(x, idx, torch.full((16, 2), 0.5), lambda t, c: t * 2.0, num_chunks=C)
    return words


@pytest.mark.multirank
@pytest.mark.parametrize("C,dedup", [(1, False), (4, False), (2, True)])
def test_the_host_reads_the_counts_of_the_calls_chunks_only(ranks, C, dedup):
    # max_chunks=16 sizes the exchange on the wire (every rank pairs it whatever its C); the host reads the
    # header, the message and C chunks' counts (with dedup also C row counts), of what it sent and received
    W, E = 2, 8
    e = E // W
    for words in ranks(W).run(_rank_read_words, E, C, dedup):
        opening, closing = words[0][1], words[1][1]
        assert opening == 2 * W * (BASE + C * (e + dedup)), words
        assert closing == 2 * W * BASE, words


def _fake_call(W, e, C, T=512, K=4, seed=0):
    """(a Dispatcher shell, the exchange of one call as Channel.end returns it, the layout) at any W: the plans
    need no process group."""
    d = Dispatcher.__new__(Dispatcher)
    d.world_size, d.num_local_experts, d.dispatch_dtype, d.direct_min_bytes = W, e, None, 1 << 60
    d.last_transport, d.backend = "", "torch"
    d.end_check, d.max_tokens_per_rank, d.carry_max_bytes = "eager", None, 1 << 20
    d.transport = lambda kind: kind.name
    g = torch.Generator().manual_seed(seed)
    lay = ops.make_layout(torch.randint(0, W * e, (T, K), generator=g), W * e, num_ranks=W, num_chunks=C,
                          backend="torch")
    X = BASE + C * e
    sent, recv = torch.zeros(W, X, dtype=torch.int64), torch.zeros(W, X, dtype=torch.int64)
    sent[:, BASE:] = rearrange(lay.counts_CWe, "c w e -> w (c e)")
    recv[:, BASE:] = torch.randint(0, 9, (W, C * e), generator=g)
    for t in (sent, recv):
        t[:, Word.ROW_BYTES], t[:, Word.ROWS] = 64, t[:, BASE:].sum(1)
    return d, SimpleNamespace(recv_WX=recv, send_WX=sent, call=3), lay


def _python_calls(fn) -> int:
    calls = [0]

    def count(frame, event, arg):
        if event == "call":
            calls[0] += 1
    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[0]


def test_plan_building_does_not_grow_with_ranks_times_experts():
    # measured before this change at W = 64, e = 32, C = 4: ~10,400 Python calls per plan (sums over W x e lists
    # per chunk), 1.8 ms; the plans are now array ops
    def calls(W, e):
        d, p, lay = _fake_call(W, e, 4)
        return _python_calls(lambda: d._plan(p, p.send_WX.numpy(), p.recv_WX.numpy(), lay, 4, 16, 1, None))
    small, large = calls(2, 2), calls(64, 32)
    assert large <= small + 20, (small, large)


@pytest.mark.parametrize("host_index", [True, False], ids=["numpy_index", "torch_index"])
@pytest.mark.parametrize("W,e,C", [(1, 1, 1), (2, 3, 1), (4, 2, 4), (3, 5, 3)])
def test_plans_match_the_counts(W, e, C, host_index, monkeypatch):
    # CPU rows: the regroup index from numpy up to HOST_INDEX_MAX_ROWS received rows, from torch above
    monkeypatch.setattr(plan_module, "HOST_INDEX_MAX_ROWS", 1 << 30 if host_index else -1)
    d, p, lay = _fake_call(W, e, C, seed=W * 10 + C)
    handle = d._plan(p, p.send_WX.numpy(), p.recv_WX.numpy(), lay, C, 16, 1, None)
    sent_WCe = p.send_WX[:, BASE:].reshape(W, C, e)
    recv_WCe = p.recv_WX[:, BASE:].reshape(W, C, e)
    offset = 0
    for c, plan in enumerate(handle.chunks):
        assert plan.send_We == sent_WCe[:, c].tolist() and plan.recv_We == recv_WCe[:, c].tolist()
        assert plan.send_splits_W == sent_WCe[:, c].sum(1).tolist()
        assert plan.recv_splits_W == recv_WCe[:, c].sum(1).tolist()
        assert plan.counts_e == recv_WCe[:, c].sum(0).tolist() == plan.tokens_per_expert_e.tolist()
        assert plan.row_offset == offset and plan.call == 3
        offset += plan.num_rows
        if e > 1 and W > 1:  # the regroup: the per-chunk reference
            ref = expert_major_index(recv_WCe[:, c], plan.num_recv)
            assert torch.equal(plan.expert_index_R, ref[0]) and torch.equal(plan.source_index_R, ref[1])
    assert lay.num_rows == offset and handle.slots_sent == offset


def test_chunk_index_counts_each_chunk_from_its_first_row():
    counts_CWe = torch.tensor([[[1, 1]], [[0, 2]], [[0, 0]], [[2, 1]]])
    index, inverse = chunk_expert_major_index(counts_CWe, [2, 2, 0, 3])
    assert [i.tolist() for i in index] == [[0, 1], [0, 1], [], [0, 1, 2]]
    counts_CWe = torch.tensor([[[1, 2], [1, 0]], [[0, 1], [2, 0]]])  # W = 2, e = 2
    index, inverse = chunk_expert_major_index(counts_CWe, [4, 3])
    assert index[0].tolist() == [0, 3, 1, 2] and index[1].tolist() == [1, 2, 0]
    for i, v in zip(index, inverse):
        assert torch.equal(v[i], torch.arange(len(i)))


def test_build_chunk_plans_takes_nested_lists():
    plans = build_chunk_plans([[[1, 2]], [[0, 1]]], [[[2, 0]], [[1, 1]]], torch.tensor([[[2, 0]], [[1, 1]]]),
                              regroup=True)
    assert plans[0].send_splits_W == [3, 1] and plans[0].recv_splits_W == [2, 2]
    assert plans[0].expert_index_R.tolist() == [0, 1, 2, 3]  # expert 0: rank 0's two rows, rank 1's; then expert 1


def test_host_and_device_regroup_index_agree():
    g = torch.Generator().manual_seed(1)
    for C, W, e in ((1, 1, 1), (3, 4, 2), (2, 3, 5), (4, 2, 3)):
        counts = torch.randint(0, 4, (C, W, e), generator=g)
        totals = counts.sum((1, 2)).tolist()
        device = chunk_expert_major_index(counts, totals)
        host = plan_module._host_expert_major_index(counts.numpy(), totals)
        for a, b in zip(device[0] + device[1], host[0] + host[1]):
            assert torch.equal(a, b), (C, W, e)
