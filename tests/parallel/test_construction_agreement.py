"""Construction is collective: a rank that rejects its own arguments, a rank building something else, a rank
that never arrives. Every rank raises, none waits past the timeout (issue #27.3).

Tier 2 (gloo ranks, 2 and 4): ``moe_comm.hf.from_hf`` / ``swap_moe_blocks`` with an option or a block that
one rank alone rejects (checked before the MoELayer exists); a MoELayer on one rank while the others build a
Dispatcher (the construction order differs); ``agree`` with ``timeout=`` while one rank never arrives (a
fresh group, so the pool's own group stays usable). After each, the next construction works.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import moe_comm

from ep_dp_model import E, batch, make_cfg
from outcome import outcome_of


def _mixtral_block(experts: int = 4):
    """A tiny transformers Mixtral sparse MoE block, the same weights on every rank."""
    import transformers as tf
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    cfg = tf.MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=experts, num_experts_per_tok=2,
                           router_jitter_noise=0.0)
    cfg._experts_implementation = "eager"
    block = MixtralSparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return block


def _rank_hf_local_rejection(rank, world_size):
    from moe_comm import hf
    bad = world_size - 1
    block = _mixtral_block(experts=2 * world_size)
    out = {}
    t0 = time.perf_counter()
    # num_chunks=0: MoEConfig rejects it on the bad rank alone, before any MoELayer exists
    out["option"] = outcome_of(lambda: hf.from_hf(block, dist.group.WORLD, num_chunks=0 if rank == bad else 1))
    # an option from_hf does not know, on one rank
    out["unknown"] = outcome_of(lambda: hf.from_hf(block, dist.group.WORLD, **({"chunks": 2} if rank == bad else {})))

    class Unsupported(torch.nn.Module):  # a sparse MoE block moe_comm cannot express, on the bad rank alone
        def __init__(self):
            super().__init__()
            self.gate, self.experts = torch.nn.Linear(16, 4), torch.nn.ModuleList()

    model = torch.nn.Sequential(_mixtral_block(experts=2 * world_size))
    if rank == bad:
        model.append(Unsupported())
    out["swap"] = outcome_of(lambda: hf.swap_moe_blocks(model, dist.group.WORLD))
    out["elapsed"] = time.perf_counter() - t0
    layer = hf.from_hf(block, dist.group.WORLD)  # the group is still usable, every rank in step
    x = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        out["next"] = bool(torch.allclose(layer(x), block(x), rtol=1e-5, atol=1e-6))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_rank_rejecting_an_hf_option_or_block_raises_on_every_rank(ranks, world_size):
    pytest.importorskip("transformers")
    bad = world_size - 1
    res = ranks(world_size).run(_rank_hf_local_rejection, timeout=120)
    for rank, out in enumerate(res):
        assert out["next"], rank
        assert out["elapsed"] < 30, (rank, out["elapsed"])  # no rank waited for a timeout
        for case, needle in (("option", "num_chunks"), ("unknown", "chunks"), ("swap", "Unsupported")):
            got = out[case]
            assert needle in got and f"[{bad}]" in got, (rank, case, got)
            if rank == bad:
                assert got.startswith(("ValueError:", "TypeError:")), (rank, case, got)
            else:
                assert got.startswith("RemoteError:"), (rank, case, got)


def _rank_order_mismatch(rank, world_size):
    cfg = make_cfg()
    if rank == 0:
        first = outcome_of(lambda: moe_comm.MoELayer(cfg, seed=1))
    else:
        first = outcome_of(lambda: moe_comm.Dispatcher(num_experts=E))
    # every later construction is in step again: a layer and a Dispatcher on every rank
    layer = moe_comm.MoELayer(cfg, seed=1)
    d = moe_comm.Dispatcher(num_experts=E)
    x, _ = batch(rank)
    y = layer(x)
    idx = torch.arange(2 * x.shape[0]).reshape(-1, 2) % E
    z = d(x, idx, torch.full(idx.shape, 0.5), lambda t, c: t)
    return first, bool(torch.isfinite(y).all()), bool(torch.allclose(z, x))


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_construction_order_mismatch_is_named_on_every_rank(ranks, world_size):
    others = list(range(1, world_size))
    for rank, (first, layer_ok, dispatcher_ok) in enumerate(ranks(world_size).run(_rank_order_mismatch)):
        assert layer_ok and dispatcher_ok, rank
        assert first.startswith("ValueError:"), (rank, first)
        assert "Dispatcher (#" in first and f"on ranks {others}" in first, (rank, first)
        assert "MoELayer (#" in first and "on ranks [0]" in first, (rank, first)
        assert "same order" in first, (rank, first)


def _rank_agree_timeout(rank, world_size):
    from moe_comm.comm.agree import agree
    group = dist.new_group(list(range(world_size)))  # a fresh group: poisoning it spares the pool's WORLD
    late = world_size - 1
    if rank == late:
        return "skipped", 0.0, "skipped", 0.0  # never arrives (as a rank that raised alone before its agreement)
    t0 = time.perf_counter()
    first = outcome_of(lambda: agree(group, {"E": E}, what="MoELayer", timeout=1.0))
    elapsed = time.perf_counter() - t0
    t1 = time.perf_counter()
    second = outcome_of(lambda: agree(group, {"E": E}, what="Dispatcher", timeout=1.0))
    return first, elapsed, second, time.perf_counter() - t1


@pytest.mark.multirank
@pytest.mark.nccl_rules_exempt("a rank skips the agreement on purpose; the rules' side check would wait for it")
@pytest.mark.parametrize("world_size", [2, 4])
def test_agree_honours_its_timeout_and_poisons_the_group(ranks, world_size):
    late = world_size - 1
    for rank, (first, elapsed, second, elapsed2) in enumerate(ranks(world_size).run(_rank_agree_timeout)):
        if rank == late:
            continue
        assert first.startswith("CollectiveError:") and "MoELayer agreement #0" in first, (rank, first)
        assert f"EP rank {late} never arrived" in first and "rebuild" in first, (rank, first)
        assert elapsed < 1.0 + 4.0, (rank, elapsed)
        assert second.startswith("CollectiveError:") and "rebuild" in second, (rank, second)
        assert elapsed2 < 0.5, (rank, elapsed2)
