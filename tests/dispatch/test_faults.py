"""Tier 2 (multi-rank gloo): fault injection. A failure on ONE rank, before or after the first exchange of a
call, forward or backward, on both transports and C = 1 and 3, must:
  - make every rank raise (no rank returns a value from the failed call), naming the failing rank and cause;
  - kill no process (the pool survives; gloo never sees a mis-sized collective);
  - leave the group usable: the next good call works on every rank.
Faults that make the transport itself fail (a stalled or dead peer) poison the group instead: every
rank raises CollectiveError within the timeout + 5 s, and every later call raises "rebuild" at once.
"""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

import moe_comm
from outcome import outcome_of

H = 8
# (transport, direct_min_bytes): point-to-point needs e > 1 (E = 2W) and a threshold of 0.
TRANSPORTS = (("all_to_all", 1 << 40), ("point_to_point", 0))
# the pipelined calls' all-to-all, both ways its phases close: inside their last transfer (small calls, the default
# here) and with an end-of-phase exchange of their own (Dispatcher.carry_max_bytes -1)
PIPELINE_TRANSPORTS = (("all_to_all", 1 << 40, None), ("all_to_all+end_exchange", 1 << 40, -1),
                       ("point_to_point", 0, None))


def _inputs(rank, E, T=7, K=2, seed=0):
    g = torch.Generator().manual_seed(100 * seed + rank)
    return (torch.randn(T, H, generator=g), torch.rand(T, E, generator=g).argsort(1)[:, :K],
            torch.rand(T, K, generator=g))


def _good_call(d, rank, E, C):
    """A good pipelined call, forward and backward, checked against the identity expert (y = sum w * x)."""
    x, idx, w = _inputs(rank, E, seed=9)
    x.requires_grad_(True)
    y = d(x, idx, w, lambda t, c: t * 2.0, num_chunks=C)
    y.sum().backward()
    torch.testing.assert_close(y, 2 * w.sum(1, keepdim=True) * x)
    return True


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t * 2.0

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in the expert backward")


def _rank_pipeline_faults(rank, world_size, bad):
    """Every pipelined-call fault, for each of PIPELINE_TRANSPORTS and C = 1, 3; returns
    {(case, transport, C): (outcome, next call works)}."""
    out = {}
    for name, threshold, carry in PIPELINE_TRANSPORTS:
        E = 2 * world_size
        d = moe_comm.Dispatcher(num_experts=E, direct_min_bytes=threshold, timeout=30.0)
        if carry is not None:
            d.carry_max_bytes = carry
        for C in (1, 3):
            x, idx, w = _inputs(rank, E, T=9)
            me = rank == bad

            def expert_raises_at(chunk):
                seen = []

                def fn(t, c):
                    seen.append(1)
                    if me and len(seen) == chunk + 1:
                        raise ValueError(f"expert_fn failed on purpose at chunk {chunk}")
                    return t * 2.0
                return fn

            cases = {
                "expert_fn_chunk0": lambda: d(x, idx, w, expert_raises_at(0), num_chunks=C),
                "expert_fn_last_chunk": lambda: d(x, idx, w, expert_raises_at(C - 1), num_chunks=C),
                "expert_fn_wrong_shape": lambda: d(x, idx, w, (lambda t, c: t[:-1]) if me else (lambda t, c: t),
                                                   num_chunks=C),
                "side_fn": lambda: d(x, idx, w, lambda t, c: t, num_chunks=C,
                                     side_fn=(lambda: 1 / 0) if me else (lambda: x.sum())),
                "weights_dtype": lambda: d(x, idx, w.to(torch.int32) if me else w, lambda t, c: t, num_chunks=C),
                "weights_shape": lambda: d(x, idx, w[:, :1] if me else w, lambda t, c: t, num_chunks=C),
                "num_chunks_differs": lambda: d(x, idx, w, lambda t, c: t, num_chunks=C + 1 if me else C),
                "dtype_e4m3_vs_e5m2": lambda: d(x.to(torch.float8_e4m3fn if me else torch.float8_e5m2), idx,
                                                w, lambda t, c: t, num_chunks=C),
            }
            for case, fn in cases.items():
                out[(case, name, C)] = (outcome_of(fn), _good_call(d, rank, E, C))

            def backward_raises():
                xg = x.clone().requires_grad_(True)
                y = d(xg, idx, w, (lambda t, c: _RaiseInBackward.apply(t)) if me else (lambda t, c: t * 2.0),
                      num_chunks=C)
                y.sum().backward()
            out[("expert_backward", name, C)] = (outcome_of(backward_raises), _good_call(d, rank, E, C))

            def skipped_backward():
                xg = x.clone().requires_grad_(True)
                y = d(xg, idx, w, lambda t, c: t * 2.0, num_chunks=C)
                if not me:  # the bad rank skips this backward and goes on to the next forward
                    y.sum().backward()
                else:
                    d(x, idx, w, lambda t, c: t * 2.0, num_chunks=C)
            out[("skipped_backward", name, C)] = (outcome_of(skipped_backward), _good_call(d, rank, E, C))
    return out


EXPECT = {  # case -> (error type on the bad rank, on the others, text every rank's error contains)
    "expert_fn_chunk0": ("ValueError", "PeerFailed", "expert_fn failed on purpose at chunk 0"),
    "expert_fn_last_chunk": ("ValueError", "PeerFailed", "expert_fn failed on purpose at chunk"),
    "expert_fn_wrong_shape": ("ValueError", "PeerFailed", "expert_fn must return [R, H]"),
    "side_fn": ("ZeroDivisionError", "PeerFailed", "ZeroDivisionError"),
    "weights_dtype": ("TypeError", "RemoteError", "topk_weight_TK"),
    "weights_shape": ("ValueError", "RemoteError", "topk_weight_TK"),
    "num_chunks_differs": ("ValueError", "ValueError", "num_chunks of this call"),
    "dtype_e4m3_vs_e5m2": ("ValueError", "ValueError", "float8_e4m3fn on ranks"),
    "expert_backward": ("RuntimeError", "PeerFailed", "boom in the expert backward"),
    "skipped_backward": ("ProtocolError", "ProtocolError", "not in the same call"),
}


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_pipeline_faults_raise_everywhere_and_the_next_call_works(ranks, world_size):
    bad = world_size - 1
    res = ranks(world_size).run(_rank_pipeline_faults, bad, timeout=240)
    assert len(res[0]) == len(EXPECT) * len(PIPELINE_TRANSPORTS) * 2
    for key in res[0]:
        case = key[0]
        bad_type, other_type, needle = EXPECT[case]
        for rank, per_rank in enumerate(res):
            outcome, next_ok = per_rank[key]
            assert next_ok, (key, rank)
            assert outcome != "value", (key, rank)  # no rank returns a value from the failed call
            want = bad_type if rank == bad else other_type
            assert outcome.startswith(want + ":"), (key, rank, outcome)
            assert needle in outcome, (key, rank, outcome)
            if case not in ("skipped_backward", "num_chunks_differs", "dtype_e4m3_vs_e5m2"):
                assert f"[{bad}]" in outcome, (key, rank, outcome)  # the failing rank is named


def _rank_dispatch_combine_faults(rank, world_size, bad):
    out = {}
    for name, threshold in TRANSPORTS:
        E = 2 * world_size
        d = moe_comm.Dispatcher(num_experts=E, direct_min_bytes=threshold, timeout=30.0)
        x, idx, w = _inputs(rank, E)
        me = rank == bad

        def combine_short_rows():
            o = d.dispatch(x, idx)
            d.combine(o.tokens[:-1] if me else o.tokens, w, o.handle)

        def combine_bad_weights():
            o = d.dispatch(x, idx)
            d.combine(o.tokens, w.t().contiguous() if me else w, o.handle)

        def skipped_backward_of_combine():
            xg = x.clone().requires_grad_(True)
            o = d.dispatch(xg, idx)
            y = d.combine(o.tokens * 2.0, w, o.handle)
            if not me:
                y.sum().backward()
            else:
                d.dispatch(x, idx)

        def good():
            xg = x.clone().requires_grad_(True)
            o = d.dispatch(xg, idx)
            y = d.combine(o.tokens * 2.0, w, o.handle)
            y.sum().backward()
            torch.testing.assert_close(y, 2 * w.sum(1, keepdim=True) * x)
            return True

        for case, fn in (("combine_short_rows", combine_short_rows), ("combine_bad_weights", combine_bad_weights),
                         ("skipped_backward", skipped_backward_of_combine)):
            out[(case, name)] = (outcome_of(fn), good())
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_combine_faults_raise_everywhere(ranks, world_size):
    bad = world_size - 1
    res = ranks(world_size).run(_rank_dispatch_combine_faults, bad, timeout=120)
    for key in res[0]:
        for rank, per_rank in enumerate(res):
            outcome, next_ok = per_rank[key]
            assert next_ok and outcome != "value", (key, rank, outcome)
            if key[0] == "skipped_backward":
                assert outcome.startswith("ProtocolError:") and "not in the same call" in outcome, outcome
            else:
                assert f"[{bad}]" in outcome, (key, rank, outcome)
                assert outcome.startswith(("ValueError:", "TypeError:") if rank == bad else "RemoteError:"), outcome


def _rank_construction(rank, world_size):
    """Dispatcher(num_experts) 4 on one rank, 2 on the others; a local argument error on one rank."""
    res = []
    for kwargs in ({"num_experts": world_size if rank == 0 else 2 * world_size}, {"num_experts": 2 * world_size,
                                                                          "timeout": -1 if rank == 1 else None}):
        res.append(outcome_of(lambda: moe_comm.Dispatcher(**kwargs)))
    ok = moe_comm.Dispatcher(num_experts=2 * world_size)  # still usable afterwards
    return res, _good_call(ok, rank, 2 * world_size, 2)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_construction_disagreement_raises_everywhere(ranks, world_size):
    for rank, (res, ok) in enumerate(ranks(world_size).run(_rank_construction)):
        assert ok
        assert "num_experts differs across the EP group" in res[0], res[0]
        assert "timeout" in res[1] and "[1]" in res[1], res[1]
        assert res[1].startswith("ValueError:" if rank == 1 else "RemoteError:"), res[1]


def _rank_stale_bytes(rank, world_size):
    """A rank issues a foreign collective of exactly the control exchange's size while the others start a
    call: nobody reads it as data, every rank raises, and the group is then refused ('rebuild')."""
    import torch.distributed as dist
    E = 2 * world_size
    group = dist.new_group(list(range(world_size)))  # a fresh group: poisoning it spares the pool's WORLD
    d = moe_comm.Dispatcher(num_experts=E, ep_group=group, timeout=20.0)
    x, idx, w = _inputs(rank, E)
    if rank == 0:
        junk = torch.full((world_size, d.channel.width), 7, dtype=torch.int64)
        dist.all_to_all_single(torch.empty_like(junk), junk, group=group)
        first = "sent junk"
    else:
        first = outcome_of(lambda: d(x, idx, w, lambda t, c: t))
    # rank 0 learns on its next call: the others poisoned the group and raise at once; rank 0 times out or
    # is refused, never returns a value.
    return first, outcome_of(lambda: d(x, idx, w, lambda t, c: t)) if rank != 0 else "skipped"


@pytest.mark.multirank
def test_stale_bytes_are_never_read_as_a_header(ranks):
    res = ranks(2).run(_rank_stale_bytes, timeout=60)
    first, second = res[1]
    assert first.startswith("ProtocolError:") and "not a moe_comm header" in first, first
    assert second.startswith("CollectiveError:") and "rebuild" in second, second


# ---- a stalled or dead peer: CollectiveError within the timeout, the group is poisoned ------------------

def _stall_rank(rank, world_size, init_file, mode, threshold, where, q):
    import datetime

    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    E = 2 * world_size
    d = moe_comm.Dispatcher(num_experts=E, timeout=2.0, direct_min_bytes=threshold)
    x, idx, w = _inputs(rank, E)

    def expert_fn(t, c):
        if rank == 1 and where == "forward":
            if mode == "die":
                os._exit(1)
            time.sleep(4.0)  # past the peers' timeout, then resumes
        return t * 2.0

    t0 = time.perf_counter()
    first = outcome_of(lambda: d(x.clone().requires_grad_(True), idx, w, expert_fn, num_chunks=2).sum().backward()
                     if where == "forward" else _stall_backward(d, rank, x, idx, w, mode))
    elapsed = time.perf_counter() - t0
    t1 = time.perf_counter()
    second = outcome_of(lambda: d(x, idx, w, lambda t, c: t))
    q.put((rank, first, elapsed, second, time.perf_counter() - t1))
    q.close()
    q.join_thread()
    os._exit(0)


def _stall_backward(d, rank, x, idx, w, mode):
    y = d(x.clone().requires_grad_(True), idx, w, lambda t, c: t * 2.0, num_chunks=2)
    if rank == 1:
        if mode == "die":
            os._exit(1)
        time.sleep(4.0)
    y.sum().backward()


@pytest.mark.multirank
# every value of each of the three dimensions twice, in 4 of the 8 combinations (each spawns 2 ranks: 5-14 s)
@pytest.mark.parametrize("where,transport,mode", [
    ("forward", "all_to_all", "stuck"), ("forward", "point_to_point", "die"),
    ("backward", "all_to_all", "die"), ("backward", "point_to_point", "stuck")])
def test_stalled_or_dead_peer_poisons_the_group(tmp_path, mode, transport, where):
    world_size = 2
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    threshold = dict(TRANSPORTS)[transport]
    procs = [ctx.Process(target=_stall_rank, args=(r, world_size, str(tmp_path / "store"), mode, threshold, where, q))
             for r in range(world_size)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < (world_size if mode == "stuck" else world_size - 1):
            rank, first, elapsed, second, elapsed2 = q.get(timeout=90)
            got[rank] = (first, elapsed, second, elapsed2)
    finally:
        for p in procs:
            p.kill()
            p.join()
    for rank, (first, elapsed, second, elapsed2) in got.items():
        # No rank returns a value: the survivor times out; a stalled rank that resumes finds nobody at
        # the end-of-phase exchange and times out too (or is refused).
        assert first.startswith("CollectiveError:"), (rank, first)
        assert "rebuild" in first, first
        if rank == 0:
            assert elapsed < 2.0 + 5.0, (rank, elapsed)
            assert "EP rank 1" in first, first  # the peer that did not arrive is named
        # The next call raises at once on every rank that is still alive.
        assert second.startswith("CollectiveError:") and "rebuild" in second, (rank, second)
        assert elapsed2 < 1.0, (rank, elapsed2)


def test_second_combine_of_a_handle_raises_locally():
    """Tier 1: combining one handle twice is a local misuse after a completed call: it raises at once, before
    any exchange, so the ranks stay in step."""
    d = moe_comm.Dispatcher(num_experts=4)
    x, idx, w = _inputs(0, 4)
    out = d.dispatch(x, idx)
    d.combine(out.tokens, w, out.handle)
    with pytest.raises(ValueError, match="already combined"):
        d.combine(out.tokens, w, out.handle)


def _rank_deferred(rank, world_size, bad):
    """end_check="deferred": every rank, the failing one too, returns placeholder rows from the failed forward
    and raises at its next read of the Dispatcher - the backward's check-in, the next call, or check()."""
    E = 2 * world_size
    out = {}
    for name, threshold in TRANSPORTS:
        d = moe_comm.Dispatcher(num_experts=E, direct_min_bytes=threshold, timeout=30.0, end_check="deferred")
        x, idx, w = _inputs(rank, E, T=9)

        def expert_fn(t, c):
            if rank == bad:
                raise ValueError("expert_fn failed on purpose")
            return t * 2.0

        def train_step():  # every rank reaches the backward: its check-in raises the deferred failure
            y = d(x.clone().requires_grad_(True), idx, w, expert_fn, num_chunks=2)
            y.sum().backward()

        out[(name, "train")] = (outcome_of(train_step), "skipped", _good_call(d, rank, E, 2))
        # check(): the deferred exchange read on demand, by every rank
        y_or_error = outcome_of(lambda: d(x, idx, w, expert_fn, num_chunks=1))
        out[(name, "check")] = (y_or_error, outcome_of(d.check), _good_call(d, rank, E, 1))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_deferred_end_check_raises_at_the_next_read_on_every_rank(ranks, world_size):
    bad = world_size - 1
    res = ranks(world_size).run(_rank_deferred, bad, timeout=120)
    for rank, per_rank in enumerate(res):
        for (name, kind), (first, second, next_ok) in per_rank.items():
            assert next_ok, (rank, name, kind)
            own = "ValueError:" if rank == bad else "PeerFailed:"  # its own error on the failing rank
            if kind == "train":  # the forward returned; the backward's check-in raised
                assert first.startswith(own) and f"[{bad}]" in first and "on purpose" in first, (rank, name, first)
            else:  # the forward returned a value (documented), check() raised
                assert first == "value", (rank, name, first)
                assert second.startswith(own) and "on purpose" in second, (rank, name, second)


def test_dispatcher_launched_without_process_group_raises(monkeypatch):
    """Tier 1: under torchrun (RANK, WORLD_SIZE > 1) without init_process_group a Dispatcher would silently run
    alone; it raises unless told allow_single_process=True."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="init_process_group"):
        moe_comm.Dispatcher(num_experts=4)
    assert moe_comm.Dispatcher(num_experts=4, allow_single_process=True).world_size == 1


def _rank_skipped_step(rank, world_size, bad):
    """A training loop that calls moe_comm.set_step(step): the bad rank skips step 1 entirely (its loop caught an
    error of its own before the layer and went on), so its step-2 call meets its peers' step-1 call."""
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=2 * world_size, top_k=2)
    layer = moe_comm.MoELayer(cfg, seed=0, timeout=30.0)
    x = torch.randn(6 + rank, H)
    out = []
    try:
        for step in ([0, 2] if rank == bad else [0, 1]):
            moe_comm.set_step(step)
            out.append(outcome_of(lambda: layer(x.clone().requires_grad_(True)).sum().backward()))
        moe_comm.set_step(7)  # the loop brought every rank to the same step: the next call works
        out.append(outcome_of(lambda: layer(x.clone().requires_grad_(True)).sum().backward()))
        moe_comm.set_step(None)
        out.append(outcome_of(lambda: layer(x.clone().requires_grad_(True)).sum().backward()))
    finally:
        moe_comm.set_step(None)  # the pool's processes serve later tests
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_rank_at_another_step_raises_on_every_rank_at_once(ranks, world_size):
    bad = world_size - 1
    for rank, (first, second, same_step, no_step) in enumerate(ranks(world_size).run(_rank_skipped_step, bad)):
        assert first == same_step == no_step == "value", (rank, first, same_step, no_step)
        assert second.startswith("ProtocolError:"), (rank, second)
        assert f"step 1 on ranks {list(range(bad))}, step 2 on ranks [{bad}]" in second, (rank, second)
        assert "moe_comm.set_step" in second, (rank, second)


def test_set_step_takes_an_int_or_none_and_every_header_carries_it():
    from moe_comm.comm.wire import Phase, Word, current_step, header

    try:
        for bad in (-1, True, 1.5, "3"):
            with pytest.raises(ValueError, match="set_step: step must be an int >= 0 or None"):
                moe_comm.set_step(bad)
        assert current_step() == -1  # nothing was set by the rejected calls
        moe_comm.set_step(12)
        assert header(Phase.FORWARD, dispatcher=0, call=1, chunks=1, experts=4, world=2)[Word.STEP] == 12
    finally:
        moe_comm.set_step(None)
    assert header(Phase.FORWARD, dispatcher=0, call=1, chunks=1, experts=4, world=2)[Word.STEP] == -1


def _rank_issue_fails(rank, world_size):
    """A transfer whose issue fails at once (a dead peer's socket closed): the error names the peers recorded
    elsewhere, as a failed wait does. Before, only a failed wait named them: a race decided which one a dead
    peer showed (seen once in CI: 'issuing the combine ... failed' without the peer)."""
    import torch.distributed as dist
    from moe_comm.comm.collectives import issuing, record_arrival
    group = dist.new_group(list(range(world_size)))  # a fresh group: poisoning it spares the pool's WORLD
    record_arrival(group, "the dispatch (fwd) transfer of chunk 0 of call 7" if rank == 0 else "the start of step 3")
    dist.barrier(group=group)
    time.sleep(0.3)  # the arrival writer coalesces for 5 ms
    if rank != 0:
        return "recorded"

    def closed_socket():
        raise RuntimeError("Connection reset by peer")
    return outcome_of(lambda: _issue(issuing, group, closed_socket))


def _issue(issuing, group, fn):
    with issuing(group, "combine (fwd) point-to-point transfer of chunk 0", 0,
                 "the dispatch (fwd) transfer of chunk 0 of call 7"):
        fn()


@pytest.mark.multirank
def test_a_failed_issue_names_the_peers_elsewhere(ranks):
    first, second = ranks(2).run(_rank_issue_fails)
    assert first.startswith("CollectiveError:") and "issuing the combine" in first, first
    assert "Peers not at this exchange: EP rank 1 last at the start of step 3" in first, first
    assert second == "recorded"
