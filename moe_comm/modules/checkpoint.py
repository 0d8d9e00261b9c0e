"""Checkpoints that move between EP sizes: expert weights are keyed by global expert id.

Each rank's ``state_dict()`` holds its own experts (``...experts.w1.<g>``) plus the replicated
weights. ``full_state_dict`` merges every rank's into one dict with all E experts;
``load_full_state_dict`` loads such a dict at any EP size (each rank takes its experts).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_comm.comm.collectives import group_size, resolve_group

__all__ = ["full_state_dict", "load_full_state_dict"]


def full_state_dict(module: nn.Module, ep_group: Optional[dist.ProcessGroup] = None) -> Dict[str, torch.Tensor]:
    """All experts of every EP rank plus the replicated weights, as CPU tensors, on every rank.

    Collective over ``ep_group`` (None: WORLD when initialised, else this process only).
    Replicated entries are taken from EP rank 0.
    """
    group = resolve_group(ep_group)
    local = {k: v.detach().cpu() for k, v in module.state_dict().items()}  # host sync: checkpointing copies to CPU
    if group_size(group) == 1:
        return local
    gathered = [None] * group_size(group)
    dist.all_gather_object(gathered, local, group=group)
    merged: Dict[str, torch.Tensor] = {}
    for sd in gathered:
        for k, v in sd.items():
            merged.setdefault(k, v)
    return merged


def load_full_state_dict(module: nn.Module, state_dict: Dict[str, torch.Tensor], strict: bool = True):
    """Load a ``full_state_dict`` (saved at any EP size) into ``module``; each rank copies its experts.

    Returns torch's ``_IncompatibleKeys``; with ``strict`` a missing expert raises.
    """
    return module.load_state_dict(state_dict, strict=strict)
