"""Transports: how one chunk's rows reach their experts' ranks and come back. One interface, three kinds.

Shapes legend: N rows sent (in (dest rank, local expert) order), R rows received (expert-major), H hidden,
W EP world size, e local experts.

    to_experts(src_NH, plan, ...) -> InFlight  # .wait() -> [R, H] expert-major rows on the experts' ranks
    to_tokens(src_RH, plan, out_NH, ...) -> InFlight  # .wait() -> out_NH, the rows back in sent order

- ``Local`` (W = 1): the permuted rows are already expert-major; nothing moves.
- ``AllToAll``: one ``all_to_all_single`` of the chunk; the received (source rank, expert) blocks are
  regrouped expert-major after it (and before the way back): one extra pass over the rows, one round trip.
- ``PointToPoint``: one ``batch_isend_irecv`` with one message per (rank pair, local expert) segment,
  straight into its expert-major rows and back: no regroup pass, W x e messages.

``choose`` picks one per call from numbers every rank knows alike (every rank's N from the control
exchange, the row bytes, C, W, e and the shared threshold), so all ranks use the same transport. The
pipeline, ``dispatch``/``combine`` and the benchmarks all move rows only through these classes: this is
the one place an all-to-all chunk is issued and the one place rows are regrouped.
"""
from __future__ import annotations

import abc
from typing import List, Optional, Tuple

import torch

from moe_comm.comm.channel import as_collective_error
from moe_comm.comm.wire import HEADER_WORDS, MESSAGE_WORDS
from moe_comm.comm.collectives import (REBUILD, CollectiveError, _as_bytes, all_to_all_v_async, issue_segments,
                                       issuing, poison, record_arrival, wait_work)
from moe_comm.dispatch.plan import ChunkPlan, call_text
from moe_comm.kernels import select_backend

__all__ = ["Transport", "Local", "AllToAll", "PointToPoint", "InFlight", "choose"]


class InFlight:
    """Rows on their way. ``wait()`` waits (raising CollectiveError naming the phase and chunk, and
    poisoning the group, on a failure or timeout), applies the receive-side regroup, returns the rows.
    Holds a reference to every tensor the transfer reads or writes until it completed. ``error``: the
    send-side work failed on this rank (the transfer went out with placeholder rows of the agreed sizes);
    ``wait()`` raises it once the transfer completed."""

    def __init__(self, transport: "Transport", works: list, result: torch.Tensor, phase: str, chunk: int,
                 direction: str, keep: Tuple = (), regroup: Optional[Tuple] = None, start=None, timed: bool = False,
                 where: Optional[str] = None, error: Optional[BaseException] = None, unpack=None):
        self.t, self.works, self.result, self.keep = transport, works, result, keep
        self.phase, self.chunk, self.direction, self.regroup = phase, chunk, direction, regroup
        self.start, self.timed = start, timed
        self.done, self.where, self.error = False, where, error
        self.unpack = unpack  # a status-carrying transfer: splits its rows from the status rows once complete

    def wait(self) -> torch.Tensor:
        if self.done:
            return self.result
        t = self.t
        for w in self.works:
            wait_work(w, self.phase, self.chunk, timeout=t.timeout, rank=t.rank, direction=self.direction,
                      what=t.what, group=t.group, where=self.where)
        if self.timed:  # point-to-point: several Works; the span ends when the last one was waited for
            t.timeline.comm(self.phase, None, chunk=self.chunk, direction=self.direction, start=self.start)
        self.done, self.works = True, []
        if self.unpack is not None:  # the status is read even when this rank's own rows were placeholders
            self.unpack()
        self.keep = ()
        if self.error is not None:
            raise self.error
        if self.regroup is not None:
            recv, index = self.regroup
            with t.timeline.compute("regroup", chunk=self.chunk, direction=self.direction):
                t.kernels(recv.device).permute_rows(recv, index, out=self.result)
        return self.result


class Transport(abc.ABC):
    """Moves one chunk's rows between the EP ranks. Built once per Dispatcher per kind; stateless per call.

    Args: group, world size W, rank, local experts e, the Dispatcher's Workspace (scratch rows that
    only live during a transfer), permutation backend, Timeline, timeout (seconds or None).
    """

    name = "base"
    what = "all-to-all"
    regroups = False  # plans for this transport carry the expert-major permutation

    def __init__(self, group, world: int, rank: int, num_local_experts: int, workspace, backend: str, timeline,
                 timeout: Optional[float]):
        self.group, self.world, self.rank, self.e = group, world, rank, num_local_experts
        self.workspace, self.backend, self.timeline, self.timeout = workspace, backend, timeline, timeout

    def arrive(self, plan: ChunkPlan, phase: str, direction: str) -> str:
        """Record in the group's store that this rank issued this transfer (a peer that times out names
        the ranks recorded elsewhere); returns the record."""
        where = f"the {phase} ({direction}) transfer of {plan.label} of {call_text(plan.call)}"
        record_arrival(self.group, where)
        return where

    def kernels(self, device):
        return select_backend(self.backend, device)

    def local(self, make, what: str):
        """(make(), None); when the local work before a transfer raises (a buffer, a send-side regroup), the
        transfer must still go out with the agreed sizes, its peers wait in it: (make() once more, the error)
        for a buffer, or the caller's placeholder. A buffer that fails twice leaves nothing to transfer with:
        the group is poisoned (CollectiveError here, the peers' wait times out)."""
        try:
            return make(), None
        except Exception as err:  # noqa: BLE001 - travels to every rank through the end-of-phase exchange
            if as_collective_error(err):
                raise
            try:
                return make(), err
            except Exception as again:  # noqa: BLE001
                reason = f"EP rank {self.rank} could not make the {what} of a transfer its peers are in: {again}"
                poison(self.group, reason)
                raise CollectiveError(f"moe_comm: {reason}; {REBUILD}") from err

    def _scratch(self, kind: str, plan: ChunkPlan, direction: str, rows: int, like: torch.Tensor) -> torch.Tensor:
        # One buffer per (kind, direction, chunk): chunks in flight at the same time never share one.
        return self.workspace.rows(f"{kind}.{direction}.{plan.label}", rows, like.shape[1], like)

    @abc.abstractmethod
    def to_experts(self, src_NH: torch.Tensor, plan: ChunkPlan, *, phase: str, direction: str,
                   out: Optional[torch.Tensor] = None) -> InFlight:
        """Start moving rows in sent order [N, H] to the experts' ranks; ``wait()`` gives [R, H] expert-major
        rows in fresh memory (the experts may save them for backward), or in ``out`` when given (not W = 1:
        there the sent rows are the result)."""

    @abc.abstractmethod
    def to_tokens(self, src_RH: torch.Tensor, plan: ChunkPlan, out_NH: torch.Tensor, *, phase: str,
                  direction: str) -> InFlight:
        """Start moving expert-major rows [R, H] back to their tokens' ranks, into ``out_NH`` (sent order)."""


class Local(Transport):
    """W = 1: rows stay where they are (the permuted rows are already expert-major)."""

    name = "local"

    def to_experts(self, src_NH, plan, *, phase, direction, out=None):
        return InFlight(self, [], src_NH, phase, plan.chunk, direction)

    def to_tokens(self, src_RH, plan, out_NH, *, phase, direction):
        if out_NH.data_ptr() != src_RH.data_ptr():
            out_NH.copy_(src_RH)
        return InFlight(self, [], out_NH, phase, plan.chunk, direction)


class AllToAll(Transport):
    """One ``all_to_all_single`` per chunk and direction, plus a regroup pass when e > 1."""

    name = "all_to_all"
    regroups = True

    def to_experts(self, src_NH, plan, *, phase, direction, out=None):
        def buffers():
            o = src_NH.new_empty(plan.num_recv, src_NH.shape[1]) if out is None else out  # fresh: the experts keep it
            r = o if plan.expert_index_R is None else self._scratch("recv", plan, direction, plan.num_recv, src_NH)
            return o, r

        (out, recv), error = self.local(buffers, "receive buffer")
        where = self.arrive(plan, phase, direction)
        t0 = self.timeline.mark()
        with issuing(self.group, f"{phase} ({direction}) {self.what} of {plan.label}", self.rank, where):
            work = all_to_all_v_async(recv, src_NH, plan.recv_splits_W, plan.send_splits_W, self.group)
        self.timeline.comm(phase, work, chunk=plan.chunk, direction=direction, start=t0)
        regroup = None if plan.expert_index_R is None else (recv, plan.expert_index_R)
        return InFlight(self, [work], out, phase, plan.chunk, direction, keep=(src_NH, recv), regroup=regroup,
                        where=where, error=error)

    def to_tokens(self, src_RH, plan, out_NH, *, phase, direction, status=None):
        error = None
        if plan.source_index_R is not None:
            def regroup():
                with self.timeline.compute("regroup", chunk=plan.chunk, direction=direction):
                    back = self._scratch("back", plan, direction, plan.num_recv, src_RH)
                    return self.kernels(src_RH.device).permute_rows(src_RH, plan.source_index_R, out=back)

            try:
                src_RH = regroup()
            except Exception as err:  # noqa: BLE001 - the rows go back unregrouped (placeholder), the error travels
                if as_collective_error(err):
                    raise
                error = err
        if status is not None:
            return self._carrying(src_RH, plan, out_NH, phase, direction, error, status)
        where = self.arrive(plan, phase, direction)
        t0 = self.timeline.mark()
        with issuing(self.group, f"{phase} ({direction}) {self.what} of {plan.label}", self.rank, where):
            work = all_to_all_v_async(out_NH, src_RH, plan.send_splits_W, plan.recv_splits_W, self.group)
        self.timeline.comm(phase, work, chunk=plan.chunk, direction=direction, start=t0)
        return InFlight(self, [work], out_NH, phase, plan.chunk, direction, keep=(src_RH,), where=where, error=error)

    def _carrying(self, src_RH, plan, out_NH, phase, direction, error, status) -> InFlight:
        """to_tokens with the phase's status (``status(error, words)``: a ``Channel.carried`` Pending, its
        ``send_WX`` [W, words] int64) in ``s`` extra rows after each destination's rows, in the same all-to-all: the
        phase needs no closing exchange of its own. Costs a copy of the rows each way (packed around the status
        rows, unpacked into out_NH)."""
        W, row_bytes = self.world, src_RH.shape[1] * src_RH.element_size()
        s = -(-(HEADER_WORDS + MESSAGE_WORDS) * 8 // row_bytes)  # status rows per destination
        # status words that fill the s rows exactly (no padding copy) when a row holds whole int64 words
        words = s * row_bytes // 8 if row_bytes % 8 == 0 else HEADER_WORDS + MESSAGE_WORDS
        exact = words * 8 == s * row_bytes
        back, sent = plan.recv_splits_W, plan.send_splits_W  # rows to each rank now, rows from each (its sent ones)

        def pack():
            pending = status(error, words)
            status_WB = pending.send_WX.to(src_RH.device)
            if exact:
                status_WSB = status_WB.view(torch.uint8).view(W, s, row_bytes)
            else:
                status_WSB = status_WB.new_zeros(W, s * row_bytes // 8 + 1).view(torch.uint8)[:, :s * row_bytes]
                status_WSB[:, :words * 8] = status_WB.view(torch.uint8)
                status_WSB = status_WSB.reshape(W, s, row_bytes)
            rows = _as_bytes(src_RH).split_with_sizes(back)  # the C method: Tensor.split's wrapper costs more
            send = torch.cat([t for w in range(W) for t in (rows[w], status_WSB[w])])  # [rows of w, s status rows]
            return pending, send, send.new_empty(sum(sent) + W * s, row_bytes)

        # Composing the status and packing may fail like any buffer: once is mended by the second try (not a
        # failure of the phase: the status sent says what the phase did); twice poisons the group (local).
        (pending, send, recv), _ = self.local(pack, "status rows")

        def unpack() -> None:
            parts = recv.split_with_sizes([n for m in sent for n in (m, s)])
            torch.cat(parts[0::2], out=_as_bytes(out_NH))  # out_NH: rows of the contiguous output (a view)
            got = torch.stack(parts[1::2]).reshape(W, s * row_bytes)
            if not exact:
                got = got[:, :words * 8].contiguous()
            # host sync: none on one device; gloo with CUDA rows: a device -> host copy, the phase's one read
            pending.recv_WX = got.view(torch.int64).to(pending.send_WX.device)

        where = self.arrive(plan, phase, direction)
        t0 = self.timeline.mark()
        with issuing(self.group, f"{phase} ({direction}) {self.what} of {plan.label}", self.rank, where):
            work = all_to_all_v_async(recv, send, [m + s for m in sent], [m + s for m in back], self.group)
        self.timeline.comm(phase, work, chunk=plan.chunk, direction=direction, start=t0)
        return InFlight(self, [work], out_NH, phase, plan.chunk, direction, keep=(send, recv), where=where,
                        error=error, unpack=unpack)


class PointToPoint(Transport):
    """One message per (rank pair, local expert) segment, straight into expert-major rows and back."""

    name = "point_to_point"
    what = "point-to-point transfer"

    def _segments(self, plan: ChunkPlan, back: bool):
        """(sent-order side, expert-major side) lists of (peer, tag, first row, rows); both ranks of a pair
        list their segments in the same (expert) order. Tags differ per chunk and direction, so the
        chunks of a pipeline in flight at once never meet the wrong receive."""
        W, e = self.world, self.e
        base = (2 * plan.chunk + int(back)) * e
        by_dest, start = [], 0
        for d in range(W):  # sent rows: (dest rank, local expert)
            for j in range(e):
                by_dest.append((d, base + j, start, plan.send_We[d][j]))
                start += plan.send_We[d][j]
        by_expert, start = [], 0
        for j in range(e):  # received rows: (local expert, source rank)
            for s in range(W):
                by_expert.append((s, base + j, start, plan.recv_We[s][j]))
                start += plan.recv_We[s][j]
        return by_dest, by_expert

    def to_experts(self, src_NH, plan, *, phase, direction, out=None):
        error = None
        if out is None:
            out, error = self.local(lambda: src_NH.new_empty(plan.num_recv, src_NH.shape[1]), "receive buffer")
        by_dest, by_expert = self._segments(plan, back=False)
        where = self.arrive(plan, phase, direction)
        t0 = self.timeline.mark()
        with issuing(self.group, f"{phase} ({direction}) {self.what} of {plan.label}", self.rank, where):
            works = issue_segments(out, src_NH, by_dest, by_expert, self.group)
        return InFlight(self, works, out, phase, plan.chunk, direction, keep=(src_NH,), start=t0, timed=True,
                        where=where, error=error)

    def to_tokens(self, src_RH, plan, out_NH, *, phase, direction):
        src_RH, error = self.local(src_RH.contiguous, "contiguous rows")
        by_dest, by_expert = self._segments(plan, back=True)
        where = self.arrive(plan, phase, direction)
        t0 = self.timeline.mark()
        with issuing(self.group, f"{phase} ({direction}) {self.what} of {plan.label}", self.rank, where):
            works = issue_segments(out_NH, src_RH, by_expert, by_dest, self.group)
        return InFlight(self, works, out_NH, phase, plan.chunk, direction, keep=(src_RH,), start=t0, timed=True,
                        where=where, error=error)


def choose(world: int, num_local_experts: int, num_chunks: int, rows_W: List[int], row_bytes: int,
           direct_min_bytes: int) -> type:
    """The transport class for a call, from numbers every rank holds alike after the control exchange.

    Point-to-point when the mean (rank pair, local expert, chunk) segment is at least ``direct_min_bytes``
    and e > 1 (with e = 1 the all-to-all needs no regroup, so it moves the same bytes in one call).
    Measured on gloo, 4 ranks on 2 cores (``moe-comm bench``): point-to-point is slower at 256 KiB
    segments, even at 1 MiB and faster at 4 MiB.
    """
    if world == 1:
        return Local
    e = num_local_experts
    mean_segment = sum(rows_W) * row_bytes / (world * world * e * num_chunks)
    if e > 1 and mean_segment >= direct_min_bytes:
        return PointToPoint
    return AllToAll
