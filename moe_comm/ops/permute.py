"""Autograd-aware permute / unpermute / row gather over the kernel backends.

Shapes legend: T tokens, K top-k slots, N routed rows, H hidden size, R rows (any gather).
Gradient pairs: permute's backward is an unweighted unpermute; unpermute's backward is a
weighted permute (for y) plus per-slot dot products (for the weights).
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_comm.kernels import select_backend
from moe_comm.ops.layout import Layout

__all__ = ["permute", "unpermute", "gather_rows"]


def _check_rows(name: str, t: torch.Tensor, rows: int, dim_name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [{dim_name}, H], got shape {tuple(t.shape)}")
    if t.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows ({dim_name} from the layout), got {t.shape[0]}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, layout: Layout, backend: str, out):
        ctx.layout, ctx.backend = layout, backend
        return select_backend(backend, x_TH.device).permute_rows(x_TH.contiguous(), layout.token_N, out=out)

    @staticmethod
    def backward(ctx, grad_NH):
        impl = select_backend(ctx.backend, grad_NH.device)
        return impl.unpermute_rows(grad_NH.contiguous(), ctx.layout.dest_row_TK), None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_NH, weight_TK, layout: Layout, backend: str):
        impl = select_backend(backend, y_NH.device)
        y_NH = y_NH.contiguous()
        w = None if weight_TK is None else weight_TK.contiguous()
        ctx.layout, ctx.backend = layout, backend
        # y_NH is needed only for the weights' gradient; not saving it otherwise lets callers pass
        # rows from a reused buffer.
        ctx.save_for_backward(y_NH if ctx.needs_input_grad[1] else None, w)
        return impl.unpermute_rows(y_NH, layout.dest_row_TK, w)

    @staticmethod
    def backward(ctx, grad_TH):
        y_NH, w_TK = ctx.saved_tensors
        layout: Layout = ctx.layout
        impl = select_backend(ctx.backend, grad_TH.device)
        grad_TH = grad_TH.contiguous()
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            scale_N = None if w_TK is None else w_TK.reshape(-1).index_select(0, layout.src_slot_N)
            grad_y = impl.permute_rows(grad_TH, layout.token_N, scale_N)
        if w_TK is not None and ctx.needs_input_grad[1]:
            grad_w = impl.unpermute_weight_grad(grad_TH, y_NH, layout.dest_row_TK).to(w_TK.dtype)
        return grad_y, grad_w, None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RH, index_R, inverse_R, backend: str, out):
        ctx.save_for_backward(inverse_R)
        ctx.backend = backend
        return select_backend(backend, x_RH.device).permute_rows(x_RH.contiguous(), index_R, out=out)

    @staticmethod
    def backward(ctx, grad_RH):
        (inverse_R,) = ctx.saved_tensors
        impl = select_backend(ctx.backend, grad_RH.device)
        return impl.permute_rows(grad_RH.contiguous(), inverse_R), None, None, None, None


def permute(x_TH: torch.Tensor, layout: Layout, *, backend: str = "auto",
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Copy token rows into routed order: row n of the result is token ``layout.token_N[n]``.

    Args:
        x_TH: [T, H] float tensor (any float dtype), T = ``layout.num_tokens``.
        layout: from ``make_layout``; rows are grouped by (chunk, dest rank, local expert),
            stable in token order. Dropped slots (-1) get no row.
        backend: "auto" | "triton" | "native" | "torch"; all give bit-identical results.
        out: optional [N, H] buffer to write into (e.g. a persistent workspace: no page faults).
    Returns: x_NH [N, H], same dtype (``out`` when given). Differentiable w.r.t. x.
    Example:
        x_TH = [[a], [b]], topk_idx_TK = [[1, 0], [0, -1]], E = 2
        -> [[a], [b], [a]]   (expert 0: token 0 then token 1; expert 1: token 0)
    """
    _check_rows("x_TH", x_TH, layout.num_tokens, "T")
    if out is not None and (tuple(out.shape) != (layout.num_rows, x_TH.shape[1]) or out.dtype != x_TH.dtype):
        raise ValueError(f"out must be [N, H] = [{layout.num_rows}, {x_TH.shape[1]}] of dtype {x_TH.dtype}, "
                         f"got {list(out.shape)} of {out.dtype}")
    return _Permute.apply(x_TH, layout, backend, out)


def unpermute(y_NH: torch.Tensor, layout: Layout, topk_weight_TK: Optional[torch.Tensor] = None, *,
              backend: str = "auto") -> torch.Tensor:
    """Return routed rows to token order, summing each token's K slots with their weights.

    Args:
        y_NH: [N, H] rows in the order ``permute`` produced.
        layout: the layout used for ``permute``.
        topk_weight_TK: [T, K] float32/float64 weights, or None for a plain sum. Weights of
            dropped slots are ignored (their gradient is 0).
        backend: as in ``permute``.
    Returns: y_TH [T, H] in y's dtype; slots summed in k order, accumulated in float32
        (float64 for float64), so the result is deterministic. Differentiable w.r.t. y and weights.
    Example:
        y_NH = [[1], [2], [3]], dest_row_TK = [[2, 0], [1, -1]], weight = [[.5, 1], [2, 9]]
        -> [[.5*3 + 1*1], [2*2]] = [[2.5], [4]]
    """
    _check_rows("y_NH", y_NH, layout.num_rows, "N")
    if topk_weight_TK is not None:
        if not isinstance(topk_weight_TK, torch.Tensor):
            raise TypeError(f"topk_weight_TK must be a torch.Tensor or None, got {type(topk_weight_TK).__name__}")
        expected = (layout.num_tokens, layout.top_k)
        if tuple(topk_weight_TK.shape) != expected:
            raise ValueError(f"topk_weight_TK must have shape [T, K] = {list(expected)}, "
                             f"got {list(topk_weight_TK.shape)}")
        if topk_weight_TK.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"topk_weight_TK must be float32 or float64, got {topk_weight_TK.dtype}")
    return _Unpermute.apply(y_NH, topk_weight_TK, layout, backend)


def gather_rows(x_RH: torch.Tensor, index_R: torch.Tensor, inverse_R: torch.Tensor, *,
                backend: str = "auto", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x_RH[index_R]`` for a permutation ``index_R`` whose inverse is ``inverse_R``.

    Used to regroup received rows between (source rank, expert) and expert-major order; the
    backward is the inverse gather. Example: index_R = [2, 0, 1], inverse_R = [1, 2, 0].
    """
    return _GatherRows.apply(x_RH, index_R, inverse_R, backend, out)
