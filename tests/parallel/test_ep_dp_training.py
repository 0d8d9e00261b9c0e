"""Tier 2 (multi-rank gloo): EP x DP training with moe_comm.parallel.

The one-process reference is the same model with every expert, its gradient the mean over the N ranks of
each rank's loss on its own batch. DDP (``wrap_ddp``) and FSDP2 (``fully_shard_moe``) over EP 2 x DP 2
(4 ranks) and EP 2 x DP 1 / EP 1 x DP 2 (2 ranks) must reproduce it: replicated gradients averaged over
N, expert gradients summed over the DP group and divided by N. Plain DDP / fully_shard over ranks that
hold different experts must raise on every rank. ``check_expert_replicas`` must name diverged replicas.
Load statistics (monitor, aux-loss-free bias) must count the global batch, identical on every rank.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

import moe_comm
from moe_comm import parallel
from moe_comm.routing import count_tokens

from ep_dp_model import (E, TinyMoENet, batch, compare_to_reference, grid, local_grads, make_cfg, rank_loss,
                         reference_grads)

SEED = 11


def _layer_groups(ep: int, dp: int) -> dict:
    """MoELayer kwargs for an EP x DP grid over the pool (the 2-D mesh; EP = world: no mesh needed)."""
    return {} if dp == 1 and ep == dist.get_world_size() else {"ep_group": grid(ep, dp)}


def _rank_ddp_step(rank, world_size, ep, dp, accumulate):
    model = TinyMoENet(make_cfg(), seed=SEED, **_layer_groups(ep, dp))
    ddp = parallel.wrap_ddp(model)
    if accumulate:  # two micro-batches, the first under no_sync: the sum of both gradients, reduced once
        with ddp.no_sync():
            rank_loss(ddp, *batch(rank, step=0)).backward()
        rank_loss(ddp, *batch(rank, step=1)).backward()
    else:
        rank_loss(ddp, *batch(rank, step=0)).backward()
    return local_grads(ddp)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,ep,dp", [(4, 2, 2), (2, 2, 1), (2, 1, 2), (4, 4, 1)])
def test_wrap_ddp_matches_one_process_reference(ranks, world_size, ep, dp):
    grads = ranks(world_size).run(_rank_ddp_step, ep, dp, False)
    compare_to_reference(grads, reference_grads(make_cfg(), SEED, world_size), ep)


@pytest.mark.multirank
def test_wrap_ddp_gradient_accumulation_reduces_once(ranks):
    grads = ranks(4).run(_rank_ddp_step, 2, 2, True)
    ref0, ref1 = reference_grads(make_cfg(), SEED, 4, step=0), reference_grads(make_cfg(), SEED, 4, step=1)
    compare_to_reference(grads, {k: ref0[k] + ref1[k] for k in ref0}, 2)


def _rank_fsdp_step(rank, world_size, ep, dp, mesh_kind):
    from torch.distributed.device_mesh import init_device_mesh
    mesh2d = grid(ep, dp)
    model = TinyMoENet(make_cfg(), seed=SEED, ep_group=mesh2d)
    mesh = mesh2d if mesh_kind == "2d" else init_device_mesh("cpu", (world_size,))
    parallel.fully_shard_moe(model, mesh)
    experts_plain = all(not hasattr(p, "full_tensor") for _, p in parallel.expert_parameters(model))
    others_dtensor = all(hasattr(p, "full_tensor") for n, p in model.named_parameters() if ".experts." not in n)
    rank_loss(model, *batch(rank, step=0)).backward()
    return local_grads(model), experts_plain, others_dtensor


@pytest.mark.multirank
@pytest.mark.parametrize("mesh_kind", ["1d", "2d"])
def test_fully_shard_moe_matches_one_process_reference(ranks, mesh_kind):
    """FSDP2 runs on CPU gloo here (torch 2.13): replicated parameters become DTensors sharded over the
    mesh (1-D: FSDP over 4 ranks; the ('dp', 'ep') mesh: HSDP), the experts stay plain tensors."""
    results = ranks(4).run(_rank_fsdp_step, 2, 2, mesh_kind)
    assert all(plain and dtensor for _, plain, dtensor in results)
    compare_to_reference([g for g, _, _ in results], reference_grads(make_cfg(), SEED, 4), 2)


def _rank_fsdp_accumulate(rank, world_size):
    model = TinyMoENet(make_cfg(), seed=SEED, ep_group=grid(2, 2))
    parallel.fully_shard_moe(model, grid(2, 2))
    model.set_requires_gradient_sync(False)  # first micro-batch: no reduction (FSDP2's nor the experts')
    rank_loss(model, *batch(rank, step=0)).backward()
    model.set_requires_gradient_sync(True)
    rank_loss(model, *batch(rank, step=1)).backward()
    return local_grads(model)


@pytest.mark.multirank
def test_fully_shard_moe_gradient_accumulation_reduces_once(ranks):
    grads = ranks(4).run(_rank_fsdp_accumulate)
    ref0, ref1 = reference_grads(make_cfg(), SEED, 4, step=0), reference_grads(make_cfg(), SEED, 4, step=1)
    compare_to_reference(grads, {k: ref0[k] + ref1[k] for k in ref0}, 2)


def _rank_plain_wrapper(rank, world_size, kind):
    model = TinyMoENet(make_cfg(), seed=SEED)  # EP = world: every rank holds other experts
    before = model.moe.experts.w1.detach().clone()
    if kind == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        wrapped = fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    overwritten = not torch.equal(before, model.moe.experts.w1.detach()) if kind == "ddp" else None
    with pytest.raises(RuntimeError) as info:
        rank_loss(wrapped, *batch(rank))
    return str(info.value), overwritten


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_plain_wrapper_over_ep_ranks_raises_on_every_rank(ranks, kind):
    results = ranks(2).run(_rank_plain_wrapper, kind)
    own, peer = results[0][0], results[1][0]
    name = "DistributedDataParallel" if kind == "ddp" else "fully_shard (FSDP2)"
    for msg in (own, peer):
        assert name in msg and "ranks [0, 1]" in msg and "moe_comm.parallel.wrap_ddp" in msg, msg
    if kind == "ddp":  # what the check is for: DDP's broadcast replaced rank 1's experts with rank 0's
        assert results[1][1] is True and results[0][1] is False


def _rank_grid_mismatch(rank, world_size):
    model = TinyMoENet(make_cfg(), seed=SEED, ep_group=grid(2, 2)["ep"])  # no dp_group: EP 2 x DP 1 != 4
    with pytest.raises(ValueError) as info:
        parallel.wrap_ddp(model)
    return str(info.value)


@pytest.mark.multirank
def test_wrap_ddp_rejects_layers_without_their_dp_group(ranks):
    for msg in ranks(4).run(_rank_grid_mismatch):
        assert "EP size 2 x DP size 1 = 2 ranks" in msg and "dp_group" in msg, msg


def _rank_replicas(rank, world_size, corrupt):
    model = TinyMoENet(make_cfg(), seed=SEED, ep_group=grid(2, 2))
    ddp = parallel.wrap_ddp(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(2):
        rank_loss(ddp, *batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()
    if corrupt and rank == 3:
        with torch.no_grad():
            model.moe.experts.w2[0, 1, 2] += 1e-6
    try:
        return parallel.check_expert_replicas(ddp), None
    except ValueError as err:
        return None, f"{type(err).__name__}: {err}"


@pytest.mark.multirank
def test_check_expert_replicas(ranks):
    """After two steps through wrap_ddp the DP replicas are bit-identical; a one-ulp change on rank 3 is
    named (layer, weight, ranks) on every rank."""
    assert ranks(4).run(_rank_replicas, False) == [(1, None)] * 4
    results = ranks(4).run(_rank_replicas, True)
    assert all(n is None for n, _ in results)
    for r in (1, 3):  # the DP group of the corrupted replica finds it
        own = results[r][1]
        assert own.startswith("ValueError") and "layer 'module.moe' (experts [4, 5, 6, 7])" in own, own
        assert "experts.w2 differs between ranks [1] and ranks [3]" in own, own
    for r in (0, 2):  # the other DP group raises too, naming the ranks that found it
        assert results[r][1].startswith("RemoteError") and "[1, 3]" in results[r][1], results[r][1]


def _rank_global_load(rank, world_size, ep, dp, rate, monitor):
    model = TinyMoENet(make_cfg(), seed=SEED, bias_update_rate=rate, monitor=monitor, **_layer_groups(ep, dp))
    x, _ = batch(rank, tokens=10 + 3 * rank)  # uneven batches
    model(x)
    model.moe.finish_bias_update()
    totals = model.moe.monitor.summary()["total"]["tokens_per_expert"] if monitor else None
    return totals, model.moe.router.expert_bias.clone()


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,ep,dp,monitor", [(4, 2, 2, True), (4, 2, 2, False), (2, 1, 2, True)])
def test_load_statistics_count_the_global_batch(ranks, world_size, ep, dp, monitor):
    """Monitor totals and the aux-loss-free bias step come from the tokens of all N ranks, identical on
    every rank (before: the EP group's tokens only, and a bias that drifted apart across DP replicas).
    monitor=False: the bias update's own reduction (``reduce_counts``)."""
    rate = 1e-3
    results = ranks(world_size).run(_rank_global_load, ep, dp, rate, monitor)
    ref = TinyMoENet(make_cfg(), seed=SEED)
    counts = torch.zeros(E, dtype=torch.int64)
    for r in range(world_size):
        x, _ = batch(r, tokens=10 + 3 * r)
        routing = ref.moe.router(ref.inp(x))
        counts += count_tokens(routing.topk_idx_TK, E)[0]
    want_bias = torch.sign(counts.double().mean() - counts.double()).float() * rate
    assert sum(counts.tolist()) == sum(10 + 3 * r for r in range(world_size)) * 2  # every token, K = 2
    for totals, bias in results:
        assert totals == (counts.tolist() if monitor else None)
        assert torch.equal(bias, want_bias)


def _rank_host_reads(rank, world_size):
    from moe_comm.testing.syncs import HostSyncs

    def _forward_syncs(layer, x):
        with HostSyncs() as syncs:
            layer(x)
        return [f"{e.what} at {os.path.basename(e.file)}: {e.source}" for e in syncs.events]

    x, _ = batch(rank, tokens=20)
    plain = moe_comm.MoELayer(make_cfg(), seed=1, monitor=False, end_check="deferred", ep_group=grid(2, 2))
    full = moe_comm.MoELayer(make_cfg(), seed=1, monitor=True, bias_update_rate=0.01, end_check="deferred",
                             ep_group=grid(2, 2))
    return [(_forward_syncs(plain, x), _forward_syncs(full, x)) for _ in range(2)]


@pytest.mark.multirank
def test_global_load_adds_no_host_sync(ranks):
    """EP 2 x DP 2: the chained EP then DP reduction of the load adds no host read to the forward (the
    dispatcher's counts read stays its one)."""
    for report in ranks(4).run(_rank_host_reads):
        for off, on in report:
            assert on == off and len(on) == 1 and "the phase's one read" in on[0], (on, off)


def _rank_clip(rank, world_size, ep, dp, max_norm):
    model = TinyMoENet(make_cfg(), seed=SEED, **_layer_groups(ep, dp))
    ddp = parallel.wrap_ddp(model)
    rank_loss(ddp, *batch(rank)).backward()
    total = parallel.clip_grad_norm_(ddp, max_norm)
    grads = local_grads(ddp)
    ddp._moe_expert_reducer.remove()
    return float(total), grads


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,ep,dp", [(2, 2, 1), (4, 2, 2)])
def test_clip_grad_norm_is_the_whole_models_on_every_rank(ranks, world_size, ep, dp):
    """The norm of every gradient of the one-process model (each expert once), and every rank's gradients
    scaled by the same factor: torch's own clip would see this rank's experts only, and scale the replicated
    gradients differently on every rank."""
    ref = reference_grads(make_cfg(), SEED, world_size)
    want = math.sqrt(sum(float(g.double().square().sum()) for g in ref.values()))
    max_norm = want / 4
    res = ranks(world_size).run(_rank_clip, ep, dp, max_norm)
    for total, _ in res:
        assert total == pytest.approx(want, rel=1e-6), (total, want)
    scale = max_norm / (want + 1e-6)
    compare_to_reference([g for _, g in res], {k: v * scale for k, v in ref.items()}, ep)
