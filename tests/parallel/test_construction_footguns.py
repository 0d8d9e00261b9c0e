"""Building layers: no silent single-process runs, DeviceMesh groups, meta-device construction, deepcopy,
and the README's aux-loss snippet.

Tier 1 (pure logic, one process): the torchrun environment check, meta construction, deepcopy, the README
snippet. Tier 2 (gloo ranks): a 1-D / 2-D DeviceMesh as ep_group, meta construction + to_empty +
reset_parameters, deepcopy, on 2 and 4 ranks.
"""
from __future__ import annotations

import copy
import os
import re

import pytest
import torch
import torch.distributed as dist

import moe_comm

from ep_dp_model import E, batch, grid, make_cfg

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------------------------------- tier 1
def test_launched_rank_without_process_group_raises(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"launched as rank 1 of WORLD_SIZE=4.*init_process_group"):
        moe_comm.MoELayer(make_cfg())
    layer = moe_comm.MoELayer(make_cfg(), allow_single_process=True)
    assert layer.world_size == 1 and layer.experts.w1.shape[0] == E
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun with one process: nothing to forget
    assert moe_comm.MoELayer(make_cfg()).world_size == 1
    with pytest.raises(TypeError, match="allow_single_process must be a bool"):
        moe_comm.MoELayer(make_cfg(), allow_single_process=1)


def test_meta_construction_then_to_empty_and_reset_parameters():
    cfg = make_cfg(num_shared_experts=1, shared_ffn_hidden_size=8, shared_expert_gate=True)
    eager = moe_comm.MoELayer(cfg, seed=5, bias_update_rate=1e-3)
    with torch.device("meta"):
        lazy = moe_comm.MoELayer(cfg, seed=5, bias_update_rate=1e-3)
    assert lazy.experts.w1.is_meta and lazy.router.weight.is_meta
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()
    for (k, a), b in zip(eager.state_dict().items(), lazy.state_dict().values()):
        assert torch.equal(a, b), k
    x, _ = batch(0)
    assert torch.equal(eager(x), lazy(x))


def test_deepcopy_in_one_process():
    layer = moe_comm.MoELayer(make_cfg(), seed=4)
    twin = copy.deepcopy(layer)
    assert twin.experts.w1 is not layer.experts.w1 and torch.equal(twin.experts.w1, layer.experts.w1)
    x, _ = batch(0)
    assert torch.equal(twin(x), layer(x))


def test_readme_snippet_sets_an_aux_coefficient_and_runs():
    """The README's "Using it" snippet adds layer.aux_loss to the loss: its config must give it a weight
    (the default 0 made it -0.), and the snippet must run as written (x of its hidden size)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "layer.aux_loss" in b)
    coeff = re.search(r"aux_loss_coeff=([0-9.e-]+)", block)
    assert coeff and float(coeff.group(1)) > 0, block
    hidden = int(re.search(r"hidden_size=(\d+)", block).group(1))
    scope = {"x": torch.randn(6, hidden)}
    exec(block, scope)  # noqa: S102 -- the README's own code
    assert float(scope["layer"].aux_loss.detach()) > 0 and scope["layer"].experts.w1.grad is not None


# ------------------------------------------------------------------------------------------- tier 2
def _rank_mesh(rank, world_size, ep, dp):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = grid(ep, dp) if dp > 1 else init_device_mesh("cpu", (world_size,))
    layer = moe_comm.MoELayer(make_cfg(), ep_group=mesh, seed=2)
    x, _ = batch(rank)
    y = layer(x).detach()
    out = {"ep": layer.world_size, "dp": layer.dp_group.size() if layer.dp_group is not None else 1,
           "experts": layer.local_expert_ids, "y": y}
    if dp == 1:  # the same layer on the plain process group gives the same output
        out["same_as_group"] = torch.equal(y, moe_comm.MoELayer(make_cfg(), ep_group=dist.group.WORLD, seed=2)(x))
    with pytest.raises(ValueError, match="mesh_dim_names"):
        moe_comm.MoELayer(make_cfg(), ep_group=init_device_mesh("cpu", (world_size // 2 or 1, 2)))
    if dp > 1:
        with pytest.raises(ValueError, match="dp_group must then be None"):
            moe_comm.MoELayer(make_cfg(), ep_group=mesh, dp_group=mesh["dp"])
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,ep,dp", [(2, 2, 1), (4, 2, 2)])
def test_device_mesh_as_ep_group(ranks, world_size, ep, dp):
    res = ranks(world_size).run(_rank_mesh, ep, dp)
    e = E // ep
    for rank, r in enumerate(res):
        assert (r["ep"], r["dp"]) == (ep, dp)
        assert r["experts"] == list(range((rank % ep) * e, (rank % ep + 1) * e))
        assert r.get("same_as_group", True)


def _rank_meta(rank, world_size):
    cfg = make_cfg()
    eager = moe_comm.MoELayer(cfg, seed=8)
    with torch.device("meta"):
        lazy = moe_comm.MoELayer(cfg, seed=8)
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()  # collective: re-initialises and broadcasts the router
    same = all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), lazy.state_dict().values()))
    x, _ = batch(rank)
    return same, torch.equal(eager(x), lazy(x)), lazy.router.weight.detach().clone()


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_meta_construction_on_ranks(ranks, world_size):
    res = ranks(world_size).run(_rank_meta)
    assert all(same and out for same, out, _ in res)
    assert all(torch.equal(r[2], res[0][2]) for r in res)


def _rank_deepcopy(rank, world_size):
    layer = moe_comm.MoELayer(make_cfg(), seed=6, bias_update_rate=1e-3)
    twin = copy.deepcopy(layer)
    x, _ = batch(rank)
    y, y_twin = layer(x), twin(x)
    y_twin.sum().backward()
    return (twin.ep_group is layer.ep_group, twin.experts.w1 is not layer.experts.w1, torch.equal(y, y_twin),
            twin.experts.w1.grad is not None and layer.experts.w1.grad is None)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_deepcopy_shares_the_group_and_runs(ranks, world_size):
    assert ranks(world_size).run(_rank_deepcopy) == [(True, True, True, True)] * world_size
