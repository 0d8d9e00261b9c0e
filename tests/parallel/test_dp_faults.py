"""Tier 2 (gloo ranks, 2 and 4): failures around the data-parallel helpers of moe_comm.parallel (issue #27.4).

- ``check_expert_replicas`` on a data-parallel group that an earlier failure poisoned: the rank that knows
  raises CollectiveError at once, its peers within the layers' timeout (not the process group's); a fresh
  group for the verdict keeps the pool's own group usable.
- One rank inside ``ddp.no_sync()`` while its peers synchronise: every rank raises ValueError at the forward
  naming the ranks of each setting, before any gradient moves; the next step (every rank alike) works and
  equals the one-process reference.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from moe_comm import parallel
from moe_comm.comm.collectives import poison

from ep_dp_model import TinyMoENet, batch, compare_to_reference, grid, local_grads, make_cfg, rank_loss, reference_grads
from outcome import outcome_of

SEED = 11
TIMEOUT = 1.5


def _grid(world_size: int):
    """EP 1 x DP 2 on 2 ranks, EP 2 x DP 2 on 4: (ep, dp)."""
    return (1, 2) if world_size == 2 else (2, 2)


def _fresh_grid(ep: int, dp: int):
    """(ep_group, dp_group) of this rank, new groups (rank = d * EP + i): a DeviceMesh dim that spans every
    rank would be the pool's own WORLD group, which this test must not poison."""
    ep_group, _ = dist.new_subgroups_by_enumeration([list(range(d * ep, (d + 1) * ep)) for d in range(dp)])
    dp_group, _ = dist.new_subgroups_by_enumeration([list(range(i, ep * dp, ep)) for i in range(ep)])
    return ep_group, dp_group


def _rank_replicas_on_poisoned_group(rank, world_size):
    ep_group, dp_group = _fresh_grid(*_grid(world_size))
    model = TinyMoENet(make_cfg(), seed=SEED, ep_group=ep_group, dp_group=dp_group, timeout=TIMEOUT)
    verdict = dist.new_group(list(range(world_size)))  # poisoned below on some ranks: not the pool's WORLD
    assert parallel.check_expert_replicas(model, group=verdict) == 1  # healthy: checked
    if rank == 0:  # as a timed-out expert-gradient all_reduce over the DP group leaves it
        poison(model.moe.dp_group, "the expert gradient all_reduce over the data-parallel group timed out")
    t0 = time.perf_counter()
    got = outcome_of(lambda: parallel.check_expert_replicas(model, group=verdict))
    return got, time.perf_counter() - t0


@pytest.mark.multirank
@pytest.mark.nccl_rules_exempt("the poisoned rank issues nothing on purpose; the rules' side check would wait for it")
@pytest.mark.parametrize("world_size", [2, 4])
def test_check_expert_replicas_honours_a_poisoned_group(ranks, world_size):
    res = ranks(world_size).run(_rank_replicas_on_poisoned_group, timeout=60)
    got, elapsed = res[0]
    assert got.startswith("CollectiveError:") and "timed out" in got and "rebuild" in got, got
    assert elapsed < 0.5, elapsed  # at once: nothing issued on the poisoned group
    for rank, (got, elapsed) in enumerate(res[1:], start=1):
        assert got.startswith("CollectiveError:") and "rebuild" in got, (rank, got)
        assert elapsed < TIMEOUT + 4.0, (rank, elapsed)  # the layers' timeout, not the group's 60 s


def _rank_no_sync_alone(rank, world_size, ep, dp):
    groups = {} if dp == 1 else {"ep_group": grid(ep, dp)}
    model = TinyMoENet(make_cfg(), seed=SEED, timeout=30.0, **groups)
    ddp = parallel.wrap_ddp(model)
    if rank == world_size - 1:  # accumulates alone: its peers would wait in the gradient all_reduce
        with ddp.no_sync():
            first = outcome_of(lambda: rank_loss(ddp, *batch(rank, step=1)).backward())
    else:
        first = outcome_of(lambda: rank_loss(ddp, *batch(rank, step=1)).backward())
    for p in ddp.parameters():
        p.grad = None
    rank_loss(ddp, *batch(rank, step=0)).backward()  # every rank alike: works
    return first, local_grads(ddp)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,ep,dp", [(2, 2, 1), (4, 2, 2)])
def test_no_sync_on_one_rank_raises_on_every_rank(ranks, world_size, ep, dp):
    res = ranks(world_size).run(_rank_no_sync_alone, ep, dp, timeout=90)
    bad = world_size - 1
    for rank, (first, _) in enumerate(res):
        assert first.startswith("ValueError:"), (rank, first)
        assert f"gradient synchronised on ranks {list(range(bad))}" in first, (rank, first)
        assert "NOT synchronised (inside ddp.no_sync()" in first and f"on ranks [{bad}]" in first, (rank, first)
    compare_to_reference([g for _, g in res], reference_grads(make_cfg(), SEED, world_size), ep)


def _rank_raises_before_the_layer_and_goes_on(rank, world_size):
    """wrap_ddp, set_step at every step; at step 1 rank 1's input has the wrong width, so the model's first Linear
    raises there, before any MoE layer; that rank catches it and goes on to step 2. Nothing outside the layers'
    exchanges may block in a forward (DDP's broadcast of the layers' buffers, a blocking gradient-sync check):
    rank 1 would wait there for peers that wait for it in step 1's exchange."""
    import moe_comm

    model = TinyMoENet(make_cfg(), seed=SEED, timeout=5.0)
    ddp = parallel.wrap_ddp(model)
    got = []
    try:
        for step in range(2 + rank):  # rank 1 is a step ahead from step 1 on: its step 2 meets rank 0's step 1
            moe_comm.set_step(step)
            x, y = batch(rank, step)
            if step == 1 and rank == 1:
                x = torch.cat([x, x[:, :1]], 1)  # H + 1 columns
            t0 = time.perf_counter()
            got.append((outcome_of(lambda: rank_loss(ddp, x, y).backward()), time.perf_counter() - t0))
    finally:
        moe_comm.set_step(None)
        ddp._moe_expert_reducer.remove()
    return got


@pytest.mark.multirank
@pytest.mark.nccl_rules_exempt("rank 1 goes out of step on purpose (it raised before the layer and went on): the "
                               "layers' exchange names it; the gradient-sync check is a gloo group on the host")
def test_a_rank_raising_before_the_layer_is_named_at_once_under_wrap_ddp(ranks):
    pool = ranks(2)
    try:
        (first0,), (first1, second1) = [g[1:] for g in pool.run(_rank_raises_before_the_layer_and_goes_on, timeout=60)]
    finally:
        pool.close(kill=True)  # its ranks are out of step on purpose (a gradient-sync check left open): a fresh pool
    assert first1[0].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied"), first1
    for got, elapsed in (first0, second1):  # step 1 of rank 0 meets step 2 of rank 1: named at once
        assert got.startswith("ProtocolError:") and "step 1 on ranks [0], step 2 on ranks [1]" in got, got
        assert elapsed < 4.0, elapsed  # not the layers' 5 s timeout


def _rank_backward_fails_then_recover(rank, world_size):
    """wrap_ddp, EP 2: rank 1's expert weight hook raises in step 1's backward; every rank raises there. Without
    recover_ddp DDP refuses the next forward; with it, the next step's gradients equal the reference's."""
    model = TinyMoENet(make_cfg(), seed=SEED, timeout=30.0)
    ddp = parallel.wrap_ddp(model)
    hook = None
    if rank == 1:
        def boom(grad):
            raise RuntimeError("my expert weight hook failed")
        hook = model.moe.experts.w1.register_hook(boom)
    failed = outcome_of(lambda: rank_loss(ddp, *batch(rank, step=1)).backward())
    if hook is not None:
        hook.remove()
    parallel.recover_ddp(ddp)
    for p in ddp.parameters():
        p.grad = None
    rank_loss(ddp, *batch(rank, step=0)).backward()
    grads = local_grads(ddp)
    ddp._moe_expert_reducer.remove()
    return failed, grads


@pytest.mark.multirank
def test_recover_ddp_after_a_backward_that_raised_on_every_rank(ranks):
    res = ranks(2).run(_rank_backward_fails_then_recover, timeout=90)
    assert res[1][0].startswith("RuntimeError: my expert weight hook failed"), res[1][0]
    assert res[0][0].startswith("PeerFailed:") and "EP rank(s) [1]" in res[0][0], res[0][0]
    compare_to_reference([g for _, g in res], reference_grads(make_cfg(), SEED, 2), 2)


def test_recover_ddp_names_what_it_needs():
    with pytest.raises(TypeError, match="recover_ddp: ddp must be the module wrap_ddp returned, got Linear"):
        parallel.recover_ddp(torch.nn.Linear(2, 2))
