"""``fully_shard_moe`` given a 2-D mesh whose EP dim is not the layers' EP group (issue #29.7).

Tier 2 (4 gloo ranks). A layer built on WORLD (EP 4) next to a ('dp', 'ep') = (2, 2) mesh used to run as EP 4
without a word; now every rank raises ValueError naming the layer's EP group, the mesh's EP groups and how to
build the layer on the mesh, before anything is sharded (the group stays usable). An unnamed 2-D mesh is read
as FSDP2 reads it (dim 1 sharded: the EP dim). A layer built on the mesh passes.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_comm.parallel import fully_shard_moe

from ep_dp_model import TinyMoENet, batch, grid, make_cfg
from outcome import outcome_of


def _rank_mesh_mismatch(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    named = grid(2, 2)
    out = {
        "named": outcome_of(lambda: fully_shard_moe(TinyMoENet(make_cfg()), named)),
        "unnamed": outcome_of(lambda: fully_shard_moe(TinyMoENet(make_cfg()), init_device_mesh("cpu", (2, 2)))),
        # a layer on the mesh's EP dim but without its DP group: the EP x DP tiling check names it
        "no_dp": outcome_of(lambda: fully_shard_moe(TinyMoENet(make_cfg(), ep_group=named["ep"]), named)),
    }
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)  # the group still pairs collectives
    model = fully_shard_moe(TinyMoENet(make_cfg(), ep_group=named), named)
    x, _ = batch(rank)
    y, _ = model(x)
    out["on_mesh"] = (model.moe.world_size, bool(torch.isfinite(y).all()))
    out["sum"] = float(t)
    return out


@pytest.mark.multirank
def test_layer_on_world_next_to_a_2d_mesh_raises_on_every_rank(ranks):
    res = ranks(4).run(_rank_mesh_mismatch, timeout=180)
    for rank, out in enumerate(res):
        named, unnamed = out["named"], out["unnamed"]
        assert named.startswith("ValueError: fully_shard_moe: MoELayer 'moe' was built on EP group [0, 1, 2, 3] "
                                "(EP 4, DP 1)"), (rank, named)
        assert "the mesh's EP dim 'ep' groups the ranks as [[0, 1], [2, 3]] (EP 2, DP 2 over dim 'dp')" in named
        assert "the layer would run as EP 4 instead" in named and "MoELayer(cfg, ep_group=mesh)" in named, named
        assert "rejected their arguments, every rank raised" in named, named  # every rank raised in the agreement
        assert "the mesh's EP dim 1 (unnamed) groups the ranks as [[0, 1], [2, 3]]" in unnamed, (rank, unnamed)
        assert "EP size 2 x DP size 1 = 2 ranks" in out["no_dp"], (rank, out["no_dp"])
        assert out["on_mesh"] == (2, True) and out["sum"] == 6.0, (rank, out)

