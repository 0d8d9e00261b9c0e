"""Tier 2 (multi-rank gloo): a backward that fails on ONE rank never hands an optimizer a gradient silently.

- end_check="eager": every rank raises in ``loss.backward()``, and no rank holds a partial expert gradient
  (the experts' weight gradients reach ``.grad`` only after the end-of-backward exchange said every rank
  completed), even when the failure is in the last chunk.
- end_check="deferred" (the CUDA default): ``loss.backward()`` returns on every rank, every gradient that
  phase produced is NaN on every rank, and ``moe_comm.check(model)`` (the supported pattern: after
  ``backward()``, before ``optimizer.step()``) raises on every rank naming the failing rank.
In both, the next step works.
"""
from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm.testing.faults import raise_in_backward

H, F, C = 8, 16, 2


def _layer(world_size, end_check):
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=2 * world_size, top_k=2, num_chunks=C)
    return moe_comm.MoELayer(cfg, seed=4, end_check=end_check, timeout=30.0, monitor=False)


def _fail_backward_at_chunk(layer, chunk):
    """The experts' output of call-chunk ``chunk`` raises in its backward (this process only)."""
    original, seen = layer.experts.forward, [0]

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        seen[0] += 1
        return raise_in_backward(out) if seen[0] == chunk + 1 else out
    layer.experts.forward = forward
    return lambda: delattr(layer.experts, "forward")


def _expert_grads(layer):
    return [p.grad for p in layer.experts.parameters()]


def _rank_failed_backward(rank, world_size, end_check, chunk):
    bad = world_size - 1
    layer = _layer(world_size, end_check)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    undo = _fail_backward_at_chunk(layer, chunk) if rank == bad else (lambda: None)
    error = None
    try:
        layer(x).sum().backward()
    except Exception as e:  # noqa: BLE001 - the test reads the type and text
        error = f"{type(e).__name__}: {e}"
    finally:
        undo()
    grads = _expert_grads(layer)
    state = dict(error=error, expert_grads=["none" if g is None else "nan" if torch.isnan(g).all() else
                                            "partial nan" if torch.isnan(g).any() else "finite" for g in grads],
                 x_grad=None if x.grad is None else "nan" if torch.isnan(x.grad).all() else "finite")
    try:
        moe_comm.check(layer)  # the supported pattern before optimizer.step()
        state["check"] = "value"
    except Exception as e:  # noqa: BLE001
        state["check"] = f"{type(e).__name__}: {e}"
    # the next step works, with finite gradients everywhere
    layer.zero_grad(set_to_none=True)
    x2 = torch.randn(12, H, generator=torch.Generator().manual_seed(10 + rank), requires_grad=True)
    layer(x2).sum().backward()
    moe_comm.check(layer)
    state["next_ok"] = bool(torch.isfinite(x2.grad).all()) and all(
        g is not None and bool(torch.isfinite(g).all()) for g in _expert_grads(layer))
    return state


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("chunk", [0, C - 1])
def test_eager_failed_backward_leaves_no_partial_expert_gradient(ranks, world_size, chunk):
    bad = world_size - 1
    for rank, s in enumerate(ranks(world_size).run(_rank_failed_backward, "eager", chunk, timeout=120)):
        assert s["error"] is not None and "injected expert backward fault" in s["error"], (rank, s)
        assert f"[{bad}]" in s["error"], (rank, s)
        assert s["expert_grads"] == ["none"] * 3, (rank, s)  # the same on every rank: nothing
        assert s["check"] == "value" and s["next_ok"], (rank, s)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("chunk", [0, C - 1])
def test_deferred_failed_backward_poisons_its_gradients_and_check_raises(ranks, world_size, chunk):
    bad = world_size - 1
    for rank, s in enumerate(ranks(world_size).run(_rank_failed_backward, "deferred", chunk, timeout=120)):
        assert s["error"] is None, (rank, s)  # deferred: backward() returned on every rank ...
        # ... with NaN gradients: every one this phase produced (the failing rank computed none after its
        # failure: at chunk 0 its experts have no gradient at all)
        assert s["x_grad"] == "nan", (rank, s)
        want = {"nan", "none"} if rank == bad and chunk == 0 else {"nan"}
        assert set(s["expert_grads"]) <= want, (rank, s)
        assert "injected expert backward fault" in s["check"] and f"[{bad}]" in s["check"], (rank, s)
        assert s["next_ok"], (rank, s)
