"""Workspace: one set of scratch rows per process on CPU, none on accelerators (tier 1 and tier 2)."""
import pytest
import torch

import moe_comm
from moe_comm.dispatch.workspace import Workspace, shared_workspace


def test_rows_reuse_on_cpu_and_allocate_fresh_elsewhere():
    ws = Workspace()
    a = ws.rows("x", 4, 8, torch.empty(0))
    b = ws.rows("x", 2, 8, torch.empty(0))
    assert b.data_ptr() == a.data_ptr() and ws.nbytes() > 0  # CPU: the same touched memory again
    meta = torch.empty(0, device="meta")
    m = ws.rows("y", 4, 8, meta)
    assert m.device.type == "meta" and tuple(m.shape) == (4, 8)
    assert all(k[2].type == "cpu" for k in ws._bufs)  # nothing persistent off the CPU (caching allocator)


def _rank_layers_share(rank, world_size, num_layers):
    cfg = moe_comm.MoEConfig(hidden_size=32, ffn_hidden_size=32, num_experts=2 * world_size, top_k=2, num_chunks=2)
    shared_workspace().clear()
    layers = torch.nn.Sequential(*[moe_comm.MoELayer(cfg, seed=i) for i in range(num_layers)])
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    layers(x).sum().backward()
    assert all(layer.dispatcher.workspace is shared_workspace() for layer in layers)
    return shared_workspace().nbytes()


def _rank_dispatchers_share(rank, world_size, num):
    E = 2 * world_size
    shared_workspace().clear()
    g = torch.Generator().manual_seed(rank)
    x, idx, w = torch.randn(64, 32, generator=g), torch.rand(64, E, generator=g).argsort(1)[:, :2], torch.rand(64, 2)
    for _ in range(num):  # the same shapes through `num` Dispatchers (as `num` layers of one model)
        d = moe_comm.Dispatcher(E, num_chunks=2)
        d(x.clone().requires_grad_(True), idx, w, lambda t, c: t * 2.0).sum().backward()
    return shared_workspace().nbytes()


@pytest.mark.multirank
def test_eight_layers_hold_the_scratch_of_one(ranks):
    one = ranks(2).run(_rank_dispatchers_share, 1)
    eight = ranks(2).run(_rank_dispatchers_share, 8)
    assert all(b > 0 for b in one)
    assert eight == one, (one, eight)  # same shapes: the same bytes, whatever the number of Dispatchers
    # Whole layers (each routes differently, so buffers grow to the largest): far from 8 sets.
    layer1, layer8 = ranks(2).run(_rank_layers_share, 1), ranks(2).run(_rank_layers_share, 8)
    assert all(b8 < 2 * b1 for b1, b8 in zip(layer1, layer8)), (layer1, layer8)
