"""MoELayer in the sync-free mode (``MoEConfig(max_tokens_per_rank=M)``) and deferred reads with a monitor.

Tier 2 (gloo ranks): the sync-free layer equals the dropless layer (outputs and every gradient, float64,
to rounding: the padded experts run other GEMM shapes), with shared experts, aux loss and capacity; a rank
that fails alone (a bad input, an expert raising) raises at once, issues the load collective its peers
issue, so both continue; the peers learn at ``check()`` (sync-free) or the backward's check-in (deferred).
"""
import pytest
import torch

import moe_comm

H, F, E, K, M = 8, 12, 8, 2, 24


def _cfg(**kw):
    return moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, num_shared_experts=1,
                              aux_loss_coeff=0.01, **kw)


def _x(rank, step, T=None):
    T = [20, 0, 24, 7][rank] if T is None else T
    return torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * step + rank))


def _grads(layer, x):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    (y.pow(2).sum() + layer.aux_loss).backward()
    out = {"y": y.detach(), "x": x.grad}
    out.update({n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None})
    layer.zero_grad(set_to_none=True)
    return out


def _rank_equal(rank, world_size, capacity):
    free = moe_comm.MoELayer(_cfg(max_tokens_per_rank=M, capacity_factor=capacity), seed=3, dtype=torch.float64)
    exact = moe_comm.MoELayer(_cfg(capacity_factor=capacity), seed=3, dtype=torch.float64)
    worst = []
    for step in range(3):
        a, b = _grads(free, _x(rank, step)), _grads(exact, _x(rank, step))
        assert a.keys() == b.keys(), (a.keys(), b.keys())
        worst.append(max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-300)).item()
                         for k in b if b[k].numel()))
    free.check()
    return worst


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,capacity", [(1, None), (2, None), (2, 1.0), (4, None)])
def test_sync_free_layer_equals_dropless(ranks, world_size, capacity):
    for worst in ranks(world_size).run(_rank_equal, capacity):
        assert max(worst) < 1e-12, worst


def _rank_fails_alone(rank, world_size, mode, kind):
    kw = dict(max_tokens_per_rank=M) if mode == "sync_free" else {}
    layer = moe_comm.MoELayer(_cfg(**kw), seed=3, dtype=torch.float64, timeout=20, bias_update_rate=0.05,
                              end_check="deferred")
    opt = torch.optim.SGD(layer.parameters(), lr=0.01)
    log = []
    for step in range(5):
        x = _x(rank, step, T=10)
        if rank == 1 and step == 2:
            if kind == "bad_input":
                x = torch.randn(10, H + 1, dtype=torch.float64)
            else:
                def boom(module, args):
                    raise RuntimeError("expert kernel failed")
                hook = layer.experts.register_forward_pre_hook(boom)
        try:
            y = layer(x)
            if mode == "sync_free":
                layer.check()  # the one read of a sync-free training step: before the backward
            (y.pow(2).sum() + layer.aux_loss).backward()
            opt.step()
            log.append("ok")
        except Exception as err:  # noqa: BLE001
            log.append(f"{type(err).__name__}: {err}")
        opt.zero_grad(set_to_none=True)
        if rank == 1 and step == 2 and kind == "expert_raises":
            hook.remove()
    layer.finish_bias_update()
    return log, layer.router.expert_bias.clone(), layer.monitor.summary()["total"]["tokens_per_expert"]


@pytest.mark.multirank
# (deferred, bad_input) is not a case: a bad input is rejected at the counts read, on every rank alike.
@pytest.mark.parametrize("mode,kind", [("sync_free", "bad_input"), ("sync_free", "expert_raises"),
                                       ("deferred", "expert_raises")])
def test_layer_rank_failing_alone_keeps_collectives_paired(ranks, mode, kind):
    (log0, bias0, total0), (log1, bias1, total1) = ranks(2).run(_rank_fails_alone, mode, kind)
    want = "last dimension hidden_size" if kind == "bad_input" else "expert kernel failed"
    assert want in log1[2] and "EP rank(s) [1]" in log0[2] and want in log0[2], (log0, log1)
    assert log0[:2] + log0[3:] == ["ok"] * 4 and log1[:2] + log1[3:] == ["ok"] * 4, (log0, log1)
    assert torch.equal(bias0, bias1), "the aux-loss-free bias stays identical on every rank"
    assert total0 == total1, "the monitors hold the same global counts"


def _rank_model_check(rank, world_size):
    from moe_comm.testing.syncs import HostSyncs

    model = torch.nn.Sequential(*[moe_comm.MoELayer(_cfg(max_tokens_per_rank=M), seed=s, dtype=torch.float64,
                                                    timeout=20) for s in (1, 2)])
    log = []
    for step in range(4):
        x = _x(rank, step, T=10)
        hook = None
        if rank == 1 and step == 2:
            def boom(module, args):
                raise RuntimeError("second layer's experts failed")
            hook = model[1].experts.register_forward_pre_hook(boom)
        try:
            y = model(x)
            with HostSyncs() as reads:
                moe_comm.check(model)
            log.append(f"ok {reads.count}")
            y.sum().backward()
        except Exception as err:  # noqa: BLE001
            log.append(f"{type(err).__name__}: {err}")
        if hook is not None:
            hook.remove()
    return log


@pytest.mark.multirank
def test_model_check_reads_every_layer_once(ranks):
    log0, log1 = ranks(2).run(_rank_model_check)
    assert log0[0] == "ok 1" and log0[1] == "ok 1" and log0[3] == "ok 1", log0  # one read for both layers
    assert log0[2].startswith("PeerFailed") and "second layer's experts failed" in log0[2], log0
    assert "second layer's experts failed" in log1[2] and log1[3] == "ok 1", log1


def _rank_stack_bad_input(rank, world_size, kind):
    """A two-layer sync-free stack; at step 1 rank 1's input is bad for both layers (too many tokens for the
    Dispatcher, or another hidden size for the layer's own check), so both of its layers return placeholders.
    Its backward must still reach the first layer, as its peer's does: the placeholder keeps x's graph (zero
    gradient). Before: the second layer's zeros were cut from its input, rank 1 skipped the first layer's backward,
    and the ranks never paired again (ProtocolError, then a timeout)."""
    model = torch.nn.Sequential(*[moe_comm.MoELayer(_cfg(max_tokens_per_rank=M), seed=s, dtype=torch.float64,
                                                    timeout=20) for s in (1, 2)])
    log = []
    for step in range(4):
        x = _x(rank, step, T=10)
        if rank == 1 and step == 1:
            x = _x(rank, step, T=M + 4) if kind == "too_many_tokens" else torch.randn(10, H + 1, dtype=torch.float64)
        x.requires_grad_(True)
        try:
            model(x).pow(2).sum().backward()
            moe_comm.check(model)
            log.append("ok")
        except Exception as err:  # noqa: BLE001
            log.append(f"{type(err).__name__}: {err}")
    return log


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["too_many_tokens", "other_hidden"])
def test_a_bad_input_through_a_stack_keeps_the_ranks_paired(ranks, kind):
    log0, log1 = ranks(2).run(_rank_stack_bad_input, kind)
    want = "max_tokens_per_rank" if kind == "too_many_tokens" else "last dimension hidden_size"
    assert want in log0[1] and want in log1[1] and "EP rank(s) [1]" in log0[1], (log0, log1)
    assert log0[:1] + log0[2:] == ["ok"] * 3 and log1[:1] + log1[2:] == ["ok"] * 3, (log0, log1)


def _rank_placement_after_unread_failure(rank, world_size):
    from moe_comm.placement.planner import plan_placement

    layer = moe_comm.MoELayer(_cfg(max_tokens_per_rank=M), seed=1, dtype=torch.float64, timeout=20)
    for step in range(2):  # step 1: rank 1 has too many tokens; nobody calls check()
        layer(_x(rank, step, T=M + 4 if (rank, step) == (1, 1) else 10)).sum().backward()
    w1 = layer.experts.w1.detach().clone()
    try:
        layer.apply_placement(plan_placement([[8, 7, 6, 5, 4, 3, 2, 1]], world_size, 2))
        return "applied", False
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}", torch.equal(layer.experts.w1, w1)


@pytest.mark.multirank
def test_apply_placement_raises_an_unread_sync_free_failure_first(ranks):
    # before: the rebuilt Dispatcher dropped the old one's unread failure (it was never raised)
    for rank, (text, untouched) in enumerate(ranks(2).run(_rank_placement_after_unread_failure)):
        assert "max_tokens_per_rank" in text and "EP rank(s) [1]" in text, (rank, text)
        assert untouched, "raised before any weight moved"
