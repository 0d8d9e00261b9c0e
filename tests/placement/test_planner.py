"""Tier 1 (pure logic): the rebalance planner.

Invariants on many shapes and load patterns (every expert placed, replica counts, distinct ranks per
expert, slots per rank, predicted loads recomputed by brute force, determinism), input errors, and the
Zipf(1.2) / 64 experts / 8 ranks case the issue sets a goal for (max/mean <= 1.10 with 8 replicas).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_comm.placement import planner as rb
from moe_comm.placement.planner import Placement, identity_placement, plan_placement, rank_loads
from moe_comm.testing.workloads import count_tokens, zipf


def _brute_rank_load(p2l, load_E, W):
    """Rank loads by a plain loop: each slot carries its expert's load / that expert's replica count."""
    p2l = list(p2l)
    S = len(p2l) // W
    out = [0.0] * W
    for p, g in enumerate(p2l):
        out[p // S] += load_E[g] / p2l.count(g)
    return out


def _check_invariants(plan: Placement, load_LE: np.ndarray, W: int, R: int) -> None:
    load_E = np.asarray(load_LE, dtype=np.float64).reshape(-1, np.asarray(load_LE).shape[-1]).mean(0)
    E = load_E.shape[0]
    P, S = E + R, (E + R) // W
    p2l = plan.phys_to_logical.tolist()
    assert plan.phys_to_logical.dtype == torch.int64 and len(p2l) == P
    assert plan.num_slots == P and plan.slots_per_rank == S
    assert sorted(set(p2l)) == list(range(E)), "every expert placed at least once"
    counts = plan.replica_count.tolist()
    assert sum(counts) == P and min(counts) >= 1
    assert counts == [p2l.count(g) for g in range(E)]
    for g in range(E):
        assert plan.logical_to_physical[g] == [p for p in range(P) if p2l[p] == g]
        ranks = [plan.rank_of_slot(p) for p in plan.logical_to_physical[g]]
        assert len(set(ranks)) == len(ranks), f"expert {g} has two replicas on one rank: {ranks}"
    for r in range(W):
        on_rank = plan.experts_on_rank(r)
        assert len(on_rank) == S and on_rank == sorted(on_rank)
    torch.testing.assert_close(plan.predicted_rank_load,
                               torch.tensor(_brute_rank_load(p2l, load_E, W), dtype=torch.float64))
    pred = plan.predicted_rank_load
    expected_mom = float(pred.max() / pred.mean()) if pred.mean() > 0 else 1.0
    assert plan.max_over_mean == pytest.approx(expected_mom)
    if E % W == 0:
        base = _brute_rank_load(range(E), load_E, W)
        torch.testing.assert_close(plan.baseline_rank_load, torch.tensor(base, dtype=torch.float64))
        mean = sum(base) / W
        assert plan.baseline_max_over_mean == pytest.approx(max(base) / mean if mean > 0 else 1.0)


def _loads(kind: str, L: int, E: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "zeros":
        return np.zeros((L, E))
    if kind == "uniform":
        return np.full((L, E), 7.0)
    if kind == "one_hot":
        out = rng.integers(0, 5, size=(L, E)).astype(float)
        out[:, E // 2] += 1000.0
        return out
    if kind == "pareto":
        return rng.pareto(0.8, size=(L, E))
    if kind == "ints":
        return rng.integers(0, 4, size=(L, E)).astype(float)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["zeros", "uniform", "one_hot", "pareto", "ints"])
@pytest.mark.parametrize("E,W,R", [(1, 1, 0), (4, 2, 0), (4, 2, 2), (6, 3, 3), (8, 4, 4), (8, 4, 24), (12, 4, 0),
                                   (5, 5, 5), (16, 8, 8), (64, 8, 8), (64, 8, 16), (64, 4, 4), (10, 4, 2)])
def test_invariants(kind, E, W, R):
    rng = np.random.default_rng(E * 1000 + W * 10 + R)
    load_LE = _loads(kind, 3, E, rng)
    plan = plan_placement(load_LE, W, R)
    _check_invariants(plan, load_LE, W, R)
    again = plan_placement(torch.from_numpy(load_LE), W, R)  # tensor input, same plan: deterministic
    assert again.phys_to_logical.tolist() == plan.phys_to_logical.tolist()


def test_docstring_example_and_identity():
    plan = plan_placement([[4, 3, 2, 1]], num_ranks=2)
    assert plan.phys_to_logical.tolist() == [0, 3, 1, 2]
    assert plan.predicted_rank_load.tolist() == [5.0, 5.0] and plan.max_over_mean == 1.0
    assert plan.baseline_rank_load.tolist() == [7.0, 3.0] and plan.baseline_max_over_mean == pytest.approx(1.4)
    ident = identity_placement(4, 2, [[4, 3, 2, 1]])
    assert ident.phys_to_logical.tolist() == [0, 1, 2, 3] and ident.max_over_mean == pytest.approx(1.4)
    assert rank_loads([0, 1, 0, 2], [6, 1, 1], 2).tolist() == [4.0, 4.0]


def test_replicas_go_to_largest_load_per_replica():
    # loads 8, 3, 1, 1: first replica -> expert 0 (8 -> 4 per replica), second -> expert 0 again (4 > 3).
    plan = plan_placement([[8, 3, 1, 1]], num_ranks=3, num_replicas=2)
    assert plan.replica_count.tolist() == [3, 1, 1, 1]
    # An expert never gets more than W replicas: with W = 2 the second replica goes to expert 1.
    plan = plan_placement([[8, 3, 1, 1]], num_ranks=2, num_replicas=2)
    assert plan.replica_count.tolist() == [2, 2, 1, 1]


def test_pack_repairs_when_only_ranks_holding_the_expert_have_room():
    # Zero loads: experts 0 and 1 fill rank 0, then expert 2's second replica finds room only on
    # rank 1, which already holds expert 2: the planner must move one replica over.
    per_rank = rb._pack(np.zeros(3), np.array([1, 1, 2]), num_ranks=2, slots=2)
    assert sorted(len(r) for r in per_rank) == [2, 2]
    assert all(len(set(r)) == len(r) for r in per_rank)
    assert sorted(g for r in per_rank for g in r) == [0, 1, 2, 2]


def test_errors():
    with pytest.raises(ValueError, match="divisible by num_ranks"):
        plan_placement(np.ones((2, 64)), 8, 4)  # 68 slots on 8 ranks
    with pytest.raises(ValueError, match="num_replicas must be <="):
        plan_placement(np.ones((1, 4)), 2, 6)  # an expert can have at most W = 2 replicas
    with pytest.raises(ValueError, match="finite loads >= 0"):
        plan_placement([[1.0, -1.0]], 2)
    with pytest.raises(ValueError, match="finite loads >= 0"):
        plan_placement([[1.0, float("nan")]], 2)
    with pytest.raises(ValueError, match=r"\[L, E\]"):
        plan_placement(np.ones((2, 2, 2)), 2)
    with pytest.raises(ValueError, match="plan_placement: num_ranks must be >= 1"):
        plan_placement([[1.0, 1.0]], 0)
    with pytest.raises(ValueError, match="plan_placement: num_replicas must be >= 0"):
        plan_placement([[1.0, 1.0]], 2, -2)


def _zipf_history(L, first_step, E, K, T=4096, seed=0):
    return torch.stack([count_tokens(zipf(T, E, K, seed=seed, step=first_step + i, s=1.2), E)[0]
                        for i in range(L)])


@pytest.mark.parametrize("top_k", [1, 8])
def test_zipf_64_experts_8_ranks(top_k):
    """Zipf(1.2), 64 experts, 8 ranks. Numbers on this history (seed 0, 8 steps of 4096 tokens), max/mean
    rank load, identity -> plan (held-out: the next 8 steps under the same plan):
    K=1: 5.46 -> 2.46 (R=0) -> 1.0002 (R=8; held-out 1.023). K=8: 4.72 -> 1.16 (R=0) -> 1.0004 (R=8;
    held-out 1.006). R=4 is not a valid slot count on 8 ranks (68 % 8 != 0); on 4 ranks R=4 gives
    1.0001 (K=1; identity 3.21, R=0 1.31)."""
    E, W = 64, 8
    history_LE = _zipf_history(8, 0, E, top_k)
    heldout_LE = _zipf_history(8, 8, E, top_k)
    plans = {R: plan_placement(history_LE, W, R) for R in (0, 8, 16)}
    for R, plan in plans.items():
        _check_invariants(plan, history_LE.numpy(), W, R)
    base = plans[0].baseline_max_over_mean
    assert base > 4.5, "identity placement: experts 0..7 (the Zipf head) all on rank 0"
    assert plans[0].max_over_mean < base / 2
    assert plans[8].max_over_mean < plans[0].max_over_mean
    assert plans[8].max_over_mean <= 1.10
    assert plans[16].max_over_mean <= 1.10
    heldout = float(rank_loads(plans[8].phys_to_logical, heldout_LE, W).max()
                    / rank_loads(plans[8].phys_to_logical, heldout_LE, W).mean())
    assert heldout <= 1.10, f"the plan must hold on fresh steps of the same workload, got {heldout:.3f}"
    with pytest.raises(ValueError, match="divisible"):
        plan_placement(history_LE, W, 4)
    # The R = 4 on the 4-rank layout (68 slots / 4 ranks), where it is valid.
    p4 = plan_placement(history_LE, 4, 4)
    _check_invariants(p4, history_LE.numpy(), 4, 4)
    assert p4.max_over_mean < plan_placement(history_LE, 4, 0).max_over_mean or p4.max_over_mean <= 1.001
    assert p4.max_over_mean <= 1.10
