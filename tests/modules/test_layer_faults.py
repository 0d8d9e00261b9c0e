"""An error on one rank reaches every rank as a clear error: MoELayer construction, the router, checkpoint
loading, activation checkpointing, and the monitor's / bias update's all_reduce.

Tier 1 (pure logic, one process): activation checkpointing (reentrant and not) on one rank.
Tier 2 (multi-rank gloo, ``ranks`` fixture, 2 and 4 ranks): a rejected argument or a failing router on one
rank raises on every rank (naming that rank) and the group stays usable; checkpoint loading is
all-or-nothing on every rank; checkpointing keeps every gradient and counts each step once.
Tier 2 with fresh spawned ranks: a peer that never joins the monitor's or the bias update's all_reduce
becomes a CollectiveError naming the phase within the layer's timeout.
Every multi-rank call runs under the pool's timeout, so a hang fails the test instead of blocking it.
"""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import moe_comm
from moe_comm.modules.checkpoint import full_state_dict, load_full_state_dict

H, F = 8, 12


def _cfg(**kw):
    return moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, **{"num_experts": 4, "top_k": 2, **kw})


def _x(rank, T=6, seed=0):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(100 * seed + rank))


def _good_step(layer, rank):
    """A full forward + backward that every rank runs after a failure: the group is still paired."""
    x = _x(rank, seed=7).requires_grad_(True)
    y = layer(x)
    (y.square().sum() + layer.aux_loss).backward()
    return bool(torch.isfinite(y).all()) and x.grad is not None


# ------------------------------------------------------------------------ construction never hangs

def _rank_bad_construction(rank, world_size, case):
    bad = world_size - 1
    cfg, kwargs = _cfg(num_experts=8), {}
    if rank == bad:
        if case == "bias_update_rate":
            kwargs["bias_update_rate"] = -1.0
        elif case == "monitor":
            kwargs["monitor"] = {"window": 0}
        elif case == "cfg":
            cfg = {"hidden_size": H}
        elif case == "num_experts":
            cfg = _cfg(num_experts=6)  # not divisible by W = 4
    error = None
    try:
        moe_comm.MoELayer(cfg, **kwargs)
    except (TypeError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    layer = moe_comm.MoELayer(_cfg(num_experts=8), seed=1)  # the group still works
    return error, _good_step(layer, rank)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case,needle", [("bias_update_rate", "bias_update_rate must be >= 0"),
                                         ("monitor", "window must be >= 1"),
                                         ("cfg", "cfg must be a MoEConfig, got dict"),
                                         ("num_experts", "num_experts (6) must be divisible")])
def test_local_construction_error_raises_on_every_rank(ranks, world_size, case, needle):
    if case == "num_experts" and world_size == 2:
        pytest.skip("6 experts divide over 2 ranks")
    bad = world_size - 1
    res = ranks(world_size).run(_rank_bad_construction, case, timeout=90)
    for rank, (error, ok) in enumerate(res):
        assert ok, rank
        assert error is not None and f"[{bad}]" in error, (rank, error)  # every rank names the failing rank
    assert needle in res[bad][0], res[bad][0]
    for rank in range(bad):  # the others say why
        assert "RemoteError" in res[rank][0] and needle in res[rank][0], res[rank][0]


def _rank_equal_values(rank, world_size):
    # 1 and 1.0 are the same value: not a config mismatch.
    cfg = _cfg(capacity_factor=1 if rank == 0 else 1.0, aux_loss_coeff=0 if rank == 0 else 0.0)
    layer = moe_comm.MoELayer(cfg, bias_update_rate=0 if rank == 0 else 0.0, seed=2)
    return _good_step(layer, rank)


@pytest.mark.multirank
def test_config_compared_by_value(ranks):
    assert all(ranks(2).run(_rank_equal_values))


# ------------------------------------------------------------------------ router errors fold into the exchange

def _rank_router_error(rank, world_size, kind):
    bad = world_size - 1
    layer = moe_comm.MoELayer(_cfg(aux_loss_coeff=0.01), seed=3)
    layer.train()
    x = _x(rank)
    if rank == bad and kind == "inference_tensor":
        with torch.inference_mode():
            x = _x(rank) * 1.0  # an inference tensor, used while training
    if rank == bad and kind == "router_raises":
        def boom(*args, **kwargs):
            raise RuntimeError("router exploded")
        layer.router.forward = boom
    error = None
    try:
        layer(x).sum().backward()
    except Exception as e:  # noqa: BLE001 -- whatever it is, every rank must get here
        error = f"{type(e).__name__}: {e}"
    if rank == bad and kind == "router_raises":
        del layer.router.forward
    steps = layer.monitor.steps  # the failed step recorded nothing, on any rank
    return error, steps, _good_step(layer, rank), layer.monitor.steps


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind,needle", [("inference_tensor", "inference tensor"),
                                         ("router_raises", "router exploded")])
def test_router_error_on_one_rank_raises_on_every_rank(ranks, world_size, kind, needle):
    bad = world_size - 1
    res = ranks(world_size).run(_rank_router_error, kind, timeout=90)
    for rank, (error, steps, ok, steps_after) in enumerate(res):
        assert error is not None and f"[{bad}]" in error, (rank, error)
        assert steps == 0 and steps_after == 1 and ok, rank
    assert needle in res[bad][0]


# ------------------------------------------------------------------------ activation checkpointing

def _checkpointing_run(rank, mode, steps=2):
    """Two layers from one seed, one run plainly, one under torch.utils.checkpoint; aux loss and
    aux-loss-free balancing on; each step runs two micro-batches before one backward (accumulation), so
    the bias moves between a micro-batch's forward and its recompute."""
    cfg = _cfg(num_experts=8, aux_loss_coeff=0.05, z_loss_coeff=0.01)
    ref = moe_comm.MoELayer(cfg, seed=5, bias_update_rate=0.2)
    ckp = moe_comm.MoELayer(cfg, seed=5, bias_update_rate=0.2)
    reentrant = mode == "reentrant"
    gy = torch.linspace(-1, 1, H)
    out = {"grads": [], "aux_only": [], "routing_moved": False}
    for step in range(steps):
        grads = []
        for layer in (ref, ckp):
            layer.zero_grad(set_to_none=True)
            xs = [_x(rank, T=16, seed=10 * step + m).requires_grad_(True) for m in range(2)]
            loss, routed = 0.0, []
            for x in xs:
                y = torch_checkpoint.checkpoint(layer, x * 1.0, use_reentrant=reentrant) if layer is ckp \
                    else layer(x * 1.0)
                loss = loss + (y * gy).sum() + layer.aux_loss
                with torch.no_grad():  # micro-batch 0's routing, under the bias it ran with and the next one
                    routed.append(layer.router(xs[0].detach()).topk_idx_TK)
            loss.backward()
            grads.append([layer.router.weight.grad.clone(), layer.experts.w1.grad.clone(),
                          layer.experts.w2.grad.clone()] + [x.grad.clone() for x in xs])
            if layer is ref:
                out["routing_moved"] |= not torch.equal(routed[0], routed[1])
        out["grads"].append(grads)
    for layer in (ref, ckp):  # the aux loss alone: its router gradient survives the checkpoint
        layer.zero_grad(set_to_none=True)
        x = _x(rank, T=16, seed=99).requires_grad_(True)
        y = torch_checkpoint.checkpoint(layer, x * 1.0, use_reentrant=reentrant) if layer is ckp else layer(x * 1.0)
        ((y * 0.0).sum() + layer.aux_loss).backward()
        out["aux_only"].append(layer.router.weight.grad.clone())
    out["steps"] = (ref.monitor.steps, ckp.monitor.steps)
    ref.finish_bias_update()
    ckp.finish_bias_update()
    out["bias"] = (ref.router.expert_bias.clone(), ckp.router.expert_bias.clone())
    return out


def _check_checkpointing(out):
    assert out["routing_moved"], "test sensitivity: the bias step changes micro-batch 0's routing before its recompute"
    assert out["steps"][0] == out["steps"][1] == 5, out["steps"]  # 2 steps x 2 micro-batches + 1: counted once
    assert torch.equal(out["bias"][0], out["bias"][1]), "the bias stepped once per forward, not per recompute"
    for ref, ckp in out["grads"]:
        for a, b in zip(ref, ckp):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    ref_aux, ckp_aux = out["aux_only"]
    assert float(ref_aux.abs().max()) > 1e-4, "the aux loss has a router gradient"
    torch.testing.assert_close(ckp_aux, ref_aux, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_activation_checkpointing_single_rank(mode):
    """Tier 1: same gradients (aux loss included) as without checkpointing; load counted once."""
    _check_checkpointing(_checkpointing_run(0, mode))


def _rank_checkpointing(rank, world_size, mode):
    return _checkpointing_run(rank, mode)


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_activation_checkpointing_two_ranks(ranks, mode):
    for out in ranks(2).run(_rank_checkpointing, mode, timeout=120):
        _check_checkpointing(out)


# ------------------------------------------------------------------------ checkpoint loading

def _params(layer):
    return {k: v.detach().clone() for k, v in layer.named_parameters()} | \
        {"bias": layer.router.expert_bias.clone()}


def _rank_bad_checkpoint(rank, world_size, case):
    cfg = _cfg(num_experts=8)
    sd = full_state_dict(moe_comm.MoELayer(cfg, seed=11))
    layer = moe_comm.MoELayer(cfg, seed=12)
    strict = True
    if case == "missing_expert":
        del sd["experts.w1.7"]  # owned by the last rank only
    elif case == "misshaped_expert":
        sd["experts.w2.0"] = sd["experts.w2.0"][:, :-1]  # owned by rank 0 only
    elif case == "unknown_id":
        sd["experts.w1.99"] = sd["experts.w1.0"].clone()
    elif case == "malformed_id":
        sd["experts.w3.0007"] = sd["experts.w3.7"].clone()
    elif case == "one_rank_differs" and rank == 1:
        del sd["router.weight"]
    elif case == "unknown_id_not_strict":
        sd["experts.w1.99"] = sd["experts.w1.0"].clone()
        sd["experts.w3.0007"] = sd["experts.w3.7"].clone()
        strict = False
    before = _params(layer)
    error, result = None, None
    try:
        result = load_full_state_dict(layer, sd, strict=strict)
    except (ValueError, TypeError) as e:
        error = f"{type(e).__name__}: {e}"
    after = _params(layer)
    untouched = all(torch.equal(before[k], after[k]) for k in before)
    loaded = all(torch.equal(w, sd[f"experts.w1.{g}"]) for w, g in zip(layer.experts.w1, layer.local_expert_ids))
    return error, untouched, loaded, None if result is None else (list(result.missing_keys),
                                                                  list(result.unexpected_keys))


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case,needle", [("missing_expert", "missing key(s): experts.w1.7"),
                                         ("misshaped_expert", "size mismatch for experts.w2.0"),
                                         ("unknown_id", "experts.w1.99"),
                                         ("malformed_id", "experts.w3.0007"),
                                         ("one_rank_differs", "router.weight")])
def test_bad_checkpoint_raises_on_every_rank_and_writes_nothing(ranks, world_size, case, needle):
    res = ranks(world_size).run(_rank_bad_checkpoint, case, timeout=90)
    for rank, (error, untouched, _, _) in enumerate(res):
        assert error is not None and untouched, (rank, error, untouched)  # all or nothing, on every rank
        if case == "one_rank_differs":
            assert "[1]" in error, (rank, error)
        else:
            assert needle in error, (rank, error)  # every rank found the bad key itself
    if case == "one_rank_differs":
        assert needle in res[1][0]


@pytest.mark.multirank
def test_unknown_ids_without_strict_are_reported_and_skipped(ranks):
    res = ranks(2).run(_rank_bad_checkpoint, "unknown_id_not_strict")
    for error, untouched, loaded, incompatible in res:
        assert error is None and not untouched and loaded
        assert incompatible == ([], ["experts.w1.99", "experts.w3.0007"])


def _rank_full_state_dict_bf16(rank, world_size):
    cfg = _cfg(num_experts=8)
    layer = moe_comm.MoELayer(cfg, seed=13, dtype=torch.bfloat16)
    if rank == 1:
        with torch.no_grad():
            layer.router.weight.add_(1.0)  # replicated entries come from EP rank 0
    sd = full_state_dict(layer)
    mine = {g: (layer.experts.w1[i].detach().clone(), layer.experts.w2[i].detach().clone())
            for i, g in enumerate(layer.local_expert_ids)}
    return sd, mine, layer.router.weight.detach().clone()


@pytest.mark.multirank
def test_full_state_dict_gathers_every_expert(ranks):
    res = ranks(2).run(_rank_full_state_dict_bf16)
    sd = res[0][0]
    assert all(list(r[0]) == list(sd) for r in res), "same keys, same order, on every rank"
    assert all(torch.equal(r[0][k], sd[k]) for r in res for k in sd)
    for _, mine, _ in res:
        for g, (w1, w2) in mine.items():
            assert sd[f"experts.w1.{g}"].dtype == torch.bfloat16 and torch.equal(sd[f"experts.w1.{g}"], w1)
            assert torch.equal(sd[f"experts.w2.{g}"], w2)
    assert torch.equal(sd["router.weight"], res[0][2])
    assert [k for k in sd if k.startswith("experts.w1.")] == [f"experts.w1.{g}" for g in range(8)]


def test_local_load_checks_every_expert_key():
    """Tier 1: a plain load_state_dict of a misshaped expert leaves every expert weight untouched; an
    unknown or malformed expert id is an unexpected key (torch raises on it with strict=True)."""
    layer = moe_comm.MoELayer(_cfg(), seed=1)
    sd = moe_comm.MoELayer(_cfg(), seed=2).state_dict()
    sd["experts.w2.3"] = sd["experts.w2.3"][:1]
    w1 = layer.experts.w1.detach().clone()
    with pytest.raises(RuntimeError, match="size mismatch for experts.w2.3"):
        layer.load_state_dict(sd)
    assert torch.equal(layer.experts.w1, w1)
    for bad in ("experts.w1.12", "experts.w1.01", "experts.w4.0"):
        sd = moe_comm.MoELayer(_cfg(), seed=2).state_dict()
        sd[bad] = sd["experts.w1.0"]
        with pytest.raises(RuntimeError, match=f"Unexpected key\\(s\\) in state_dict: \"{bad}\""):
            layer.load_state_dict(sd)
        assert layer.load_state_dict(sd, strict=False).unexpected_keys == [bad]
        assert all(torch.equal(layer.experts.w1[g], sd[f"experts.w1.{g}"]) for g in range(4)), "the rest loaded"


# ------------------------------------------------------------------------ all_reduce timeouts

def _timeout_rank(rank, world_size, init_file, q):
    """EP 2 x DP 2 (rank = d * 2 + i). The load counts are summed over EP inside the forward's control exchange,
    then over DP by an all_reduce: rank 2 never issues that DP all_reduce, for the monitor (layer A) nor for
    the bias update (layer B); rank 0, its DP peer, times out naming the phase."""
    import datetime

    import torch.distributed as dist

    from moe_comm.comm.collectives import CollectiveError
    from moe_comm.monitor.load import GlobalCounts

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    groups = []
    for _ in range(2):  # layer a, layer b: their own EP and DP groups (a timed-out group is poisoned)
        ep = [dist.new_group(r) for r in ([0, 1], [2, 3])][rank // 2]
        dp = [dist.new_group(r) for r in ([0, 2], [1, 3])][rank % 2]
        groups.append((ep, dp))
    sync = dist.new_group(list(range(world_size)))
    a = moe_comm.MoELayer(_cfg(), groups[0][0], dp_group=groups[0][1], seed=1, timeout=2.0)
    b = moe_comm.MoELayer(_cfg(), groups[1][0], dp_group=groups[1][1], seed=1, timeout=2.0, monitor=False,
                          bias_update_rate=0.1)
    if rank == 2:
        a.monitor.record = lambda buf_X, *args, **kwargs: GlobalCounts(buf_X[:4])
        b._record_load = lambda routing: None
    results = []
    for layer, read in ((a, lambda: a.monitor.summary()), (b, b.finish_bias_update)):
        layer(_x(rank))
        t0 = time.perf_counter()
        try:
            if rank == 0:
                read()
            results.append(("no error", 0.0))
        except CollectiveError as e:
            results.append((str(e), time.perf_counter() - t0))
        dist.barrier(group=sync)  # rank 2 waits out rank 0's timeout before the next layer's exchanges
    q.put((rank, results))
    q.close()
    q.join_thread()
    os._exit(0)  # rank 0's all_reduces are still pending: no orderly shutdown


@pytest.mark.multirank
def test_monitor_and_bias_all_reduce_time_out_with_a_named_phase(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_timeout_rank, args=(r, 4, str(tmp_path / "store"), q)) for r in range(4)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < 4:
            rank, results = q.get(timeout=90)
            got[rank] = results
    finally:
        for p in procs:
            p.kill()
            p.join()
    (monitor_msg, t_monitor), (bias_msg, t_bias) = got[0]
    assert "EP rank 0" in monitor_msg and "load monitor all_reduce" in monitor_msg, monitor_msg
    assert "EP rank 0" in bias_msg and "bias update (global expert load) all_reduce" in bias_msg, bias_msg
    assert t_monitor < 2.0 + 5.0 and t_bias < 2.0 + 5.0, (t_monitor, t_bias)
