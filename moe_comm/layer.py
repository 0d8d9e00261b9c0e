"""MoELayer: router + dispatcher + experts (+ shared experts).

Shapes legend: T tokens (all leading dims of x flattened), H hidden, E experts, e = E / W.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .comm import group_rank, group_size, resolve_group
from .config import MoEConfig
from .dispatcher import Dispatcher
from .experts import GroupedExperts, SwiGLU
from .router import Router

__all__ = ["MoELayer"]


def _check_same_config(cfg: MoEConfig, dtype: torch.dtype, group) -> None:
    """One all_gather_object of the config across the EP group; every rank raises on a mismatch,
    naming the fields and which ranks hold which value (a mismatch would otherwise hang or corrupt)."""
    mine = dict(dataclasses.asdict(cfg), dtype=str(dtype))
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    diffs = []
    for name in mine:
        values = [fp[name] for fp in every]
        if len(set(map(repr, values))) > 1:
            by_value = {}
            for r, v in enumerate(values):
                by_value.setdefault(repr(v), []).append(r)
            diffs.append(f"{name}: " + ", ".join(f"{v} on ranks {rs}" for v, rs in by_value.items()))
    if diffs:
        raise ValueError("MoELayer: the MoEConfig differs across the EP group; " + "; ".join(diffs))


class MoELayer(nn.Module):
    """A Mixture-of-Experts feed-forward layer with expert parallelism.

    ``y = sum over the K chosen experts of weight * y_e(x)`` (+ shared experts), where global expert g
    lives on EP rank g // e as local expert g % e. Each rank passes its own tokens.

    Args:
        cfg: MoEConfig.
        ep_group: EP process group (any backend). None: WORLD if torch.distributed is initialised,
            else a single process (W = 1).
        backend: permutation kernels, "auto" | "triton" | "native" | "torch".
        seed: initialisation seed; None draws one from torch's default CPU generator (so
            ``torch.manual_seed`` makes it reproducible and consecutive layers differ). Expert g is
            initialised from ``seed + g``: the same experts whatever the EP size.
        device, dtype: of the parameters (x must have the experts' dtype).

    The router weight is replicated: it is broadcast from EP rank 0 at construction, and its
    gradient holds the local tokens' contribution only; all-reduce it over the data-parallel
    ranks yourself (as DDP does). ``layer.aux_loss`` is the last forward's router loss (a scalar
    that backpropagates); add it to your loss. Every EP rank must call forward and backward
    together (they are collective), even a rank with zero tokens.
    """

    def __init__(self, cfg: MoEConfig, ep_group: Optional[dist.ProcessGroup] = None, *, backend: str = "auto",
                 seed: Optional[int] = None, device=None, dtype=None):
        super().__init__()
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.ep_group = resolve_group(ep_group)
        W, rank = group_size(self.ep_group), group_rank(self.ep_group)
        if cfg.num_experts % W:
            raise ValueError(f"MoEConfig.num_experts ({cfg.num_experts}) must be divisible by the EP world "
                             f"size, got world size {W}")
        e = cfg.num_experts // W
        if W > 1:
            _check_same_config(cfg, dtype or torch.get_default_dtype(), self.ep_group)
        if seed is None:
            seed = int(torch.randint(0, 2 ** 62, ()).item())  # host sync: none, a CPU generator draw
        self.router = Router(cfg, device=device, dtype=dtype)
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            self.router.weight.copy_(torch.randn(self.router.weight.shape, generator=g) * cfg.hidden_size ** -0.5)
        self.experts = GroupedExperts(e, cfg.hidden_size, cfg.ffn_hidden_size, first_expert=rank * e,
                                      seed=seed + 1, device=device, dtype=dtype)
        self.shared_experts = None
        if cfg.num_shared_experts:
            self.shared_experts = SwiGLU(cfg.hidden_size, cfg.shared_ffn_size, seed=seed - 1,
                                         device=device, dtype=dtype)
        self.dispatcher = Dispatcher(cfg.num_experts, self.ep_group, cfg.num_chunks, backend=backend)
        self.aux_loss: Optional[torch.Tensor] = None
        if W > 1:
            self._broadcast_replicated()

    @torch.no_grad()
    def _broadcast_replicated(self) -> None:
        src = dist.get_global_rank(self.ep_group, 0)
        params = [self.router.weight] + ([] if self.shared_experts is None else list(self.shared_experts.parameters()))
        for p in params:
            dist.broadcast(p.data, src=src, group=self.ep_group)

    @property
    def timeline(self):
        """The layer's Timeline (disabled by default): ``layer.timeline.enabled = True`` to record spans."""
        return self.dispatcher.timeline

    @property
    def pipeline_plan(self):
        """With num_chunks="auto": the PipelinePlan chosen on the first forward (C, the fit, the reason)."""
        return self.dispatcher.plan

    @property
    def local_expert_ids(self) -> List[int]:
        """Global ids of the experts this rank holds (rank * e ... rank * e + e - 1)."""
        return self.experts.expert_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., H] -> [..., H], same dtype. Sets ``self.aux_loss``."""
        H = self.cfg.hidden_size
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != H:
            raise ValueError(f"x must have last dimension hidden_size={H}, got shape {tuple(x.shape)}")
        if x.dtype != self.experts.w1.dtype:
            raise TypeError(f"x must have the experts' dtype {self.experts.w1.dtype}, got {x.dtype}")
        if x.device != self.experts.w1.device:
            raise ValueError(f"x must be on the layer's device {self.experts.w1.device}, got {x.device}")
        x_TH = x.reshape(-1, H).contiguous()  # one layout for every view: the same bits as a contiguous x
        with self.timeline.compute("router"):
            routing = self.router(x_TH)
        self.aux_loss = routing.aux_loss
        if self.shared_experts is None:
            y_TH = self.dispatcher(x_TH, routing.topk_idx_TK, routing.topk_weight_TK, self.experts)
        else:  # shared experts compute while the first dispatch is in flight
            y_TH, shared_TH = self.dispatcher(x_TH, routing.topk_idx_TK, routing.topk_weight_TK, self.experts,
                                              side_fn=lambda: self.shared_experts(x_TH))
            y_TH = y_TH + shared_TH
        return y_TH.reshape(x.shape)
