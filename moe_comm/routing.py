"""Router: scores, group-limited top-k, aux / z losses, optional capacity.

Shapes legend: T tokens, H hidden, E experts (global), K top-k, G expert groups, n = E / G experts per group.
Logits are computed in float32 (float64 when x is float64); weights come out in that dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

from moe_comm._checks import check_int, check_tensor
from moe_comm.config import MoEConfig

__all__ = ["Router", "RouterOutput", "route"]


@dataclass
class RouterOutput:
    """topk_idx_TK: [T, K] int64 expert ids, -1 = dropped by capacity.
    topk_weight_TK: [T, K] float32 (float64 for float64 x); 0 for dropped slots.
    scores_TE: [T, E] softmax/sigmoid scores. aux_loss: [] scalar (0 when both coefficients are 0)."""

    topk_idx_TK: torch.Tensor
    topk_weight_TK: torch.Tensor
    scores_TE: torch.Tensor
    aux_loss: torch.Tensor


def _group_limited_mask(select_TE: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """-inf outside each token's best ``topk_groups`` groups. A group's score is the sum of its top-2
    scores (DeepSeek-V3), or its max when a group holds one expert."""
    per_group = select_TE.shape[1] // num_groups
    grouped_TGn = rearrange(select_TE, "t (g n) -> t g n", g=num_groups)  # n = experts per group
    group_score_TG = grouped_TGn.topk(min(2, per_group), dim=-1).values.sum(-1)
    keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
    keep_TG.scatter_(1, group_score_TG.topk(topk_groups, dim=-1).indices, True)
    keep_TE = repeat(keep_TG, "t g -> t (g n)", n=per_group)
    return select_TE.masked_fill(~keep_TE, float("-inf"))


def _apply_capacity(topk_idx_TK: torch.Tensor, topk_score_TK: torch.Tensor, num_experts: int,
                    capacity: int) -> torch.Tensor:
    """Drop (set -1) each expert's lowest-score slots beyond ``capacity``; ties keep the earlier slot."""
    flat_idx = topk_idx_TK.reshape(-1)
    flat_score = topk_score_TK.reshape(-1)
    by_score = torch.sort(flat_score, descending=True, stable=True).indices
    by_expert = by_score[torch.sort(flat_idx[by_score], stable=True).indices]  # expert, then score desc
    counts_E = torch.bincount(flat_idx, minlength=num_experts)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    rank_in_expert = torch.empty_like(flat_idx)
    rank_in_expert[by_expert] = torch.arange(flat_idx.numel(), device=flat_idx.device) - start_E[flat_idx[by_expert]]
    kept = rank_in_expert < capacity
    return torch.where(kept, flat_idx, torch.full_like(flat_idx, -1)).reshape(topk_idx_TK.shape)


def route(logits_TE: torch.Tensor, cfg: MoEConfig, expert_bias_E: torch.Tensor | None = None) -> RouterOutput:
    """Top-K routing from logits (functional core of ``Router``, also used by the dense reference).

    Args:
        logits_TE: [T, E] float32/float64 router logits.
        cfg: score_func, top_k, norm_topk_prob, num_groups/topk_groups, capacity_factor, route_scale,
            aux_loss_coeff, z_loss_coeff.
        expert_bias_E: optional [E] bias added to the scores for selection only (aux-loss-free balancing).
    Example (softmax, K=1): logits [[0, ln 3]] -> scores [[.25, .75]] -> idx [[1]], weight [[1.0]]
        (norm_topk_prob renormalises the single weight to 1).
    """
    if not isinstance(cfg, MoEConfig):
        raise TypeError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
    check_tensor("logits_TE", logits_TE, shape=(None, cfg.num_experts), shape_from="[T, E], E = cfg.num_experts",
                 floating=True)
    if expert_bias_E is not None:
        check_tensor("expert_bias_E", expert_bias_E, shape=(cfg.num_experts,), shape_from="E = cfg.num_experts",
                     floating=True)
    T, E = logits_TE.shape
    K = cfg.top_k
    scores_TE = logits_TE.softmax(-1) if cfg.score_func == "softmax" else logits_TE.sigmoid()
    select_TE = scores_TE.detach() if expert_bias_E is None else scores_TE.detach() + expert_bias_E
    if cfg.num_groups is not None and cfg.num_groups > 1:
        select_TE = _group_limited_mask(select_TE, cfg.num_groups, cfg.topk_groups)
    topk_idx_TK = select_TE.topk(K, dim=-1, sorted=True).indices
    topk_weight_TK = scores_TE.gather(1, topk_idx_TK)
    if cfg.norm_topk_prob:
        topk_weight_TK = topk_weight_TK / topk_weight_TK.sum(-1, keepdim=True).clamp_min(1e-20)
    if cfg.route_scale != 1.0:
        topk_weight_TK = topk_weight_TK * cfg.route_scale
    if cfg.capacity_factor is not None and T > 0:
        capacity = math.ceil(cfg.capacity_factor * T * K / E)
        topk_idx_TK = _apply_capacity(topk_idx_TK, scores_TE.detach().gather(1, topk_idx_TK), E, capacity)
        topk_weight_TK = topk_weight_TK.masked_fill(topk_idx_TK < 0, 0.0)

    aux = logits_TE.sum() * 0.0  # keeps the graph (and dtype/device) even when T = 0
    if T > 0 and cfg.aux_loss_coeff > 0:
        # Switch/GShard: E * sum_e f_e * P_e; f = fraction of routed slots, P = mean probability.
        probs_TE = scores_TE if cfg.score_func == "softmax" else scores_TE / scores_TE.sum(-1, keepdim=True)
        routed = topk_idx_TK[topk_idx_TK >= 0]
        f_E = torch.bincount(routed, minlength=E).to(probs_TE.dtype) / max(T * K, 1)
        aux = aux + cfg.aux_loss_coeff * E * (f_E * probs_TE.mean(0)).sum()
    if T > 0 and cfg.z_loss_coeff > 0:
        aux = aux + cfg.z_loss_coeff * torch.logsumexp(logits_TE, dim=-1).square().mean()
    return RouterOutput(topk_idx_TK=topk_idx_TK, topk_weight_TK=topk_weight_TK, scores_TE=scores_TE, aux_loss=aux)


class Router(nn.Module):
    """Linear router: ``logits = x @ weight.T`` in float32 (float64 for float64 x), then ``route``.

    Args:
        cfg: the layer's MoEConfig.
    Parameters: weight [E, H]. Buffers: expert_bias [E], added to the scores for top-K
    selection only (not to the weights); zeros unless the user or a balancing policy sets it.
    """

    def __init__(self, cfg: MoEConfig, *, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, device=device, dtype=dtype))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, device=device, dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.cfg.hidden_size ** -0.5)

    def forward(self, x_TH: torch.Tensor) -> RouterOutput:
        """x_TH: [T, H] -> RouterOutput (see ``route``)."""
        acc = torch.float64 if x_TH.dtype == torch.float64 else torch.float32
        logits_TE = F.linear(x_TH.to(acc), self.weight.to(acc))
        return route(logits_TE, self.cfg, self.expert_bias)


def count_tokens(topk_idx_TK: torch.Tensor, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Slots per expert and dropped slots of a routing, without a host sync.

    Args:
        topk_idx_TK: [T, K] int64, -1 means dropped.
        num_experts: E.
    Returns: (counts_E [E] int64, dropped [] int64), on topk_idx_TK's device.
    Example: idx [[0, 2], [2, -1]], E=3 -> counts [1, 0, 2], dropped 1.
    """
    check_tensor("topk_idx_TK", topk_idx_TK, dtypes=(torch.int64,))
    check_int("num_experts", num_experts, 1)
    flat = topk_idx_TK.reshape(-1)
    # scatter_add into E + 1 bins (bin 0 = dropped) rather than bincount, which syncs on CUDA to size its output.
    bins = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    bins.scatter_add_(0, flat + 1, torch.ones_like(flat))
    return bins[1:], bins[0]
