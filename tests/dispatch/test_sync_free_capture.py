"""Tier 1-2: what a CUDA graph needs of the sync-free mode, checked on CPU (gloo). After its first call, a training
step of a sync-free MoELayer (load monitor on) changes nothing on the host - no counter, no list, no cached value -
and builds no tensor from host data (on CUDA each would be a host -> device copy, which a graph captures as a copy
of stale host memory): call numbers, the deferred checks and the monitor's step live on the device, advanced there.
The failures such a step can meet are still raised at ``check()``, in full (see test_sync_free.py). The capture
itself runs on a GPU: ``benchmarks/gpu_check.py`` (sync_free section).

Before: each call advanced the channel's call counter and appended its four exchanges to the unread list, the
monitor advanced its step counter, and every exchange built its header with ``torch.tensor(host ints)``.
"""
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

import moe_comm

H, E, M = 8, 4, 12
FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.pin_memory)


class _FromHostData(TorchFunctionMode):
    """Records the library's tensors built from host data (and pinned copies) while open, each with the line that
    built it. The gloo runs' NCCL-rule checks (``moe_comm.testing.nccl_rules``, test machinery) are not the library."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in FROM_DATA:
            where = next((f for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename), None)
            if where is not None and "/moe_comm/" in where.filename and "/moe_comm/testing/" not in where.filename:
                self.seen.append(f"{getattr(func, '__name__', func)} at {where.filename}:{where.lineno}")
        return func(*args, **(kwargs or {}))


def _plain(value, depth=0):
    """A comparable picture of host state: plain values as they are, tensors by shape and dtype only (their contents
    live on the device), other objects by type."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if depth < 3 and isinstance(value, (list, tuple)):
        return type(value).__name__, [_plain(v, depth + 1) for v in value]
    if depth < 3 and isinstance(value, dict):
        return "dict", sorted((repr(k), _plain(v, depth + 1)) for k, v in value.items())
    return type(value).__name__


def _host_state(layer):
    d = layer.dispatcher
    objects = {"layer": layer, "router": layer.router, "experts": layer.experts, "dispatcher": d,
               "channel": d.channel, "monitor": layer.monitor, "timeline": d.timeline}
    skip = {"_modules", "_parameters", "_buffers"}
    return {name: {k: _plain(v) for k, v in vars(obj).items() if k not in skip} for name, obj in objects.items()}


def _rank_steps(rank, world_size):
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=E * world_size, top_k=2,
                             max_tokens_per_rank=M)
    layer = moe_comm.MoELayer(cfg, seed=2, timeout=30.0)
    assert layer.monitor is not None

    def step(seed):
        x = torch.randn(9, H, generator=torch.Generator().manual_seed(seed * 10 + rank), requires_grad=True)
        layer(x).square().mean().backward()

    step(0)  # the first call agrees (H, dtype, K) with one read; the device counters start after it
    step(1)
    before = _host_state(layer)
    with _FromHostData() as built:
        step(2)
    after = _host_state(layer)
    changed = sorted(f"{name}.{k}: {before[name].get(k)!r} -> {after[name].get(k)!r}"
                     for name in before for k in set(before[name]) | set(after[name])
                     if before[name].get(k) != after[name].get(k))
    moe_comm.check(layer)  # the three steps were fine: nothing to raise
    return changed, built.seen, layer.monitor.steps


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_sync_free_step_changes_nothing_on_the_host(ranks, world_size):
    for changed, built, steps in ranks(world_size).run(_rank_steps):
        assert changed == [], changed
        assert built == [], built
        assert steps == 3  # the monitor counted every step, on the device
