"""Fault injection for the fault suite and the random fault loop: ``inject(kind)`` makes one named piece of a
call's own work raise on this process (a RuntimeError "injected <what> fault"), for as long as the block runs.

Kinds (each a point after the call's control exchange was issued, where a rank must not leave alone):
    permute        the send permute (``send_rows.presend``: the rows a call sends, FP8 packing included)
    quantize       FP8 ``quantize_rows``
    piece          the permute of the second and later pieces of a streamed chunk (one copy per rank)
    send_regroup   the regroup before rows go back (all-to-all, e > 1), in ``direction`` "fwd" or "bwd"
    recv_buffer    a receive buffer, once (retried: the call then runs, and still raises on every rank)
    plan           building the chunk plans from the exchange, once
    unpermute      the final unpermute (after the call's last exchange)
    sf_permute     the sync-free mode's permute
    sf_regroup     the sync-free mode's regroup index
"""
from __future__ import annotations

import contextlib

import torch

import moe_comm.ops
from moe_comm.dispatch import control as _control
from moe_comm.dispatch import send_rows, sync_free
from moe_comm.dispatch.transport import AllToAll

__all__ = ["KINDS", "inject", "injected", "raise_in_backward"]

KINDS = ("permute", "quantize", "piece", "send_regroup", "recv_buffer", "plan", "unpermute", "sf_permute",
         "sf_regroup")


def injected(what: str) -> RuntimeError:
    return RuntimeError(f"injected {what} fault")


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        raise injected("expert backward")


def raise_in_backward(t: torch.Tensor) -> torch.Tensor:
    """``t`` unchanged in the forward; its backward raises ``injected("expert backward")`` (wrap an expert output)."""
    return _RaiseInBackward.apply(t)


@contextlib.contextmanager
def _patched(obj, name: str, make):
    """obj.name = make(original) inside the block."""
    original = getattr(obj, name)
    setattr(obj, name, make(original))
    try:
        yield
    finally:
        setattr(obj, name, original)


def _raising(what: str, times: int = 1 << 62):
    """make(original) -> a function raising ``injected(what)`` on its first ``times`` calls, then the original."""
    def make(original):
        left = [times]

        def fn(*args, **kwargs):
            if left[0] > 0:
                left[0] -= 1
                raise injected(what)
            return original(*args, **kwargs)
        return fn
    return make


def inject(kind: str, direction: str = "fwd"):
    """A context manager injecting ``kind`` (see the module docstring) on this process."""
    if kind == "permute":
        return _patched(send_rows, "presend", _raising("send permute"))
    if kind == "quantize":
        return _patched(moe_comm.ops, "quantize_rows", _raising("FP8 quantize"))
    if kind == "piece":
        def make(original):
            def presend(*args, **kwargs):
                out, fill = original(*args, **kwargs)
                if fill is None:
                    return out, fill

                def failing(piece):
                    if piece.piece >= 1:
                        raise injected("streamed piece permute")
                    fill(piece)
                return out, failing
            return presend
        return _patched(send_rows, "presend", make)
    if kind in ("send_regroup", "recv_buffer"):
        scratch = "back" if kind == "send_regroup" else "recv"
        left = [1 if kind == "recv_buffer" else 1 << 62]

        def make(original):
            def _scratch(self, name, plan, d, rows, like):
                if name == scratch and d == direction and left[0] > 0:
                    left[0] -= 1
                    raise injected(kind.replace("_", " "))
                return original(self, name, plan, d, rows, like)
            return _scratch
        return _patched(AllToAll, "_scratch", make)
    if kind == "plan":
        return _patched(_control, "build_chunk_plans", _raising("plan building", times=1))
    if kind == "unpermute":
        return _patched(moe_comm.ops, "unpermute", _raising("final unpermute"))
    if kind == "sf_permute":
        return _patched(sync_free, "_send_rows", _raising("sync-free permute"))
    if kind == "sf_regroup":
        return _patched(sync_free, "padded_expert_major_index", _raising("sync-free regroup index"))
    raise ValueError(f"inject: kind must be one of {KINDS}, got {kind!r}")
