"""Checkpoints that move between EP sizes: expert weights (and their optimizer state) are keyed by global
(logical) expert id.

Shapes legend: E experts (global, logical), W EP world size, S expert slots per rank, F FFN size, H hidden.

Each rank's ``state_dict()`` holds its own experts (``...experts.w1.<g>``) plus the replicated weights.
Two ways to save and load at any EP size:

- torch.distributed.checkpoint (the scalable one): ``get_state_dict(model, optimizer)`` /
  ``set_state_dict`` and ``dcp.save`` / ``dcp.load`` work as for any model. Each rank writes its own
  experts (replicas and DP copies are written once), nothing is gathered; loading at another EP size
  reads each rank's experts by key. Two pieces make that work: ``ExpertKeyPath`` (MoELayer's
  ``_fqn_modifiers`` sends DCP's key-to-attribute walk through it, so ``experts.w1.<g>`` resolves), and
  ``key_optimizer_by_expert`` (optimizer state of an expert parameter keyed by expert id, nested under
  the parameter's key: ``state.<...>.experts.w1.<g>.exp_avg``), which ``get_state_dict`` /
  ``set_state_dict`` install on the optimizers they are given.
- ``full_state_dict`` merges every rank's experts into one dict (on every rank, or on EP rank 0 only with
  ``rank0_only=True``; cost in its docstring);
  ``load_full_state_dict`` loads such a dict at any EP size (each rank takes its experts), collectively
  and all-or-nothing.
"""
from __future__ import annotations

import hashlib
import sys
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from moe_comm.comm.agree import agree
from moe_comm.comm.collectives import group_rank, group_size, resolve_group
from moe_comm.modules.experts import _WEIGHTS, GroupedExperts

__all__ = ["full_state_dict", "load_full_state_dict", "check_full_state_dict", "key_optimizer_by_expert",
           "ExpertKeyPath", "dcp_fqn_modifiers"]

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
def full_state_dict(module: nn.Module, ep_group=None, *, rank0_only: bool = False) -> Dict[str, torch.Tensor]:
    """Every expert of every EP rank plus the replicated weights, as CPU tensors, in one dict.

    Collective over ``ep_group`` (a ProcessGroup or 1-D DeviceMesh; None: WORLD when initialised, else this
    process only); every rank must call it with the same module structure, whose tensors live on the
    group's device (CUDA for NCCL). A replicated expert (after ``apply_placement``) appears once.
    Returns keys in the module's state_dict order, experts of one module in (weight, id) order.

    Cost. The experts travel one weight of one module at a time ([S, F, H] rows of every rank), then to CPU:
    the device holds one such weight of every rank at a time, the host the whole checkpoint (E x 3 x F x H
    elements per MoE layer).
    rank0_only=False (default): every rank receives everything (an ``all_gather`` per weight, a
    ``broadcast`` per replicated tensor): W copies of the checkpoint in host memory, W times the traffic.
    rank0_only=True: only EP rank 0 receives and returns the dict (a ``gather`` per weight); the others
    send their experts and return {}: one copy, and the traffic of the experts once. Save from there.
    For large models use torch.distributed.checkpoint (``dcp.save(get_state_dict(model, optimizer))``):
    each rank writes its own experts, nothing is gathered, and the optimizer state comes along.
    With data parallelism call it on every rank: each EP group's rank 0 gets the (identical) dict.
    """
    group = resolve_group(ep_group, name="full_state_dict: ep_group")
    W = group_size(group)
    receives = not rank0_only or group_rank(group) == 0
    local = module.state_dict()  # an MoELayer applies its pending bias step first
    experts = _expert_modules(module)
    prefixes = [p for p, _ in experts]
    gathered: Dict[str, Dict[str, torch.Tensor]] = {}
    for prefix, m in experts:
        gathered[prefix] = _gather_experts(m, prefix, group, rank0_only)
    out: Dict[str, torch.Tensor] = {}
    for key, value in local.items():
        expert_prefix = next((p for p in prefixes if key.startswith(p)), None)
        if expert_prefix is not None:
            out.update(gathered.pop(expert_prefix, {}))
            continue
        if isinstance(value, torch.Tensor):
            if W > 1 and not rank0_only:
                buf = _as_bytes(value.detach().clone())
                dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
                value = _from_bytes(buf, value)
            if receives:
                out[key] = value.detach().to("cpu", copy=True)  # host sync: checkpointing copies to CPU
        elif receives:
            out[key] = value
    for rest in gathered.values():  # an expert module whose state_dict entries were all filtered away
        out.update(rest)
    return out


def _collect(t: torch.Tensor, group, rank0_only: bool) -> Optional[List[torch.Tensor]]:
    """Every EP rank's ``t`` (same shape everywhere), in rank order: on every rank (all_gather), or on EP
    rank 0 only (gather; the others get None)."""
    W = group_size(group)
    if W == 1:
        return [t]
    if not rank0_only:
        parts = [torch.empty_like(t) for _ in range(W)]
        dist.all_gather(parts, t, group=group)
        return parts
    dst = dist.get_global_rank(group, 0)
    parts = [torch.empty_like(t) for _ in range(W)] if group_rank(group) == 0 else None
    dist.gather(t, gather_list=parts, dst=dst, group=group)
    return parts


def _gather_experts(m: GroupedExperts, prefix: str, group, rank0_only: bool) -> Dict[str, torch.Tensor]:
    """{"<prefix>w1.<g>": [F, H] CPU tensor, ...} for every expert of every rank (first replica wins);
    {} on the ranks that do not receive."""
    device = m.w1.device
    every_ids = _collect(torch.tensor(m.expert_ids, dtype=torch.int64, device=device), group, rank0_only)
    ids = None if every_ids is None else torch.cat(every_ids).tolist()  # host sync: checkpointing reads the ids
    out: Dict[str, torch.Tensor] = {}
    for name in _WEIGHTS:
        w = getattr(m, name).detach()
        parts = _collect(_as_bytes(w), group, rank0_only)  # one weight at a time: bounded device memory
        if parts is None:
            continue
        rows = torch.cat(parts).view(w.dtype).reshape((len(parts) * w.shape[0],) + tuple(w.shape[1:]))
        first: Dict[int, int] = {}
        for slot, g in enumerate(ids):
            first.setdefault(int(g), slot)
        for g in sorted(first):
            out[f"{prefix}{name}.{g}"] = rows[first[g]].to("cpu", copy=True)  # host sync: to CPU
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
    group = resolve_group(ep_group, name="load_full_state_dict: ep_group")
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


# ------------------------------------------------------------------------ torch.distributed.checkpoint
class ExpertKeyPath:
    """Lets torch.distributed.checkpoint resolve the expert keys of a state_dict.

    DCP's ``get_state_dict`` / ``set_state_dict`` map every state_dict key to the attribute path of its
    tensor, one ``getattr`` per dot. ``experts.w1.<g>`` names row g of a stacked parameter, not an
    attribute, so the walk would fail at ``<g>`` ("'Parameter' object has no attribute '0'"). DCP lets a
    module redirect the walk (``_fqn_modifiers``: key atom -> an attribute to step through first);
    ``MoELayer._fqn_modifiers`` returns ``dcp_fqn_modifiers()``, which sends "experts" through the layer's
    ExpertKeyPath: every further atom (``w1``, ``<g>``) resolves to it. The key itself is unchanged.
    """

    __slots__ = ()

    def __getattr__(self, name: str) -> "ExpertKeyPath":
        if name.startswith("_"):  # dunders (copy, pickle) and DCP's own hooks (_fqn_modifiers): not key atoms
            raise AttributeError(name)
        return self

    def __deepcopy__(self, memo) -> "ExpertKeyPath":
        return self


_DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"
_FRAMES_UP = 12  # from _fqn_modifiers to DCP's _verify_options: _get_fqns, its generator frames, ...


def dcp_fqn_modifiers(expert_attr: str = "_expert_keys") -> Dict[str, str]:
    """``MoELayer._fqn_modifiers()``: {"experts": expert_attr} (see ``ExpertKeyPath``).

    Called by DCP's ``get_state_dict`` / ``set_state_dict`` while they check their arguments
    (``_verify_options(model, optims, ...)``, torch 2.13); the optimizers found there get
    ``key_optimizer_by_expert(optimizer, model)`` before DCP reads or loads their state, so
    ``get_state_dict(model, optimizer)`` needs no extra call. (tests/parallel pins this: a torch that
    renames those frames fails the test; ``key_optimizer_by_expert`` can always be called by hand.)
    """
    frame = sys._getframe(1)
    for _ in range(_FRAMES_UP):
        if frame is None:
            break
        if frame.f_code.co_name == "_verify_options" and frame.f_globals.get("__name__") == _DCP_STATE_DICT:
            model, optims = frame.f_locals.get("model"), frame.f_locals.get("optims") or ()
            for optimizer in optims:
                if isinstance(model, nn.Module) and isinstance(optimizer, torch.optim.Optimizer):
                    key_optimizer_by_expert(optimizer, model)
            break
        frame = frame.f_back
    return {"experts": expert_attr}


def _expert_ids_by_param(model: nn.Module) -> Dict[int, List[int]]:
    """id(expert parameter) -> logical expert id of each of its rows (local slots), for every
    GroupedExperts / PlacedExperts in ``model`` (as they are now: placements change them)."""
    out: Dict[int, List[int]] = {}
    for _, m in _expert_modules(model):
        for name in _WEIGHTS:
            out[id(getattr(m, name))] = m.expert_ids
    return out


def _param_keys(optimizer: torch.optim.Optimizer, state_dict: Mapping) -> List[Tuple[object, nn.Parameter]]:
    """(state key, parameter) pairs: the i-th key of the dict's param_groups is the optimizer's i-th parameter
    (int ids from ``Optimizer.state_dict``, FQNs from DCP)."""
    keys = [k for g in state_dict["param_groups"] for k in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if len(keys) != len(params):
        raise ValueError(f"optimizer state_dict has {len(keys)} parameters in its param_groups, the optimizer "
                         f"{len(params)}")
    return list(zip(keys, params))


def _split_expert_state(model: nn.Module, optimizer, state_dict):
    """Optimizer state_dict post-hook: each expert parameter's state {name: [S, ...] tensor} becomes
    {"<g>": {name: [...] row of expert g}} (0-dim entries such as Adam's step and non-tensors repeated)."""
    ids_by_param = _expert_ids_by_param(model)
    state = dict(state_dict["state"])
    for key, p in _param_keys(optimizer, state_dict):
        ids, st = ids_by_param.get(id(p)), state.get(key)
        if ids is None or not st:
            continue
        for name, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != tuple(p.shape):
                raise ValueError(f"key_optimizer_by_expert: optimizer state {name!r} of expert parameter {key} has "
                                 f"shape {tuple(v.shape)}; only per-row state (shape {tuple(p.shape)}), 0-dim "
                                 f"tensors and non-tensors can be keyed by expert")
        by_expert: Dict[str, Dict[str, object]] = {}
        for i, g in enumerate(ids):
            if str(g) not in by_expert:  # a replica on this rank holds the same state: first wins
                by_expert[str(g)] = {name: v[i] if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                                     for name, v in st.items()}
        state[key] = by_expert
    state_dict["state"] = state
    return state_dict


def _is_by_expert(st) -> bool:
    return isinstance(st, Mapping) and len(st) > 0 and all(
        isinstance(k, str) and k.isdigit() and str(int(k)) == k and isinstance(v, Mapping) for k, v in st.items())


def _stack_expert_state(model: nn.Module, optimizer, state_dict):
    """Optimizer load_state_dict pre-hook: the inverse of ``_split_expert_state`` for this rank's experts
    (the rows of the experts it holds now, at any EP size)."""
    ids_by_param = _expert_ids_by_param(model)
    state = dict(state_dict["state"])
    for key, p in _param_keys(optimizer, state_dict):
        ids, st = ids_by_param.get(id(p)), state.get(key)
        if ids is None or not _is_by_expert(st):
            continue
        missing = sorted({g for g in ids if str(g) not in st})
        if missing:
            raise ValueError(f"optimizer state of expert parameter {key} has no entry for expert(s) {missing} "
                             f"held by this rank (it has experts {sorted(int(k) for k in st)})")
        first = st[str(ids[0])]
        merged = {}
        for name, v in first.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                merged[name] = torch.stack([st[str(g)][name] for g in ids])
            else:
                merged[name] = v
        state[key] = merged
    state_dict = dict(state_dict)
    state_dict["state"] = state
    return state_dict


def key_optimizer_by_expert(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Key the optimizer state of ``model``'s expert parameters by global expert id (idempotent).

    After this, ``optimizer.state_dict()["state"][k]`` of an expert parameter (``experts.w1`` [S, F, H])
    is ``{"<g>": {"exp_avg": [F, H], "exp_avg_sq": [F, H], "step": []}, ...}`` for the experts this rank
    holds (rows of per-row tensors are views; 0-dim entries and non-tensors repeated per expert), and
    ``optimizer.load_state_dict`` of such a dict takes the rows of the experts this rank holds now, at any
    EP size or placement (raising ValueError naming the experts that are missing). So the state moves
    between EP sizes like the weights, and torch.distributed.checkpoint writes each expert's state once
    instead of keeping one rank's [S, F, H] tensor for every rank (its de-duplication of equal keys).

    ``get_state_dict`` / ``set_state_dict`` call it for the optimizers they are given; call it yourself
    for ``optimizer.state_dict()`` / ``load_state_dict`` used directly. Per-row state (shape of the
    parameter), 0-dim tensors and non-tensors are supported (Adam/AdamW, SGD with momentum, RMSprop, ...);
    any other tensor raises ValueError at ``state_dict()``.
    Args:
        optimizer: holds (some of) ``model``'s parameters, state keyed by parameter.
        model: the module holding the experts (a DDP wrapper is fine); looked up at every state_dict /
            load, so a later ``apply_placement`` is followed.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"key_optimizer_by_expert: optimizer must be a torch.optim.Optimizer, "
                        f"got {type(optimizer).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"key_optimizer_by_expert: model must be an nn.Module, got {type(model).__name__}")
    current = getattr(optimizer, "_moe_comm_expert_keys", None)
    if current is not None:
        if current[0] is model:
            return
        for handle in current[1]:
            handle.remove()
    handles = (optimizer.register_state_dict_post_hook(lambda opt, sd: _split_expert_state(model, opt, sd)),
               optimizer.register_load_state_dict_pre_hook(lambda opt, sd: _stack_expert_state(model, opt, sd)))
    optimizer._moe_comm_expert_keys = (model, handles)
