"""Rebalance planner: place E logical experts, plus R redundant replicas of the hottest, onto W ranks.

Shapes legend: L load-history steps, E logical experts, R redundant replicas, P = E + R physical slots,
W EP world size, S = P / W slots per rank. Physical slot p lives on rank p // S.

The idea is DeepSeek's EPLB (replicate by load per replica, then pack replicas onto ranks balancing
load); this is an independent implementation with one extra guarantee, that no rank holds two replicas
of one expert (a replica on the same rank would add memory and no balance):

1. load_E = mean load of each expert over the history.
2. Replication: R times, give one more replica to the expert with the largest load per replica
   (load_E / replicas_E; ties: lower expert id), never more than W replicas of one expert.
3. Packing: replicas sorted heaviest first (load per replica; ties: expert id) each go to the least
   loaded rank that has a free slot and no replica of that expert yet (ties: lower rank). If every rank
   with a free slot already holds that expert, a full rank b without it gives up a replica y to the free
   rank a (y chosen so the larger of the two new rank loads is smallest) and takes the new replica;
   such a y always exists (b holds S distinct experts, a at most S - 2 besides this one).
4. Refinement: while some swap of two replicas between the most loaded rank and another rank lowers the
   larger of their two loads (and keeps replicas of one expert on distinct ranks), do the best such swap.
A replicated expert's tokens are assumed split evenly over its replicas (the predicted rank load).
Everything is deterministic: same history, same plan, on every rank.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Dict, List, Sequence, Union

import numpy as np
import torch

from moe_comm._checks import check_int

__all__ = ["Placement", "plan_placement", "identity_placement", "rank_loads"]


@dataclass(frozen=True)
class Placement:
    """Where every physical expert slot lives and which logical expert it holds.

    Attributes:
        num_experts: E logical experts. num_ranks: W. num_replicas: R redundant slots (P = E + R).
        phys_to_logical: [P] int64, logical expert held by physical slot p (slot p is on rank p // S,
            local slot p % S; within a rank, slots are ordered by logical id).
        logical_to_physical: E lists of the physical slots of each logical expert, ascending.
        replica_count: [E] int64, replicas of each logical expert (>= 1, sums to P).
        expert_load: [E] float64, mean load per step the plan was made from.
        predicted_rank_load: [W] float64, load per rank with each expert's load split evenly over its
            replicas. max_over_mean: max / mean of predicted_rank_load (1.0 when there is no load).
        baseline_rank_load: [W] float64, the same for the identity placement (expert g on rank g // (E/W),
            no replicas); NaN when E % W != 0. baseline_max_over_mean: its max / mean.
    Example (E=4, W=2, R=0, load [4, 3, 2, 1]): phys_to_logical [0, 3, 1, 2], rank loads [5, 5],
        max_over_mean 1.0; baseline (identity [0, 1 | 2, 3]) [7, 3], 1.4.
    """

    num_experts: int
    num_ranks: int
    num_replicas: int
    phys_to_logical: torch.Tensor
    logical_to_physical: List[List[int]]
    replica_count: torch.Tensor
    expert_load: torch.Tensor
    predicted_rank_load: torch.Tensor
    max_over_mean: float
    baseline_rank_load: torch.Tensor
    baseline_max_over_mean: float

    @property
    def num_slots(self) -> int:
        """P = E + R physical slots."""
        return self.num_experts + self.num_replicas

    @property
    def slots_per_rank(self) -> int:
        """S = P / W."""
        return self.num_slots // self.num_ranks

    def rank_of_slot(self, p: int) -> int:
        return p // self.slots_per_rank

    def experts_on_rank(self, rank: int) -> List[int]:
        """Logical ids held by ``rank``, in local slot order."""
        S = self.slots_per_rank
        return self.phys_to_logical[rank * S:(rank + 1) * S].tolist()  # host sync: planner works on CPU tensors

    def to_dict(self) -> Dict[str, object]:
        """JSON-ready dict of every field."""
        return {
            "num_experts": self.num_experts, "num_ranks": self.num_ranks, "num_replicas": self.num_replicas,
            "slots_per_rank": self.slots_per_rank,
            "phys_to_logical": self.phys_to_logical.tolist(),  # host sync: planner works on CPU tensors
            "logical_to_physical": [list(s) for s in self.logical_to_physical],
            "replica_count": self.replica_count.tolist(),  # host sync: planner works on CPU tensors
            "expert_load": self.expert_load.tolist(),  # host sync: planner works on CPU tensors
            "predicted_rank_load": self.predicted_rank_load.tolist(),  # host sync: planner works on CPU tensors
            "max_over_mean": self.max_over_mean,
            "baseline_rank_load": self.baseline_rank_load.tolist(),  # host sync: planner works on CPU tensors
            "baseline_max_over_mean": self.baseline_max_over_mean,
        }


def _max_over_mean(load_W: np.ndarray) -> float:
    mean = float(load_W.mean()) if load_W.size else 0.0
    if not np.isfinite(mean):
        return float("nan")
    return float(load_W.max()) / mean if mean > 0 else 1.0


def _as_history(load_history_LE) -> np.ndarray:
    if isinstance(load_history_LE, torch.Tensor):
        hist = load_history_LE.detach().to("cpu", torch.float64).numpy()  # host sync: the planner runs on the host
    else:
        hist = np.asarray(load_history_LE, dtype=np.float64)
    if hist.ndim == 1:
        hist = hist[None, :]
    if hist.ndim != 2 or hist.shape[0] < 1 or hist.shape[1] < 1:
        raise ValueError(f"load_history_LE must be [L, E] (or [E]) with L, E >= 1, got shape {hist.shape}")
    if not np.isfinite(hist).all() or (hist < 0).any():
        raise ValueError("load_history_LE must hold finite loads >= 0")
    return hist


def rank_loads(phys_to_logical: Union[torch.Tensor, Sequence[int]], load_E, num_ranks: int) -> torch.Tensor:
    """[W] float64 load of each rank when ``load_E`` ([E] or [L, E]: summed over L) is split evenly over
    the replicas in ``phys_to_logical`` ([P], slot p on rank p // (P / W)).
    Example: phys_to_logical [0, 1, 0, 2], load [6, 1, 1], W=2 -> [3 + 1, 3 + 1] = [4, 4]."""
    if isinstance(phys_to_logical, torch.Tensor):
        phys_to_logical = phys_to_logical.tolist()  # host sync: the planner works on host lists
    p2l = np.asarray(phys_to_logical, dtype=np.int64)
    load = _as_history(load_E).sum(0)
    E, P = load.shape[0], p2l.shape[0]
    if P % num_ranks:
        raise ValueError(f"phys_to_logical length ({P}) must be divisible by num_ranks, got {num_ranks}")
    if p2l.min(initial=0) < 0 or p2l.max(initial=0) >= E:
        raise ValueError(f"phys_to_logical entries must be in [0, {E}), got range [{p2l.min()}, {p2l.max()}]")
    replicas = np.bincount(p2l, minlength=E)
    per_slot = load[p2l] / np.maximum(replicas[p2l], 1)
    return torch.from_numpy(per_slot.reshape(num_ranks, -1).sum(1))


def _replicate(load_E: np.ndarray, num_replicas: int, num_ranks: int) -> np.ndarray:
    E = load_E.shape[0]
    count_E = np.ones(E, dtype=np.int64)
    # Max-heap on load per replica; ties go to the lower expert id.
    heap = [(-float(load_E[e]), e) for e in range(E) if num_ranks > 1]
    heapq.heapify(heap)
    for _ in range(num_replicas):
        if not heap:
            raise ValueError(f"num_replicas too large: every expert already has num_ranks={num_ranks} replicas")
        _, e = heapq.heappop(heap)
        count_E[e] += 1
        if count_E[e] < num_ranks:
            heapq.heappush(heap, (-float(load_E[e]) / count_E[e], e))
    return count_E


def _pack(load_E: np.ndarray, count_E: np.ndarray, num_ranks: int, slots: int) -> List[List[int]]:
    """Greedy heaviest-first packing with the distinct-ranks rule, then swap refinement.
    Returns the logical experts on each rank."""
    items = sorted(((load_E[e] / count_E[e], e) for e in range(len(count_E)) for _ in range(count_E[e])),
                   key=lambda it: (-it[0], it[1]))
    per_replica = load_E / count_E
    held: List[List[int]] = [[] for _ in range(num_ranks)]
    holds = [set() for _ in range(num_ranks)]
    load_W = np.zeros(num_ranks)
    for w_item, e in items:
        ok = [r for r in range(num_ranks) if len(held[r]) < slots and e not in holds[r]]
        if ok:
            r = min(ok, key=lambda r: (load_W[r], r))
        else:  # every rank with room already holds e: free a slot on a rank without e (see module doc)
            a = min((r for r in range(num_ranks) if len(held[r]) < slots), key=lambda r: (load_W[r], r))
            best = None
            for b in range(num_ranks):
                if e in holds[b]:
                    continue
                for y in held[b]:
                    if y in holds[a]:
                        continue
                    wy = per_replica[y]
                    key = (max(load_W[a] + wy, load_W[b] - wy + w_item), b, y)
                    if best is None or key < best:
                        best = key
            if best is None:  # cannot happen (see the module doc); an error, not an assert (python -O drops those)
                raise RuntimeError("moe_comm placement planner: no swap partner (internal error; please report)")
            _, b, y = best
            held[b].remove(y), holds[b].discard(y)
            held[a].append(y), holds[a].add(y)
            load_W[a] += per_replica[y]
            load_W[b] -= per_replica[y]
            r = b
        held[r].append(e)
        holds[r].add(e)
        load_W[r] += w_item
    _refine(held, holds, load_W, per_replica)
    return held


def _refine(held, holds, load_W: np.ndarray, per_replica: np.ndarray, max_rounds: int = 10000) -> None:
    """Swap replicas between the most loaded rank and another while that lowers the pair's maximum."""
    W = len(held)
    for _ in range(max_rounds):
        hi = int(np.argmax(load_W))  # first of the maxima: deterministic
        best = None
        for lo in range(W):
            if lo == hi:
                continue
            for i, x in enumerate(held[hi]):
                for j, y in enumerate(held[lo]):
                    d = per_replica[x] - per_replica[y]
                    if d <= 0 or x == y or x in holds[lo] or y in holds[hi]:
                        continue
                    new_max = max(load_W[hi] - d, load_W[lo] + d)
                    if new_max < load_W[hi] - 1e-12 * max(load_W[hi], 1.0):
                        key = (new_max, lo, i, j)
                        if best is None or key < best:
                            best = key
        if best is None:
            return
        _, lo, i, j = best
        x, y = held[hi][i], held[lo][j]
        d = per_replica[x] - per_replica[y]
        held[hi][i], held[lo][j] = y, x
        holds[hi].discard(x), holds[hi].add(y)
        holds[lo].discard(y), holds[lo].add(x)
        load_W[hi] -= d
        load_W[lo] += d


def _int_arg(name: str, value, low: int) -> int:
    """check_int that also takes a numpy integer (a count read from an array)."""
    return check_int(name, int(value) if isinstance(value, np.integer) else value, low)


def _placement(load_E: np.ndarray, per_rank: List[List[int]], num_ranks: int) -> Placement:
    E = load_E.shape[0]
    p2l = [g for experts in per_rank for g in sorted(experts)]
    l2p: List[List[int]] = [[] for _ in range(E)]
    for p, g in enumerate(p2l):
        l2p[g].append(p)
    p2l_P = torch.tensor(p2l, dtype=torch.int64)
    pred_W = rank_loads(p2l_P, load_E, num_ranks)
    if E % num_ranks == 0:
        base_W = rank_loads(torch.arange(E), load_E, num_ranks)
        base_mom = _max_over_mean(base_W.numpy())
    else:
        base_W, base_mom = torch.full((num_ranks,), float("nan"), dtype=torch.float64), float("nan")
    return Placement(
        num_experts=E, num_ranks=num_ranks, num_replicas=len(p2l) - E, phys_to_logical=p2l_P,
        logical_to_physical=l2p, replica_count=torch.tensor([len(s) for s in l2p], dtype=torch.int64),
        expert_load=torch.from_numpy(load_E.copy()), predicted_rank_load=pred_W,
        max_over_mean=_max_over_mean(pred_W.numpy()), baseline_rank_load=base_W, baseline_max_over_mean=base_mom)


def plan_placement(load_history_LE, num_ranks: int, num_replicas: int = 0) -> Placement:
    """Plan where E logical experts and R redundant replicas go on W ranks, balancing predicted load.

    Args:
        load_history_LE: [L, E] (or [E]) tokens per expert per step: numpy array, nested list or tensor
            (any device; a device tensor is copied to the host once). Finite, >= 0.
        num_ranks: W >= 1.
        num_replicas: R >= 0 extra slots, given to the experts with the largest load per replica;
            (E + R) % W == 0 is required and an expert gets at most W replicas (one per rank).
    Returns: Placement (see its docstring), deterministic in its inputs.
    Raises: ValueError for a bad shape, a negative/non-finite load, (E + R) % W != 0, or R > E * (W - 1).
    Example: plan_placement([[4, 3, 2, 1]], num_ranks=2).phys_to_logical -> [0, 3, 1, 2].
    """
    load_E = _as_history(load_history_LE).mean(0)
    E = load_E.shape[0]
    W = _int_arg("plan_placement: num_ranks", num_ranks, 1)
    R = _int_arg("plan_placement: num_replicas", num_replicas, 0)
    if (E + R) % W:
        raise ValueError(f"num_experts + num_replicas ({E} + {R} = {E + R}) must be divisible by num_ranks "
                         f"({W}): each rank holds the same number of slots")
    if R > E * (W - 1):
        raise ValueError(f"num_replicas must be <= num_experts * (num_ranks - 1) = {E * (W - 1)} (at most one "
                         f"replica of an expert per rank), got {R}")
    count_E = _replicate(load_E, R, W)
    per_rank = _pack(load_E, count_E, W, (E + R) // W)
    return _placement(load_E, per_rank, W)


def identity_placement(num_experts: int, num_ranks: int, load_history_LE=None) -> Placement:
    """The layer's default placement (expert g on rank g // (E / W), no replicas) as a Placement; its
    loads come from ``load_history_LE`` when given (else zeros)."""
    E = _int_arg("identity_placement: num_experts", num_experts, 1)
    W = _int_arg("identity_placement: num_ranks", num_ranks, 1)
    if E % W:
        raise ValueError(f"num_experts ({E}) must be divisible by num_ranks, got {W}")
    load_E = np.zeros(E) if load_history_LE is None else _as_history(load_history_LE).mean(0)
    if load_E.shape[0] != E:
        raise ValueError(f"load_history_LE must have {E} columns, got {load_E.shape[0]}")
    e = E // W
    return _placement(load_E, [list(range(r * e, (r + 1) * e)) for r in range(W)], W)
