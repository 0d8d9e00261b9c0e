"""The chunked dispatch -> experts -> combine schedule, forward and backward, written once against the
Transport interface (``moe_comm.dispatch.transport``).

Shapes legend: N routed rows sent, R rows received (per chunk), H hidden, e local experts, C chunks.

Forward, per rank (D = rows to the experts, X = experts, B = rows back):
    issue D0 | issue D1, wait D0, X0, issue B0 | issue D2, wait D1, X1, issue B1 | ... | wait all B | end
so D(c+1) and B(c-1) are in flight while X(c) computes. Backward mirrors it with the gradients (the
combine gradient travels to the experts and vice versa), after a control exchange that checks every
rank is in the same backward. Every rank issues its transfers in the same order (chunk-major), so the
schedule cannot deadlock whatever the routing.

Failures: an exception in side_fn, expert_fn, a regroup kernel or the expert backward on one rank
does not leave the schedule: that rank sends placeholder rows for the chunks left (the sizes every
rank agreed on), and the end-of-phase control exchange carries its error to every rank, which all
raise (``PeerFailed`` on the others, its own error on it): at once with end_check="eager"; with
"deferred" and in the sync-free mode every rank, the failing one too, returns placeholder rows and all
raise at their next read (the backward pass's first check-in, the next call, ``check()``), so every rank issues the
same collectives meanwhile. A small eager call (``handle.carry``) has no end-of-phase exchange: each rank's status
rows ride in the phase's last transfer, which goes out once the rank's outcome of the phase is known (after the
last chunk's weight gradients), and are read like that exchange. A failed or timed-out transfer (CollectiveError)
poisons the group instead: see ``moe_comm.comm``.

The experts' own backward runs as a nested ``torch.autograd.backward`` per chunk (as reentrant
activation checkpointing does): any differentiable ``expert_fn`` gets correct gradients, which are
accumulated into ``.grad`` of the leaves it uses. Consequently ``torch.autograd.grad(loss, params)``
does not return expert-parameter gradients (and ``torch.autograd.grad(loss, [x])`` still accumulates
them into ``.grad``); use ``loss.backward()``. Double backward (``create_graph=True``) and a second
backward through the same forward raise on every rank instead of returning wrong gradients.

Determinism: the same inputs give bit-identical outputs and gradients run to run (fixed collective
order, fixed-order slot sums, no atomics on CPU). Different chunk counts agree only to rounding: each
expert's GEMM sees another row count M per chunk, BLAS picks M-dependent kernels that round a row
differently (measured on the CPU build: 2 of 40 values of M), and weight gradients are summed chunk
by chunk. cuBLAS behaves the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
from torch.autograd.graph import get_gradient_edge

from moe_comm import _wgrad, ops
from moe_comm.comm.channel import as_collective_error, kept
from moe_comm.comm.wire import Failure, Phase
from moe_comm.dispatch.autotune import call_expert_fn, now
from moe_comm.dispatch.plan import call_text
from moe_comm.dispatch.transport import InFlight
from moe_comm.kernels import select_backend

__all__ = ["run_pipeline"]


@dataclass
class _Run:
    """Everything one pipelined call needs, handed to the autograd Function."""

    dispatcher: "object"
    handle: "object"
    expert_fn: Callable
    side_fn: Optional[Callable[[], torch.Tensor]]
    grad_enabled: bool
    keep_output: bool = True  # y_NH is saved for backward (the weights need grad): fresh memory
    measure: bool = False  # time the experts (num_chunks="auto" planning; syncs CUDA once)
    expert_s: float = 0.0
    side_out: Optional[torch.Tensor] = None
    expert_io: List = field(default_factory=list)  # per chunk: (tokens_in_RH leaf, w_in, out grad edge, dtype)
    backward_done: bool = False
    failed: Optional[BaseException] = None  # this rank's input was rejected, or its forward failed with reads
    # deferred: its phases move placeholder rows, and the error is raised at the next read
    meta: bool = False  # one copy per (token, rank): a [N, 2K] (local expert ids, weights) payload travels along
    meta_dtype: Optional[torch.dtype] = None  # its dtype (the weights' gradient comes back in it)
    wire: Optional[torch.Tensor] = None  # the permuted rows [N, B] sent instead of x (x is then x_TH); FP8: packed
    fill: Optional[Callable] = None  # fill(piece plan): permutes a piece's rows of ``wire`` just before it goes
    closing: Optional[object] = None  # the last phase's end exchange when its read is deferred (a channel Pending)
    checks: List = field(default_factory=list)  # deferred exchanges whose failure flag poisons the backward's grads


class _Failure:
    """The first exception this rank met mid-phase, and the chunk (kept while the schedule completes)."""

    def __init__(self):
        self.error: Optional[BaseException] = None
        self.chunk = -1
        self.carried = None  # the phase's status when it travels in the last transfer (a channel Pending)

    def note(self, chunk: int, err: Optional[BaseException]) -> None:
        """Record ``err`` (None: nothing) unless an earlier failure is recorded."""
        if err is not None and self.error is None:
            self.error, self.chunk = err, chunk

    def catch(self, chunk: int, fn, *args, always: bool = False):
        """fn(*args), or None after recording its exception; transport failures propagate (the group
        is poisoned: nothing more may be issued). After an earlier failure: None, without calling fn unless
        ``always`` (fn issues collectives its group's other ranks issue too: the node level of a hierarchy)."""
        if self.error is not None and not always:
            return None
        try:
            out = fn(*args)
        except Exception as err:  # noqa: BLE001 - any user or kernel error travels to every rank
            if as_collective_error(err):
                raise
            if self.error is None:
                self.error, self.chunk = err, chunk
            return None
        return out if self.error is None else None

    def status(self, d, phase: Phase, handle, chunk: int, err: Optional[BaseException], words: int):
        """This rank's outcome of the phase, ``words`` int64 per destination, to travel in its last transfer
        (``handle.carry``); ``err``: that transfer's own send-side failure."""
        if self.carried is None:  # a second try (Transport.local) sends the same status
            self.note(chunk, err)
            self.carried = d._carried_status(phase, handle, self.error, self.chunk, words)
        return self.carried

    def close(self, d, phase: Phase, handle, meanwhile=None, lost=None):
        """The end-of-phase control exchange: raises on every rank if any rank failed (at the next read when
        reads are deferred: then returns that exchange). ``meanwhile()`` runs while it travels. When the status
        travelled in the phase's last transfer (completed by now) it is read instead: no exchange (``lost``: see
        ``_read_carried``)."""
        if self.carried is not None:
            d._read_carried(self.carried, self.error, lost)
            return None
        failed = Failure.NONE if self.error is None else Failure.RAISED
        pending = d._exchange_status(phase, handle, self.error, failed, chunk=self.chunk, deferrable=True,
                                     meanwhile=meanwhile)
        if self.error is None or pending is not None:
            return pending  # deferred: placeholder rows like its peers, so all stay in step; all raise at the next read
        raise self.error


def _wait(inflight, failure: _Failure, chunk: int, rows: int, like: torch.Tensor) -> torch.Tensor:
    """The rows of a transfer, or placeholder rows when the receive-side regroup failed on this rank."""
    try:
        return inflight.wait()
    except Exception as err:  # noqa: BLE001
        if as_collective_error(err):
            raise
        if failure.error is None:
            failure.error, failure.chunk = err, chunk
        return like.new_empty(rows, like.shape[1])


class _PipelinedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, meta_w_TK: Optional[torch.Tensor], anchor: Optional[torch.Tensor],
                run: _Run) -> torch.Tensor:
        # x: the permuted rows x_NH, or x_TH when run.wire (rows permuted without autograd) is what travels.
        # meta_w_TK: one copy per rank, the slot weights; their [N, 2K] metadata is built once chunk 0's rows
        # are on their way (off the path to the first byte)
        rows = _made(run, x.contiguous, "contiguous rows") if run.wire is None else run.wire
        src = (rows,)
        if meta_w_TK is not None:
            src += (lambda: _slot_meta(run.handle.rank_rows, meta_w_TK.detach(), rows.shape[0]),)
        with run.dispatcher.workspace.dropped_on_error():
            y_NH = _forward(run, src, x)
        ctx.run = run
        return y_NH

    @staticmethod
    def backward(ctx, grad_y_NH: torch.Tensor):
        run: _Run = ctx.run
        d = run.dispatcher
        error = None
        if run.backward_done or not run.grad_enabled:
            error = RuntimeError("moe_comm pipeline: backward ran twice through the same forward (retain_graph), "
                                 "or the forward ran without grad; neither is supported: run the forward again")
        elif torch.is_grad_enabled():
            error = RuntimeError("moe_comm pipeline: double backward (create_graph=True) is not supported: the "
                                 "experts' gradient is computed by a nested backward")
        # Every rank checks in before gradient rows move: a rank that skipped this backward, or rejects it,
        # is named on every rank. end_check="deferred": only the first check-in after a forward on this group (the
        # backward pass's first layer) is read, with every deferred exchange of the group's Dispatchers (one host
        # read: a failure in any layer's forward raises on every rank here); the later ones are read with the next
        # read, and every gradient of their backward is NaN on every rank when the forward's end, the check-in or
        # the backward's end shows a failure (a device-side check). The sync-free mode defers every check-in.
        opening = d.channel.reads_with_group and d.channel.opens_backward()
        checked = d._exchange_status(Phase.BACKWARD, run.handle, error,
                                     Failure.NONE if error is None else Failure.REJECTED, deferrable=not opening,
                                     read_group=opening)
        run.checks = [checked] if checked is not None and d.channel.reads_with_group else []
        run.backward_done = True
        run.failed = run.failed or kept(error)
        with d.workspace.dropped_on_error():
            grad_x, grad_w_NK = _backward(run, _made(run, grad_y_NH.contiguous, "contiguous gradient"))
        with d.alone(f"the backward of {call_text(run.handle.call)}, after its last exchange"):
            if run.wire is not None and run.handle.layout is None:  # FP8 on a rank whose input was rejected
                grad_x = None
            elif run.wire is not None:  # to the tokens (permute's backward); FP8: straight through the quantization
                grad_x = select_backend(d.backend, grad_x.device).unpermute_rows(grad_x, run.handle.layout.dest_row_TK)
            grad_w_TK = None
            if run.meta and ctx.needs_input_grad[1]:  # slot (t, k) sits at row * K + k of grad_w_NK; dropped: 0
                pos_TK = run.handle.rank_rows.slot_pos_TK
                flat = torch.cat([grad_w_NK.reshape(-1), grad_w_NK.new_zeros(1)])
                grad_w_TK = flat[pos_TK.clamp(max=grad_w_NK.numel())]
        return grad_x, grad_w_TK, None, None


def _slot_meta(rank_rows, w_TK: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, 2K] what travels with the first ``rows`` rows of one copy per rank: each row's slots' local expert
    ids (-1: not on that rank; exact as floats) and weights (0 there), in w_TK's dtype."""
    w_SK = rank_rows.slot_weights(w_TK)
    return torch.cat([rank_rows.local_idx_SK[:rows].to(w_TK.dtype), w_SK[:rows]], 1)


def _schedule(run: _Run, src: Tuple[torch.Tensor, ...], out: Tuple[torch.Tensor, ...], compute,
              phases: Tuple[str, str], direction: str, end: Phase, before=None,
              failed: Optional[BaseException] = None, after=None, fill=None) -> Tuple[torch.Tensor, ...]:
    """The one chunk schedule, forward and backward: the rows of chunk c of every tensor in ``src`` (sent
    order, [N, *]; a callable there is called once, after the tensors before it issued chunk 0) go to the
    experts' ranks (phases[0]), ``compute(c, received)`` runs there and returns one
    tensor per ``out`` tensor, which go back into ``out`` (phases[1]); chunk c+1 travels while chunk c
    computes. A chunk in pieces (``ChunkPlan.pieces``) moves each piece in its own transfers, and
    ``fill(piece)`` writes a piece's rows of src[0] just before they go (so the first moves while the next
    is permuted). ``before()`` runs while chunk 0 travels; ``after(c)`` once chunk c's result is on its way
    back. A failure on this rank keeps the schedule with placeholder rows and is raised on every rank by
    the end-of-phase exchange ``end``; ``failed``: this rank failed before the schedule (placeholder rows
    from the start)."""
    d, handle = run.dispatcher, run.handle
    transport, chunks = handle.transport, handle.chunks
    K = handle.layout.top_k if run.meta else 0
    failure = _Failure()
    failure.error = failed
    to_experts, back, src = [None] * len(chunks), [], list(src)

    def buffer(c: int, make) -> torch.Tensor:
        rows, err = transport.local(make, "rows")
        failure.note(c, err)
        return rows

    def issue(c: int) -> None:
        # Local work that fails here (a piece's permute, the metadata, a buffer) leaves the rows as they are:
        # the transfers still go out with the agreed sizes and the failure travels in the end-of-phase exchange.
        p = chunks[c]
        flights, recv = [], []
        for q in p.parts:
            if fill is not None:
                failure.catch(c, fill, q)
            for i, t in enumerate(src):
                if callable(t):  # the [N, 2K] slot metadata of one copy per rank: real even after a failure
                    try:  # (the experts' ranks expand rows by it, to the slot counts the exchange announced)
                        t = t()
                    except Exception as err:  # noqa: BLE001
                        failure.note(c, err)
                        t = src[0].new_zeros(src[0].shape[0], 2 * K, dtype=run.meta_dtype)
                    src[i] = t
                if len(p.parts) > 1 and len(recv) == i:  # the chunk's rows, all pieces
                    recv.append(buffer(c, lambda: t.new_empty(p.num_recv, t.shape[1])))
                into = recv[i].narrow(0, q.recv_offset, q.num_recv) if recv else None
                flights.append((i, transport.to_experts(t.narrow(0, q.row_offset, q.num_rows), q,
                                                        phase=phases[0], direction=direction, out=into)))
        to_experts[c] = (flights, recv)

    def received_rows(c: int) -> Tuple[torch.Tensor, ...]:
        flights, recv = to_experts[c]
        to_experts[c] = None
        rows = [_wait(f, failure, c, chunks[c].num_recv, src[i]) for i, f in flights]
        return tuple(recv) if recv else tuple(rows)

    issue(0)
    if before is not None:
        failure.catch(0, before)
    for c, p in enumerate(chunks):
        if c + 1 < len(chunks):
            issue(c + 1)
        received = received_rows(c)
        # a collective expert function (a node's level) runs on every rank, failed or not: its peers are in it
        results = failure.catch(c, compute, c, received, always=getattr(run.expert_fn, "takes_slot_rows", False))
        if results is None:  # this rank failed: placeholder rows of the agreed sizes keep the schedule
            results = tuple(buffer(c, lambda: o.new_empty(p.num_recv, o.shape[1])) for o in out)
        # handle.carry (small eager calls): the phase's status rides in its last transfer, which goes out once this
        # rank's outcome of the phase is known (after the last chunk's ``after``): no closing exchange.
        closing = handle.carry and c == len(chunks) - 1
        if closing and after is not None:
            failure.catch(c, after, c)
        pairs = [(q, r, o) for q in p.parts for r, o in zip(results, out)]
        flights = []
        for i, (q, r, o) in enumerate(pairs):
            status = {}
            if closing and i == len(pairs) - 1:
                status["status"] = lambda err, words, c=c: failure.status(d, end, handle, c, err, words)
            f = transport.to_tokens(r.narrow(0, q.recv_offset, q.num_recv), q, o.narrow(0, q.row_offset, q.num_rows),
                                    phase=phases[1], direction=direction, **status)
            failure.note(c, getattr(f, "error", None))  # a send-side failure: placeholder rows from here on
            flights.append((f, o))
        back.append(flights)
        if after is not None and not closing:
            failure.catch(c, after, c)

    def wait_back() -> None:
        for c, flights in enumerate(back):
            for f, o in flights:
                _wait(f, failure, c, chunks[c].num_rows, o)

    # Once the last rows are on their way back, this rank's outcome of the phase is known: a transfer's own
    # send-side failure is recorded when it is issued (InFlight.error, noted above), and waiting for rows that go
    # back adds no work that can fail (no receive-side regroup) - only a CollectiveError, which poisons the group.
    # So with a deferred read the end-of-phase exchange goes out now and travels while the last transfers complete
    # (one round trip less on the phase's path). Not with an eager read: a rank whose wait then times out (gloo)
    # would already have told its peers "no failure", and they would return from the call it raised in. A carried
    # status (handle.carry) takes that risk only where one link fails alone: a stalled or dead rank's rows are
    # missing on every peer, so every peer times out in the same transfer.
    early = (d.sync_free or d.end_check == "deferred") and all(
        type(f) is InFlight and f.regroup is None for flights in back for f, _ in flights)
    if not early:
        wait_back()
    # a forward with a backward to come: a status this rank could not read leaves NaN rows, its check-in raises
    lost = (lambda: [o.fill_(float("nan")) for o in out]) if end == Phase.FORWARD_END and run.grad_enabled else None
    run.closing = failure.close(d, end, handle, meanwhile=wait_back if early else None, lost=lost)
    if failure.error is not None:  # deferred: the backward of this call moves placeholder rows too
        run.failed = kept(failure.error)
    return out


def _made(run: _Run, make, what: str) -> torch.Tensor:
    """make() after the phase's opening exchange, before its schedule: a failure is retried once and then
    travels as this rank's failure of the phase (``run.failed``: placeholder rows, every rank raises)."""
    value, err = run.handle.transport.local(make, what)
    if err is not None and run.failed is None:
        run.failed = kept(err)
    return value


def _forward(run: _Run, src: Tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
    """src: the rows that travel (x_NH, or the rows permuted without autograd: FP8 packed or in x's dtype; then
    the [N, 2K] metadata with one copy per rank)."""
    d, chunks, tl = run.dispatcher, run.handle.chunks, run.dispatcher.timeline
    N, H, dtype = src[0].shape[0], x.shape[1], x.dtype
    K = run.handle.layout.top_k if run.meta else 0
    y_NH = _made(run, lambda: x.new_empty(N, H) if run.keep_output or d.world_size == 1 else
                 d.workspace.rows("combined", N, H, x), "output rows")

    def experts(c: int, received: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor]:
        p = chunks[c]
        tokens_RH = received[0]
        if d.dispatch_dtype is not None:
            with tl.compute("dequantize", chunk=c):
                tokens_RH = d._dequantize(tokens_RH, H, dtype)
        with tl.compute("experts", chunk=c):
            t0 = now(x.device) if run.measure else 0.0
            w_in = None
            with torch.set_grad_enabled(run.grad_enabled):
                t_in = tokens_RH.detach().requires_grad_(run.grad_enabled)
                if run.meta:  # one row per (token, rank): expand to its local experts, sum their weighted outputs
                    meta_RM = received[1]
                    w_in = meta_RM[:, K:].detach().requires_grad_(run.grad_enabled)
                    if getattr(run.expert_fn, "takes_slot_rows", False):  # a node's level of dispatch.hierarchy
                        ids_RK = meta_RM[:, :K].to(torch.int64)
                        entered[0] = True
                        out_RH = run.expert_fn(t_in, ids_RK, w_in)
                    else:
                        lay = ops.make_layout(meta_RM[:, :K].to(torch.int64), d.num_local_experts, backend=d.backend)
                        lay.set_num_rows(sum(p.counts_e))  # host counts from the control exchange: no sync
                        out_RH = call_expert_fn(run.expert_fn, ops.permute(t_in, lay, backend=d.backend),
                                                p.tokens_per_expert_e, p.counts_e)
                        out_RH = ops.unpermute(out_RH.to(dtype), lay, w_in, backend=d.backend)
                else:  # rank_major: the rows as the all-to-all delivered them, no regroup pass
                    out_RH = call_expert_fn(run.expert_fn, t_in, p.tokens_per_expert_e, p.counts_e,
                                            p.segments if p.rank_major else None)
            if run.measure:
                run.expert_s += now(x.device) - t0
            if run.grad_enabled:  # the output's gradient edge, not its rows: R x H freed once they went back
                edge = get_gradient_edge(out_RH) if out_RH.requires_grad else None
                run.expert_io[c] = (t_in, w_in, edge, out_RH.dtype)
            return (out_RH.detach().to(dtype),)  # rows travel in x's dtype (autocast may change out_RH's)

    def side() -> None:  # e.g. shared experts, while the first dispatch is in flight
        with torch.set_grad_enabled(run.grad_enabled), tl.compute("shared"):
            run.side_out = run.side_fn()

    run.expert_io = [None] * len(chunks)
    entered = [False]  # the collective expert function was called for this chunk

    def experts_joined(c: int, received: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor]:
        """A collective expert function (a node's level): a failure before it is called joins it with the error
        (``fail``): its node's other ranks are waiting in it, and all of them raise."""
        entered[0] = False
        try:
            return experts(c, received)
        except Exception as err:  # noqa: BLE001
            if not entered[0] and not as_collective_error(err):
                run.expert_fn.fail(err)
            raise

    compute = experts_joined if getattr(run.expert_fn, "takes_slot_rows", False) else experts
    return _schedule(run, src, (y_NH,), compute, ("dispatch", "combine"), "fwd", Phase.FORWARD_END,
                     before=side if run.side_fn is not None else None, failed=run.failed, fill=run.fill)[0]


def _backward(run: _Run, grad_y_NH: torch.Tensor):
    """(grad of the sent rows [N, H], grad of the slot weights [N, K] or None with one copy per rank)."""
    # The gradient of combine goes the dispatch way (to the experts' ranks), the input gradient comes back.
    tl = run.dispatcher.timeline
    K = run.handle.layout.top_k if run.meta else 0
    weight_grads = {}

    def experts_backward(c: int, received: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
        # The input gradient first: it travels back while this chunk's weight gradients compute (_wgrad).
        g_RH = received[0]
        with tl.compute("experts", chunk=c, direction="bwd"):
            t_in, w_in, edge, out_dtype = run.expert_io[c]
            run.expert_io[c] = None  # free the chunk's activations once its backward ran
            with _wgrad.deferring() as weight_grads[c]:
                if edge is not None:
                    torch.autograd.backward([edge], [g_RH.to(out_dtype)])
            g_in = t_in.grad if t_in.grad is not None else torch.zeros_like(t_in)
            if w_in is None:
                return (g_in.to(grad_y_NH.dtype),)
            return g_in.to(grad_y_NH.dtype), (w_in.grad if w_in.grad is not None else torch.zeros_like(w_in))

    sums = _wgrad.GradSums()  # every chunk's weight gradients, into .grad once after the last chunk

    def experts_weight_grads(c: int) -> None:
        if c in weight_grads:
            with tl.compute("experts_wgrad", chunk=c, direction="bwd"):
                weight_grads.pop(c).run(sums)

    N = grad_y_NH.shape[0]
    out = (_made(run, lambda: torch.empty_like(grad_y_NH), "gradient rows"),)
    if run.meta:
        out += (_made(run, lambda: grad_y_NH.new_empty(N, K, dtype=run.meta_dtype), "weight gradient rows"),)
    out = _schedule(run, (grad_y_NH,), out, experts_backward, ("combine", "dispatch"), "bwd", Phase.BACKWARD_END,
                    failed=run.failed, after=experts_weight_grads)
    run.expert_io = []
    # The weight gradients reach .grad only after the end-of-backward exchange: a failed backward (raised above
    # on every rank) leaves no partial expert gradient on any rank. Deferred reads: every gradient of this phase
    # is NaN on every rank when any rank failed in the call (a device-side check of the check-in and the backward's
    # end exchanges, no host read; the forward's end was read with the backward pass's first check-in).
    checks = run.checks + ([run.closing] if run.closing is not None else [])
    poisoned = None
    for p in checks:
        flag = run.dispatcher.channel.failed_flag(p)
        poisoned = flag if poisoned is None else poisoned | flag
    if poisoned is not None:
        for grad in list(out) + [g for _, grads in sums.entries.values() for g in grads if g is not None]:
            grad.masked_fill_(poisoned, float("nan"))
    with tl.compute("experts_wgrad", chunk=len(run.handle.chunks) - 1, direction="bwd"):
        sums.flush()
    return out[0], (out[1] if run.meta else None)


def run_pipeline(dispatcher, handle, x: torch.Tensor, expert_fn: Callable,
                 side_fn: Optional[Callable[[], torch.Tensor]] = None, measure: bool = False,
                 keep_output: bool = True, failed: Optional[BaseException] = None,
                 meta_w_TK: Optional[torch.Tensor] = None, wire_NB: Optional[torch.Tensor] = None,
                 fill: Optional[Callable] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor], float]:
    """Pipelined dispatch -> expert_fn -> combine of the permuted rows ``x`` = x_NH [N, H]. ``failed``: this
    rank's input was rejected; it moves placeholder rows through the whole schedule, then raises ``failed``.
    ``meta_w_TK``: one copy per rank (``handle.rank_rows``): the slot weights [T, K] (float32 or float64); each
    row travels with its [2K] local expert ids (as floats) and weights, and the experts' ranks expand it and
    return the weighted sum. ``wire_NB``: the rows to send, permuted
    without autograd (FP8: packed); ``x`` is then x_TH and its gradient comes back through ``handle.layout``.
    ``fill``: wire_NB's rows are permuted piece by piece (``send_rows.presend``), each just before it goes.

    Returns (y_NH [N, H] combined rows in sent order, side_fn's result or None, expert seconds
    when ``measure`` else 0).
    """
    run = _Run(dispatcher=dispatcher, handle=handle, expert_fn=expert_fn, side_fn=side_fn,
               grad_enabled=torch.is_grad_enabled(), measure=measure, keep_output=keep_output, failed=kept(failed),
               meta=meta_w_TK is not None, meta_dtype=None if meta_w_TK is None else meta_w_TK.dtype, wire=wire_NB,
               fill=fill)
    # The anchor makes the output require grad whenever grad mode is on, so backward runs (and the
    # experts get their gradients) even when x itself needs none, e.g. the first layer's input.
    anchor = torch.empty(0, device=x.device, requires_grad=True) if run.grad_enabled else None
    y_NH = _PipelinedExperts.apply(x, meta_w_TK, anchor, run)
    return y_NH, run.side_out, run.expert_s
