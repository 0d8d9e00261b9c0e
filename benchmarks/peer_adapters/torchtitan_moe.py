"""torchtitan 0.3.0's MoE (``torchtitan.models.common.moe.MoE``) with its ``AllToAllTokenDispatcher``, expert
parallel over the group on CPU gloo ranks.

Configured, not stubbed:
- SPMD backend ``partial_dtensor`` (``set_spmd_backend``): the dispatcher then moves rows with the functional
  ``all_to_all_single`` on a 1-D CPU ``DeviceMesh`` of the group; the default ``spmd_types`` backend expects
  a mesh set up by torchtitan's trainer.
- The inner experts are moe_comm's ``GroupedExperts`` (same weights, same per-expert float32 GEMMs), so the
  two layers differ only in routing, permutation and communication. torchtitan's own ``GroupedExperts``
  casts rows and weights to bfloat16 and runs ``torch._grouped_mm``.
- Router: softmax, ``route_norm=True`` (torchtitan adds 1e-20 to the denominator), no expert bias
  (``load_balance_coeff=None``).
"""
from __future__ import annotations

import torch
from torch import nn

NAME = "torchtitan"
# --no-deps: its declared dependencies (datasets, torchdata, wandb, ...) are for training runs, not this layer
INSTALL = "pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 && pip install tyro"


def missing():
    try:
        import torchtitan.models.common.moe  # noqa: F401
    except Exception as e:  # ImportError, or a dependency failing at import
        return f"{type(e).__name__}: {e}"
    return None


class _Layer(nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x_TH):
        return self.moe(x_TH.unsqueeze(0)).squeeze(0)


def build(ref, group):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import MoE, RoutedExperts, GroupedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    from moe_comm.modules.experts import GroupedExperts as OurExperts

    set_spmd_backend("partial_dtensor")
    cfg = ref.cfg
    E, H, F, K = cfg.num_experts, cfg.hidden_size, cfg.ffn_hidden_size, cfg.top_k
    e = ref.experts.num_local_experts
    moe = MoE.Config(
        num_experts=E, load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=H, hidden_dim=F, num_experts=e),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=E, top_k=K)),
        router=TokenChoiceTopKRouter.Config(
            num_experts=E, gate=Linear.Config(in_features=H, out_features=E), top_k=K,
            score_func="softmax", route_norm=True)).build()
    experts = OurExperts(e, H, F, first_expert=ref.experts.first_expert)
    with torch.no_grad():
        moe.router.gate.weight.copy_(ref.router.weight)
        for name in ("w1", "w3", "w2"):
            getattr(experts, name).copy_(getattr(ref.experts, name))
    moe.routed_experts.inner_experts = experts  # the same call: (rows_RD, tokens per local expert) -> [R, D]
    ranks = dist.get_process_group_ranks(group)
    mesh = DeviceMesh.from_group(group, "cpu", mesh=torch.tensor(ranks))
    moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return _Layer(moe)
