"""GroupedExperts (SwiGLU over expert-major rows) and the dense SwiGLU used for shared experts.

Shapes legend: R rows, H hidden, F FFN size, e local experts.
y_e(x) = (silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from moe_comm import _wgrad
from moe_comm._checks import check_int, check_int_list
from moe_comm.dispatch.plan import segments_of

__all__ = ["GroupedExperts", "SwiGLU", "swiglu", "PlacedExperts"]

_WEIGHTS = ("w1", "w3", "w2")  # the per-expert weights, in state_dict order


def swiglu(x_RH: torch.Tensor, w1_FH: torch.Tensor, w3_FH: torch.Tensor, w2_HF: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert on rows x_RH: [R, H] -> [R, H]."""
    return F.linear(F.silu(F.linear(x_RH, w1_FH)) * F.linear(x_RH, w3_FH), w2_HF)


def _init_expert_(w1_FH, w3_FH, w2_HF, generator: torch.Generator) -> None:
    # nn.Linear's default bound 1/sqrt(fan_in) for all three: keeps activations O(1) through a stack.
    H, F_ = w1_FH.shape[1], w1_FH.shape[0]
    for w, fan_in in ((w1_FH, H), (w3_FH, H), (w2_HF, F_)):
        b = 1.0 / math.sqrt(fan_in)
        w.copy_(torch.empty(w.shape, dtype=torch.float32).uniform_(-b, b, generator=generator).to(w.dtype))


def _autocast_dtype(x_RH: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype ``torch.autocast`` computes x's GEMMs in, or None (autocast off, or x float64, which
    autocast leaves alone)."""
    device_type = x_RH.device.type
    if x_RH.dtype == torch.float64 or not torch.amp.is_autocast_available(device_type) \
            or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


# torch._grouped_mm (torch 2.13; rules read in ATen/native/GroupedMMUtils.h, cuda/GroupedBlas.cpp,
# cuda/GroupMM.cu, cuda/GroupMMCommon.cuh):
# - every operand: one of its last two strides is 1, the other at least the size it steps over and a
#   multiple of 16 bytes (else "strides should be multiple of 16 bytes"); on CUDA also a 16-byte aligned
#   data pointer. Checked on CPU too: bf16 with H or F not a multiple of 8 raises, forward or backward.
# - dtypes float32 / bfloat16 / float16, all operands the same; offs int32 cumulative row ends.
# - CUDA: the CUTLASS kernel runs for bf16 on compute capability 9.x and 10.x only, with fewer than 1024
#   groups; any other dtype or device (sm80, sm120) takes a per-group loop that copies offs to the host
#   (a sync). CPU: always that per-group mm loop.
# - rows past offs[-1] of its output are not written (torch.empty); a 2-D operand with a zero-length
#   contraction dim (R = 0 in the weight-gradient GEMM) fails the stride check whatever its strides.
_GMM_CUDA_MAJORS = (9, 10)
_GMM_MAX_GROUPS = 1023
_GMM_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Devices where the weight gradient of an expert with no rows is set to 0 after the grouped GEMM: on
# CUDA a zero-length group is not written on every GPU (pytorch issue 172439, sm100). CPU's per-group mm
# writes zeros itself; the fill (3 passes over [e, F, H]) costs 9 ms per step at e=4, H=F=512, fp32.
_GMM_ZERO_EMPTY_DEVICES = ("cuda",)


def _gmm_operand_ok(t: torch.Tensor) -> bool:
    """torch._grouped_mm's stride rule for one operand (its transpose passes or fails alike), plus 16-byte
    aligned data and per-group pointers on CUDA (TMA loads)."""
    align = 16 // t.element_size()
    (s2, s1), (n2, n1) = t.stride()[-2:], t.shape[-2:]
    if s2 == 1 and s1 >= max(1, n2):
        ld = s1
    elif s1 == 1 and s2 >= max(1, n1):
        ld = s2
    else:
        return False
    if ld % align:
        return False
    if t.device.type == "cpu":
        return True
    return t.data_ptr() % 16 == 0 and (t.dim() == 2 or t.stride(0) % align == 0)


def _grouped_mm_works(x_RH: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> bool:
    """True where ``_GroupedSwiGLU`` is known to work, without a host sync on CUDA: x [R, H], w1/w3
    [e, F, H], w2 [e, H, F], forward and backward (every intermediate [R, F] / [R, H] is contiguous, so
    H and F themselves must step in 16 bytes)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    dtype, device = x_RH.dtype, x_RH.device
    if any(w.dtype != dtype or w.device != device for w in (w1, w3, w2)):
        return False
    (R, H), (e, F_) = x_RH.shape, w1.shape[:2]
    align = 16 // x_RH.element_size()
    if R == 0 or e > _GMM_MAX_GROUPS or H % align or F_ % align:
        return False
    if device.type == "cuda":
        if torch.version.hip is not None or dtype != torch.bfloat16 \
                or torch.cuda.get_device_capability(device)[0] not in _GMM_CUDA_MAJORS:
            return False
    elif device.type != "cpu" or dtype not in _GMM_CPU_DTYPES:
        return False
    return all(_gmm_operand_ok(t) for t in (x_RH, w1, w3, w2))


def _use_grouped_mm(x_RH: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                    padded: bool = False) -> bool:
    """Whether GroupedExperts takes ``_GroupedSwiGLU``: where it works (``_grouped_mm_works``), on CUDA
    always; on CPU for padded rows only, where the other sync-free path is the e-times slab one. Unpadded
    on CPU the loop is as fast or faster: R=4096, H=F=512, e=4, 1 thread, forward+backward, median thread
    CPU time over 31 alternating steps: fp32 loop 319 / 298 ms vs grouped 332 / 326 ms (two runs; the
    loop's per-expert elementwise ops stay in cache), bf16 (7 steps) 6080 vs 6107 ms."""
    return (padded or x_RH.device.type != "cpu") and _grouped_mm_works(x_RH, w1, w3, w2)


def _gemm_weights(weights, low) -> tuple:
    """The weights an expert forward's GEMMs read: ``low`` (the weights cast to the autocast dtype, made
    without autograd by ``GroupedExperts.forward``) or, without it, the weights themselves."""
    return tuple(weights) if low is None else tuple(low)


def _recast(weights, low_dtype) -> tuple:
    """In an expert backward: the saved weights cast again to the dtype the forward's GEMMs read (None: as
    they are). The cast rounds the same bits as the forward's, so the GEMMs see the same operands."""
    return tuple(weights) if low_dtype is None else tuple(w.to(low_dtype) for w in weights)


def _to_weight_dtypes(grads, weights) -> tuple:
    """Weight gradients computed in the autocast dtype, back in their weights' dtypes (what the autocast cast's
    backward did when the forward saved the cast copies)."""
    return tuple(g if g is None or g.dtype == w.dtype else g.to(w.dtype) for g, w in zip(grads, weights))


def _input_then_weight_grads(gx, weight_grads, weights) -> tuple:
    """(gx, gw1, gw3, gw2) of an expert backward. Inside the pipeline's backward (``_wgrad.active()``) the
    weight gradients are queued and computed while gx travels back: (gx, None, None, None). ``weights``
    are the forward's input tensors (kept on ctx), not their saved copies: under activation checkpointing a
    saved tensor unpacks to a recomputed alias that autograd would not route to the Parameter."""
    collector = _wgrad.active()
    if collector is not None and gx is not None:
        collector.add(weight_grads, weights)
        return (gx, None, None, None)
    return (gx, *weight_grads())


# Autocast (issue 26.4). Every expert Function below takes the weights themselves (the Parameters, fp32) and
# ``low``: None, or those weights cast to the autocast dtype (no autograd). Its GEMMs read ``low``; it saves
# the weights themselves, not the copies, and casts them again in backward (``_recast``); the weight
# gradients, computed in the autocast dtype, are returned in the weights' dtype. Saving the cast copies
# instead kept C copies of e x 3 x F x H per layer until backward (the pipeline calls the experts once per
# chunk, each call casting anew); now none (the Parameters are alive anyway). Cost: one more cast of the
# weights per chunk, in backward (e = 4, H = F = 512: 3 M elements, 0.7 ms median of 21 on one CPU thread;
# the bf16 GEMMs of one call at R = 4096 take 6 s forward + backward there, ``_use_grouped_mm``).


class _GroupedSwiGLU(torch.autograd.Function):
    """The SwiGLU of ``_LoopSwiGLU`` with torch._grouped_mm over offs = cumsum(tokens_per_expert_e): no
    host read of the counts. Only where ``_grouped_mm_works`` holds.

    padded: rows past offs[-1] are padding. No GEMM reads them (every group ends by offs[-1]), so
    whatever they hold (NaN included) reaches no weight gradient; their output and input-gradient rows,
    which _grouped_mm leaves unwritten, are set to 0. On CUDA the weight gradients of experts with no
    rows are set to 0 as well (``_GMM_ZERO_EMPTY_DEVICES``).
    On CPU its forward and weight gradients came out bit-identical to _LoopSwiGLU's (the same per-group
    mm; R=4096, H=F=512, e=4, fp32 and bf16).
    """

    @staticmethod
    def forward(ctx, x_RH, w1, w3, w2, tokens_per_expert_e, padded, low=None):
        ctx.weights = (w1, w3, w2)  # the inputs themselves: where deferred weight gradients go
        ctx.low_dtype = None if low is None else low[0].dtype
        l1, l3, l2 = _gemm_weights(ctx.weights, low)
        offs_e = tokens_per_expert_e.cumsum(0).to(torch.int32)
        h1 = torch._grouped_mm(x_RH, l1.mT, offs=offs_e)
        h3 = torch._grouped_mm(x_RH, l3.mT, offs=offs_e)
        out_RH = torch._grouped_mm(F.silu(h1) * h3, l2.mT, offs=offs_e)
        pad_R1 = None
        if padded:
            pad_R1 = (torch.arange(x_RH.shape[0], device=x_RH.device) >= offs_e[-1:])[:, None]
            out_RH.masked_fill_(pad_R1, 0)
        ctx.padded = padded
        ctx.save_for_backward(x_RH, w1, w3, w2, offs_e, tokens_per_expert_e, h1, h3, pad_R1)
        return out_RH

    @staticmethod
    def backward(ctx, g_RH):
        x_RH, *weights, offs_e, tokens_per_expert_e, h1, h3, pad_R1 = ctx.saved_tensors
        w1, w3, w2 = _recast(weights, ctx.low_dtype)
        gmm = torch._grouped_mm
        g_RH = g_RH.contiguous()  # an expanded gradient (y.sum()) has strides (0, 0): not a valid operand
        if not _gmm_operand_ok(g_RH):
            g_RH = g_RH.clone()
        sig = torch.sigmoid(h1)
        silu = h1 * sig
        ga = gmm(g_RH, w2, offs=offs_e)                      # [R, F]
        gh3 = ga * silu
        gh1 = ga * h3 * (sig * (1 + h1 * (1 - sig)))         # d silu / d h1
        gx = None
        if ctx.needs_input_grad[0]:
            gx = gmm(gh1, w1, offs=offs_e)
            gx += gmm(gh3, w3, offs=offs_e)
            if ctx.padded:
                gx.masked_fill_(pad_R1, 0)
        needs = ctx.needs_input_grad

        def weight_grads():
            gw1 = gmm(gh1.mT, x_RH, offs=offs_e) if needs[1] else None          # [e, F, H]
            gw3 = gmm(gh3.mT, x_RH, offs=offs_e) if needs[2] else None
            gw2 = gmm(g_RH.mT, silu * h3, offs=offs_e) if needs[3] else None    # [e, H, F]
            if x_RH.device.type in _GMM_ZERO_EMPTY_DEVICES:
                empty_e11 = (tokens_per_expert_e == 0)[:, None, None]
                for gw in (gw1, gw3, gw2):
                    if gw is not None:
                        gw.masked_fill_(empty_e11, 0)
            return _to_weight_dtypes((gw1, gw3, gw2), weights)

        return _input_then_weight_grads(gx, weight_grads, ctx.weights) + (None, None, None)


class _BmmSwiGLU(torch.autograd.Function):
    """SwiGLU of expert i on its [cap, H] slab: x_ECH [e, cap, H] -> [e, cap, H] with torch.bmm, the
    backward of ``_LoopSwiGLU`` batched (h1, h3 kept, silu recomputed). A zero slab row gives a zero
    output row and adds nothing to any gradient."""

    @staticmethod
    def forward(ctx, x_ECH, w1, w3, w2, low=None):
        ctx.weights = (w1, w3, w2)  # the inputs themselves: where deferred weight gradients go
        ctx.low_dtype = None if low is None else low[0].dtype
        l1, l3, l2 = _gemm_weights(ctx.weights, low)
        h1, h3 = torch.bmm(x_ECH, l1.mT), torch.bmm(x_ECH, l3.mT)
        ctx.save_for_backward(x_ECH, w1, w3, w2, h1, h3)
        return torch.bmm(F.silu(h1) * h3, l2.mT)

    @staticmethod
    def backward(ctx, g_ECH):
        x_ECH, *weights, h1, h3 = ctx.saved_tensors
        w1, w3, w2 = _recast(weights, ctx.low_dtype)
        sig = torch.sigmoid(h1)
        silu = h1 * sig
        ga = torch.bmm(g_ECH, w2)                            # [e, cap, F]
        gh3 = ga * silu
        gh1 = ga * h3 * (sig * (1 + h1 * (1 - sig)))
        gx = torch.baddbmm(torch.bmm(gh1, w1), gh3, w3) if ctx.needs_input_grad[0] else None
        needs = ctx.needs_input_grad

        def weight_grads():
            return _to_weight_dtypes((torch.bmm(gh1.mT, x_ECH) if needs[1] else None,
                                      torch.bmm(gh3.mT, x_ECH) if needs[2] else None,
                                      torch.bmm(g_ECH.mT, silu * h3) if needs[3] else None), weights)

        return _input_then_weight_grads(gx, weight_grads, ctx.weights) + (None,)


def _padded_bmm_swiglu(x_RH, w1, w3, w2, tokens_per_expert_e, low=None) -> torch.Tensor:
    """Sync-free SwiGLU of expert-major rows followed by padding, without torch._grouped_mm: expert i's
    rows are gathered into slab i of a zeroed [e, cap, H] buffer (cap = R: one expert may hold every row),
    run through ``_BmmSwiGLU`` and gathered back; padding rows give 0. Every index is computed on the
    device. Memory and GEMM work are e times those of R rows: slabs x [e, R, H] and h1, h3 [e, R, F] are
    kept for backward."""
    R, H = x_RH.shape
    e, cap = w1.shape[0], R
    end_e = tokens_per_expert_e.cumsum(0)
    start_e = end_e - tokens_per_expert_e
    p_C = torch.arange(cap, device=x_RH.device)
    src_EC = (start_e[:, None] + p_C).clamp_max(max(R - 1, 0))          # slot (i, p) <- row start_i + p
    take_EC1 = (p_C < tokens_per_expert_e[:, None])[..., None]
    # where, not a product with the mask: the rows read by unused slots may be padding holding NaN
    x_ECH = torch.where(take_EC1, x_RH.index_select(0, src_EC.reshape(-1)).view(e, cap, H), 0)
    y_ECH = _BmmSwiGLU.apply(x_ECH, w1, w3, w2, low)
    r_R = torch.arange(R, device=x_RH.device)
    expert_R = torch.bucketize(r_R, end_e, right=True)           # first i with end_i > r; e = padding row
    last_R = expert_R.clamp_max(e - 1)
    slot_R = last_R * cap + (r_R - start_e[last_R])              # in [0, e * cap) for padding rows too
    y_RH = y_ECH.reshape(e * cap, H).index_select(0, slot_R)
    return torch.where((expert_R < e)[:, None], y_RH, 0)


class _LoopSwiGLU(torch.autograd.Function):
    """SwiGLU of every expert on its blocks of rows, with an explicit backward.

    segments: [(local expert, first row, rows), ...] covering the rows in order: one block per expert
    (expert-major rows) or several (rows in (source rank, expert) blocks as an all-to-all delivers them).
    Autograd through ``w1[i]`` would materialise a zero-filled [e, F, H] gradient per expert per call
    (select's backward) and add them up: 3e full-size tensors per chunk. Here each weight gradient is
    one [e, F, H] tensor whose slices the per-block GEMMs write (the first block of an expert) or add to.
    Measured, 1 rank, 1 thread, T=4096, H=F=512, E=4, K=2, layer forward+backward: C=1 481 -> 463 ms,
    C=8 535 -> 493 ms. Activations h1, h3 are kept for backward; silu is recomputed.
    """

    @staticmethod
    def forward(ctx, x_RH, w1, w3, w2, segments, low=None):
        ctx.weights = (w1, w3, w2)  # the inputs themselves: where deferred weight gradients go
        ctx.low_dtype = None if low is None else low[0].dtype
        l1, l3, l2 = _gemm_weights(ctx.weights, low)
        out_RH = x_RH.new_empty(x_RH.shape)
        h1s, h3s = [], []
        for i, start, n in segments:
            x = x_RH[start:start + n]
            h1, h3 = x @ l1[i].t(), x @ l3[i].t()
            torch.mm(F.silu(h1) * h3, l2[i].t(), out=out_RH[start:start + n])
            h1s.append(h1)
            h3s.append(h3)
        ctx.segments = segments
        ctx.save_for_backward(x_RH, w1, w3, w2, *h1s, *h3s)
        return out_RH

    @staticmethod
    def backward(ctx, g_RH):
        x_RH, *acts = ctx.saved_tensors
        weights, acts = acts[:3], acts[3:]
        w1, w3, w2 = _recast(weights, ctx.low_dtype)
        segments = ctx.segments
        h1s, h3s = acts[:len(segments)], acts[len(segments):]
        g_RH = g_RH.contiguous()
        gx = torch.empty_like(x_RH) if ctx.needs_input_grad[0] else None
        parts = []  # per block: what its weight gradients need
        for (i, start, n), h1, h3 in zip(segments, h1s, h3s):
            x, g = x_RH[start:start + n], g_RH[start:start + n]
            sig = torch.sigmoid(h1)
            silu = h1 * sig
            ga = g @ w2[i]                                   # [n, F]
            gh3 = ga * silu
            gh1 = ga * h3 * (sig * (1 + h1 * (1 - sig)))     # d silu / d h1
            if gx is not None:
                torch.mm(gh1, w1[i], out=gx[start:start + n])
                gx[start:start + n].addmm_(gh3, w3[i])
            parts.append((i, x, g, gh1, gh3, silu * h3))

        def weight_grads(into=None):
            # into: (gw1, gw3, gw2) sums of earlier chunks (_wgrad.GradSums): added to by the GEMMs themselves
            written = set()  # experts whose slices hold a block's gradient (the rest are 0 or earlier sums)
            if into is None:
                gw1, gw3, gw2 = torch.zeros_like(w1), torch.zeros_like(w3), torch.zeros_like(w2)
            else:
                gw1, gw3, gw2 = into
                written = set(range(w1.shape[0]))
            for i, x, g, gh1, gh3, act in parts:
                if i not in written:
                    torch.mm(g.t(), act, out=gw2[i])         # [H, F]
                    torch.mm(gh1.t(), x, out=gw1[i])         # [F, H]
                    torch.mm(gh3.t(), x, out=gw3[i])
                    written.add(i)
                else:
                    gw2[i].addmm_(g.t(), act)
                    gw1[i].addmm_(gh1.t(), x)
                    gw3[i].addmm_(gh3.t(), x)
            return _to_weight_dtypes((gw1, gw3, gw2), weights)

        # GradSums' buffers have the weights' dtype: the GEMMs add into them only when they compute in it
        weight_grads.accumulates = ctx.low_dtype is None

        return _input_then_weight_grads(gx, weight_grads, ctx.weights) + (None, None)


def _blocks(counts: Sequence[int]) -> List[Tuple[int, int, int]]:
    """Expert-major rows' segments: (expert, first row, rows) of every expert with rows."""
    return segments_of(enumerate(counts))


def _check_segments(segments, rows: int, num_experts: int) -> List[Tuple[int, int, int]]:
    """segments must cover rows 0..R-1 in order with blocks of known local experts."""
    out, start = [], 0
    try:
        for i, first, n in segments:
            if not (0 <= i < num_experts) or first != start or n < 0:
                raise ValueError
            if n:
                out.append((int(i), int(first), int(n)))
            start += n
    except (TypeError, ValueError):
        start = -1
    if start != rows:
        raise ValueError(f"segments must be (local expert < {num_experts}, first row, rows) blocks covering the "
                         f"R = {rows} rows in order, got {list(segments)[:8]}")
    return out


class GroupedExperts(nn.Module):
    """The e experts of this rank as stacked SwiGLU weights.

    Args:
        num_local_experts: e.
        hidden_size, ffn_hidden_size: H, F.
        first_expert: global id of local expert 0 (rank * e); state_dict keys use global ids,
            ``w1.{g}``, ``w3.{g}``, ``w2.{g}``, so checkpoints move between EP sizes.
        num_experts: E, experts over the whole EP group (MoELayer passes it): a checkpoint key whose id
            is not in [0, E) is unknown (unexpected with ``strict``). None: unknown; only ids that are
            not canonical decimals (``w1.0007``, ``w1.x``) are then rejected.
        seed: expert g is initialised from a generator seeded with ``seed + g``, so a layer built
            at any EP size with the same seed holds the same experts.
    Parameters: w1 [e, F, H], w3 [e, F, H], w2 [e, H, F].
    """

    wants_host_counts = True  # the Dispatcher passes counts= (host list): the loop needs no sync
    supports_padded = True  # forward(..., padded=True): the sync-free dispatch's padded rows

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int, *, first_expert: int = 0,
                 seed: int = 0, device=None, dtype=None, num_experts: Optional[int] = None):
        super().__init__()
        e, H, F_ = num_local_experts, hidden_size, ffn_hidden_size
        self.first_expert = check_int("GroupedExperts: first_expert", first_expert, 0)
        self.num_experts = None if num_experts is None else \
            check_int("GroupedExperts: num_experts", num_experts, first_expert + e)
        self.w1 = nn.Parameter(torch.empty(e, F_, H, device=device, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(e, F_, H, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(e, H, F_, device=device, dtype=dtype))
        self.reset_parameters(seed)

    @property
    def num_local_experts(self) -> int:
        return self.w1.shape[0]

    def prefers_segments(self, block_rows: float, device: torch.device) -> bool:
        """Whether ``forward(..., segments=)`` on rows in (source rank, expert) blocks of ``block_rows`` mean
        rows costs less than expert-major rows plus a regroup pass each way (the Dispatcher asks). CPU only
        (on CUDA the grouped GEMM wants expert-major rows). Measured on CPU, 1 thread, fp32, forward +
        backward, segments / (4 regroups + expert-major), R = 2048 unless said: blocks of 256 rows at
        H x F = 512 x 256: 0.97 (W = 2 and 4); 512 rows at 512 x 512 (R = 4096): 0.95; 256 rows at 1024 x 512:
        1.00; but 256 at 256 x 1024: 1.04, 128 at 512 x 512: 1.05, 128 at 1024 x 512: 1.06, 64 at 256 x 256
        (R = 512): 1.11. Smaller blocks split each expert's GEMMs, most of all the weight gradients' (the rows
        are their reduction), so: blocks of at least max(256, F / 2) rows."""
        return device.type == "cpu" and block_rows >= max(256, self.w1.shape[1] / 2)

    @property
    def expert_ids(self) -> List[int]:
        return list(range(self.first_expert, self.first_expert + self.num_local_experts))

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        for i, g in enumerate(self.expert_ids):
            _init_expert_(self.w1[i], self.w3[i], self.w2[i], torch.Generator().manual_seed(seed + g))

    def forward(self, tokens_RH: torch.Tensor, tokens_per_expert_e: torch.Tensor,
                counts: Optional[List[int]] = None, padded: bool = False,
                segments: Optional[Sequence[Tuple[int, int, int]]] = None) -> torch.Tensor:
        """tokens_RH: [R, H] expert-major rows; tokens_per_expert_e: [e] int64 -> [R, H].

        counts: host list equal to tokens_per_expert_e; without it the loop path reads the
        tensor once (a host sync on CUDA). The torch._grouped_mm path (``_use_grouped_mm``) needs neither.
        padded: rows past tokens_per_expert_e.sum() are padding, their number unknown on the host (the
        sync-free dispatch); nothing reads a tensor value on the host, forward or backward. Padding rows
        may hold anything, NaN included: their output rows are exactly 0 and they add nothing to any
        gradient (their input-gradient rows are 0). Takes no ``counts``.
        segments: [(local expert, first row, rows), ...] covering the rows in order, when they are not
        expert-major (the Dispatcher's all-to-all rows in (source rank, expert) blocks); host ints, so no
        sync; always the per-block GEMM loop. Not with ``counts`` or ``padded``.
        Under ``torch.autocast`` the GEMMs run in the autocast dtype, as autocast runs a linear: rows and
        weights are cast to it (the weight gradients flow back to the parameters' dtype) and the output
        is in that dtype (the pipeline casts it to x's dtype for the wire). The cast weights are not kept
        for backward: the parameters are, and backward casts them again (one call per pipeline chunk would
        otherwise keep one copy of e x 3 x F x H per chunk until backward).
        """
        if padded and counts is not None:
            raise ValueError("GroupedExperts: padded=True takes no host counts (the row count is on the device)")
        if segments is not None:
            if padded or counts is not None:
                raise ValueError("GroupedExperts: segments= is given instead of counts= and padded=True")
            segments = _check_segments(segments, tokens_RH.shape[0], self.num_local_experts)
        weights = (self.w1, self.w3, self.w2)
        amp_dtype = _autocast_dtype(tokens_RH)
        if amp_dtype is not None:
            device_type = tokens_RH.device.type
            with torch.autocast(device_type, enabled=False):  # the explicit casts below are the whole policy
                low = None
                if any(w.dtype != amp_dtype for w in weights):
                    with torch.no_grad():  # not saved: the expert Function saves the weights, recasts in backward
                        low = tuple(w.to(amp_dtype) for w in weights)
                return self._compute(tokens_RH.to(amp_dtype), *weights, tokens_per_expert_e, counts, padded,
                                     segments, low)
        return self._compute(tokens_RH, *weights, tokens_per_expert_e, counts, padded, segments)

    @staticmethod
    def _compute(x_RH, w1, w3, w2, tokens_per_expert_e, counts, padded, segments=None, low=None) -> torch.Tensor:
        """The expert Function for these rows. low: None, or (w1, w3, w2) cast to x_RH's dtype without autograd:
        the GEMMs read them, the weights themselves are saved (the comment above ``_GroupedSwiGLU``)."""
        if segments is not None:
            return _LoopSwiGLU.apply(x_RH, w1, w3, w2, segments, low)
        if counts is not None and (sum(counts) != x_RH.shape[0] or len(counts) != w1.shape[0]):
            raise ValueError(f"counts must hold e = {w1.shape[0]} row counts summing to R = {x_RH.shape[0]}, "
                             f"got {counts}")
        if _use_grouped_mm(x_RH, *_gemm_weights((w1, w3, w2), low), padded):
            return _GroupedSwiGLU.apply(x_RH, w1, w3, w2, tokens_per_expert_e, padded, low)
        if padded:
            return _padded_bmm_swiglu(x_RH, w1, w3, w2, tokens_per_expert_e, low)
        if counts is None:
            counts = tokens_per_expert_e.tolist()  # host sync: loop bounds (free on CPU tensors)
        return _LoopSwiGLU.apply(x_RH, w1, w3, w2, _blocks(counts), low)

    # state_dict keyed by global expert id ------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name in _WEIGHTS:
            p = getattr(self, name)
            for i, g in enumerate(self.expert_ids):
                t = p[i]
                destination[f"{prefix}{name}.{g}"] = t if keep_vars else t.detach()

    def _expert_key(self, rest: str) -> Optional[Tuple[str, int]]:
        """``"w1.3"`` -> ("w1", 3); None for anything else: another name, a non-canonical id ("0007",
        "+3", "x"), or an id outside [0, num_experts) when num_experts is known."""
        name, dot, g = rest.partition(".")
        if name not in _WEIGHTS or not dot or not (g.isascii() and g.isdigit()) or str(int(g)) != g:
            return None
        if self.num_experts is not None and int(g) >= self.num_experts:
            return None
        return name, int(g)

    def check_state_dict(self, state_dict, prefix: str = "", *, all_experts: bool = False):
        """Validate the expert keys of ``state_dict`` under ``prefix`` without writing anything.

        Args:
            state_dict: mapping of keys to tensors (a local or a full, expert-keyed checkpoint).
            prefix: this module's key prefix (e.g. "layers.0.moe.experts.").
            all_experts: check every expert 0..E-1 (a full checkpoint: every rank finds a problem of any
                expert, not only its owner), else this rank's experts only. Needs ``num_experts``.
        Returns: (missing keys, unexpected keys, size errors), lists of str. Unexpected keys are keys under
        ``prefix`` that name no expert weight: another name, a malformed id (``w1.0007``) or an unknown one.
        """
        ids = self.expert_ids
        if all_experts and self.num_experts is not None:
            ids = range(self.num_experts)
        missing, errors = [], []
        for name in _WEIGHTS:
            shape = tuple(getattr(self, name).shape[1:])
            for g in sorted(set(ids)):
                key = f"{prefix}{name}.{g}"
                if key not in state_dict:
                    missing.append(key)
                    continue
                src = state_dict[key]
                if not isinstance(src, torch.Tensor):
                    errors.append(f"{key} must be a tensor, got {type(src).__name__}")
                elif tuple(src.shape) != shape:
                    errors.append(f"size mismatch for {key}: copying a param with shape {tuple(src.shape)}, "
                                  f"the expert has shape {shape}")
        unexpected = [k for k in state_dict if k.startswith(prefix) and self._expert_key(k[len(prefix):]) is None]
        return missing, unexpected, errors

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Every key of this module is checked before the first copy: a wrong shape leaves all of them
        # untouched. Missing and unexpected keys are reported; torch decides after the walk over all
        # modules whether they raise (it passes strict=True here whatever the caller's strict), when the
        # other keys are already written, as for any module. The all-or-nothing, collective load (every
        # rank, every module) is moe_comm.modules.checkpoint.load_full_state_dict.
        missing, unexpected, errors = self.check_state_dict(state_dict, prefix)
        missing_keys.extend(missing)
        unexpected_keys.extend(unexpected)
        error_msgs.extend(errors)
        if errors:
            return
        with torch.no_grad():
            for name in _WEIGHTS:
                p = getattr(self, name)
                for i, g in enumerate(self.expert_ids):
                    key = f"{prefix}{name}.{g}"
                    if key in state_dict:
                        p[i].copy_(state_dict[key])


class SwiGLU(nn.Module):
    """Dense SwiGLU (shared experts): w1 [F, H], w3 [F, H], w2 [H, F]."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, seed: int = 0, device=None, dtype=None):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(ffn_hidden_size, hidden_size, device=device, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(ffn_hidden_size, hidden_size, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, device=device, dtype=dtype))
        with torch.no_grad():
            _init_expert_(self.w1, self.w3, self.w2, torch.Generator().manual_seed(seed))

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        return swiglu(x_TH, self.w1, self.w3, self.w2)


class PlacedExperts(GroupedExperts):
    """The experts of this rank's physical slots (after ``MoELayer.apply_placement``).

    Args:
        w1, w3, w2: the layer's existing Parameters, already holding [S, F, H] / [S, F, H] / [S, H, F]
            data (the same Parameter objects as before the placement, so optimizers keep them).
        logical_ids: S logical expert ids, one per local slot (distinct on one rank with the planner).
        first_slot: global physical id of local slot 0 (rank * S).
        num_experts: E logical experts (checkpoint keys with other ids are unknown); None: unknown.
    ``expert_ids`` returns the LOGICAL ids of the local slots, so ``state_dict`` is keyed ``w1.<g>`` by
    logical id (a replica writes the same key as its original: ``full_state_dict`` keeps one copy per
    logical expert) and ``load_state_dict`` of a logical checkpoint fills every replica.
    """

    def __init__(self, w1: nn.Parameter, w3: nn.Parameter, w2: nn.Parameter, logical_ids: Sequence[int],
                 first_slot: int, num_experts: Optional[int] = None):
        nn.Module.__init__(self)
        if not (w1.shape[0] == w3.shape[0] == w2.shape[0] == len(logical_ids)):
            raise ValueError(f"PlacedExperts: w1/w3/w2 must have len(logical_ids) = {len(logical_ids)} slots, "
                             f"got {w1.shape[0]}, {w3.shape[0]}, {w2.shape[0]}")
        self.w1, self.w3, self.w2 = w1, w3, w2
        self.first_expert = first_slot  # physical id of local slot 0 (GroupedExperts' attribute)
        self._logical_ids = check_int_list("PlacedExperts: logical_ids", logical_ids, 0)
        self.num_experts = None if num_experts is None else \
            check_int("PlacedExperts: num_experts", num_experts, max(self._logical_ids, default=-1) + 1)

    @property
    def expert_ids(self) -> List[int]:
        """Logical expert id of each local slot, in local slot order."""
        return list(self._logical_ids)

    @property
    def slot_ids(self) -> List[int]:
        """Global physical slot id of each local slot (first_slot ... first_slot + S - 1)."""
        return list(range(self.first_expert, self.first_expert + len(self._logical_ids)))

    def extra_repr(self) -> str:
        return f"slots={self.slot_ids}, logical={self._logical_ids}"
