"""Tier 2 (multi-rank gloo): torch.distributed.checkpoint with MoELayers, across EP sizes.

``get_state_dict(model, optimizer)`` -> ``dcp.save`` at one EP x DP grid, then ``get_state_dict`` ->
``dcp.load`` -> ``set_state_dict`` at another: every expert's weights and Adam state (exp_avg,
exp_avg_sq, step) and the replicated weights must come back bit-identical, no rank's file may hold every
expert (nothing is gathered), and training continues with the same loss as without the round trip.
Also: EP = 1 in one process, a DDP-wrapped model, and ``full_state_dict`` on EP rank 0 only.
"""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

from moe_comm import parallel
from moe_comm.modules.checkpoint import full_state_dict

from ep_dp_model import E, TinyMoENet, batch, grid, make_cfg, rank_loss

SEED = 21


def _build(ep: int, dp: int, seed: int = SEED, wrap: bool = False):
    kwargs = {} if dp == 1 and ep == dist.get_world_size() else {"ep_group": grid(ep, dp)}
    model = TinyMoENet(make_cfg(), seed=seed, **kwargs)
    net = parallel.wrap_ddp(model) if wrap else model
    return model, net, torch.optim.Adam(net.parameters(), lr=1e-2)


def _train(rank, net, opt, steps, first_step=0):
    losses = []
    for step in range(first_step, first_step + steps):
        loss = rank_loss(net, *batch(rank, step))
        loss.backward()
        if not isinstance(net, torch.nn.parallel.DistributedDataParallel):  # one rank of EP only: sum by hand
            for name, p in net.named_parameters():
                if ".experts." not in name and dist.get_world_size() > 1 and p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
                elif p.grad is not None and dist.get_world_size() > 1:
                    p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _by_expert(model, opt):
    """{expert id: (w1, w3, w2, exp_avg of w1, exp_avg_sq of w2, step)} of this rank, and the replicated weights."""
    ex, out = model.moe.experts, {}
    for i, g in enumerate(model.moe.local_expert_ids):
        st1, st2 = opt.state[ex.w1], opt.state[ex.w2]
        out[g] = tuple(t.detach().clone() for t in (ex.w1[i], ex.w3[i], ex.w2[i], st1["exp_avg"][i],
                                                       st2["exp_avg_sq"][i], st1["step"]))
    rep = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." not in n}
    return out, rep


def _rank_save(rank, world_size, path, ep, dp):
    model, net, opt = _build(ep, dp, wrap=dp > 1)
    _train(rank, net, opt, 2)
    msd, osd = get_state_dict(net, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    experts, rep = _by_expert(model, opt)
    next_loss = _train(rank, net, opt, 1, first_step=2)  # what the next step gives without a round trip
    return experts, rep, next_loss


def _rank_load(rank, world_size, path, ep, dp):
    model, net, opt = _build(ep, dp, seed=SEED + 100, wrap=dp > 1)  # other weights: the load must replace them
    msd, osd = get_state_dict(net, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    # set_state_dict takes the unwrapped model (DCP would look for a whole "experts.w1" key under DDP).
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    experts, rep = _by_expert(model, opt)
    return experts, rep


def _check_same(saved, loaded):
    saved_experts = {g: v for experts, _, _ in saved for g, v in experts.items()}
    assert sorted(saved_experts) == list(range(E))
    for experts, rep in loaded:
        assert experts, "a rank got no experts"
        for g, got in experts.items():
            for a, b in zip(got, saved_experts[g]):
                assert torch.equal(a, b), f"expert {g} differs after the round trip"
        for name, t in rep.items():
            assert torch.equal(t, saved[0][1][name]), name


def _files_hold_no_rank_with_every_expert(path):
    """From the checkpoint's metadata: every expert weight is stored once, in the file of a rank holding
    it, and no file holds every expert (nothing was gathered to one rank)."""
    storage = dcp.FileSystemReader(path).read_metadata().storage_data
    files_of = {}
    for index, info in storage.items():
        if index.fqn.startswith("model.moe.experts.w1."):
            files_of.setdefault(int(index.fqn.rsplit(".", 1)[1]), []).append(info.relative_path)
    assert sorted(files_of) == list(range(E)) and all(len(f) == 1 for f in files_of.values()), files_of
    experts_by_file = {}
    for g, (f,) in files_of.items():
        experts_by_file.setdefault(f, []).append(g)
    assert len(experts_by_file) > 1 and max(len(v) for v in experts_by_file.values()) < E, experts_by_file


@pytest.mark.multirank
def test_dcp_save_at_ep2_dp2_loads_at_ep4_and_ep1_dp4(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = ranks(4).run(_rank_save, path, 2, 2)
    _files_hold_no_rank_with_every_expert(path)
    _check_same(saved, ranks(4).run(_rank_load, path, 4, 1))
    _check_same(saved, ranks(4).run(_rank_load, path, 1, 4))


@pytest.mark.multirank
def test_dcp_save_at_ep2_loads_at_ep1_dp2(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = ranks(2).run(_rank_save, path, 2, 1)
    _check_same(saved, ranks(2).run(_rank_load, path, 1, 2))


def _rank_resume(rank, world_size, path, ep, dp):
    model, net, opt = _build(ep, dp, seed=SEED + 100, wrap=dp > 1)
    msd, osd = get_state_dict(net, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    return _train(rank, net, opt, 1, first_step=2)


@pytest.mark.multirank
def test_training_continues_after_resharding(ranks, tmp_path):
    """Step 3 after loading the EP 2 x DP 2 checkpoint at EP 4 gives each rank the loss it had without the
    round trip (to fp32 rounding: other EP sizes sum in another order)."""
    path = str(tmp_path / "ckpt")
    saved = ranks(4).run(_rank_save, path, 2, 2)
    resumed = ranks(4).run(_rank_resume, path, 4, 1)
    for (_, _, want), got in zip(saved, resumed):
        assert got == pytest.approx(want, rel=1e-5)


def test_get_state_dict_at_ep1_in_one_process():
    """Tier 1: the issue's AttributeError ('Parameter' object has no attribute '0') at EP = 1."""
    model = TinyMoENet(make_cfg(), seed=SEED)
    opt = torch.optim.Adam(model.parameters())
    rank_loss(model, *batch(0)).backward()
    opt.step()
    assert sorted(k for k in get_model_state_dict(model) if k.startswith("moe.experts.w1.")) == \
        [f"moe.experts.w1.{g}" for g in range(E)]
    msd, osd = get_state_dict(model, opt)
    assert sorted(osd["state"]["moe.experts.w3"]) == [str(g) for g in range(E)]
    assert osd["state"]["moe.experts.w3"]["5"]["exp_avg"].shape == (24, 16)
    fresh = TinyMoENet(make_cfg(), seed=SEED + 1)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    assert torch.equal(fresh.moe.experts.w2, model.moe.experts.w2)
    got, want = fresh_opt.state[fresh.moe.experts.w2], opt.state[model.moe.experts.w2]
    assert torch.equal(got["exp_avg_sq"], want["exp_avg_sq"]) and torch.equal(got["step"], want["step"])


def _rank_full(rank, world_size, rank0_only):
    model, _, _ = _build(world_size, 1)
    sd = full_state_dict(model, rank0_only=rank0_only)
    return sorted(sd), {k: v for k, v in sd.items() if k.startswith("moe.experts.w1.")}


@pytest.mark.multirank
def test_full_state_dict_lands_on_ep_rank0_only(ranks):
    full = ranks(4).run(_rank_full, True)
    assert [k for k in full[0][0] if k.startswith("moe.experts.w1.")] == [f"moe.experts.w1.{g}" for g in range(E)]
    assert all(keys == [] for keys, _ in full[1:])
    everywhere = ranks(4).run(_rank_full, False)
    ref = TinyMoENet(make_cfg(), seed=SEED).moe.experts.w1
    for keys, w1 in everywhere:
        assert keys == full[0][0]
        for g in range(E):
            key = f"moe.experts.w1.{g}"
            assert torch.equal(w1[key], ref[g]) and torch.equal(full[0][1][key], ref[g])
