"""Checkpoints that move between EP sizes: expert weights are keyed by global (logical) expert id.

Shapes legend: E experts (global, logical), W EP world size, S expert slots per rank, F FFN size, H hidden.

Each rank's ``state_dict()`` holds its own experts (``...experts.w1.<g>``) plus the replicated weights.
``full_state_dict`` merges every rank's into one dict with all E experts; ``load_full_state_dict`` loads
such a dict at any EP size (each rank takes its experts), collectively and all-or-nothing.
"""
from __future__ import annotations

import hashlib
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from moe_comm.comm.agree import agree
from moe_comm.comm.collectives import group_size, resolve_group
from moe_comm.modules.experts import _WEIGHTS, GroupedExperts

__all__ = ["full_state_dict", "load_full_state_dict", "check_full_state_dict"]

_SHOWN = 8  # keys named per kind of problem in an error message


def _expert_modules(module: nn.Module) -> List[Tuple[str, GroupedExperts]]:
    """(key prefix, module) of every expert-keyed module (GroupedExperts, PlacedExperts), in module order."""
    return [(f"{name}." if name else "", m) for name, m in module.named_modules() if isinstance(m, GroupedExperts)]


def _under(key: str, prefixes: List[str]) -> bool:
    return any(key.startswith(p) for p in prefixes)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a flat uint8 tensor (a view when contiguous): every dtype travels on every
    backend (gloo has no bfloat16 collectives; copying bytes needs none)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(b: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_as_bytes``: flat bytes -> a tensor of ``like``'s dtype and shape."""
    return b.view(like.dtype).reshape(like.shape)


@torch.no_grad()
def full_state_dict(module: nn.Module, ep_group: Optional[dist.ProcessGroup] = None) -> Dict[str, torch.Tensor]:
    """All experts of every EP rank plus the replicated weights, as CPU tensors, on every rank.

    Collective over ``ep_group`` (None: WORLD when initialised, else this process only); every rank must
    call it with the same module structure, whose tensors live on the group's device (CUDA for NCCL).
    Replicated entries (router, shared experts, buffers) are taken from EP rank 0 (one broadcast each).
    Experts are gathered module by module with tensor all_gathers (the ids of every rank's slots, then
    w1, w3, w2 as raw bytes): each rank receives E x (3 F H) elements per expert module, the size of
    the result, and nothing is pickled. A replicated expert (after ``apply_placement``) appears once.
    Returns keys in the module's state_dict order, experts of one module in (weight, id) order.
    """
    group = resolve_group(ep_group)
    W = group_size(group)
    local = module.state_dict()  # host sync (to CPU below); an MoELayer applies its pending bias step first
    experts = _expert_modules(module)
    prefixes = [p for p, _ in experts]
    gathered: Dict[str, Dict[str, torch.Tensor]] = {}
    for prefix, m in experts:
        gathered[prefix] = _gather_experts(m, prefix, group)
    out: Dict[str, torch.Tensor] = {}
    for key, value in local.items():
        expert_prefix = next((p for p in prefixes if key.startswith(p)), None)
        if expert_prefix is not None:
            out.update(gathered.pop(expert_prefix, {}))
            continue
        if isinstance(value, torch.Tensor):
            if W > 1:
                buf = _as_bytes(value.detach().clone())
                dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
                value = _from_bytes(buf, value)
            out[key] = value.detach().to("cpu", copy=True)  # host sync: checkpointing copies to CPU
        else:
            out[key] = value
    for rest in gathered.values():  # an expert module whose state_dict entries were all filtered away
        out.update(rest)
    return out


def _gather_experts(m: GroupedExperts, prefix: str, group) -> Dict[str, torch.Tensor]:
    """{"<prefix>w1.<g>": [F, H] CPU tensor, ...} for every expert of every rank (first replica wins)."""
    W = group_size(group)
    ids = m.expert_ids
    weights = {name: getattr(m, name).detach() for name in _WEIGHTS}
    if W > 1:
        device = weights["w1"].device
        ids_S = torch.tensor(ids, dtype=torch.int64, device=device)
        every = [torch.empty_like(ids_S) for _ in range(W)]
        dist.all_gather(every, ids_S, group=group)
        ids = torch.cat(every).tolist()  # host sync: checkpointing reads the ids
        for name, w in weights.items():
            rows = _as_bytes(w)
            parts = [torch.empty_like(rows) for _ in range(W)]
            dist.all_gather(parts, rows, group=group)
            weights[name] = torch.cat(parts).view(w.dtype).reshape((W * w.shape[0],) + tuple(w.shape[1:]))
    out: Dict[str, torch.Tensor] = {}
    for name in _WEIGHTS:
        first = {}
        for slot, g in enumerate(ids):
            first.setdefault(int(g), slot)
        for g in sorted(first):
            out[f"{prefix}{name}.{g}"] = weights[name][first[g]].to("cpu", copy=True)  # host sync: to CPU
    return out


def check_full_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True):
    """Validate a full checkpoint against ``module`` on this rank, writing nothing.

    Every key is checked, not only this rank's: each expert module checks all E experts (every expert
    has the same shape), the other entries are checked against the module's own state_dict.
    Returns torch's ``_IncompatibleKeys(missing_keys, unexpected_keys)`` (identical on every rank).
    Raises ValueError naming the keys when a tensor has the wrong shape or is not a tensor, or, with
    ``strict``, when a key is missing or unexpected (an unknown or malformed expert id: ``w1.99``,
    ``w1.0007``).
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of keys to tensors, got {type(state_dict).__name__}")
    experts = _expert_modules(module)
    prefixes = [p for p, _ in experts]
    missing: List[str] = []
    unexpected: List[str] = []
    errors: List[str] = []
    for prefix, m in experts:
        miss, unexp, errs = m.check_state_dict(state_dict, prefix, all_experts=True)
        missing += miss
        errors += errs
        unexpected += unexp
    own = {k: v for k, v in module.state_dict().items() if not _under(k, prefixes)}
    for key, value in own.items():
        if key not in state_dict:
            missing.append(key)
        elif isinstance(value, torch.Tensor):
            src = state_dict[key]
            if not isinstance(src, torch.Tensor):
                errors.append(f"{key} must be a tensor, got {type(src).__name__}")
            elif tuple(src.shape) != tuple(value.shape):
                errors.append(f"size mismatch for {key}: copying a param with shape {tuple(src.shape)}, the "
                              f"module has shape {tuple(value.shape)}")
    unexpected += [k for k in state_dict if k not in own and not _under(k, prefixes)]
    problems = list(errors)
    if strict:
        for kind, keys in (("missing", missing), ("unexpected (unknown or malformed)", unexpected)):
            if keys:
                shown = ", ".join(keys[:_SHOWN]) + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")
                problems.append(f"{len(keys)} {kind} key(s): {shown}")
    if problems:
        raise ValueError("load_full_state_dict: the checkpoint does not fit the module: " + "; ".join(problems))
    return _IncompatibleKeys(missing, unexpected)


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                         ep_group: Optional[dist.ProcessGroup] = None):
    """Load a ``full_state_dict`` (saved at any EP size) into ``module``; each rank copies its experts.

    Collective and all-or-nothing: every rank validates EVERY key (``check_full_state_dict``: all E
    experts, whatever rank owns them), then one ``agree`` over ``ep_group`` (None: WORLD when initialised)
    compares the outcome and the checkpoint's key set; on any problem on any rank, every rank raises
    (naming the ranks and keys) and no tensor is written anywhere. Only then does each rank copy.

    Args:
        module: the model (any nn.Module holding MoELayers / GroupedExperts).
        state_dict: the full checkpoint, the same keys on every rank.
        strict: missing keys, unexpected keys and unknown or malformed expert ids (``w1.99`` with E = 8,
            ``w1.0007``) raise; without it they are returned and skipped. A wrong shape always raises.
        ep_group: the EP process group (every rank of it must call).
    Returns: torch's ``_IncompatibleKeys`` (missing_keys, unexpected_keys), the same on every rank.
    """
    group = resolve_group(ep_group)
    result, local_error = None, None
    try:
        result = check_full_state_dict(module, state_dict, strict)
    except (TypeError, ValueError) as err:
        local_error = err
    keys = sorted(state_dict) if local_error is None else []
    digest = hashlib.sha1("\n".join(keys).encode()).hexdigest()
    agree(group, {"strict": bool(strict), "checkpoint keys (count, sha1)": (len(keys), digest)},
          what="load_full_state_dict", local_error=local_error)
    module.load_state_dict(state_dict, strict=False)  # every key was checked on every rank: only copies
    return result
