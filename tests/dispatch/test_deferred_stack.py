"""Tier 2 (multi-rank gloo): end_check="deferred" (the CUDA default) through a stack of two layers on one group.

The backward reads once, at its first check-in (the last layer's), with every deferred exchange of the group's
Dispatchers. So a failure in ANY layer's forward - mid-call (the send permute) or after the call's last exchange
(the final unpermute, carried by the rank's next exchange) - raises on every rank there, before any gradient
moves: no expert of either layer gets a gradient in that step. Before, the first check-in read only its own
layer's exchanges: a failure in the first layer let the second layer's backward run (its experts got gradients)
and raised one layer later. The next step works everywhere.
"""
import contextlib
import copy

import pytest
import torch

import moe_comm
from moe_comm.testing.faults import inject
from outcome import outcome_of

H = 8


def _rank_stack(rank, world_size, bad, fault, copied):
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=2 * world_size, top_k=2)
    first, second = (moe_comm.MoELayer(cfg, seed=s, timeout=30.0, end_check="deferred") for s in (1, 2))
    if copied:  # a deep copy's Dispatcher reads with the group too
        second = copy.deepcopy(first)
    steps = []
    for step in range(3):
        x = torch.randn(6, H, generator=torch.Generator().manual_seed(10 * step + rank), requires_grad=True)

        def one_step():
            with inject(fault) if (rank == bad and step == 1) else contextlib.nullcontext():
                h = first(x)
            second(h).sum().backward()
            moe_comm.check(torch.nn.ModuleList([first, second]))
            return "finite" if bool(torch.isfinite(x.grad).all()) else "nan grad"
        text = outcome_of(one_step)
        moved = [p.grad is not None for layer in (first, second) for p in layer.experts.parameters()]
        steps.append((text, any(moved)))
        for layer in (first, second):
            layer.zero_grad(set_to_none=True)
    return steps


@pytest.mark.multirank
@pytest.mark.parametrize("fault,what,copied", [("permute", "send permute", False),
                                              ("unpermute", "final unpermute", False),
                                              ("permute", "send permute", True)])
def test_a_failure_in_any_layer_raises_at_the_first_check_in(ranks, fault, what, copied):
    W, bad = 2, 1
    for rank, steps in enumerate(ranks(W).run(_rank_stack, bad, fault, copied, timeout=120)):
        assert steps[0] == ("finite", True), (rank, steps)
        text, moved = steps[1]
        assert f"injected {what} fault" in text, (rank, text)
        assert text.startswith("RuntimeError:" if rank == bad else "PeerFailed:"), (rank, text)
        assert f"[{bad}]" in text or rank == bad, (rank, text)
        assert not moved, (rank, steps)  # raised before any gradient moved, in either layer
        assert steps[2] == ("finite", True), (rank, steps)
