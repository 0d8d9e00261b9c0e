"""Tier 2 (multi-rank gloo): an eager call whose ranks together send at most ``Dispatcher.carry_max_bytes`` of rows
closes each phase inside its last transfer (its status rows ride after each destination's rows) instead of an
end-of-phase exchange of its own: two collectives fewer per training step, the same outputs and gradients bit for
bit, and the same failure behaviour - including a failure in the last chunk's weight gradients, which now runs
before that transfer goes out."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import moe_comm
from moe_comm import _wgrad
from moe_comm.dispatch import transport
from outcome import outcome_of

H = 8


@contextlib.contextmanager
def _counted_all_to_alls():
    """Counts dist.all_to_all_single calls (every exchange and every transfer of the all-to-all transport)."""
    n, original = [0], dist.all_to_all_single

    def counted(*args, **kwargs):
        n[0] += 1
        return original(*args, **kwargs)
    dist.all_to_all_single = counted
    try:
        yield n
    finally:
        dist.all_to_all_single = original


def _layer(world_size, C, carry, dedup=False):
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=2 * world_size, top_k=2, num_chunks=C,
                             dedup=dedup)
    layer = moe_comm.MoELayer(cfg, seed=1, timeout=30.0, monitor=False)
    layer.dispatcher.carry_max_bytes = carry
    return layer


def _rank_counts_and_values(rank, world_size):
    out = {}
    for C, dedup in ((1, False), (3, False), (2, True)):
        x = torch.randn(12, H, generator=torch.Generator().manual_seed(rank))
        got = {}
        bound = world_size * 12 * 2 * H * 4  # the group: each rank sends 12 tokens x top-2 rows of H float32
        variants = (("carried", 1 << 20), ("exchange", -1)) + (
            () if dedup else (("at_bound", bound), ("above_bound", bound - 1)))
        for name, carry in variants:
            layer = _layer(world_size, C, carry, dedup)
            xg = x.clone().requires_grad_(True)
            layer(xg).square().sum().backward()  # warm
            layer.zero_grad()
            xg.grad = None
            with _counted_all_to_alls() as n:
                y = layer(xg)
                y.square().sum().backward()
            got[name] = (n[0], y.detach(), xg.grad, [p.grad.clone() for p in layer.parameters()])
        out[(C, dedup)] = (
            {k: v[0] for k, v in got.items()},
            all(torch.equal(a, b) for k in got if k != "carried"
                for a, b in zip([got["carried"][1], got["carried"][2]] + got["carried"][3],
                                [got[k][1], got[k][2]] + got[k][3])))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_small_calls_close_inside_their_last_transfer_with_equal_results(ranks, world_size):
    for per_rank in ranks(world_size).run(_rank_counts_and_values, timeout=120):
        for (C, dedup), (counts, equal) in per_rank.items():
            assert equal, (C, dedup)  # outputs, input and every parameter gradient bit for bit
            # two closing exchanges fewer per step (end of forward, end of backward); the check-in stays
            assert counts["exchange"] - counts["carried"] == 2, (C, dedup, counts)
            if not dedup:  # control + C transfers each way, check-in + C each way; + 2 end exchanges
                assert counts["carried"] == 2 + 4 * C, (C, counts)
                # the bound is on the most bytes of rows any rank sends: at it carried, one byte below not
                assert counts["at_bound"] == counts["carried"] and counts["above_bound"] == counts["exchange"], counts


def _rank_weight_grads_fault(rank, world_size, bad, C, carry):
    layer = _layer(world_size, C, carry)
    steps = []
    for step in range(3):
        x = torch.randn(12, H, generator=torch.Generator().manual_seed(10 * step + rank), requires_grad=True)
        layer.zero_grad(set_to_none=True)
        original = _wgrad.WeightGrads.run
        calls = [0]

        def run(self, sums=None):  # the last chunk's weight gradients fail on the bad rank, in step 1
            calls[0] += 1
            if rank == bad and step == 1 and calls[0] == C:
                raise RuntimeError("injected weight-gradient fault")
            return original(self, sums)
        _wgrad.WeightGrads.run = run
        try:
            text = outcome_of(lambda: layer(x).sum().backward())
        finally:
            _wgrad.WeightGrads.run = original
        steps.append((text, any(p.grad is not None for p in layer.experts.parameters())))
    return steps


@pytest.mark.multirank
@pytest.mark.parametrize("C,carry", [(1, 1 << 20), (3, 1 << 20), (1, -1)])
def test_a_failure_in_the_last_chunks_weight_gradients_raises_on_every_rank(ranks, C, carry):
    """The last chunk's weight gradients run before the transfer that carries the phase's status (carried) or
    before the end-of-backward exchange (not carried): either way every rank raises in that backward, naming the
    failing rank, no expert has a gradient on any rank, and the next step works."""
    bad = 1
    for rank, steps in enumerate(ranks(2).run(_rank_weight_grads_fault, bad, C, carry, timeout=120)):
        (first, moved0), (failed, moved1), (third, moved2) = steps
        assert first == "value" and third == "value" and moved0 and moved2, (rank, steps)
        want = "RuntimeError" if rank == bad else "PeerFailed"
        assert failed.startswith(want + ":") and "injected weight-gradient fault" in failed, (rank, failed)
        assert f"[{bad}]" in failed, (rank, failed)
        assert not moved1, (rank, "an expert got a gradient from the failed backward")


@contextlib.contextmanager
def _status_unpack_fails(on: bool):
    """On this rank (``on``), the first carried status cannot be copied out of its transfer."""
    original, hit = transport.InFlight.wait, []

    def wait(self):
        if self.unpack is not None and on and not hit:
            hit.append(1)

            def fail():
                raise RuntimeError("injected status unpack fault")
            self.unpack = fail
        return original(self)
    transport.InFlight.wait = wait
    try:
        yield
    finally:
        transport.InFlight.wait = original


def _rank_unpack_fault(rank, world_size, bad, train):
    d = moe_comm.Dispatcher(num_experts=2 * world_size, timeout=30.0)
    g = torch.Generator().manual_seed(rank)
    x, idx, w = torch.randn(9, H, generator=g), torch.rand(9, 2 * world_size, generator=g).argsort(1)[:, :2], \
        torch.rand(9, 2, generator=g)
    out = []
    for step in range(3):
        moe_comm.set_step(step)
        with _status_unpack_fails(rank == bad and step == 0), torch.set_grad_enabled(train):
            xg = x.clone().requires_grad_(train)
            if train:  # forward, then backward: the check-in carries what the forward could not read
                out.append(outcome_of(lambda: d(xg, idx, w, lambda t, c: t * 2.0).sum().backward()))
            else:
                out.append(outcome_of(lambda: d(xg, idx, w, lambda t, c: t * 2.0)))
    moe_comm.set_step(None)
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("train", [False, True])
def test_a_status_this_rank_cannot_read_raises_on_every_rank_at_its_next_exchange(ranks, train):
    """The rows arrived but this rank could not copy the status out: its peers read "no failure" from its own
    status rows and return. Its next exchange carries the error, where every rank raises naming it (as a failure
    after a call's last exchange): in training the same step's backward check-in (the rank returns NaN rows, so its
    backward runs with its peers'); under no_grad it raises at once, and every rank at the next call. The ranks
    stay in step (set_step checks it): the call after works."""
    bad = 1
    for rank, steps in enumerate(ranks(2).run(_rank_unpack_fault, bad, train, timeout=120)):
        first, second, third = steps
        if train:  # every rank raises in step 0's backward
            failed, fine = first, (second, third)
        else:  # the bad rank at once, every rank at the next call
            failed, fine = second, (third,)
            assert (first == "value") == (rank != bad), (rank, first)
            assert rank != bad or "injected status unpack fault" in first, first
        assert "injected status unpack fault" in failed and "carried here" in failed, (rank, steps)
        assert f"EP rank {bad}" in failed, (rank, failed)
        assert all(f == "value" for f in fine), (rank, steps)


def _rank_zero_width_and_mismatch(rank, world_size):
    d = moe_comm.Dispatcher(num_experts=2 * world_size, timeout=30.0)
    g = torch.Generator().manual_seed(rank)
    idx, w = torch.rand(9, 2 * world_size, generator=g).argsort(1)[:, :2], torch.rand(9, 2, generator=g)
    zero = outcome_of(lambda: d(torch.zeros(9, 0), idx, w, lambda t, c: t * 2.0).shape == (9, 0) and "value")
    d.carry_max_bytes = 1 << 20 if rank == 0 else -1  # one rank differs: every rank raises before rows move
    mismatch = outcome_of(lambda: d(torch.randn(9, H), idx, w, lambda t, c: t * 2.0))
    d.carry_max_bytes = 1 << 20
    after = outcome_of(lambda: d(torch.randn(9, H), idx, w, lambda t, c: t * 2.0))
    return zero, mismatch, after


@pytest.mark.multirank
def test_zero_width_rows_and_ranks_with_different_bounds(ranks):
    """Zero-width rows (nothing to carry them in) close with the exchange; a rank whose carry_max_bytes differs is
    named by the settings hash of the next call's control exchange on every rank, before any row moves."""
    for zero, mismatch, after in ranks(2).run(_rank_zero_width_and_mismatch, timeout=120):
        assert zero == "value", zero
        assert mismatch.startswith("ValueError:") and "carry_max_bytes" in mismatch, mismatch
        assert after == "value", after


def test_carry_max_bytes_is_checked():
    d = moe_comm.Dispatcher(num_experts=2)
    with pytest.raises(ValueError, match="carry_max_bytes"):
        d.carry_max_bytes = -2
    with pytest.raises(TypeError, match="carry_max_bytes"):
        d.carry_max_bytes = 1.5


def _rank_row_widths(rank, world_size, bad):
    """(dtype, H): rows of 2, 6, 40 and 256 bytes: the status fills whole rows (a row of whole int64 words) or is
    padded into them (6 and 2 bytes). Returns per case: equal to the exchange-closed call, and a failure's outcome."""
    out = {}
    for dtype, H_ in ((torch.bfloat16, 1), (torch.float16, 3), (torch.float64, 5), (torch.float32, 64)):
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(9, H_, generator=g).to(dtype)
        idx = torch.rand(9, 2 * world_size, generator=g).argsort(1)[:, :2]
        w = torch.rand(9, 2, generator=g)
        ys = []
        for carry in (1 << 20, -1):
            d = moe_comm.Dispatcher(num_experts=2 * world_size, num_chunks=2, timeout=30.0)
            d.carry_max_bytes = carry
            xg = x.clone().requires_grad_(True)
            y = d(xg, idx, w, lambda t, c: t * 2.0)
            y.float().square().sum().backward()
            ys.append((y, xg.grad))

        def fails():
            seen = []

            def fn(t, c):
                seen.append(1)
                if rank == bad and len(seen) == 2:
                    raise ValueError("expert_fn failed at the last chunk")
                return t * 2.0
            d(x, idx, w, fn)
        d = moe_comm.Dispatcher(num_experts=2 * world_size, num_chunks=2, timeout=30.0)
        out[(str(dtype), H_)] = (all(torch.equal(a, b) for a, b in zip(*ys)), outcome_of(fails),
                                 outcome_of(lambda: d(x, idx, w, lambda t, c: t * 2.0)))
    return out


@pytest.mark.multirank
def test_every_row_width_carries_the_status_and_a_failure(ranks):
    bad = 1
    for rank, per_rank in enumerate(ranks(2).run(_rank_row_widths, bad, timeout=120)):
        for case, (equal, failed, after) in per_rank.items():
            assert equal, case
            want = "ValueError" if rank == bad else "PeerFailed"
            assert failed.startswith(want + ":") and "expert_fn failed at the last chunk" in failed, (case, failed)
            assert f"EP rank {bad} (at chunk 1)" in failed or rank == bad, (case, failed)
            assert after == "value", (case, after)


def _rank_status_compose_fault(rank, world_size, bad, times):
    from moe_comm.comm.channel import Channel

    # twice poisons the group: a group of its own, so the pool's WORLD stays usable for the tests after this one
    group = dist.new_group(list(range(world_size))) if times > 1 else None
    d = moe_comm.Dispatcher(num_experts=2 * world_size, ep_group=group, timeout=3.0)
    g = torch.Generator().manual_seed(rank)
    x, idx, w = torch.randn(9, H, generator=g), torch.rand(9, 2 * world_size, generator=g).argsort(1)[:, :2], \
        torch.rand(9, 2, generator=g)
    original, left = Channel.carried, [times if rank == bad else 0]

    def carried(self, *args, **kwargs):  # composing the forward's status fails on the bad rank
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("injected status compose fault")
        return original(self, *args, **kwargs)
    Channel.carried = carried
    try:
        with torch.no_grad():
            got = outcome_of(lambda: "exact" if torch.allclose(d(x, idx, w, lambda t, c: t * 2.0),
                                                               2 * w.sum(1, keepdim=True) * x) else "wrong")
    finally:
        Channel.carried = original
    on_world = moe_comm.Dispatcher(num_experts=2 * world_size, timeout=30.0)  # the pool's group is still usable
    with torch.no_grad():
        after = outcome_of(lambda: on_world(x, idx, w, lambda t, c: t * 2.0))
    return got, after


@pytest.mark.multirank
@pytest.mark.parametrize("times", [1, pytest.param(2, marks=pytest.mark.nccl_rules_exempt(
    "the failing rank issues nothing more: its peers must meet the timeout, which the mode's side check, waiting "
    "for every rank before each issue, would report first"))])
def test_a_status_that_cannot_be_composed_never_leaves_peers_waiting(ranks, times):
    """Composing the status that rides in the last transfer is retried once like any buffer of a transfer: once,
    the call completes exactly on every rank; twice, that rank has nothing to send with: it raises CollectiveError
    at once (the group poisoned) and its peers theirs within the timeout - no rank is left waiting."""
    bad = 1
    for rank, (got, after) in enumerate(ranks(2).run(_rank_status_compose_fault, bad, times, timeout=120)):
        assert after == "value", (rank, after)
        if times == 1:
            assert got == "exact", (rank, got)
        else:
            assert got.startswith("CollectiveError:"), (rank, got)
            assert rank != bad or "status rows" in got, got
