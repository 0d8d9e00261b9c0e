"""Tier 2 (multi-rank gloo): the sync-free mode (no host read per call) when one rank skips a backward its peers
run, with ``check()`` after each forward as documented.

Before: the peers' backward paired with that rank's next forward (same sizes: no error), returned gradients made
of the wrong rows, and the ranks never paired again (ProtocolError at every check, or, with the layer's load
monitor, an all_reduce paired with an all-to-all: a timeout that poisons the group). Now: the mis-paired backward's
gradients are NaN on every rank, the next read raises ProtocolError on every rank, the rank that skipped issues a
placeholder backward there so every rank's collectives pair again, and the next step is exact.
"""
from __future__ import annotations

import pytest
import torch

import moe_comm
from outcome import outcome_of

M, H, STEPS, SKIP = 12, 8, 6, 2


def _rank_skip(rank, world_size, with_layer):
    E = 2 * world_size
    skipper = world_size - 1
    if with_layer:  # monitor on (default) and aux-loss-free balancing: both need the global load
        cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=E, top_k=2, max_tokens_per_rank=M)
        layer = moe_comm.MoELayer(cfg, seed=3, timeout=20.0, bias_update_rate=1e-3)
    else:
        d = moe_comm.Dispatcher(num_experts=E, max_tokens_per_rank=M, timeout=20.0)
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(9, H, generator=g, requires_grad=True)
        idx, w = torch.rand(9, E, generator=g).argsort(1)[:, :2], torch.rand(9, 2, generator=g)

        def one_step():
            if with_layer:
                y = layer(x)
                moe_comm.check(layer)
            else:
                y = d(x, idx, w, lambda t, c: t * 2.0)
                d.check()
            if step == SKIP and rank == skipper:
                return "skipped"
            y.sum().backward()
            if torch.isnan(x.grad).any():
                return "nan" if torch.isnan(x.grad).all() else "partly nan"
            if not with_layer:
                return "exact" if torch.equal(x.grad, 2 * w.sum(1, keepdim=True).expand_as(x)) else "wrong"
            return "finite"
        out.append(outcome_of(one_step))
    monitor = None
    if with_layer:
        moe_comm.check(layer)
        hist = layer.monitor.history()
        # every step but the mis-paired one (its exchange met a backward: the peers' words were missing)
        monitor = (hist["steps"], [c for s, c in zip(hist["steps"], hist["tokens_per_expert"]) if s != SKIP + 1],
                   layer.router.expert_bias.tolist())  # the replicated bias stays equal (the failed step's dropped)
    return out, monitor


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("with_layer", [False, True])
def test_a_skipped_backward_raises_everywhere_and_the_ranks_pair_again(ranks, world_size, with_layer):
    res = ranks(world_size).run(_rank_skip, with_layer, timeout=180)
    good = "finite" if with_layer else "exact"
    for rank, (out, _) in enumerate(res):
        assert out[:SKIP] == [good] * SKIP, (rank, out)
        assert out[SKIP] == ("skipped" if rank == world_size - 1 else "nan"), (rank, out)  # never wrong rows
        assert out[SKIP + 1].startswith("ProtocolError:") and "not in the same call" in out[SKIP + 1], (rank, out)
        assert out[SKIP + 2:] == [good] * (STEPS - SKIP - 2), (rank, out)  # paired again
    if with_layer:  # the monitor saw the same global batches on every rank, but in the failed step
        assert all(m == res[0][1] for _, m in res), [m for _, m in res]
