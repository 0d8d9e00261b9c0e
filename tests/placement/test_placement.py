"""Applying a rebalance plan to a layer (``MoELayer.apply_placement``).

Tier 1 (pure logic, one process): the transfer plan, the replica tables, the logical -> physical routing
(deterministic, balanced within one row, dropped slots stay -1), unsupported optimizer state raises;
replicas on one rank are summed; a float phys_to_logical raises (never truncated); ``relayout_slots``
moves weights and optimizer state outside the Module; placement/ and monitor/ never import modules/.
Tier 2 (multi-rank gloo, ``ranks`` fixture, 2 and 4 ranks): a layer before and after apply_placement (and
after a second placement) gives the same outputs and gradients (<= 1e-5, replica gradients summed by
``sync_replica_grads``) with replicas that really receive tokens; Adam state moves with the experts and
training continues step for step like an unplaced twin; checkpoints stay keyed by logical expert id and
a logical checkpoint fills every replica; a hand-made placement with two replicas of one expert on one
rank gives the unplaced gradients (``sync_replica_grads`` adds them).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import moe_comm
from moe_comm.testing import workloads as wl
from moe_comm.modules.checkpoint import full_state_dict, load_full_state_dict
from moe_comm.placement.apply import physical_topk, relayout_slots, replica_tables, sync_replica_grads, transfer_plan
from moe_comm.placement.planner import identity_placement, plan_placement

H, F = 16, 24


# ------------------------------------------------------------------------------------ tier 1: logic

def test_transfer_plan_example():
    plan = transfer_plan([0, 1, 2, 3], [0, 3, 1, 2], 2)
    assert plan == [(0, 0, 0, 0), (0, 1, 1, 1), (1, 0, 0, 1), (1, 1, 1, 0)]
    # A replica: expert 0 onto rank 1 too (3 slots per rank); rank 1 holds 2 and 3 already.
    plan = transfer_plan([0, 1, 2, 3], [0, 1, 3, 0, 2, 3], 2)
    assert [(d, i, s) for d, i, s, _ in plan] == [(0, 0, 0), (0, 1, 0), (0, 2, 1), (1, 0, 0), (1, 1, 1), (1, 2, 1)]


def test_physical_topk_example_and_balance():
    slots, count, C = replica_tables([0, 1, 0], 2)
    assert slots.tolist() == [[0, 2], [1, 1]] and count.tolist() == [2, 1] and C == 2
    idx = torch.tensor([[0, 1], [0, -1], [1, 0]])
    assert physical_topk(idx, slots, count, C, rank=0).tolist() == [[0, 1], [2, -1], [1, 0]]
    assert physical_topk(idx, slots, count, C, rank=1).tolist() == [[2, 1], [0, -1], [1, 2]]
    # Zipf routing over 8 experts, expert 0 on 3 slots: every replica within one row of the others.
    p2l = [0, 1, 2, 3, 0, 4, 5, 6, 0, 7]
    slots, count, C = replica_tables(p2l, 8)
    idx = wl.zipf(999, 8, 2, seed=1)
    idx.view(-1)[::7] = -1
    for rank in range(3):
        phys = physical_topk(idx, slots, count, C, rank=rank)
        assert torch.equal(phys, physical_topk(idx, slots, count, C, rank=rank)), "deterministic"
        assert torch.equal(phys < 0, idx < 0), "dropped slots stay dropped"
        assert torch.equal(torch.tensor(p2l)[phys[phys >= 0]], idx[idx >= 0]), "same logical expert"
        per_replica = torch.bincount(phys[phys >= 0], minlength=10)[[0, 4, 8]]
        assert int(per_replica.max() - per_replica.min()) <= 1 and int(per_replica.sum()) == int((idx == 0).sum())


def test_apply_placement_validates_and_rejects_unsupported_optimizer_state():
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4, top_k=2)
    layer = moe_comm.MoELayer(cfg, seed=0)
    with pytest.raises(TypeError, match="Placement"):
        layer.apply_placement([0, 1, 2, 3])
    with pytest.raises(ValueError, match="num_experts"):
        layer.apply_placement(plan_placement([[1.0] * 6], 1))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    opt.state[layer.experts.w1]["odd"] = torch.zeros(7)
    w1 = layer.experts.w1.detach().clone()
    with pytest.raises(ValueError, match="odd"):
        layer.apply_placement(plan_placement([[4, 3, 2, 1]], 1), opt)
    assert torch.equal(layer.experts.w1, w1) and layer.placement is None, "nothing moved"
    plan = plan_placement([[1, 2, 3, 4]], 1)
    layer.dispatcher.carry_max_bytes = -1
    layer.apply_placement(plan)
    assert layer.local_expert_ids == plan.phys_to_logical.tolist() and layer.local_slot_ids == [0, 1, 2, 3]
    assert layer.dispatcher.carry_max_bytes == -1  # the new Dispatcher keeps what was set (it is in every header)


# ------------------------------------------------------------------------------------ tier 2: ranks

def _data(rank, world_size, cfg, tokens_per_rank, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(t, H, generator=g) for t in tokens_per_rank]
    gys = [torch.randn(t, H, generator=g) for t in tokens_per_rank]
    return xs[rank], gys[rank]


def _skewed_plan(E, W, R, seed):
    """A plan from a Zipf(1.2) history (expert 0 hottest): the hottest experts get the replicas."""
    hist = torch.stack([wl.count_tokens(wl.zipf(256, E, 2, seed=seed, step=s), E)[0] for s in range(4)])
    return plan_placement(hist, W, R)


def _step(layer, x, gy):
    """One forward + backward: output, grads of x and router, expert grads by logical id, rows per slot."""
    rows = []
    hook = layer.experts.register_forward_hook(lambda m, args, out: rows.append(args[1].clone()))
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = layer(x)
    ((y * gy).sum() + layer.aux_loss).backward()
    layer.sync_replica_grads()
    hook.remove()
    ex = layer.experts
    grads = {g: torch.cat([getattr(ex, n).grad[i].reshape(-1) for n in ("w1", "w3", "w2")])
             for i, g in enumerate(layer.local_expert_ids)}
    shared = None if layer.shared_experts is None else \
        torch.cat([p.grad.reshape(-1) for p in layer.shared_experts.parameters()])
    return dict(y=y.detach(), x=x.grad, router=layer.router.weight.grad.clone(), experts=grads, shared=shared,
                rows=torch.stack(rows).sum(0), ids=layer.local_expert_ids)


def _rank_equivalence(rank, world_size, cfg_kwargs, tokens_per_rank, replicas, seed):
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, **cfg_kwargs)
    E = cfg.num_experts
    layer = moe_comm.MoELayer(cfg, seed=seed)
    with torch.no_grad():  # skew the routing toward low expert ids (selection only), as the plan expects
        layer.router.expert_bias.copy_(torch.linspace(0.3, 0.0, E))
    x, gy = _data(rank, world_size, cfg, tokens_per_rank, seed)
    out = [_step(layer, x, gy)]
    for R in replicas:  # the second placement moves from the first
        layer.apply_placement(_skewed_plan(E, world_size, R, seed + R), optimizer=None)
        out.append(_step(layer, x, gy))
        out[-1]["p2l"] = layer.placement.phys_to_logical.tolist()
    return out


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) if b.numel() else 0.0


EQUIV_CASES = [
    # (world size, cfg kwargs, tokens per rank, replicas of each successive placement)
    (2, dict(num_experts=4, top_k=2), [40, 25], [2, 0]),
    (2, dict(num_experts=4, top_k=1, score_func="sigmoid", norm_topk_prob=False, num_shared_experts=1),
     [30, 0], [4]),
    (4, dict(num_experts=8, top_k=2, num_chunks=2, aux_loss_coeff=0.01), [30, 18, 0, 25], [4, 8]),
    (4, dict(num_experts=8, top_k=3, capacity_factor=1.5), [24, 24, 12, 30], [8]),
]


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,cfg_kwargs,tokens_per_rank,replicas", EQUIV_CASES)
def test_outputs_and_gradients_unchanged_by_placement(ranks, world_size, cfg_kwargs, tokens_per_rank, replicas):
    res = ranks(world_size).run(_rank_equivalence, cfg_kwargs, tokens_per_rank, replicas, 11 + world_size)
    before = [r[0] for r in res]
    ref_experts = {g: v for b in before for g, v in b["experts"].items()}
    assert sorted(ref_experts) == list(range(cfg_kwargs["num_experts"]))
    for k, R in enumerate(replicas, start=1):
        after = [r[k] for r in res]
        p2l = after[0]["p2l"]
        assert len(p2l) == cfg_kwargs["num_experts"] + R and all(a["p2l"] == p2l for a in after)
        assert [g for a in after for g in a["ids"]] == p2l, "local_expert_ids: the logical id of each local slot"
        for b, a in zip(before, after):
            assert _rel(a["y"], b["y"]) <= 1e-5 and _rel(a["x"], b["x"]) <= 1e-5
            assert _rel(a["router"], b["router"]) <= 1e-5
            if b["shared"] is not None:
                assert _rel(a["shared"], b["shared"]) <= 1e-5
            for g, grad in a["experts"].items():  # every replica holds the full (summed) gradient
                assert _rel(grad, ref_experts[g]) <= 1e-5, (R, g)
        replicated = {g for g in p2l if p2l.count(g) > 1}
        assert len(replicated) >= min(R, 1)
        for g in replicated:  # replicas stay bit-identical, and each really served tokens
            copies = [(a["experts"][g], a["rows"][a["ids"].index(g)]) for a in after if g in a["ids"]]
            assert len(copies) == p2l.count(g)
            assert all(torch.equal(c[0], copies[0][0]) for c in copies)
        hot = [g for g in sorted(replicated) if g == 0]
        for g in hot:
            assert all(int(a["rows"][a["ids"].index(g)]) > 0 for a in after if g in a["ids"]), "split over replicas"


def _rank_training(rank, world_size, replicas, steps_before, steps_after, seed):
    """An unplaced layer A and a twin B placed (with its Adam state) after ``steps_before`` steps."""
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=8, top_k=2)
    layers = [moe_comm.MoELayer(cfg, seed=seed) for _ in range(2)]
    opts = [torch.optim.Adam(lay.parameters(), lr=3e-3) for lay in layers]
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(48, H, generator=g)
    target = torch.tanh(x @ torch.randn(H, H, generator=torch.Generator().manual_seed(seed)) * 0.5)
    with torch.no_grad():
        for lay in layers:  # a skewed router, so the replicated experts carry real load
            lay.router.expert_bias.copy_(torch.linspace(0.2, 0.0, 8))
    losses = [[], []]
    out = {}

    def step(i):
        lay, opt = layers[i], opts[i]
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(lay(x), target)
        loss.backward()
        lay.sync_replica_grads()
        opt.step()
        losses[i].append(float(loss))

    for _ in range(steps_before):
        step(0), step(1)
    a_state = {gid: (opts[0].state[layers[0].experts.w1]["exp_avg"][i].clone(),
                     opts[0].state[layers[0].experts.w2]["exp_avg_sq"][i].clone())
               for i, gid in enumerate(layers[0].local_expert_ids)}
    plan = _skewed_plan(8, world_size, replicas, seed)
    layers[1].apply_placement(plan, opts[1])
    b = layers[1].experts
    assert opts[1].state[b.w1]["exp_avg"].shape[0] == b.w1.shape[0] == (8 + replicas) // world_size
    out["b_state"] = {gid: (opts[1].state[b.w1]["exp_avg"][i].clone(), opts[1].state[b.w2]["exp_avg_sq"][i].clone())
                      for i, gid in enumerate(layers[1].local_expert_ids)}
    out["a_state"] = a_state
    out["steps"] = (int(opts[0].state[layers[0].experts.w1]["step"]), int(opts[1].state[b.w1]["step"]))
    for _ in range(steps_after):
        step(0), step(1)
    out["losses"] = losses
    out["a_sd"] = full_state_dict(layers[0])
    out["b_sd"] = full_state_dict(layers[1])
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,replicas", [(2, 2), (4, 4)])
def test_training_continues_with_moved_optimizer_state(ranks, world_size, replicas):
    res = ranks(world_size).run(_rank_training, replicas, 2, 5, 7)
    a_state = {g: v for r in res for g, v in r["a_state"].items()}
    for r in res:
        assert r["steps"] == (2, 2)
        for g, (m, v) in r["b_state"].items():  # moved (and copied to replicas) exactly
            assert torch.equal(m, a_state[g][0]) and torch.equal(v, a_state[g][1])
    losses_a, losses_b = res[0]["losses"]
    assert all(torch.isfinite(torch.tensor(losses_b)))
    assert losses_b[-1] < losses_b[0] and losses_b[-1] < losses_b[2], "still learning after the placement"
    for la, lb in zip(losses_a, losses_b):
        assert abs(la - lb) <= 1e-5 * max(1.0, abs(la))
    sd_a, sd_b = res[0]["a_sd"], res[0]["b_sd"]
    assert sorted(sd_a) == sorted(sd_b)
    for k in sd_a:
        assert _rel(sd_b[k], sd_a[k]) <= 1e-5, k


def _rank_checkpoint(rank, world_size, replicas):
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=8, top_k=2)
    plain = moe_comm.MoELayer(cfg, seed=3)
    placed = moe_comm.MoELayer(cfg, seed=3)
    placed.apply_placement(_skewed_plan(8, world_size, replicas, 0))
    out = {"plain": full_state_dict(plain), "placed": full_state_dict(placed),
           "local_keys": sorted(placed.state_dict())}
    other = full_state_dict(moe_comm.MoELayer(cfg, seed=99))  # a logical checkpoint of another layer
    result = load_full_state_dict(placed, other)
    load_full_state_dict(plain, other)
    out["incompatible"] = (list(result.missing_keys), list(result.unexpected_keys))
    out["slots"] = {(i, gid): placed.experts.w1[i].detach().clone() for i, gid in enumerate(placed.local_expert_ids)}
    out["other"] = other
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(rank))
    out["y"] = (plain(x).detach(), placed(x).detach())
    return out


@pytest.mark.multirank
def test_checkpoint_keyed_by_logical_id_and_fills_replicas(ranks):
    res = ranks(2).run(_rank_checkpoint, 4)
    plain, placed = res[0]["plain"], res[0]["placed"]
    assert sorted(plain) == sorted(placed), "one key per logical expert, as without a placement"
    assert {k for k in placed if k.startswith("experts.w1.")} == {f"experts.w1.{g}" for g in range(8)}
    for k in plain:
        assert torch.equal(plain[k], placed[k]), k
    for r in res:
        assert r["incompatible"] == ([], [])
        assert all(k.startswith(("router.", "experts.w")) for k in r["local_keys"])
        for (i, gid), w in r["slots"].items():  # every replica filled from the logical checkpoint
            assert torch.equal(w, r["other"][f"experts.w1.{gid}"])
        assert _rel(r["y"][1], r["y"][0]) <= 1e-5


def test_rebalance_plans_from_the_monitor():
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4, top_k=1)
    layer = moe_comm.MoELayer(cfg, seed=0)
    with pytest.raises(ValueError, match="no forward"):
        layer.rebalance()
    x = torch.randn(30, H)
    y = layer(x).detach()
    plan = layer.rebalance(0)
    assert torch.equal(plan.expert_load, layer.monitor.load_history().double().mean(0))
    assert layer.placement is plan and layer.monitor.summary()["placement"] == plan.phys_to_logical.tolist()
    assert _rel(layer(x).detach(), y) <= 1e-5


def _rank_bad_call(rank, world_size, case):
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4, top_k=2)
    layer = moe_comm.MoELayer(cfg, seed=0)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    layer(torch.randn(5, H)).sum().backward()
    opt.step()
    plan = plan_placement([[4, 3, 2, 1]], world_size, 2)
    if case == "odd_state" and rank == 1:
        opt.state[layer.experts.w1]["odd"] = torch.zeros(7)
    if case == "other_plan" and rank == 1:
        plan = plan_placement([[1, 2, 3, 4]], world_size, 2)
    try:
        layer.apply_placement(plan, opt)
    except ValueError as e:
        return str(e), layer.placement is None
    return None, layer.placement is None


@pytest.mark.multirank
@pytest.mark.parametrize("case,match", [("odd_state", "rejected"), ("other_plan", "placement differs")])
def test_bad_call_on_one_rank_raises_on_every_rank(ranks, case, match):
    for err, untouched in ranks(2).run(_rank_bad_call, case):
        assert err is not None and (match in err or "odd" in err) and untouched


# ------------------------------------------------------------------------ hand-made placements, checks

def _hand_placement(p2l, E, W):
    """A Placement with an arbitrary phys_to_logical (the planner never puts two replicas of one expert
    on one rank; a user may)."""
    return dataclasses.replace(identity_placement(E, W), phys_to_logical=torch.as_tensor(p2l),
                               num_replicas=len(p2l) - E)


def test_sync_replica_grads_sums_replicas_on_one_rank():
    """Tier 1: two replicas of expert 0 on the only rank: both end with the sum (was: left unsummed)."""
    w = torch.nn.Parameter(torch.zeros(3, 2))
    w.grad = torch.tensor([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]])
    assert sync_replica_grads([w], [0, 1, 0], [0, 1, 0], None) == 1
    assert w.grad.tolist() == [[101.0, 202.0], [10.0, 20.0], [101.0, 202.0]]


def _rank_sync_two_local_replicas(rank, world_size):
    p2l = [0, 0, 1, 2, 3, 0, 1, 2]  # rank 0 holds expert 0 twice; expert 0 has 3 replicas, 1 and 2 have 2
    S = len(p2l) // world_size
    local = p2l[rank * S:(rank + 1) * S]
    w = torch.nn.Parameter(torch.zeros(S, 3, dtype=torch.float64))
    w.grad = torch.arange(S * 3, dtype=torch.float64).reshape(S, 3) + 100.0 * rank
    v = torch.nn.Parameter(torch.zeros(S, 2))  # no .grad: counts as zeros
    n = sync_replica_grads([w, v], local, p2l, dist.group.WORLD)
    return n, local, w.grad, v.grad


@pytest.mark.multirank
def test_sync_replica_grads_adds_two_replicas_on_one_rank(ranks):
    res = ranks(2).run(_rank_sync_two_local_replicas)
    before = {}  # (rank, slot) -> grad before the sync
    for rank in range(2):
        for i in range(4):
            before[(rank, i)] = torch.arange(3, dtype=torch.float64) + 3 * i + 100.0 * rank
    for rank, (n, local, wg, vg) in enumerate(res):
        assert n == 3 and torch.count_nonzero(vg) == 0
        for i, g in enumerate(local):
            holders = [(r, j) for r in range(2) for j, h in enumerate(res[r][1]) if h == g]
            want = sum(before[h] for h in holders)
            assert torch.equal(wg[i], want), (rank, i, g)


def _rank_hand_placement_equivalence(rank, world_size):
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4, top_k=2)
    layer = moe_comm.MoELayer(cfg, seed=21)
    x, gy = _data(rank, world_size, cfg, [40, 30], 21)
    out = [_step(layer, x, gy)]
    layer.apply_placement(_hand_placement([0, 0, 1, 2, 3, 0, 1, 2], 4, world_size))
    out.append(_step(layer, x, gy))
    return out


@pytest.mark.multirank
def test_two_replicas_on_one_rank_give_the_unplaced_gradients(ranks):
    res = ranks(2).run(_rank_hand_placement_equivalence)
    ref = {g: v for r in res for g, v in r[0]["experts"].items()}
    for before, after in res:
        assert _rel(after["y"], before["y"]) <= 1e-5 and _rel(after["router"], before["router"]) <= 1e-5
        for g, grad in after["experts"].items():
            assert _rel(grad, ref[g]) <= 1e-5, g
    ex0 = [r[1]["rows"][i] for r in res for i, g in enumerate(r[1]["ids"]) if g == 0]
    assert len(ex0) == 3 and all(int(n) > 0 for n in ex0), "each replica of expert 0 served tokens"


def test_float_phys_to_logical_is_rejected_not_truncated():
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4, top_k=2)
    layer = moe_comm.MoELayer(cfg, seed=0)
    plan = plan_placement([[4, 3, 2, 1]], 1)
    for bad in (plan.phys_to_logical.double() + 0.7, [0.0, 1.0, 2.0, 3.0]):
        with pytest.raises(TypeError, match="placement.phys_to_logical"):
            layer.apply_placement(dataclasses.replace(plan, phys_to_logical=bad))
        with pytest.raises(TypeError, match="phys_to_logical"):
            layer.monitor.set_placement(bad)
    assert layer.placement is None
    with pytest.raises(ValueError, match=r"placement.phys_to_logical\[0\] must be <= 3"):
        layer.apply_placement(_hand_placement([4, 1, 2, 3], 4, 1))


def test_relayout_slots_moves_weights_and_optimizer_state():
    """Tier 1: the function behind apply_placement, outside the Module (no MoELayer involved)."""
    w = torch.nn.Parameter(torch.arange(8.0).reshape(4, 2))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    w.grad = torch.ones(4, 2)
    opt.step()
    momentum = opt.state[w]["momentum_buffer"].clone()
    data = w.detach().clone()
    p2l = relayout_slots([w], _hand_placement([2, 0, 3, 1, 0, 2], 4, 1), [0, 1, 2, 3], 4, None, opt)
    assert p2l == [2, 0, 3, 1, 0, 2] and w.grad is None and opt.state[w]["momentum_buffer"].shape == (6, 2)
    for i, g in enumerate(p2l):
        assert torch.equal(w[i], data[g]) and torch.equal(opt.state[w]["momentum_buffer"][i], momentum[g])
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        relayout_slots([w], _hand_placement([0, 1, 2, 3], 4, 1), p2l, 4, None, optimizer="adam")


def test_placement_and_monitor_do_not_import_modules():
    """Tier 1: the dependency rule (moe_comm/__init__.py): placement and monitor sit below modules."""
    import ast
    import pathlib

    root = pathlib.Path(moe_comm.__file__).parent
    for package in ("placement", "monitor"):
        for path in sorted((root / package).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                assert not any(n == "moe_comm.modules" or n.startswith("moe_comm.modules.") for n in names), path
