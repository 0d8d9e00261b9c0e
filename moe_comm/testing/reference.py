"""Dense reference MoE: every expert on every token, in one process. The oracle for the layer.

Shapes legend: T tokens, H hidden, F FFN size, E experts, K top-k.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from moe_comm.config import MoEConfig
from moe_comm.modules.experts import swiglu
from moe_comm.routing import route

__all__ = ["dense_moe"]


def dense_moe(x_TH: torch.Tensor, router_weight_EH: torch.Tensor, w1_EFH: torch.Tensor, w3_EFH: torch.Tensor,
              w2_EHF: torch.Tensor, cfg: MoEConfig, shared: Optional[Tuple[torch.Tensor, ...]] = None,
              expert_bias_E: Optional[torch.Tensor] = None):
    """y_TH and aux loss of an MoE layer computed densely (use float64 inputs for an oracle).

    Args:
        x_TH: [T, H]; router_weight_EH: [E, H]; w1_EFH, w3_EFH: [E, F, H]; w2_EHF: [E, H, F].
        cfg: the layer's config (routing options).
        shared: optional (w1 [F', H], w3 [F', H], w2 [H, F']) of the shared experts.
    Returns: (y_TH, aux_loss, topk_idx_TK).
    """
    logits_TE = F.linear(x_TH, router_weight_EH)
    r = route(logits_TE, cfg, expert_bias_E)
    y_TH = torch.zeros_like(x_TH)
    for g in range(cfg.num_experts):
        y_g = swiglu(x_TH, w1_EFH[g], w3_EFH[g], w2_EHF[g])  # every token through expert g
        w_T = (r.topk_weight_TK * (r.topk_idx_TK == g)).sum(-1)
        y_TH = y_TH + w_T[:, None].to(y_g.dtype) * y_g
    if shared is not None:
        y_TH = y_TH + swiglu(x_TH, *shared)
    return y_TH, r.aux_loss, r.topk_idx_TK
