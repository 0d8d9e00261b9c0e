"""Router: scores, group-limited top-k, aux / z losses, optional capacity and token mask.

Shapes legend: T tokens, H hidden, E experts (global), K top-k, G expert groups, n = E / G experts per group.
Logits are computed in ``cfg.router_dtype`` (default float32, float64 when x is float64) outside autocast;
scores and weights come out in float32 (float64 when the logits are). A bf16 / fp16 x is never copied whole
into that dtype: cast in row blocks of _CAST_BYTES (or not at all with CUDA's mm out_dtype), and autograd
keeps x in its own dtype.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

from moe_comm._checks import check_int, check_tensor
from moe_comm.config import MoEConfig

__all__ = ["Router", "RouterOutput", "route"]


@dataclass
class RouterOutput:
    """topk_idx_TK: [T, K] int64 expert ids, -1 = dropped by capacity or masked.
    topk_weight_TK: [T, K] float32 (float64 for float64 logits); 0 for dropped and masked slots.
    scores_TE: [T, E] softmax/sigmoid scores, float32/float64; rows of masked tokens are 0.
    aux_loss: [] scalar (0 when both coefficients are 0), over the unmasked tokens.
    logits_TE: [T, E] the logits routed from, as given (a Router's are in its router dtype), masked rows
        included: what a Hugging Face model returns as router logits.
    token_mask_T: [T] bool, True = routed token; None = every token is routed."""

    topk_idx_TK: torch.Tensor
    topk_weight_TK: torch.Tensor
    scores_TE: torch.Tensor
    aux_loss: torch.Tensor
    logits_TE: Optional[torch.Tensor] = None
    token_mask_T: Optional[torch.Tensor] = None


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


def _bin_counts(bins_N: torch.Tensor, num_bins: int) -> torch.Tensor:
    """[num_bins] int64 counts of the int64 values in bins_N (each in [0, num_bins)): ``torch.bincount``'s
    result, but a fixed-size scatter_add (bincount syncs on CUDA to size its output)."""
    return torch.zeros(num_bins, dtype=torch.int64, device=bins_N.device).scatter_add_(0, bins_N,
                                                                                        torch.ones_like(bins_N))


def _apply_capacity(topk_idx_TK: torch.Tensor, topk_score_TK: torch.Tensor, num_experts: int,
                    capacity: int) -> torch.Tensor:
    """Drop (set -1) each expert's lowest-score slots beyond ``capacity``; ties keep the earlier slot.
    Slots that are already -1 (masked tokens) stay -1 and take no capacity."""
    flat_idx = topk_idx_TK.reshape(-1)
    bin_idx = torch.where(flat_idx >= 0, flat_idx, num_experts)  # -1 slots in an extra bin E
    flat_score = topk_score_TK.reshape(-1)
    by_score = torch.sort(flat_score, descending=True, stable=True).indices
    by_expert = by_score[torch.sort(bin_idx[by_score], stable=True).indices]  # expert, then score desc
    counts_E = _bin_counts(bin_idx, num_experts + 1)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    rank_in_expert = torch.empty_like(flat_idx)
    rank_in_expert[by_expert] = torch.arange(flat_idx.numel(), device=flat_idx.device) - start_E[bin_idx[by_expert]]
    kept = (rank_in_expert < capacity) & (flat_idx >= 0)
    return torch.where(kept, flat_idx, torch.full_like(flat_idx, -1)).reshape(topk_idx_TK.shape)


def route(logits_TE: torch.Tensor, cfg: MoEConfig, expert_bias_E: torch.Tensor | None = None,
          token_mask_T: torch.Tensor | None = None) -> RouterOutput:
    """Top-K routing from logits (functional core of ``Router``, also used by the dense reference).

    Args:
        logits_TE: [T, E] floating router logits; scores are computed from them in float32 (float64 for
            float64 logits), as ``softmax(logits.float())`` in Hugging Face models.
        cfg: score_func, top_k, norm_topk_prob, num_groups/topk_groups, capacity_factor, route_scale,
            aux_loss_coeff, z_loss_coeff.
        expert_bias_E: optional [E] bias added to the scores for selection only (aux-loss-free balancing).
        token_mask_T: optional [T] bool, False = a token that is not routed (padding): its K slots are -1
            with weight 0, its scores row is 0, and the aux and z losses average over the unmasked tokens
            only. Capacity (``capacity_factor``) is still sized from all T rows (no host sync).
    Example (softmax, K=1): logits [[0, ln 3]] -> scores [[.25, .75]] -> idx [[1]], weight [[1.0]]
        (norm_topk_prob renormalises the single weight to 1); with token_mask [False]: idx [[-1]], weight [[0.]].
    """
    if not isinstance(cfg, MoEConfig):
        raise TypeError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
    check_tensor("logits_TE", logits_TE, shape=(None, cfg.num_experts), shape_from="[T, E], E = cfg.num_experts",
                 floating=True)
    if expert_bias_E is not None:
        check_tensor("expert_bias_E", expert_bias_E, shape=(cfg.num_experts,), shape_from="E = cfg.num_experts",
                     floating=True)
    T, E = logits_TE.shape
    if token_mask_T is not None:
        check_tensor("token_mask_T", token_mask_T, shape=(T,), shape_from="T from logits_TE", dtypes=(torch.bool,),
                     device=logits_TE.device)
    K = cfg.top_k
    acc = torch.float64 if logits_TE.dtype == torch.float64 else torch.float32
    given_TE, logits_TE = logits_TE, logits_TE.to(acc)
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
    keep_T1 = None if token_mask_T is None else token_mask_T[:, None]
    if keep_T1 is not None:  # before capacity: masked tokens take no expert's capacity
        topk_idx_TK = topk_idx_TK.masked_fill(~keep_T1, -1)
    if cfg.capacity_factor is not None and T > 0:
        capacity = math.ceil(cfg.capacity_factor * T * K / E)
        topk_idx_TK = _apply_capacity(topk_idx_TK, scores_TE.detach().gather(1, topk_idx_TK.clamp_min(0)), E,
                                      capacity)
    if keep_T1 is not None or cfg.capacity_factor is not None:
        topk_weight_TK = topk_weight_TK.masked_fill(topk_idx_TK < 0, 0.0)

    # Token weights of the loss means: 1 per token, 0 for masked ones (a device tensor: no host sync).
    w_T = None if token_mask_T is None else token_mask_T.to(acc)
    n_tok = T if w_T is None else w_T.sum().clamp_min(1.0)
    aux = logits_TE.sum() * 0.0  # keeps the graph (and dtype/device) even when T = 0
    if T > 0 and cfg.aux_loss_coeff > 0:
        # Switch/GShard: E * sum_e f_e * P_e; f = fraction of routed slots, P = mean probability.
        probs_TE = scores_TE if cfg.score_func == "softmax" else scores_TE / scores_TE.sum(-1, keepdim=True)
        routed_TK = torch.where(topk_idx_TK >= 0, topk_idx_TK, E)  # -1 slots in an extra bin E, left out
        f_E = _bin_counts(routed_TK.reshape(-1), E + 1)[:E].to(probs_TE.dtype) \
            / (n_tok * K if w_T is not None else max(T * K, 1))
        P_E = probs_TE.mean(0) if w_T is None else (probs_TE * w_T[:, None]).sum(0) / n_tok
        aux = aux + cfg.aux_loss_coeff * E * (f_E * P_E).sum()
    if T > 0 and cfg.z_loss_coeff > 0:
        z_T = torch.logsumexp(logits_TE, dim=-1).square()
        aux = aux + cfg.z_loss_coeff * (z_T.mean() if w_T is None else (z_T * w_T).sum() / n_tok)
    if keep_T1 is not None:
        scores_TE = scores_TE.masked_fill(~keep_T1, 0.0)
    return RouterOutput(topk_idx_TK=topk_idx_TK, topk_weight_TK=topk_weight_TK, scores_TE=scores_TE, aux_loss=aux,
                        logits_TE=given_TE, token_mask_T=token_mask_T)


# Bytes of one acc-dtype cast of x's rows in the router GEMMs: a bf16 x is cast (and multiplied) this many
# bytes of rows at a time, never as a whole [T, H] float32 copy (twice x's own bytes). CPU torch has no
# bf16 x bf16 -> float32 GEMM (aten::mm.dtype has no CPU kernel in torch 2.13; addmm / linear / mm(out=)
# refuse mixed dtypes), so the rows are cast; on CUDA ``torch.mm(..., out_dtype=float32)`` needs no cast.
# Measured (CPU, 1 thread, T=4096 H=2048 E=64, bf16 x, fp32 weight, forward + backward, 9 interleaved runs):
# 46 ms median in 4 blocks vs 56 ms for autograd through F.linear(x.float(), w), three 32 MiB copies fewer.
_CAST_BYTES = 8 << 20


def _mm_out_dtype(x_TH: torch.Tensor, w_EH: torch.Tensor, acc: torch.dtype) -> bool:
    """Whether ``torch.mm(x, w.T, out_dtype=acc)`` computes the logits from the half-precision x and weight
    as they are (float32 accumulation and output): CUDA builds with the ``aten::mm.dtype`` kernel."""
    return (acc == torch.float32 and x_TH.dtype in (torch.bfloat16, torch.float16) and w_EH.dtype == x_TH.dtype
            and x_TH.device.type == "cuda" and torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype", "CUDA"))


def _row_blocks(T: int, H: int, acc: torch.dtype):
    """Row ranges (r0, r1) whose acc-dtype cast of H columns fits in _CAST_BYTES (one block when T fits)."""
    rows = max(1, _CAST_BYTES // max(1, H * torch.finfo(acc).bits // 8))
    return [(r0, min(T, r0 + rows)) for r0 in range(0, T, rows)] if T > rows else [(0, T)]


class _RouterLogits(torch.autograd.Function):
    """logits = x.to(acc) @ weight.to(acc).T, saving x and the weight in their own dtypes, and never holding a
    whole acc-dtype copy of x: a lower-precision x is cast _CAST_BYTES of rows at a time (forward, and both
    GEMMs of backward), or not at all where ``torch.mm(..., out_dtype=)`` takes it as it is (CUDA, x and
    weight in one half dtype). Forward and gradients are bit-identical to autograd through
    ``F.linear(x.to(acc), w.to(acc))`` while x fits in one block (the same GEMMs in the same layouts, then
    the casts' backward); beyond, logits and x's gradient are computed row block by row block (rows are
    independent) and the weight's gradient is accumulated over the blocks in acc. Autocast is off in
    backward as in forward: also where nothing is cast, autograd's own linear would compute the gradients in
    the autocast dtype of a ``backward()`` called inside ``torch.autocast`` (bf16: ~3e-3 relative error)."""

    @staticmethod
    def forward(ctx, x_TH, w_EH, acc):
        ctx.acc = acc
        ctx.save_for_backward(x_TH, w_EH)
        if x_TH.dtype == acc:
            return F.linear(x_TH, w_EH.to(acc))
        x_NH = x_TH.reshape(-1, x_TH.shape[-1])
        if _mm_out_dtype(x_NH, w_EH, acc):
            return torch.mm(x_NH, w_EH.mT, out_dtype=acc).view(*x_TH.shape[:-1], w_EH.shape[0])
        w_EH = w_EH.to(acc)
        blocks = _row_blocks(*x_NH.shape, acc)
        if len(blocks) == 1:
            return F.linear(x_TH.to(acc), w_EH)
        out_NE = x_NH.new_empty(x_NH.shape[0], w_EH.shape[0], dtype=acc)
        for r0, r1 in blocks:
            torch.mm(x_NH[r0:r1].to(acc), w_EH.mT, out=out_NE[r0:r1])
        return out_NE.view(*x_TH.shape[:-1], w_EH.shape[0])

    @staticmethod
    def backward(ctx, g_TE):
        x_TH, w_EH = ctx.saved_tensors
        acc = ctx.acc
        gx = gw = None
        x_NH, g_NE = x_TH.reshape(-1, x_TH.shape[-1]), g_TE.reshape(-1, g_TE.shape[-1])
        blocks = [(0, x_NH.shape[0])] if x_TH.dtype == acc else _row_blocks(*x_NH.shape, acc)
        with _autocast_off(g_TE.device.type):
            if ctx.needs_input_grad[0]:
                w_acc = w_EH.to(acc)
                if len(blocks) == 1:
                    gx = (g_TE @ w_acc).to(x_TH.dtype)
                else:  # each block's acc-dtype product is cast into x's dtype at once
                    gx = torch.empty_like(x_NH)
                    for r0, r1 in blocks:
                        gx[r0:r1] = g_NE[r0:r1] @ w_acc
                    gx = gx.view_as(x_TH)
            if ctx.needs_input_grad[1]:
                gw = g_NE[:blocks[0][1]].mT @ x_NH[:blocks[0][1]].to(acc)
                for r0, r1 in blocks[1:]:
                    gw.addmm_(g_NE[r0:r1].mT, x_NH[r0:r1].to(acc))
                gw = gw.to(w_EH.dtype)
        return gx, gw, None


def _autocast_off(device_type: str):
    return torch.autocast(device_type, enabled=False) if torch.amp.is_autocast_available(device_type) \
        else contextlib.nullcontext()


class Router(nn.Module):
    """Linear router: ``logits = x @ weight.T`` in ``cfg.router_dtype`` (None: float32, float64 for float64
    x), outside ``torch.autocast``, then ``route``.

    Args:
        cfg: the layer's MoEConfig.
        device, dtype: of the weight; ``cfg.router_dtype``, when set, replaces ``dtype``.
    Parameters: weight [E, H]. Buffers: expert_bias [E], added to the scores for top-K
    selection only (not to the weights); zeros unless the user or a balancing policy sets it.
    """

    def __init__(self, cfg: MoEConfig, *, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        dtype = cfg.router_dtype if cfg.router_dtype is not None else dtype
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, device=device, dtype=dtype))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, device=device, dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.cfg.hidden_size ** -0.5)

    def forward(self, x_TH: torch.Tensor, token_mask_T: Optional[torch.Tensor] = None) -> RouterOutput:
        """x_TH: [T, H]; token_mask_T: optional [T] bool, False = not routed -> RouterOutput (see ``route``).

        Under ``torch.autocast`` the logits stay in the router dtype and the scores and weights in float32:
        autocast is off inside (it would compute the matmul in its own dtype)."""
        acc = self.cfg.router_dtype or (torch.float64 if x_TH.dtype == torch.float64 else torch.float32)
        with _autocast_off(x_TH.device.type):
            logits_TE = _RouterLogits.apply(x_TH, self.weight, acc)
            return route(logits_TE, self.cfg, self.expert_bias, token_mask_T)


def count_tokens(topk_idx_TK: torch.Tensor, num_experts: int,
                 token_mask_T: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Slots per expert and dropped slots of a routing, without a host sync.

    Args:
        topk_idx_TK: [T, K] int64, -1 means dropped.
        num_experts: E.
        token_mask_T: optional [T] bool, False = a masked token: its slots (-1) are not counted as dropped.
    Returns: (counts_E [E] int64, dropped [] int64), on topk_idx_TK's device.
    Example: idx [[0, 2], [2, -1]], E=3 -> counts [1, 0, 2], dropped 1; with token_mask [True, False]:
        idx [[0, 2], [-1, -1]] -> counts [1, 0, 1], dropped 0.
    """
    check_tensor("topk_idx_TK", topk_idx_TK, dtypes=(torch.int64,))
    check_int("num_experts", num_experts, 1)
    if token_mask_T is not None:
        check_tensor("token_mask_T", token_mask_T, shape=(topk_idx_TK.shape[0],), shape_from="T from topk_idx_TK",
                     dtypes=(torch.bool,), device=topk_idx_TK.device)
        # Masked slots go to bin E + 1, counted nowhere (any id they held is ignored).
        topk_idx_TK = topk_idx_TK.masked_fill(~token_mask_T[:, None], num_experts)
    flat = topk_idx_TK.reshape(-1)
    # scatter_add into E + 1 bins (bin 0 = dropped) rather than bincount, which syncs on CUDA to size its output.
    bins = torch.zeros(num_experts + 2, dtype=torch.int64, device=flat.device)
    bins.scatter_add_(0, flat + 1, torch.ones_like(flat))
    return bins[1:num_experts + 1], bins[0]
