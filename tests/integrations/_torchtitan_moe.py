"""Test fixtures for ``moe_comm.integrations.torchtitan`` (torchtitan 0.3.0 on CPU gloo ranks), shared by its
tests, the example's test and the peers benchmark adapter. Every change to torchtitan's behaviour is here,
named, never in the library:

- ``use_partial_dtensor_backend()``: torchtitan's SPMD backend "partial_dtensor" (``set_spmd_backend``); its
  default "spmd_types" expects a mesh that torchtitan's trainer sets up. The all-to-all dispatcher then moves
  rows with the functional ``all_to_all_single`` on the EP ``DeviceMesh`` (gloo on CPU).
- ``Fp32GroupedExperts``: torchtitan's ``GroupedExperts`` (same parameters, same ``torch._grouped_mm``), minus
  its casts to bfloat16, for float32 parity figures. torchtitan's own class runs as is in the bf16 tests
  (``torch._grouped_mm`` has a CPU path; dims a multiple of 8).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
from torch.distributed.tensor import DTensor


def use_partial_dtensor_backend() -> None:
    set_spmd_backend("partial_dtensor")


class Fp32GroupedExperts(GroupedExperts):
    """torchtitan's GroupedExperts computing in the weights' dtype (torchtitan's casts rows and weights to
    bfloat16): y = (silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T per expert, by ``torch._grouped_mm``."""

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h_RF = F.silu(torch._grouped_mm(x_RD, w1.transpose(-2, -1), offs=offs))
        h_RF = h_RF * torch._grouped_mm(x_RD, w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h_RF, w2.transpose(-2, -1), offs=offs).type_as(x_RD)


# Routing configurations of torchtitan's models, tiny: qwen3-MoE (softmax, renormalised), deepseek-v3 (sigmoid,
# group-limited, scaled, aux-loss-free expert bias, a shared expert).
ROUTINGS = {
    "qwen3": dict(score_func="softmax", route_norm=True),
    "deepseek_v3": dict(score_func="sigmoid", route_norm=True, route_scale=2.5, num_expert_groups=4,
                        num_limited_groups=2),
}


def build_moe(routing: str, *, E: int = 8, D: int = 16, F_: int = 32, K: int = 2, world_size: int = 1,
              rank: int = 0, fp32_experts: bool = True, seed: int = 0) -> MoE:
    """One torchtitan MoE (float32) with torchtitan's all-to-all dispatcher, this rank's E / W experts, seeded
    weights (identical on every rank for the replicated ones); the EP mesh is wired by ``wire_ep``."""
    deepseek = routing == "deepseek_v3"
    e = E // world_size
    cfg = MoE.Config(
        num_experts=E, load_balance_coeff=1e-3 if deepseek else None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=D, hidden_dim=F_, num_experts=e),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=E, top_k=K)),
        router=TokenChoiceTopKRouter.Config(num_experts=E, gate=Linear.Config(in_features=D, out_features=E),
                                            top_k=K, **ROUTINGS[routing]),
        shared_experts=FeedForward.Config(w1=Linear.Config(in_features=D, out_features=F_),
                                          w2=Linear.Config(in_features=F_, out_features=D),
                                          w3=Linear.Config(in_features=D, out_features=F_)) if deepseek else None)
    moe = cfg.build()
    if fp32_experts:
        inner = moe.routed_experts.inner_experts
        inner.__class__ = Fp32GroupedExperts
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(moe.named_parameters()):
            if "inner_experts" in name:  # all E experts drawn, this rank's slice kept
                full = torch.randn((E,) + tuple(p.shape[1:]), generator=g) * p.shape[-1] ** -0.5
                p.copy_(full[rank * e:(rank + 1) * e])
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        if moe.expert_bias_E is not None:
            moe.expert_bias_E.copy_(torch.randn(E, generator=g) * 0.05)
    return moe


def wire_ep(moe: MoE, group) -> None:
    """torchtitan's all-to-all dispatcher on ``group`` (a 1-D CPU DeviceMesh of it); nothing for 1 rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if dist.get_world_size(group) > 1:
        mesh = DeviceMesh.from_group(group, "cpu", mesh=torch.tensor(dist.get_process_group_ranks(group)))
        moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)


def twin(moe: MoE) -> MoE:
    return copy.deepcopy(moe)


def grads(moe: MoE) -> dict:
    return {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
