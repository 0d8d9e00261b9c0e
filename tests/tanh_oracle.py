"""A float64 oracle for Dispatcher tests: tanh experts over H = 10, tokens and routing per rank from a seed.

``dense(x, idx, w, W_full)`` is y[t] = sum_k w[t, k] tanh(x[t] @ W_full[idx[t, k]]) with float64 autograd, the
reference the pipelined call (flat, one copy per rank, two-level) must equal."""
import torch

H = 10


def data(rank, E, K, T, drop, seed=5):
    g = torch.Generator().manual_seed(seed * 31 + rank)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    if drop and T:
        idx[torch.rand(T, K, generator=g) < 0.25] = -1
    return x, idx, torch.rand(T, K, generator=g, dtype=torch.float64)


def experts(E, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, H, H, generator=g, dtype=torch.float64) * H ** -0.5


def dense(x, idx, w, W_full):
    """y[t] = sum_k w[t, k] tanh(x[t] @ W_full[idx[t, k]]) with float64 autograd: the oracle."""
    y = torch.zeros_like(x)
    for k in range(idx.shape[1]):
        valid = idx[:, k] >= 0
        out = torch.tanh(torch.einsum("th,thf->tf", x, W_full[idx[:, k].clamp(min=0)]))
        y = y + torch.where(valid[:, None], w[:, k:k + 1] * out, torch.zeros_like(out))
    return y
