"""Tier 2 (multi-rank gloo): a fault on ONE rank after the control exchange was issued, anywhere in the call's
own work (the send permute, FP8 quantize, a streamed piece, the send-side regroup, a receive buffer, plan building,
the sync-free permute and regroup index, the final unpermute), in every mode (eager, deferred, sync-free, one copy
per rank with streaming, point-to-point, C > 1), must:
  - make every rank raise, naming the failing rank and its error (deferred: at the next read; a fault after the
    call's last exchange: on the failing rank at once and on every rank at its next exchange);
  - kill no process and leave the group usable: the next good call works on every rank and is exact.
One rule: after the control exchange is issued no exception leaves a rank before the phase's closing exchange.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import moe_comm
from moe_comm.testing.faults import inject
from outcome import outcome_of

H = 8


def _inputs(rank, E, T=9, K=2, seed=0):
    g = torch.Generator().manual_seed(100 * seed + rank)
    return (torch.randn(T, H, generator=g, dtype=torch.float64), torch.rand(T, E, generator=g).argsort(1)[:, :K],
            torch.rand(T, K, generator=g, dtype=torch.float64))


def _expert(t, c):
    return t * 2.0


def _good_step(d, rank, E, C=None):
    """fwd + bwd, exact against y = 2 * sum_k w_k * x, x.grad = 2 * sum_k w_k (FP8 rows: within e4m3's
    relative rounding, 2^-4)."""
    x, idx, w = _inputs(rank, E, seed=7)
    x.requires_grad_(True)
    y = d(x, idx, w, _expert) if C is None else d(x, idx, w, _expert, num_chunks=C)
    y.sum().backward()
    d.check()
    tol = dict(rtol=2 ** -4, atol=1e-6) if d.dispatch_dtype is not None else {}
    torch.testing.assert_close(y, 2 * w.sum(1, keepdim=True) * x, **tol)
    torch.testing.assert_close(x.grad, 2 * w.sum(1, keepdim=True).expand_as(x))
    return True


# ------------------------------------------------------------------------ the pipelined call, every mode

# (fault, direction) -> the Dispatcher settings it applies to
PIPELINE_CASES = [
    ("permute", "fwd"), ("plan", "fwd"), ("recv_buffer", "fwd"), ("send_regroup", "fwd"), ("send_regroup", "bwd"),
]


def _dispatcher(mode, W, transport="all_to_all"):
    E = 2 * W
    kw = dict(num_experts=E, timeout=30.0, direct_min_bytes=0 if transport == "point_to_point" else 1 << 40)
    if mode in ("eager", "deferred"):
        kw["end_check"] = mode
    elif mode == "fp8":
        kw["dispatch_dtype"] = torch.float8_e4m3fn
    elif mode == "dedup":
        kw["dedup"] = True
    return moe_comm.Dispatcher(**kw), E


def _rank_pipeline(rank, world_size, bad, cases):
    out = {}
    me = rank == bad
    for mode, transport, C, fault, direction in cases:
        d, E = _dispatcher(mode, world_size, transport)
        if mode == "dedup":
            d._stream = True  # as after a call that moved 12 MiB from some rank: this one streams in pieces
        x, idx, w = _inputs(rank, E)
        x.requires_grad_(True)
        grads = {}

        def step():
            with inject(fault, direction) if me else contextlib.nullcontext():
                y = d(x, idx, w, _expert, num_chunks=C)
                y.sum().backward()
            grads["x"] = x.grad
            d.check()

        outcome = outcome_of(step)
        nan_grad = grads.get("x") is not None and bool(torch.isnan(grads["x"]).all())
        out[(mode, transport, C, fault, direction)] = (outcome, nan_grad, _good_step(d, rank, E, C))
    return out


def _check_everyone_raised(res, bad, needle, key):
    for rank, per_rank in enumerate(res):
        outcome = per_rank[key][0]
        assert outcome != "value", (key, rank)
        assert needle in outcome and f"[{bad}]" in outcome, (key, rank, outcome)
        if rank != bad:
            assert outcome.startswith("PeerFailed:"), (key, rank, outcome)
        assert per_rank[key][-1] is True, (key, rank)  # the next call worked and was exact


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("mode", ["eager", "deferred"])
def test_send_side_faults_raise_on_every_rank(ranks, world_size, mode):
    bad = world_size - 1
    cases = [(mode, t, C, f, dr) for t in ("all_to_all", "point_to_point") for C in (1, 3)
             for f, dr in PIPELINE_CASES if t == "all_to_all" or f in ("permute", "plan")]
    res = ranks(world_size).run(_rank_pipeline, bad, cases, timeout=240)
    for key in cases:
        _check_everyone_raised(res, bad, "injected", key)
        if mode == "deferred" and key[4] == "bwd":
            # the backward returned on every rank: its gradients are NaN everywhere, check() raised
            assert all(per_rank[key][1] for per_rank in res), key


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_fp8_and_streamed_piece_faults_raise_on_every_rank(ranks, world_size):
    bad = world_size - 1
    cases = [("fp8", "all_to_all", C, "quantize", "fwd") for C in (1, 3)]
    cases += [("fp8", "all_to_all", 1, "permute", "fwd"), ("dedup", "all_to_all", 1, "piece", "fwd"),
              ("dedup", "all_to_all", 1, "permute", "fwd")]
    res = ranks(world_size).run(_rank_pipeline, bad, cases, timeout=240)
    for key in cases:
        _check_everyone_raised(res, bad, "injected", key)


# ------------------------------------------------------------------------ sync-free mode

M = 12


def _rank_sync_free(rank, world_size, bad, fault):
    E = 2 * world_size
    d = moe_comm.Dispatcher(num_experts=E, max_tokens_per_rank=M, timeout=30.0)
    x, idx, w = _inputs(rank, E)
    _good_sync_free(d, x, idx, w)  # the first call agrees on (H, dtype, K)

    def step():
        xg = x.clone().requires_grad_(True)
        with inject(fault) if rank == bad else contextlib.nullcontext():
            y = d(xg, idx, w, _expert)
        y.sum().backward()  # deferred: the backward moves placeholder rows like its peers
        d.check()

    return outcome_of(step), _good_sync_free(d, x, idx, w)


def _good_sync_free(d, x, idx, w):
    xg = x.clone().requires_grad_(True)
    y = d(xg, idx, w, _expert)
    y.sum().backward()
    d.check()
    torch.testing.assert_close(y, 2 * w.sum(1, keepdim=True) * x)
    return True


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("fault", ["sf_permute", "sf_regroup"])
def test_sync_free_send_side_faults_raise_at_check(ranks, world_size, fault):
    bad = world_size - 1
    res = ranks(world_size).run(_rank_sync_free, bad, fault, timeout=120)
    for rank, (outcome, next_ok) in enumerate(res):
        assert next_ok, rank
        assert "injected" in outcome and f"[{bad}]" in outcome, (rank, outcome)
        assert "no rows were sent" not in outcome, outcome  # the call ran, with placeholder rows
        assert "discard" in outcome, outcome


# ------------------------------------------------------------------------ dispatch() / combine()

def _rank_two_step(rank, world_size, bad):
    E = 2 * world_size
    d = moe_comm.Dispatcher(num_experts=E, timeout=30.0)
    x, idx, w = _inputs(rank, E)

    def step():
        with inject("permute") if rank == bad else contextlib.nullcontext():
            o = d.dispatch(x, idx)
        return d.combine(o.tokens * 2.0, w, o.handle)  # every rank raises here

    outcome = outcome_of(step)
    o = d.dispatch(x, idx)
    y = d.combine(o.tokens * 2.0, w, o.handle)
    torch.testing.assert_close(y, 2 * w.sum(1, keepdim=True) * x)
    return outcome


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_permute_fault_raises_on_every_rank_at_combine(ranks, world_size):
    bad = world_size - 1
    for rank, outcome in enumerate(ranks(world_size).run(_rank_two_step, bad, timeout=120)):
        assert "injected send permute fault" in outcome and f"[{bad}]" in outcome, (rank, outcome)
        assert "the dispatch() of call" in outcome, outcome


# ------------------------------------------------------------------------ after the call's last exchange

def _rank_unpermute(rank, world_size, bad, with_layer):
    """The final unpermute fails on one rank: it raises at once, its peers return; the next exchange makes every
    rank raise naming it (the layer's monitor collective stays paired); the call after that works."""
    E = 2 * world_size
    if with_layer:
        layer = moe_comm.MoELayer(moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=E, top_k=2),
                                  seed=5, timeout=30.0)
        x = torch.randn(6, H, generator=torch.Generator().manual_seed(rank))

        def call():
            return layer(x)
    else:
        d = moe_comm.Dispatcher(num_experts=E, timeout=30.0)
        x, idx, w = _inputs(rank, E)

        def call():
            return d(x, idx, w, _expert)
    with torch.no_grad():
        with inject("unpermute") if rank == bad else contextlib.nullcontext():
            first = outcome_of(call)
        second = outcome_of(call)
        third = outcome_of(call)
    return first, second, third


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("with_layer", [False, True])
def test_unpermute_fault_reaches_every_rank_at_the_next_exchange(ranks, world_size, with_layer):
    bad = world_size - 1
    res = ranks(world_size).run(_rank_unpermute, bad, with_layer, timeout=120)
    for rank, (first, second, third) in enumerate(res):
        if rank == bad:
            assert first.startswith("RuntimeError:") and "injected final unpermute fault" in first, first
        else:
            assert first == "value", (rank, first)
        assert "injected final unpermute fault" in second and f"[{bad}]" in second, (rank, second)
        assert third == "value", (rank, third)


def _rank_unpermute_training(rank, world_size, bad, sync_free):
    """A training loop whose final unpermute fails on one rank: with a backward to come, that rank returns NaN
    rows and every rank raises in the same step's backward (at its check-in; sync-free: at check()), so the
    ranks stay in step and the next step works everywhere (before: the failing rank raised in the forward and
    skipped its backward, its peers' backward met its next forward, and the ranks stayed a step apart)."""
    E = 2 * world_size
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=E, top_k=2,
                             max_tokens_per_rank=12 if sync_free else None)
    layer = moe_comm.MoELayer(cfg, seed=5, timeout=30.0)
    steps = []
    for step in range(4):
        moe_comm.set_step(step)
        x = torch.randn(6, H, generator=torch.Generator().manual_seed(10 * step + rank), requires_grad=True)
        seen = {}

        def one_step():
            with inject("unpermute") if (rank == bad and step == 1) else contextlib.nullcontext():
                y = layer(x)
            seen["nan"] = bool(torch.isnan(y).all())
            y.sum().backward()
            moe_comm.check(layer)
            return "finite" if bool(torch.isfinite(x.grad).all()) else "nan grad"
        steps.append((outcome_of(one_step), seen.get("nan")))
    moe_comm.set_step(None)
    return steps


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("sync_free", [False, True])
def test_unpermute_fault_in_training_raises_in_the_same_step_everywhere(ranks, world_size, sync_free):
    bad = world_size - 1
    for rank, steps in enumerate(ranks(world_size).run(_rank_unpermute_training, bad, sync_free, timeout=120)):
        assert steps[0] == ("finite", False), (rank, steps)
        text, nan_y = steps[1]
        assert "injected final unpermute fault" in text and f"[{bad}]" in text, (rank, text)
        assert text.startswith("RuntimeError:" if rank == bad else "PeerFailed:"), (rank, text)
        assert nan_y is (rank == bad), (rank, steps)  # the failing rank's rows were NaN, the others' real
        assert steps[2:] == [("finite", False)] * 2, (rank, steps)  # the same step on every rank again


def _rank_late_then_rejected(rank, world_size, bad):
    """A failure carried from call 1 (final unpermute, no grad) meets this rank's own rejected input in call 2:
    that exchange carries both, every rank raises once, and nothing stays behind (before: the carried failure
    stayed pending, the layer issued its monitor collective on that rank alone and the group timed out)."""
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=2 * world_size, top_k=2)
    layer = moe_comm.MoELayer(cfg, seed=5, timeout=20.0)  # monitor on
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        with inject("unpermute") if rank == bad else contextlib.nullcontext():
            first = outcome_of(lambda: layer(x))
        second = outcome_of(lambda: layer(torch.randn(6, H + 1) if rank == bad else x))
        return first, second, outcome_of(lambda: layer(x)), outcome_of(lambda: layer(x))


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_carried_failure_meeting_a_rejected_input_raises_once(ranks, world_size):
    bad = world_size - 1
    for rank, (first, second, third, fourth) in enumerate(ranks(world_size).run(_rank_late_then_rejected, bad,
                                                                                 timeout=120)):
        assert ("injected" in first) == (rank == bad), (rank, first)
        assert f"[{bad}]" in second and "hidden_size" in second and "injected final unpermute fault" in second, second
        assert (third, fourth) == ("value", "value"), (rank, third, fourth)


def _rank_combine_buffer_once(rank, world_size, bad):
    """combine()'s receive buffer fails once on one rank: made again, the transfer goes (its peers are in it), the
    rank raises after it and every rank raises at the next exchange (before: it left before the transfer and
    its peer's process aborted in gloo)."""
    E = 2 * world_size
    d = moe_comm.Dispatcher(num_experts=E, timeout=20.0)
    x, idx, w = _inputs(rank, E)
    left = [1 if rank == bad else 0]
    original = d.workspace.rows

    def rows(name, *args, **kwargs):
        if name == "combined" and left[0]:
            left[0] -= 1
            raise RuntimeError("injected combine buffer fault")
        return original(name, *args, **kwargs)

    with torch.no_grad():
        out = d.dispatch(x, idx)
        d.workspace.rows = rows
        try:
            first = outcome_of(lambda: d.combine(out.tokens * 2.0, w, out.handle))
        finally:
            d.workspace.rows = original

        def call():
            o = d.dispatch(x, idx)
            torch.testing.assert_close(d.combine(o.tokens * 2.0, w, o.handle), 2 * w.sum(1, keepdim=True) * x)
        return first, outcome_of(call), outcome_of(call)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_combine_buffer_fault_raises_after_the_transfer(ranks, world_size):
    bad = world_size - 1
    for rank, (first, second, third) in enumerate(ranks(world_size).run(_rank_combine_buffer_once, bad,
                                                                         timeout=120)):
        assert ("injected combine buffer fault" in first) == (rank == bad), (rank, first)
        assert "injected combine buffer fault" in second and f"[{bad}]" in second, (rank, second)
        assert third == "value", (rank, third)
