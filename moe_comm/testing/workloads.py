"""Reproducible routing workloads shared by tests and benchmarks.

Shapes legend: T tokens, E experts (global), K top-k, W EP world size (ranks own E / W consecutive experts).

Every generator returns ``topk_idx_TK``: [T, K] int64, K distinct experts per token (never -1), the same
tensor for the same ``(num_tokens, num_experts, top_k, seed, step)`` on every machine and every call.

How a workload is sampled. Each workload defines a target *slot share* ``q_E`` (the fraction of the T*K
routed slots each expert should receive, summing to 1). A token holds an expert at most once, so an
expert can take at most 1/K of the slots: the inclusion probabilities ``pi_E = K * q_E`` are capped at 1
and the excess is spread over the other experts in proportion to their share (``expected_shares``
returns the result, which equals ``q_E`` whenever every ``q_E <= 1/K``). Each token then draws K distinct
experts with exactly these inclusion probabilities by randomised systematic sampling: shuffle the experts,
lay their ``pi`` end to end on [0, K), and take the experts under the points ``u, u+1, ..., u+K-1`` for
one uniform ``u``. It is vectorised over tokens (one argsort, one cumsum, one searchsorted), and unlike
Gumbel top-k (Plackett-Luce) sampling its marginals are exact: "2 hot experts take 40% of the slots"
really means 40% in expectation, for any K.

    >>> make_workload("hot_experts", k=2, p=0.4)(1024, 16, 2, seed=0).shape
    torch.Size([1024, 2])
"""
from __future__ import annotations

import inspect
from typing import Callable, Dict, Tuple

import torch

from moe_comm._checks import check_float, check_fraction, check_int, check_tensor
from moe_comm.routing import count_tokens  # noqa: F401  (re-exported: generators' users count with it)

__all__ = [
    "WORKLOADS", "Workload", "make_workload", "uniform", "zipf", "hot_experts", "hot_rank", "drifting",
    "target_shares", "expected_shares", "sample_topk", "routing_logits", "count_tokens",
]


# ---------------------------------------------------------------------------------------------------------
# Target slot shares q_E of each workload (float64, sum 1). ``step`` only matters for drifting.

def _uniform_shares(num_experts: int, step: int) -> torch.Tensor:
    return torch.full((num_experts,), 1.0 / num_experts, dtype=torch.float64)


def _zipf_shares(num_experts: int, step: int, *, s: float = 1.2) -> torch.Tensor:
    s = check_float("zipf: s", s, 0.0)
    w_E = torch.arange(1, num_experts + 1, dtype=torch.float64).pow(-s)
    return w_E / w_E.sum()


def _hot_set_shares(num_experts: int, hot_E: torch.Tensor, p: float) -> torch.Tensor:
    """Experts in the bool mask ``hot_E`` share ``p`` evenly; the others share ``1 - p`` evenly."""
    n_hot = int(hot_E.sum())
    n_cold = num_experts - n_hot
    q_E = torch.zeros(num_experts, dtype=torch.float64)
    if n_cold == 0:
        return q_E + 1.0 / num_experts
    q_E[hot_E] = p / n_hot
    q_E[~hot_E] = (1.0 - p) / n_cold
    return q_E


def _hot_experts_shares(num_experts: int, step: int, *, k: int = 2, p: float = 0.5) -> torch.Tensor:
    k = check_int("hot_experts: k", k, 1, high=num_experts)
    hot_E = torch.zeros(num_experts, dtype=torch.bool)
    hot_E[:k] = True  # experts 0 .. k-1 are hot
    return _hot_set_shares(num_experts, hot_E, check_fraction("hot_experts: p", p))


def _hot_rank_shares(num_experts: int, step: int, *, rank: int = 0, num_ranks: int = 2,
                     p: float = 0.5) -> torch.Tensor:
    num_ranks = check_int("hot_rank: num_ranks", num_ranks, 1, high=num_experts)
    if num_experts % num_ranks:
        raise ValueError(f"hot_rank: num_experts ({num_experts}) must be divisible by num_ranks, got {num_ranks}")
    rank = check_int("hot_rank: rank", rank, 0, high=num_ranks - 1)
    e = num_experts // num_ranks
    hot_E = torch.zeros(num_experts, dtype=torch.bool)
    hot_E[rank * e:(rank + 1) * e] = True
    return _hot_set_shares(num_experts, hot_E, check_fraction("hot_rank: p", p))


def drifting_hot_set(num_experts: int, step: int, hot: int = 2, period: int = 10) -> torch.Tensor:
    """[hot] int64 ids of the hot experts of ``drifting`` at ``step``: ``hot`` experts spaced E / hot
    apart, all moving up by one expert (mod E) every ``period`` steps.
    Example (E=8, hot=2, period=10): steps 0-9 -> [0, 4]; steps 10-19 -> [1, 5]; step 80 -> [0, 4]."""
    check_int("drifting: num_experts", num_experts, 1)
    check_int("drifting: step", step, 0)
    check_int("drifting: hot", hot, 1, high=num_experts)
    check_int("drifting: period", period, 1)
    return (torch.arange(hot, dtype=torch.int64) * num_experts // hot + step // period) % num_experts


def _drifting_shares(num_experts: int, step: int, *, hot: int = 2, period: int = 10,
                     p: float = 0.5) -> torch.Tensor:
    hot_E = torch.zeros(num_experts, dtype=torch.bool)
    hot_E[drifting_hot_set(num_experts, step, hot, period)] = True  # checks hot and period
    return _hot_set_shares(num_experts, hot_E, check_fraction("drifting: p", p))


_SHARES: Dict[str, Callable[..., torch.Tensor]] = {
    "uniform": _uniform_shares,
    "zipf": _zipf_shares,
    "hot_experts": _hot_experts_shares,
    "hot_rank": _hot_rank_shares,
    "drifting": _drifting_shares,
}
WORKLOADS: Tuple[str, ...] = tuple(_SHARES)
"""Names accepted by ``make_workload``."""


def _params_of(name: str) -> Dict[str, object]:
    """Keyword parameters of a workload and their defaults."""
    sig = inspect.signature(_SHARES[name])
    return {p.name: p.default for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _check_name_params(name: str, params: Dict[str, object]) -> None:
    if name not in _SHARES:
        raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")
    known = _params_of(name)
    unknown = sorted(set(params) - set(known))
    if unknown:
        allowed = ", ".join(f"{k}={v!r}" for k, v in known.items()) or "none"
        raise ValueError(f"workload {name!r} got unknown parameter(s) {', '.join(unknown)}; "
                         f"its parameters are: {allowed}")


def _check_sizes(num_tokens: int, num_experts: int, top_k: int) -> None:
    check_int("num_tokens", num_tokens, 0)
    check_int("num_experts", num_experts, 1)
    check_int("top_k", top_k, 1)
    if top_k > num_experts:
        raise ValueError(f"top_k must be <= num_experts ({num_experts}), got {top_k}")


def target_shares(name: str, num_experts: int, step: int = 0, **params) -> torch.Tensor:
    """[E] float64 slot shares the workload asks for (sum 1), before the 1/K cap; see the module doc."""
    _check_name_params(name, params)
    return _SHARES[name](num_experts, step, **params)


def _cap_inclusion(q_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """Inclusion probabilities pi_E = K * q_E with every pi <= 1 and sum K: capped experts get 1, the
    excess goes to the uncapped ones in proportion to q (repeated until nothing exceeds 1)."""
    pi_E = q_E * top_k
    capped_E = torch.zeros_like(q_E, dtype=torch.bool)
    while True:
        over_E = (pi_E > 1.0) & ~capped_E
        if not bool(over_E.any()):
            break
        capped_E |= over_E  # fewer than K experts can exceed 1 while the total is K
        rest_E = q_E.masked_fill(capped_E, 0.0)
        if float(rest_E.sum()) <= 0.0:
            break
        pi_E = torch.where(capped_E, torch.ones_like(q_E), rest_E * ((top_k - int(capped_E.sum())) / rest_E.sum()))
    if int((pi_E > 0).sum()) < top_k:
        raise ValueError(f"the workload puts weight on only {int((q_E > 0).sum())} experts, fewer than "
                         f"top_k={top_k} distinct experts per token; lower top_k or p")
    return pi_E.clamp(max=1.0)


def expected_shares(name: str, num_experts: int, top_k: int, step: int = 0, **params) -> torch.Tensor:
    """[E] float64 expected fraction of the T*K slots each expert receives (sum 1): the target shares
    after the 1/K cap (a token holds an expert at most once). Tests compare counts against this."""
    _check_sizes(0, num_experts, top_k)
    return _cap_inclusion(target_shares(name, num_experts, step, **params), top_k) / top_k


def _generator(seed: int, step: int) -> torch.Generator:
    check_int("seed", seed)
    check_int("step", step, 0)
    # One stream per (seed, step): a 64-bit mix so that neighbouring seeds and steps do not collide.
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % (2 ** 63)
    return torch.Generator().manual_seed(mixed)


def sample_topk(pi_E: torch.Tensor, num_tokens: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """K distinct experts per token with inclusion probabilities ``pi_E`` (randomised systematic sampling).

    Args:
        pi_E: [E] float64, each in [0, 1], summing to K.
        num_tokens: T. top_k: K. generator: CPU torch.Generator (the only source of randomness).
    Returns: [T, K] int64, each row K distinct ids sorted by the shuffled order (not by id).
    Example: pi = [1, .5, .5], K = 2 -> every row holds expert 0 and one of {1, 2}, each half the time.
    """
    E = pi_E.numel()
    order_TE = torch.rand(num_tokens, E, generator=generator, dtype=torch.float64).argsort(dim=1)
    cum_TE = pi_E[order_TE].cumsum(dim=1)
    u_T1 = torch.rand(num_tokens, 1, generator=generator, dtype=torch.float64)
    points_TK = u_T1 + torch.arange(top_k, dtype=torch.float64)
    # Interval of the i-th shuffled expert is [cum[i-1], cum[i]); length pi <= 1, so it holds at most one
    # of the K points (one apart): the K experts are distinct.
    # Rounding can leave cum[-1] a hair under K: keep the last point inside the last non-empty interval.
    points_TK = torch.minimum(points_TK, cum_TE[:, -1:] * (1.0 - 1e-12))
    pos_TK = torch.searchsorted(cum_TE, points_TK, right=True)
    return order_TE.gather(1, pos_TK)


def _generate(name: str, num_tokens: int, num_experts: int, top_k: int, seed: int, step: int,
              params: Dict[str, object]) -> torch.Tensor:
    _check_sizes(num_tokens, num_experts, top_k)
    pi_E = _cap_inclusion(target_shares(name, num_experts, step, **params), top_k)
    return sample_topk(pi_E, num_tokens, top_k, _generator(seed, step))


# ---------------------------------------------------------------------------------------------------------
# Public generators: (num_tokens T, num_experts E, top_k K, seed, step) -> topk_idx_TK [T, K] int64.

def uniform(num_tokens: int, num_experts: int, top_k: int, seed: int = 0, step: int = 0) -> torch.Tensor:
    """Every expert equally likely: each takes 1/E of the slots."""
    return _generate("uniform", num_tokens, num_experts, top_k, seed, step, {})


def zipf(num_tokens: int, num_experts: int, top_k: int, seed: int = 0, step: int = 0, *,
         s: float = 1.2) -> torch.Tensor:
    """Expert i (0-based) takes a share proportional to (i + 1) ** -s: expert 0 hottest, monotone in id
    (before the 1/K cap, which flattens the head: see ``expected_shares``)."""
    return _generate("zipf", num_tokens, num_experts, top_k, seed, step, {"s": s})


def hot_experts(num_tokens: int, num_experts: int, top_k: int, seed: int = 0, step: int = 0, *,
                k: int = 2, p: float = 0.5) -> torch.Tensor:
    """Experts 0 .. k-1 share the fraction ``p`` of the slots evenly; the others share 1 - p."""
    return _generate("hot_experts", num_tokens, num_experts, top_k, seed, step, {"k": k, "p": p})


def hot_rank(num_tokens: int, num_experts: int, top_k: int, seed: int = 0, step: int = 0, *,
             rank: int = 0, num_ranks: int = 2, p: float = 0.5) -> torch.Tensor:
    """The E / num_ranks experts of ``rank`` (rank * E / W ...) share ``p`` of the slots evenly."""
    return _generate("hot_rank", num_tokens, num_experts, top_k, seed, step,
                     {"rank": rank, "num_ranks": num_ranks, "p": p})


def drifting(num_tokens: int, num_experts: int, top_k: int, seed: int = 0, step: int = 0, *,
             hot: int = 2, period: int = 10, p: float = 0.5) -> torch.Tensor:
    """``hot`` experts spaced E / hot apart share ``p`` of the slots; they all move up by one expert every
    ``period`` steps (``drifting_hot_set`` gives the set at a step)."""
    return _generate("drifting", num_tokens, num_experts, top_k, seed, step,
                     {"hot": hot, "period": period, "p": p})


class Workload:
    """A named workload with fixed parameters: ``wl(num_tokens, num_experts, top_k, seed=0, step=0)``
    returns topk_idx_TK [T, K] int64; ``wl.expected_shares(num_experts, top_k, step)`` its [E] shares."""

    def __init__(self, name: str, **params):
        _check_name_params(name, params)
        self.name = name
        self.params = {**_params_of(name), **params}

    def __call__(self, num_tokens: int, num_experts: int, top_k: int, seed: int = 0, step: int = 0) -> torch.Tensor:
        return _generate(self.name, num_tokens, num_experts, top_k, seed, step, self.params)

    def expected_shares(self, num_experts: int, top_k: int, step: int = 0) -> torch.Tensor:
        return expected_shares(self.name, num_experts, top_k, step, **self.params)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"Workload({self.name!r}{', ' + args if args else ''})"


def make_workload(name: str, **params) -> Workload:
    """Workload by name (one of ``WORKLOADS``) with keyword parameters; unknown names or parameters raise
    ValueError listing what is accepted. ``make_workload("zipf", s=1.2)(4096, 64, 8, seed=1)``."""
    return Workload(name, **params)


# ---------------------------------------------------------------------------------------------------------
# Helpers

def routing_logits(topk_idx_TK: torch.Tensor, num_experts: int, seed: int = 0,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Router-like logits [T, E] whose top-K (softmax or sigmoid, both monotone) is exactly ``topk_idx_TK``,
    in the order given (column 0 gets the largest logit).

    Args:
        topk_idx_TK: [T, K] int64 distinct expert ids per row (no -1).
        num_experts: E. seed: for the small noise on the unchosen logits. dtype: of the result.
    Chosen experts get logits in [1, 2] (decreasing with the column), the others in [-1, 0).
    Example (E=4, idx [[2, 0]]): logits[0] = [1.5, ~-0.6, 2.0, ~-0.2].
    """
    check_tensor("topk_idx_TK", topk_idx_TK, dim=2, integer=True)
    T, K = topk_idx_TK.shape
    g = torch.Generator().manual_seed(seed)
    logits_TE = -torch.rand(T, num_experts, generator=g, dtype=torch.float64)
    chosen_TK = 2.0 - torch.arange(K, dtype=torch.float64) / K
    idx_TK = topk_idx_TK.cpu()  # host sync: generators build CPU routings
    logits_TE.scatter_(1, idx_TK, chosen_TK.expand(T, K).contiguous())
    return logits_TE.to(dtype=dtype, device=topk_idx_TK.device)
