"""Tier 1 and 2: where a call's tensors live, checked on CPU for what a CUDA run would hit (the CUDA review of
issue #26). ``meta`` stands in for a device other than the group's: a gloo group exchanges on the CPU while
the rows may be on CUDA; an NCCL group takes CUDA tensors while a layer may be built on the CPU.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import moe_comm
from moe_comm.comm.wire import Phase
from moe_comm.modules import layer as layer_mod


def _rank_plan_devices(rank, world_size):
    """The chunk plans of a real W-rank exchange, built for rows on another device than the exchange's:
    every count and index tensor the kernels and experts read is on the rows' device."""
    E, C = 2 * world_size, 2
    d = moe_comm.Dispatcher(num_experts=E)
    g = torch.Generator().manual_seed(rank)
    x, idx = torch.randn(9, 4, generator=g), torch.rand(9, E, generator=g).argsort(1)[:, :2]
    pending, layout = d._open(Phase.FORWARD, x, idx, C)
    sent, rows = d.channel.end(pending)
    meta_layout = dataclasses.replace(layout, dest_row_TK=layout.dest_row_TK.to("meta"))
    handle = d._plan(pending, sent, rows, meta_layout, C, 4, 1, None)
    devices = set()
    for p in handle.chunks:
        devices |= {t.device.type for t in (p.tokens_per_expert_e, p.expert_index_R, p.source_index_R)
                    if t is not None}
    return devices, handle.chunks[0].expert_index_R is not None


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_plan_tensors_live_on_the_rows_device(ranks, world_size):
    for devices, regrouped in ranks(world_size).run(_rank_plan_devices):
        assert regrouped and devices == {"meta"}, devices


def test_router_broadcast_runs_on_the_groups_device(monkeypatch):
    """An NCCL group takes its tensors on the current CUDA device: a layer built on the CPU broadcasts its
    replicated weights there and copies them back (before the fix: dist.broadcast got the CPU tensor)."""
    seen = []

    def broadcast(t, src, group):
        seen.append(t.device.type)
        t.fill_(0.5)  # what "rank 0" sent

    monkeypatch.setattr(layer_mod, "group_device", lambda group: torch.device("meta"))
    monkeypatch.setattr(layer_mod.dist, "broadcast", broadcast)
    w = torch.randn(4, 3)
    with pytest.raises(NotImplementedError, match="meta"):  # the copy back (meta holds no data to copy)
        layer_mod._broadcast(w, 0, None)
    assert seen == ["meta"]  # issued on the group's device, not on the weight's
    monkeypatch.setattr(layer_mod, "group_device", lambda group: torch.device("cpu"))
    layer_mod._broadcast(w, 0, None)
    assert seen == ["meta", "cpu"] and bool((w == 0.5).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_routing_weights_are_taken_exactly(dtype):
    """fp16/bf16 routing weights pass the checks and are summed in float32 (before: accepted by the Dispatcher's
    check, rejected by unpermute after every transfer ran, on the rank that had them)."""
    d = moe_comm.Dispatcher(num_experts=4)
    g = torch.Generator().manual_seed(0)
    x, idx = torch.randn(5, 8, generator=g), torch.rand(5, 4, generator=g).argsort(1)[:, :2]
    w = torch.rand(5, 2, generator=g).to(dtype).requires_grad_(True)
    y = d(x, idx, w, lambda t, c: t * 2.0)
    torch.testing.assert_close(y, 2 * w.float().sum(1, keepdim=True) * x)
    y.sum().backward()
    assert w.grad is not None and w.grad.dtype == dtype
    o = d.dispatch(x, idx)
    torch.testing.assert_close(d.combine(o.tokens, w, o.handle), w.float().sum(1, keepdim=True) * x)


def _rank_low_precision_weights(rank, world_size):
    d = moe_comm.Dispatcher(num_experts=4)
    g = torch.Generator().manual_seed(rank)
    x, idx = torch.randn(6, 8, generator=g), torch.rand(6, 4, generator=g).argsort(1)[:, :2]
    w = torch.rand(6, 2, generator=g)
    w_in = w.to(torch.bfloat16) if rank == world_size - 1 else w  # one rank's router runs in bf16
    y = d(x, idx, w_in, lambda t, c: t)
    torch.testing.assert_close(y, w_in.float().sum(1, keepdim=True) * x)
    return dist.get_rank()


@pytest.mark.multirank
def test_low_precision_weights_on_one_rank(ranks):
    assert ranks(2).run(_rank_low_precision_weights) == [0, 1]
