"""The sync-free mode (``max_tokens_per_rank``): fixed-size exchanges, no host sync after the first call.

Checked against the dropless Dispatcher on the same inputs (equal outputs and gradients when nothing
overflows), with HostSyncs for zero host syncs forward and backward, on 1, 2 and 4 gloo ranks; and what a
rank with a bad input does (returns zeros like its peers' placeholder rows; all raise at check(), never
a hang).
"""
import pytest
import torch

import moe_comm
from moe_comm.testing.syncs import HostSyncs
from outcome import outcome_of

H, E, K, M = 8, 8, 2, 16


def expert_scale(tokens_RH, tokens_per_expert_e, padded=False):
    """A differentiable expert function on device counts only: row * (local expert + 1) * tanh(row).
    Padding rows (past the counts) are zero in and out."""
    ends = torch.cumsum(tokens_per_expert_e, 0)
    expert_R = torch.bucketize(torch.arange(tokens_RH.shape[0]), ends, right=True)
    return tokens_RH * torch.tanh(tokens_RH) * (expert_R + 1).to(tokens_RH.dtype)[:, None]


expert_scale.supports_padded = True


def _inputs(rank, step, T=None):
    g = torch.Generator().manual_seed(1000 * step + rank)
    T = [11, 0, 16, 5][rank] if T is None else T
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    idx[torch.rand(T, K, generator=g) < 0.2] = -1  # dropped slots
    w = torch.rand(T, K, generator=g, dtype=torch.float64)
    return x, idx, w


def _run(d, x, idx, w):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    y = d(x, idx, w, expert_scale)
    (y * torch.arange(1, H + 1, dtype=y.dtype)).sum().backward()
    return y.detach(), x.grad, w.grad


def _rank_equal_to_dropless(rank, world_size, steps):
    free = moe_comm.Dispatcher(E, max_tokens_per_rank=M)
    exact = moe_comm.Dispatcher(E)
    out = []
    for step in range(steps):
        x, idx, w = _inputs(rank, step)
        a = _run(free, x, idx, w)
        b = _run(exact, x, idx, w)
        out.append([torch.equal(u, v) for u, v in zip(a, b)])
    free.check()
    return out, free.last_transport


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_sync_free_equals_dropless(ranks, world_size):
    for same, transport in ranks(world_size).run(_rank_equal_to_dropless, 3):
        assert same == [[True, True, True]] * 3
        assert transport == ("local" if world_size == 1 else "all_to_all")


def _rank_syncs(rank, world_size):
    d = moe_comm.Dispatcher(E, max_tokens_per_rank=M)
    x, idx, w = _inputs(rank, 0)
    _run(d, x, idx, w)  # the first call agrees on (H, dtype, K): one read
    events = []
    for step in (1, 2):
        x, idx, w = _inputs(rank, step)
        x = x.requires_grad_(True)
        with HostSyncs() as fwd:
            y = d(x, idx, w, expert_scale)
        with HostSyncs() as bwd:
            y.sum().backward()
        events.append((fwd.report(), bwd.report(), fwd.count, bwd.count))
    with HostSyncs() as chk:
        d.check()
    return events, chk.count


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [1, 2])
def test_sync_free_has_no_host_sync(ranks, world_size):
    for events, check_reads in ranks(world_size).run(_rank_syncs):
        for fwd, bwd, nf, nb in events:
            assert (nf, nb) == (0, 0), (fwd, bwd)
        assert check_reads == (1 if world_size > 1 else 0), "check() reads the deferred exchanges at once"


def _rank_bad_input(rank, world_size, bad_rank, kind):
    d = moe_comm.Dispatcher(E, max_tokens_per_rank=M, timeout=20)
    log = []
    for step in range(4):
        x, idx, w = _inputs(rank, step)
        if step == 1 and rank == bad_rank:
            if kind == "too_many_tokens":
                x, idx, w = _inputs(rank, step, T=M + 1)
            elif kind == "other_hidden":
                x = torch.randn(x.shape[0], H + 1, dtype=x.dtype)
            elif kind == "weights_not_a_tensor":
                w = w.tolist()
        fn = expert_scale
        if step == 1 and rank == bad_rank and kind == "expert_fn_raises":
            def fn(t, c, padded=False):
                raise RuntimeError("expert kernel failed")
            fn.supports_padded = True
        try:
            with torch.no_grad():
                y = d(x, idx, w, fn)
            log.append("ok" if step != 1 or rank != bad_rank or not y.any() else "nonzero placeholder")
        except Exception as err:  # noqa: BLE001
            log.append(f"{type(err).__name__}: {err}")
        if step == 1:
            try:
                d.check()
                log.append("check ok")
            except Exception as err:  # noqa: BLE001
                log.append(f"check {type(err).__name__}: {err}")
    return log


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["too_many_tokens", "other_hidden", "expert_fn_raises", "weights_not_a_tensor"])
def test_sync_free_bad_input_on_one_rank(ranks, kind):
    logs = ranks(2).run(_rank_bad_input, 1, kind)
    bad, good = logs[1], logs[0]
    want = {"too_many_tokens": "max_tokens_per_rank = 16", "other_hidden": "must stay as in the first call",
            "expert_fn_raises": "expert kernel failed", "weights_not_a_tensor": "topk_weight_TK"}[kind]
    # Deferred on every rank: both calls return (zeros on the failing rank), both raise at check().
    assert bad[:2] == ["ok", "ok"] and good[:2] == ["ok", "ok"], (bad, good)
    assert bad[2].startswith("check") and want in bad[2] and "EP rank(s) [1]" in bad[2], bad
    assert good[2].startswith("check") and want in good[2] and "EP rank(s) [1]" in good[2], good
    assert bad[3:] == ["ok", "ok"] and good[3:] == ["ok", "ok"], "both ranks go on after the failure"


def test_sync_free_arguments_are_checked():
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        moe_comm.Dispatcher(E, max_tokens_per_rank=0)
    with pytest.raises(ValueError, match="needs num_chunks=1"):
        moe_comm.Dispatcher(E, num_chunks=2, max_tokens_per_rank=4)
    with pytest.raises(ValueError, match="needs num_chunks=1"):
        moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=H, num_experts=E, top_k=K, num_chunks=4,
                           max_tokens_per_rank=4)
    d = moe_comm.Dispatcher(E, max_tokens_per_rank=4)
    x, idx, _ = _inputs(0, 0, T=3)
    with pytest.raises(ValueError, match="dispatch\\(\\) is not available in sync-free mode"):
        d.dispatch(x, idx)


def _rank_folded_step(rank, world_size, mismatch):
    """70 forwards without a read: every exchange after the first call is checked on the device as it goes out,
    and the first failed one's rows are kept there (no unread list, nothing on the host per call). In the second
    call (the first one's exchange is read at once), the last rank may be at another step."""
    d = moe_comm.Dispatcher(E, max_tokens_per_rank=M)
    x, idx, w = _inputs(rank, 0)
    try:
        for call in range(70):
            moe_comm.set_step(call + (1 if mismatch and call == 1 and rank == world_size - 1 else 0))
            with torch.no_grad():
                d(x, idx, w, expert_scale)
        return outcome_of(d.check)
    finally:
        moe_comm.set_step(None)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("mismatch", [False, True])
def test_a_step_mismatch_many_calls_before_the_read_raises_there_naming_it(ranks, world_size, mismatch):
    for rank, outcome in enumerate(ranks(world_size).run(_rank_folded_step, mismatch)):
        if mismatch:  # the first failed exchange in full, 68 calls later: its call, the steps and their ranks
            assert outcome.startswith("ProtocolError:") and "in the forward of call 2 " in outcome, (rank, outcome)
            steps = f"step 1 on ranks {list(range(world_size - 1))}, step 2 on ranks [{world_size - 1}]"
            assert f"the training step (moe_comm.set_step) differs across the EP group: {steps}" in outcome, outcome
        else:
            assert outcome == "value", (rank, outcome)


def _rank_two_failures(rank, world_size):
    """Rank 1 fails in call 2, rank 0 in call 3 (too many tokens each); one read after both."""
    d = moe_comm.Dispatcher(E, max_tokens_per_rank=M)
    for call in range(4):
        x, idx, w = _inputs(rank, call, T=M + 1 if (call, rank) in ((2, 1), (3, 0)) else None)
        with torch.no_grad():
            d(x, idx, w, expert_scale)
    return outcome_of(d.check)


@pytest.mark.multirank
def test_the_read_raises_the_first_failure_on_every_rank_not_a_later_own_one(ranks):
    # every rank raises the first failed call's error: rank 1 its own, rank 0 the remote one (its own failure came
    # one call later; the kept exchange is the first). Before the fix rank 0 raised its own later error there.
    first, second = ranks(2).run(_rank_two_failures)
    assert first.startswith("RemoteError:") and "EP rank(s) [1] rejected" in first, first
    assert second.startswith("ValueError:") and "max_tokens_per_rank = 16" in second, second
    assert "the forward of call 3 " in first and "the forward of call 3 " in second, (first, second)
