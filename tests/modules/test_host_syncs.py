"""Tier 1 (the recorder, the W = 1 lists) and tier 2 (multi-rank gloo): host syncs of one MoELayer step, listed
exactly, for every option, on 1 and 2 gloo ranks.

HostSyncs (moe_comm.testing.syncs) records on CPU what would make the host wait for a CUDA device. With
backend="torch" (the layout a CUDA run uses) and end_check="deferred" (the CUDA default) a forward has
exactly one: the dispatcher's control-exchange read; a backward on W > 1 has one, however many layers: the
first layer's check-in read, which reads every deferred exchange of the group and raises a forward failure on
every rank before any gradient moves (W = 1: none); the sync-free mode
(max_tokens_per_rank) has none after its first call. One copy per rank (dedup) and FP8 dispatch add none.
The recorder also sees the CUDA-only kinds (host -> device copies, torch.equal, stream and event waits) on
CPU, with ``meta`` standing in for the device; the layer's tensors are on the CPU here, so its host -> device
copies show only on a CUDA run (benchmarks/gpu_check.py, host_syncs).
"""
import pytest
import torch

import moe_comm.testing.syncs as syncs
import moe_comm
from moe_comm.placement.planner import plan_placement
from moe_comm.testing.syncs import HostSyncs

H, F, E, K = 16, 24, 4, 2
READ = "cpu at "  # the one read: Channel.end

CONFIGS = {
    "plain": {},
    "aux_z_capacity": dict(aux_loss_coeff=0.01, z_loss_coeff=0.001, capacity_factor=1.0),
    "group_sigmoid_shared": dict(num_groups=2, topk_groups=1, score_func="sigmoid", route_scale=2.5,
                                 num_shared_experts=1, shared_expert_gate=True),
    "chunks": dict(num_chunks=4),
    "bias_monitor": "bias",
    "placement": "placement",
    "timeline": "timeline",
    "sync_free": dict(max_tokens_per_rank=32),
    "dedup_fp8": dict(dedup=True, num_chunks=2, dispatch_dtype=torch.float8_e4m3fn),
    "sync_free_fp8": dict(max_tokens_per_rank=32, dispatch_dtype=torch.float8_e4m3fn, dispatch_scales="ue8m0"),
}


def _layer(name, world_size):
    opts = CONFIGS[name]
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K,
                             **(opts if isinstance(opts, dict) else {}))
    layer = moe_comm.MoELayer(cfg, seed=1, backend="torch", end_check="deferred", monitor=opts == "bias",
                              bias_update_rate=0.01 if opts == "bias" else 0.0)
    if opts == "placement":
        layer.apply_placement(plan_placement([[8, 4, 2, 1]], world_size, 2 * (world_size - 1)))
    if opts == "timeline":
        layer.timeline.enabled = True
    return layer


def _step(layer, x):
    with HostSyncs() as fwd:
        y = layer(x)
        loss = y.float().pow(2).mean() + layer.aux_loss if hasattr(layer, "aux_loss") else y.float().pow(2).mean()
    with HostSyncs() as bwd:
        loss.backward()
    return fwd, bwd


def _rank_syncs(rank, world_size, name):
    layer = _layer(name, world_size)
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    out = []
    for step in range(3):  # step 0 agrees the sync-free shapes; later steps also apply the bias update
        fwd, bwd = _step(layer, x)
        out.append(([e.what + " at " + e.file.rsplit("/", 1)[-1] + ": " + e.source for e in fwd.events],
                    [e.what + " at " + e.file.rsplit("/", 1)[-1] + ": " + e.source for e in bwd.events]))
    layer.dispatcher.check()
    return out


def _expected(name, world_size, step):
    if name.startswith("sync_free"):
        return (0, 0) if step > 0 or world_size == 1 else (1, 0)
    return 1, (1 if world_size > 1 else 0)


def _check(results, name, world_size):
    for per_rank in results:
        for step, (fwd, bwd) in enumerate(per_rank):
            nf, nb = _expected(name, world_size, step)
            assert len(fwd) == nf and len(bwd) == nb, (step, fwd, bwd)
            for event in fwd + bwd:
                assert event.startswith(READ + "channel.py") and "the phase's one read" in event, event


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_host_syncs_single_rank(name):
    _check([_rank_syncs(0, 1, name)], name, 1)


@pytest.mark.multirank
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_host_syncs_two_ranks(ranks, name):
    _check(ranks(2).run(_rank_syncs, name), name, 2)


def _rank_stack_syncs(rank, world_size, depth):
    layers = torch.nn.Sequential(*(_layer("plain", world_size) for _ in range(depth)))
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    out = []
    for _ in range(2):
        fwd, bwd = _step(layers, x)
        out.append((fwd.count, [e.what + " at " + e.file.rsplit("/", 1)[-1] + ": " + e.source for e in bwd.events]))
    moe_comm.check(layers)
    return out


@pytest.mark.multirank
def test_a_backward_through_a_stack_reads_once(ranks):
    # end_check="deferred": one read per layer forward; the backward reads once, at the first layer's check-in
    # (with every deferred exchange of the group); the later check-ins are read with the next read. Before: one
    # read per layer's check-in (3 here).
    depth = 3
    for per_rank in ranks(2).run(_rank_stack_syncs, depth):
        for fwd, bwd in per_rank:
            assert fwd == depth and len(bwd) == 1, (fwd, bwd)
            assert bwd[0].startswith(READ + "channel.py") and "the phase's one read" in bwd[0], bwd


def test_host_syncs_sees_what_it_should():
    """The recorder itself: each kind of sync is seen once, a marked host-only read is not."""
    t = torch.arange(6)
    with HostSyncs() as s:
        t.tolist()
        t.nonzero()
        t[t > 2]
        torch.bincount(t)
        torch.repeat_interleave(t, t)
        torch.repeat_interleave(t, t, output_size=15)  # sized by the caller: no sync
        bool(t[0])
        t.sum().item()
        t.tolist()  # host sync: none, a test of the marker
    whats = [e.what for e in s.events]
    assert whats == ["tolist", "aten.nonzero", "index[bool]", "aten.bincount", "aten.repeat_interleave",
                     "__bool__", "item"], s.report()


def _called(fn):
    """fn(), whose failure is expected where there is no CUDA: the recorder sees the call before it runs."""
    try:
        fn()
    except (AssertionError, RuntimeError, TypeError):  # "not compiled with CUDA", no accelerator, a stand-in
        pass


def test_host_syncs_sees_cuda_only_kinds():
    """The kinds that block only on a device, seen on CPU: a copy to any device type but cpu (meta here) is
    host -> device; torch.equal; the waits of torch.cuda / accelerator, Event and Stream. A pinned
    non_blocking source, a copy to the CPU, host data kept on the CPU and a marked line are not recorded."""
    x = torch.arange(6)
    cuda = torch.cuda.is_available()
    with HostSyncs() as s:
        torch.tensor([1, 2], device="meta")
        torch.as_tensor([1, 2], device="meta")
        torch.as_tensor(x, device="meta")  # a tensor's copy: one event (the aten copy), not two
        x.to("meta")
        x.to("meta", non_blocking=True)  # pageable source: CUDA stages it and may wait
        torch.empty(6, dtype=torch.int64, device="meta").copy_(x)
        torch.equal(x, x + 0)
        torch.empty(6, device="meta")[torch.tensor([0, 1])]
        _called(torch.cuda.synchronize)
        _called(lambda: (torch.cuda.Event() if cuda else torch.cuda.Event.synchronize(object())).synchronize())
        _called(lambda: torch.cuda.current_stream().synchronize() if cuda else torch.cuda.Stream.synchronize(object()))
        if hasattr(torch, "accelerator"):
            _called(torch.accelerator.synchronize)
        torch.tensor([1, 2])  # host data on the host: nothing to wait for
        x.to("cpu")
        x.to("meta")  # host sync: none, a test of the marker
        if cuda:
            x.pin_memory().to("cuda", non_blocking=True)
    whats = [e.what for e in s.events]
    want = ["tensor(data) to device", "tensor(data) to device", "copy to device", "copy to device",
            "copy to device from pageable memory", "copy to device", "aten.equal", "index with host indices",
            "cuda.synchronize", "Event.synchronize", "Stream.synchronize"]
    want += ["accelerator.synchronize"] if hasattr(torch, "accelerator") else []
    assert whats == want, s.report()
    assert all(e.file == __file__ for e in s.events), s.report()


def test_host_syncs_default_device_and_restore():
    """torch.tensor(data) with no device follows the default device; the wrapped methods are restored on exit."""
    saved = {(id(obj), attr): getattr(obj, attr) for obj, attr, _ in syncs.WAITS}
    tolist = torch.Tensor.tolist
    with HostSyncs() as s:
        with torch.device("meta"):
            torch.tensor([1.0, 2.0])
        torch.tensor([1.0, 2.0])
    assert [e.what for e in s.events] == ["tensor(data) to device"], s.report()
    assert {(id(obj), attr): getattr(obj, attr) for obj, attr, _ in syncs.WAITS} == saved
    assert torch.Tensor.tolist is tolist and torch.get_default_device().type == "cpu"
    with HostSyncs() as inner:  # nothing leaks from one recorder into the next
        pass
    assert inner.count == 0
