"""The autograd of ``Dispatcher.dispatch`` and ``Dispatcher.combine`` called on their own (user code between
them): each direction's transfer forward, and in the backward a control exchange that checks every rank is
in this backward, then the transfer back (plus, for dispatch, the sum of each token's K slots)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe_comm.comm.channel import as_collective_error
from moe_comm.comm.wire import Phase
from moe_comm.dispatch.plan import DispatchHandle
from moe_comm.kernels import select_backend

if TYPE_CHECKING:  # the Dispatcher imports this module
    from moe_comm.dispatch.dispatcher import Dispatcher

__all__ = ["DispatchRows", "CombineRows"]


class DispatchRows(torch.autograd.Function):
    """Permuted rows [N, H] -> expert-major rows [R, H]; backward sends the gradient back and sums
    each token's K slots (an unweighted unpermute), after a control exchange that checks every rank
    is in this backward."""

    @staticmethod
    def forward(ctx, x_TH, x_NH, d: "Dispatcher", handle: DispatchHandle):
        ctx.d, ctx.handle = d, handle
        plan = handle.chunks[0]
        inflight = handle.transport.to_experts(x_NH, plan, phase="dispatch", direction="fwd")
        try:
            with d.workspace.dropped_on_error():
                rows_RH = inflight.wait()
            if d.dispatch_dtype is None:
                return rows_RH
            with d.timeline.compute("dequantize"):  # FP8 rows: the gradient passes straight through
                return d._dequantize(rows_RH, x_TH.shape[1], x_TH.dtype)
        except Exception as err:  # noqa: BLE001 - the transfer completed: placeholder rows, raised at combine()
            if as_collective_error(err) or d.world_size == 1:
                raise
            d.channel.carry(err, f"the dispatch() of call {handle.call}")
            return x_TH.new_zeros(plan.num_recv, x_TH.shape[1])

    @staticmethod
    def backward(ctx, grad_RH):
        d, handle = ctx.d, ctx.handle
        plan = handle.chunks[0]
        d._exchange_status(Phase.DISPATCH_BWD, handle)
        with d.alone(f"the backward of dispatch() of call {handle.call}"):
            grad_NH = handle.transport.local(
                lambda: d.workspace.rows("grad_rows", plan.num_rows, grad_RH.shape[1], grad_RH), "gradient rows")[0]
            with d.workspace.dropped_on_error():
                handle.transport.to_tokens(grad_RH.contiguous(), plan, grad_NH, phase="dispatch",
                                           direction="bwd").wait()
            impl = select_backend(d.backend, grad_RH.device)
            return impl.unpermute_rows(grad_NH, handle.layout.dest_row_TK), None, None, None


class CombineRows(torch.autograd.Function):
    """Expert-major rows [R, H] -> rows in sent order [N, H] back on their tokens' ranks."""

    @staticmethod
    def forward(ctx, y_RH, d: "Dispatcher", handle: DispatchHandle, keep: bool):
        ctx.d, ctx.handle = d, handle
        plan = handle.chunks[0]
        # The peers are in this transfer: a buffer that fails is made once more and the rows still go; the error
        # is raised after it (combine()'s ``alone`` carries it to every rank's next exchange).
        out, err = handle.transport.local(lambda: y_RH.new_empty(plan.num_rows, y_RH.shape[1]) if keep else
                                          d.workspace.rows("combined", plan.num_rows, y_RH.shape[1], y_RH),
                                          "receive buffer")
        src, err2 = handle.transport.local(y_RH.contiguous, "contiguous rows")
        with d.workspace.dropped_on_error():
            rows = handle.transport.to_tokens(src, plan, out, phase="combine", direction="fwd").wait()
        if err or err2:
            raise err or err2
        return rows

    @staticmethod
    def backward(ctx, grad_NH):
        d, handle = ctx.d, ctx.handle
        d._exchange_status(Phase.COMBINE_BWD, handle)
        with d.alone(f"the backward of combine() of call {handle.call}"), d.workspace.dropped_on_error():
            grad = handle.transport.to_experts(grad_NH.contiguous(), handle.chunks[0], phase="combine",
                                               direction="bwd").wait()
        return grad, None, None, None

