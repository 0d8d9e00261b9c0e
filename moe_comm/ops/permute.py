"""Autograd-aware permute / unpermute / row gather over the kernel backends.

Shapes legend: T tokens, K top-k slots, N routed rows, H hidden size, R rows (any gather).
Gradient pairs: permute's backward is an unweighted unpermute; unpermute's backward is one kernel
(``unpermute_backward``) that reads each token's gradient once and writes its K weighted rows (for y)
and its K dot products with the forward's rows (for the weights).
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_comm._checks import check_out, check_tensor
from moe_comm.kernels import select_backend
from moe_comm.ops.layout import Layout

__all__ = ["permute", "unpermute", "gather_rows"]


def _zero_padding(rows_NH: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Padding rows of a padded layout (``layout.valid_N`` False) set to 0 in place; a device op, no sync."""
    if layout.valid_N is not None:
        rows_NH.masked_fill_(~layout.valid_N[:, None], 0)
    return rows_NH


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, layout: Layout, backend: str, out):
        ctx.layout, ctx.backend = layout, backend
        if layout.num_tokens == 0:  # only a padded layout has rows without tokens: all padding
            return x_TH.new_zeros(layout.num_rows, x_TH.shape[1]) if out is None else out.zero_()
        return _zero_padding(select_backend(backend, x_TH.device).permute_rows(x_TH.contiguous(), layout.token_N,
                                                                               out=out), layout)

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
        need_y, need_w = ctx.needs_input_grad[0], w_TK is not None and ctx.needs_input_grad[1]
        if not (need_y or need_w):
            return None, None, None, None
        if layout.num_tokens == 0:  # only a padded layout has rows without tokens
            grad_y = grad_TH.new_zeros(layout.num_rows, grad_TH.shape[1]) if need_y else None
            return grad_y, (torch.zeros_like(w_TK) if need_w else None), None, None
        # one kernel, one pass per token over grad: y's rows (grad * w) and the weights' dot products
        grad_y, grad_w = impl.unpermute_backward(grad_TH, layout.dest_row_TK, layout.num_rows, w_TK,
                                                 y_NH if need_w else None, need_y)
        if grad_y is not None:  # every row is one slot's, except a padded layout's padding: not written, zeroed
            _zero_padding(grad_y, layout)
        return grad_y, None if grad_w is None else grad_w.to(w_TK.dtype), None, None


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
    check_tensor("x_TH", x_TH, shape=(layout.num_tokens, None), shape_from="[T, H], T from the layout", floating=True)
    if out is not None:  # the kernels stage a non-contiguous out through a dense buffer
        check_out("out", out, (layout.num_rows, x_TH.shape[1]), x_TH.dtype, x_TH.device, like="x_TH", contiguous=False)
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
    check_tensor("y_NH", y_NH, shape=(layout.num_rows, None), shape_from="[N, H], N from the layout", floating=True)
    if topk_weight_TK is not None:
        check_tensor("topk_weight_TK", topk_weight_TK, shape=(layout.num_tokens, layout.top_k),
                     shape_from="[T, K] from the layout", dtypes=(torch.float32, torch.float64))
    return _Unpermute.apply(y_NH, topk_weight_TK, layout, backend)


def gather_rows(x_RH: torch.Tensor, index_R: torch.Tensor, inverse_R: torch.Tensor, *,
                backend: str = "auto", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x_RH[index_R]`` for a permutation ``index_R`` whose inverse is ``inverse_R``.

    Args:
        x_RH: [R, H] float rows.
        index_R, inverse_R: [R] integer (int64 preferred), a permutation of 0..R-1 and its inverse
            (not checked: that would need a host sync).
        backend: as in ``permute``. out: optional [R, H] buffer of x's dtype.
    Used to regroup received rows between (source rank, expert) and expert-major order; the
    backward is the inverse gather. Example: index_R = [2, 0, 1], inverse_R = [1, 2, 0].
    """
    check_tensor("x_RH", x_RH, dim=2, floating=True)
    R = x_RH.shape[0]
    check_tensor("index_R", index_R, shape=(R,), shape_from="R from x_RH", integer=True)
    check_tensor("inverse_R", inverse_R, shape=(R,), shape_from="R from x_RH", integer=True)
    check_out("out", out, (R, x_RH.shape[1]), x_RH.dtype, x_RH.device, like="x_RH", contiguous=False)
    return _GatherRows.apply(x_RH, index_R, inverse_R, backend, out)
