"""Detects a data-parallel wrapper that would mix the experts of different EP ranks.

Shapes legend: W EP world size.

Plain ``DistributedDataParallel(model)`` over ranks that hold different experts broadcasts rank 0's
parameters at wrap time (every rank's experts become rank 0's) and averages the gradients of different
experts; ``fully_shard(model)`` (FSDP2) over such ranks shards and re-assembles one tensor out of
different ranks' experts. Neither says anything. ``MoELayer`` calls ``data_parallel_error`` before every
forward (a forward pre-hook): it looks at the modules whose call is on the Python stack, and returns an
error when a DDP or FSDP2 wrapper there manages this layer's expert parameters over a process group
that holds another rank of the layer's EP group. ``moe_comm.parallel.wrap_ddp`` / ``fully_shard_moe``
keep the experts out of such wrappers. Cost: one walk up the stack per forward when W > 1 (a wrapper
found harmless is remembered, by weak reference, and not inspected again).

The check issues no collective. Its verdict and its text depend on the wrapper's ranks and the EP group's
ranks only, not on which rank asks, so every rank of the wrapper returns the same error; the layer's hook
hands it to the Dispatcher's control exchange, which every EP rank joins (a rank with no such wrapper joins
it from its ordinary forward). Every rank has then issued the same collectives - the wrapper's own before
the layer (DDP: the buffer broadcast; FSDP2: the all-gathers), then the one exchange - and raises the same
RuntimeError, so the group stays usable (tests/parallel/test_ddp_misuse.py).
"""
from __future__ import annotations

import sys
import weakref
from typing import List, Optional

import torch.distributed as dist
from torch import nn

__all__ = ["data_parallel_error"]

_CALL_IMPL_CODE = nn.Module._call_impl.__code__


def _enclosing_modules() -> List[nn.Module]:
    """Modules whose ``__call__`` is on this thread's Python stack, innermost first."""
    out, frame = [], sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL_IMPL_CODE:
            m = frame.f_locals.get("self")
            if isinstance(m, nn.Module):
                out.append(m)
        frame = frame.f_back
    return out


def _wrapper_classes():
    from torch.nn.parallel import DistributedDataParallel
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        FSDPModule = ()
    return DistributedDataParallel, FSDPModule


def _managed_over(wrapper, experts: nn.Module, ddp_cls, fsdp_cls) -> Optional[List[int]]:
    """Global ranks over which ``wrapper`` (DDP, or an FSDP2 unit) manages the experts' parameters; None
    when it does not manage them."""
    if isinstance(wrapper, ddp_cls):
        ignored = getattr(wrapper, "parameters_to_ignore", set())
        ids = {id(experts.w1), id(experts.w3), id(experts.w2)}
        managed = any(id(p) in ids for name, p in wrapper.module.named_parameters() if name not in ignored)
        return dist.get_process_group_ranks(wrapper.process_group) if managed else None
    if fsdp_cls and isinstance(wrapper, fsdp_cls):
        # torch 2.13's layout (tests/parallel pins it): a state holds param groups, each a mesh and params.
        for group in getattr(wrapper._get_fsdp_state(), "_fsdp_param_groups", ()):
            if any(fp._module_info.module is experts for fp in group.fsdp_params):
                return group.mesh_info.mesh.mesh.flatten().tolist()  # host sync: none, a CPU rank table
        return None
    return None


def data_parallel_error(layer) -> Optional[Exception]:
    """A RuntimeError when a data-parallel wrapper around ``layer`` (on the stack now) manages its expert
    parameters over ranks that hold other experts; None otherwise (always None when W = 1)."""
    group = layer.ep_group
    if group is None or dist.get_world_size(group) == 1:
        return None
    ddp_cls, fsdp_cls = _wrapper_classes()
    checked = layer.__dict__.setdefault("_wrappers_checked", {})  # id -> weakref of harmless wrappers
    ep_ranks = set(dist.get_process_group_ranks(group))
    for m in _enclosing_modules():
        if not isinstance(m, (ddp_cls, fsdp_cls) if fsdp_cls else ddp_cls):
            continue
        ref = checked.get(id(m))
        if ref is not None and ref() is m:
            continue
        ranks = _managed_over(m, layer.experts, ddp_cls, fsdp_cls)
        # The wrapper's ranks that are EP ranks of this layer: each holds other experts. Rank-independent (this
        # rank is one of them), so every rank of the wrapper reaches the same verdict and the same text.
        clash = sorted(set(ranks or ()) & ep_ranks)
        if len(clash) > 1:
            if isinstance(m, ddp_cls):
                kind, harm = "DistributedDataParallel", (
                    "DDP broadcast rank 0's experts to every rank when it wrapped the model (rebuild the model or "
                    "load a checkpoint: its experts are overwritten) and would average different experts' gradients")
                fix = "moe_comm.parallel.wrap_ddp(model) (moe_comm.parallel.fully_shard_moe(model, mesh) for FSDP2)"
            else:
                kind, harm = "fully_shard (FSDP2)", "FSDP2 would assemble one tensor out of different ranks' experts"
                fix = "moe_comm.parallel.fully_shard_moe(model, mesh) (moe_comm.parallel.wrap_ddp(model) for DDP)"
            # One statement of the error, the same on every rank: the control exchange adds no copy of it.
            return RuntimeError(
                f"MoELayer: {kind} over ranks {sorted(ranks)} manages this layer's expert parameters "
                f"(experts.w1/w3/w2), but its ranks {clash} hold DIFFERENT experts (each is a different rank of "
                f"this layer's EP group {sorted(ep_ranks)}): {harm}. Use {fix}: it keeps the experts out of the "
                f"wrapper and reduces their gradients over each layer's dp_group.")
        checked[id(m)] = weakref.ref(m)
    return None
