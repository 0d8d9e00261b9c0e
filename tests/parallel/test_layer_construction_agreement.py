"""Tier 2 (gloo ranks, 2 and 4): MoELayer and Dispatcher constructions that one rank rejects before or outside
its argument checks, and their timeout= bounding the agreement (issue #27.3)."""
from __future__ import annotations

import time

import pytest
import torch.distributed as dist

import moe_comm

from ep_dp_model import E, make_cfg
from outcome import outcome_of


def _rank_local_rejections(rank, world_size):
    bad = world_size - 1
    me = rank == bad
    out = {
        # torch raises AssertionError (not compiled with CUDA) on this rank alone
        "device": outcome_of(lambda: moe_comm.MoELayer(make_cfg(), seed=1, device="cuda" if me else None)),
        "allow_single_process": outcome_of(lambda: moe_comm.MoELayer(make_cfg(), seed=1,
                                                                   allow_single_process=1 if me else False)),
        "dispatcher_device_free": outcome_of(lambda: moe_comm.Dispatcher(E, timeout=-1.0 if me else 5.0)),
    }
    moe_comm.MoELayer(make_cfg(), seed=1)  # every rank in step afterwards
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_rank_failing_outside_its_checks_raises_on_every_rank(ranks, world_size):
    bad = world_size - 1
    for rank, out in enumerate(ranks(world_size).run(_rank_local_rejections, timeout=90)):
        for case, needle in (("device", "CUDA"), ("allow_single_process", "allow_single_process"),
                             ("dispatcher_device_free", "timeout")):
            got = out[case]
            assert needle in got and f"[{bad}]" in got, (rank, case, got)
            assert got.startswith("RemoteError:") != (rank == bad), (rank, case, got)


def _rank_layer_timeout(rank, world_size):
    group = dist.new_group(list(range(world_size)))  # poisoned below: not the pool's WORLD
    if rank == world_size - 1:
        return "skipped", 0.0  # never builds its layer
    t0 = time.perf_counter()
    got = outcome_of(lambda: moe_comm.MoELayer(make_cfg(), group, seed=1, timeout=1.0))
    return got, time.perf_counter() - t0


@pytest.mark.multirank
@pytest.mark.nccl_rules_exempt("a rank skips the construction on purpose; the rules' side check would wait for it")
@pytest.mark.parametrize("world_size", [2, 4])
def test_moe_layer_construction_honours_its_timeout(ranks, world_size):
    for rank, (got, elapsed) in enumerate(ranks(world_size).run(_rank_layer_timeout)[:-1]):
        assert got.startswith("CollectiveError:") and "MoELayer agreement" in got, (rank, got)
        assert f"EP rank {world_size - 1} never arrived" in got, (rank, got)
        assert elapsed < 1.0 + 4.0, (rank, elapsed)
