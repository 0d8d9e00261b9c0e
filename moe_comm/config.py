"""MoEConfig: the one keyword-only, validated description of an MoE layer.

Shapes legend: H hidden size, F expert FFN size, E experts (global), K top-k, C chunks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch

from moe_comm._checks import check_bool, check_choice, check_float, check_int

__all__ = ["MoEConfig"]

_SCORE_FUNCS = ("softmax", "sigmoid")
_ROUTER_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Configuration of one MoE layer; validated when built, errors name the field.

    Args:
        hidden_size: H, the model width (x is [..., H]).
        ffn_hidden_size: F, the inner width of each SwiGLU expert.
        num_experts: E, routed experts across the whole EP group (must divide by the EP size).
        top_k: K, experts chosen per token, 1 <= K <= E.
        score_func: "softmax" or "sigmoid" over the E router logits.
        norm_topk_prob: divide the K chosen scores by their sum.
        num_chunks: C, pipeline depth of the dispatch/experts/combine schedule (int >= 1).
        num_groups: expert groups for group-limited routing (DeepSeek-V3); None disables it.
            With expert parallelism, groups of E/num_groups consecutive experts map onto ranks,
            so ``topk_groups`` caps how many ranks one token is sent to.
        topk_groups: groups kept per token when ``num_groups`` is set.
        aux_loss_coeff: weight of the Switch/GShard load-balancing loss (0 disables it).
        z_loss_coeff: weight of the router z-loss mean(logsumexp(logits)^2) (0 disables it).
        capacity_factor: None = dropless (default). A float c gives each expert
            ceil(c * T * K / E) slots per rank; the lowest-score overflow slots are dropped (-1).
        route_scale: constant multiplying the routing weights (DeepSeek-V3 uses 2.5 with sigmoid).
        num_shared_experts: always-on dense SwiGLU experts added to the routed output.
        shared_ffn_hidden_size: F of the shared experts (default: ffn_hidden_size * num_shared_experts).
        shared_expert_gate: scale the shared experts' output per token by ``sigmoid(x @ g.T)``, g the
            layer's ``shared_expert_gate.weight`` [1, H] (Qwen2-MoE). Needs num_shared_experts >= 1.
        router_dtype: dtype of the router weight and of the logits matmul (x is cast to it), independent
            of the experts' dtype: torch.float32 keeps an fp32 router next to bf16 experts (DeepSeek-V3),
            torch.bfloat16 computes bf16 logits as a bf16 Hugging Face model does. None (default): the
            weight has the layer's dtype, the logits are float32 (float64 for float64 x). Scores and
            routing weights are float32 (float64 when the logits are). Under ``torch.autocast`` the
            router runs as stated here, outside autocast.
        max_tokens_per_rank: None (default): dropless with exact exchange sizes, one host sync per forward.
            M: the sync-free mode (``Dispatcher(max_tokens_per_rank=M)``): fixed-size exchanges of
            W x M x K rows, no host sync in forward or backward after the first call; at most M tokens per
            rank per call; needs num_chunks=1. Call ``MoELayer.check()`` once a step to surface a failure of
            another rank (see ``Dispatcher``).
        dedup: one copy per (token, destination rank): a token travels once to each rank holding any of its
            experts, that rank sums its experts' weighted outputs and sends one row back (``Dispatcher(dedup=)``).
            Not with ``max_tokens_per_rank``. Default False.
        dispatch_dtype: None (default: rows travel in the layer's dtype) or torch.float8_e4m3fn: FP8 dispatch,
            one scale per 128 elements (``Dispatcher(dispatch_dtype=)``); combine and the backward stay in the
            layer's dtype.
        dispatch_scales: "fp32" (default) or "ue8m0" (power-of-two scales) for FP8 dispatch.
        ranks_per_node: None (default): flat dispatch. L or "auto" (torchrun's LOCAL_WORLD_SIZE): EP ranks
            k*L .. k*L+L-1 form node k, and a token crosses to each destination node once, then fans out
            inside it (``Dispatcher(ranks_per_node=)``). Not with max_tokens_per_rank nor num_chunks="auto".
        node_limited: node-limited routing: the ``num_groups`` expert groups are the nodes (checked when the
            layer is built: num_groups = EP size / ranks_per_node), so ``topk_groups`` is the most nodes a
            token's experts span. Needs ranks_per_node and num_groups.
    """

    hidden_size: int
    ffn_hidden_size: int
    num_experts: int
    top_k: int
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True
    num_chunks: Union[int, Literal["auto"]] = 1
    num_groups: Optional[int] = None
    topk_groups: Optional[int] = None
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    capacity_factor: Optional[float] = None
    route_scale: float = 1.0
    num_shared_experts: int = 0
    shared_ffn_hidden_size: Optional[int] = None
    shared_expert_gate: bool = False
    router_dtype: Optional[torch.dtype] = None
    max_tokens_per_rank: Optional[int] = None
    dedup: bool = False
    dispatch_dtype: Optional[torch.dtype] = None
    dispatch_scales: Literal["fp32", "ue8m0"] = "fp32"
    ranks_per_node: Union[None, int, Literal["auto"]] = None
    node_limited: bool = False

    def __post_init__(self) -> None:
        for name, low in (("hidden_size", 1), ("ffn_hidden_size", 1), ("num_experts", 1), ("top_k", 1),
                          ("num_shared_experts", 0)):
            check_int(f"MoEConfig.{name}", getattr(self, name), low)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k must be <= num_experts ({self.num_experts}), got {self.top_k}")
        check_choice("MoEConfig.score_func", self.score_func, _SCORE_FUNCS)
        check_bool("MoEConfig.norm_topk_prob", self.norm_topk_prob)
        if isinstance(self.num_chunks, str):
            if self.num_chunks != "auto":
                raise ValueError(f"MoEConfig.num_chunks must be an int >= 1 or 'auto', got {self.num_chunks!r}")
        else:
            check_int("MoEConfig.num_chunks", self.num_chunks, 1)
        if (self.num_groups is None) != (self.topk_groups is None):
            raise ValueError(
                "MoEConfig.num_groups and topk_groups must be given together, got "
                f"num_groups={self.num_groups!r}, topk_groups={self.topk_groups!r}")
        if self.num_groups is not None:
            check_int("MoEConfig.num_groups", self.num_groups, 1)
            check_int("MoEConfig.topk_groups", self.topk_groups, 1)
            if self.num_experts % self.num_groups:
                raise ValueError(
                    f"MoEConfig.num_groups must divide num_experts ({self.num_experts}), got {self.num_groups}")
            if self.topk_groups > self.num_groups:
                raise ValueError(
                    f"MoEConfig.topk_groups must be <= num_groups ({self.num_groups}), got {self.topk_groups}")
            if self.topk_groups * (self.num_experts // self.num_groups) < self.top_k:
                raise ValueError(
                    "MoEConfig.topk_groups * experts per group must be >= top_k "
                    f"({self.top_k}), got {self.topk_groups} * {self.num_experts // self.num_groups}")
        check_float("MoEConfig.aux_loss_coeff", self.aux_loss_coeff, 0.0)
        check_float("MoEConfig.z_loss_coeff", self.z_loss_coeff, 0.0)
        check_float("MoEConfig.route_scale", self.route_scale, 0.0, low_open=True)
        if self.capacity_factor is not None:  # None: dropless
            check_float("MoEConfig.capacity_factor", self.capacity_factor, 0.0, low_open=True)
        if self.shared_ffn_hidden_size is not None:
            check_int("MoEConfig.shared_ffn_hidden_size", self.shared_ffn_hidden_size, 1)
        check_bool("MoEConfig.shared_expert_gate", self.shared_expert_gate)
        if self.shared_expert_gate and self.num_shared_experts == 0:
            raise ValueError("MoEConfig.shared_expert_gate needs num_shared_experts >= 1, got num_shared_experts=0")
        if self.max_tokens_per_rank is not None:
            check_int("MoEConfig.max_tokens_per_rank", self.max_tokens_per_rank, 1)
            if self.num_chunks != 1:
                raise ValueError("MoEConfig.max_tokens_per_rank (the sync-free mode) needs num_chunks=1, got "
                                 f"num_chunks={self.num_chunks!r}")
        check_bool("MoEConfig.dedup", self.dedup)
        if self.dedup and self.max_tokens_per_rank is not None:
            raise ValueError("MoEConfig.dedup=True is not available with max_tokens_per_rank (the sync-free mode)")
        if self.dispatch_dtype is not None and self.dispatch_dtype != torch.float8_e4m3fn:
            raise ValueError("MoEConfig.dispatch_dtype must be None or torch.float8_e4m3fn, got "
                             f"{self.dispatch_dtype!r}")
        check_choice("MoEConfig.dispatch_scales", self.dispatch_scales, ("fp32", "ue8m0"))
        if self.ranks_per_node is not None and self.ranks_per_node != "auto":
            check_int("MoEConfig.ranks_per_node", self.ranks_per_node, 1)
        if self.ranks_per_node is not None and (self.max_tokens_per_rank is not None or self.num_chunks == "auto"):
            raise ValueError("MoEConfig.ranks_per_node (two-level dispatch) is not available with max_tokens_per_rank "
                             f"nor num_chunks='auto', got max_tokens_per_rank={self.max_tokens_per_rank!r}, "
                             f"num_chunks={self.num_chunks!r}")
        check_bool("MoEConfig.node_limited", self.node_limited)
        if self.node_limited and (self.ranks_per_node is None or self.num_groups is None):
            raise ValueError("MoEConfig.node_limited needs ranks_per_node and num_groups (one expert group per node, "
                             f"topk_groups = nodes per token), got ranks_per_node={self.ranks_per_node!r}, "
                             f"num_groups={self.num_groups!r}")
        if self.router_dtype is not None:
            if not isinstance(self.router_dtype, torch.dtype):
                raise TypeError(f"MoEConfig.router_dtype must be None or a torch.dtype, got {self.router_dtype!r}")
            check_choice("MoEConfig.router_dtype", self.router_dtype, _ROUTER_DTYPES)

    @property
    def shared_ffn_size(self) -> int:
        """F of the fused shared-expert SwiGLU (0 when there are no shared experts)."""
        if self.num_shared_experts == 0:
            return 0
        return self.shared_ffn_hidden_size or self.ffn_hidden_size * self.num_shared_experts

    def replace(self, **changes) -> "MoEConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)
