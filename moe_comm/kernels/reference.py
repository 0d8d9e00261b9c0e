"""Pure-torch reference of the permutation kernels: the oracle every backend is tested against.

Shapes legend: T tokens, K top-k slots, N permuted rows, H hidden size.
Accumulation: float64 inputs accumulate in float64, everything else in float32, slots summed in
k = 0..K-1 order (fixed order => deterministic), then cast to the input dtype.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["permute_rows", "unpermute_rows", "unpermute_weight_grad", "acc_dtype"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for rows of ``dtype``: float64 stays float64, the rest use float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def permute_rows(x_TH: torch.Tensor, token_N: torch.Tensor, scale_N: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gather rows: ``out[n] = x_TH[token_N[n]]`` (times ``scale_N[n]`` when given).

    Args:
        x_TH: [T, H] any dtype, contiguous rows.
        token_N: [N] int64, each in [0, T).
        scale_N: optional [N] float32 or float64; the product is computed in ``acc_dtype`` and cast back.
        out: optional [N, H] buffer of x's dtype to write into.
    Example:
        x_TH = [[1, 1], [2, 2]], token_N = [1, 0, 1]
        -> [[2, 2], [1, 1], [2, 2]]
        with scale_N = [0.5, 1, 2] -> [[1, 1], [1, 1], [4, 4]]
    """
    if scale_N is None:
        if out is None:
            return x_TH.index_select(0, token_N)
        return torch.index_select(x_TH, 0, token_N, out=out)
    acc = acc_dtype(x_TH.dtype)
    res = (x_TH.index_select(0, token_N).to(acc) * scale_N.to(acc)[:, None]).to(x_TH.dtype)
    if out is None:
        return res
    return out.copy_(res)


def unpermute_rows(y_NH: torch.Tensor, row_TK: torch.Tensor, weight_TK: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scatter-reduce rows back to tokens: ``out[t] = sum_k weight_TK[t, k] * y_NH[row_TK[t, k]]``.

    Args:
        y_NH: [N, H] any float dtype.
        row_TK: [T, K] int64; -1 means the slot was dropped and contributes nothing.
        weight_TK: optional [T, K] float32 or float64 (None: plain sum).
        out: optional [T, H] buffer of y's dtype.
    Example:
        y_NH = [[1, 1], [2, 2], [3, 3]], row_TK = [[2, 0], [1, -1]], weight_TK = [[.5, 1], [2, 9]]
        -> [[.5*3 + 1, ...], [2*2, ...]] = [[2.5, 2.5], [4, 4]]
        token 1's slot 1 is dropped, so its weight 9 is ignored.
    """
    T, K = row_TK.shape
    acc = acc_dtype(y_NH.dtype)
    total = torch.zeros(T, y_NH.shape[1], dtype=acc, device=y_NH.device)
    if y_NH.shape[0] > 0:
        zero = torch.zeros((), dtype=acc, device=y_NH.device)
        for k in range(K):  # fixed slot order: deterministic sum; dropped slots read nothing
            valid = (row_TK[:, k] >= 0)[:, None]
            rows = y_NH.index_select(0, row_TK[:, k].clamp(min=0)).to(acc)
            if weight_TK is not None:
                rows = rows * weight_TK[:, k].to(acc)[:, None]
            total += torch.where(valid, rows, zero)
    if out is None:
        return total.to(y_NH.dtype)
    return out.copy_(total)


def unpermute_weight_grad(grad_TH: torch.Tensor, y_NH: torch.Tensor, row_TK: torch.Tensor) -> torch.Tensor:
    """Gradient of ``unpermute_rows`` w.r.t. its weights: ``g[t, k] = <grad_TH[t], y_NH[row_TK[t, k]]>``.

    Args:
        grad_TH: [T, H] gradient of the unpermuted output.
        y_NH: [N, H] the rows that were unpermuted.
        row_TK: [T, K] int64, -1 for dropped slots (their gradient is 0).
    Returns: [T, K] in ``acc_dtype(y_NH.dtype)`` (float32, or float64 for float64 rows).
    Example:
        grad_TH = [[1, 2]], y_NH = [[3, 4], [5, 6]], row_TK = [[1, -1]]
        -> [[1*5 + 2*6, 0]] = [[17, 0]]
    """
    T, K = row_TK.shape
    acc = acc_dtype(y_NH.dtype)
    g = grad_TH.to(acc)
    out = torch.zeros(T, K, dtype=acc, device=y_NH.device)
    if y_NH.shape[0] == 0:
        return out
    for k in range(K):
        rows = y_NH.index_select(0, row_TK[:, k].clamp(min=0)).to(acc)
        dots = (rows * g).sum(dim=1)
        out[:, k] = torch.where(row_TK[:, k] >= 0, dots, torch.zeros_like(dots))
    return out
