"""The control exchange of a Dispatcher call, and the failure rule around it (a mixin of ``Dispatcher``).

Shapes legend: T tokens, H hidden, K top-k, e local experts, W EP world size, C chunks.

``_open`` checks the inputs, builds the layout and issues the call's control exchange (header, counts);
``_close`` reads it (the forward's one host sync) and builds the chunk plans and the transport;
``_exchange_status`` opens or closes a phase without counts. The rule: after the control exchange is issued,
no exception leaves a rank before the phase's closing exchange (a local failure keeps the schedule with
placeholder rows and travels in that exchange); a failure after a call's last exchange is carried by the
rank's next exchange (``alone``, ``last_step``), so every rank raises there and all issue the same collectives.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.utils.checkpoint
from einops import rearrange

from moe_comm import ops
from moe_comm._checks import check_int, check_tensor
from moe_comm.comm.channel import as_collective_error, kept
from moe_comm.comm.wire import HEADER_WORDS, MESSAGE_WORDS, Failure, Phase, Word, dtype_code, header
from moe_comm.dispatch import send_rows
from moe_comm.dispatch.plan import (DispatchHandle, build_chunk_plans, group_pieces, layout_device, rank_major_pays,
                                    to_device)
from moe_comm.dispatch.transport import AllToAll, choose

__all__ = ["CallControl"]

_STOP_RECOMPUTE = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())


class CallControl:
    """The control-exchange half of ``Dispatcher`` (its state: group, channel, settings, transports)."""

    def _header(self, phase: Phase, call: int, C: int, row_bytes: int = -1, dtype: int = -1, top_k: int = -1) -> list:
        return header(phase, dispatcher=self.index, call=call, chunks=C, experts=self.num_experts,
                      world=self.world_size, row_bytes=row_bytes, dtype=dtype, config=self.config_hash, top_k=top_k)

    def _check_inputs(self, x_TH, topk_idx_TK, C) -> None:
        check_tensor("x_TH", x_TH, dim=2, floating=True)
        dtype_code(x_TH.dtype)
        check_tensor("topk_idx_TK", topk_idx_TK, dim=2, integer=True, device=x_TH.device)
        if topk_idx_TK.shape[0] != x_TH.shape[0]:
            raise ValueError(f"topk_idx_TK must be [T, K] with T = {x_TH.shape[0]} (x_TH rows), "
                             f"got shape {tuple(topk_idx_TK.shape)}")
        check_int("num_chunks", C, 1, high=self.max_chunks)

    def _open(self, phase: Phase, x_TH, topk_idx_TK, C, local_error=None, extra_check=None, rank_rows=False,
              pieces: int = 1, summed_X=None):
        """Check the inputs, build the layout and issue the call's control exchange (header, counts).
        A rank whose input is rejected still joins the exchange with zero counts and its error, so every
        rank raises instead of the others hanging. Returns (pending, layout or None); with ``rank_rows``
        (one copy per rank) the layout is a ``RankRows`` of C x ``pieces`` chunks."""
        call_dev = self.channel.next_call()  # device calls: advanced on the device
        call = self.channel.call
        layout, failed = None, Failure.NONE
        if local_error is None:
            try:
                self._check_inputs(x_TH, topk_idx_TK, C)
                if extra_check is not None:
                    extra_check()
                if self.world_size == 1 and self.timeline.device != x_TH.device:
                    self.timeline.device = x_TH.device  # no group to say where the work runs: the rows do
                if self.channel.device.type == x_TH.device.type == "cuda" and self.channel.device != x_TH.device:
                    # NCCL: the exchanges go on this rank's own device, which the rows name (a Dispatcher built
                    # before torch.cuda.set_device(local_rank) took cuda:0's)
                    self.channel.device = self.auto.device = x_TH.device
                with self.timeline.compute("layout"):
                    make = ops.make_rank_rows if rank_rows else ops.make_layout
                    layout = make(topk_idx_TK, self.num_experts, num_ranks=self.world_size,
                                  num_chunks=C * pieces, backend=self.backend)
            except (TypeError, ValueError) as err:
                local_error = err
        if local_error is not None:
            failed = Failure.REJECTED
            C = C if isinstance(C, int) and not isinstance(C, bool) and 1 <= C <= self.max_chunks else 1
            pending = self.channel.begin(phase, self._header(phase, call, C), local_error=local_error, failed=failed,
                                         call_dev=call_dev)
            return pending, None
        row_bytes = x_TH.shape[1] * x_TH.element_size()
        if self.strict:
            nonfinite = (~torch.isfinite(x_TH)).any(1).sum()
        else:
            nonfinite = torch.zeros_like(layout.num_invalid)
        if rank_rows:  # the experts' slots, then the rows per chunk
            rows_CW = layout.layout.counts_CWe[:, :, 0]
            slots_WS = torch.cat([rearrange(layout.slot_counts_CWe, "c w e -> w (c e)"), rows_CW.t()], 1)
            dynamic = torch.stack([layout.num_invalid, nonfinite, rows_CW.sum()])
        else:
            slots_WS = layout.counts_CWe.transpose(0, 1).reshape(self.world_size, -1)  # "c w e -> w (c e)"
            dynamic = torch.stack([layout.num_invalid, nonfinite, layout.counts_CWe.sum()])
        top_k = topk_idx_TK.shape[1] if self.sync_free else -1  # sync-free rows are sized by K: agreed
        pending = self.channel.begin(phase, self._header(phase, call, C * pieces, row_bytes, dtype_code(x_TH.dtype),
                                                         top_k), dynamic=dynamic, slots_WS=slots_WS, summed_X=summed_X,
                                     call_dev=call_dev)
        return pending, layout

    def _close(self, pending, layout, C: int, hidden: int, pieces: int = 1, expert_fn=None) -> DispatchHandle:
        """Read the control exchange (raises on every rank alike), build the chunk plans, pick the transport.
        ``pieces``: as given to ``_open``; the counts are per piece. ``expert_fn``: the experts of a pipelined
        call; where they take the all-to-all's rows as they arrive (``rank_major_pays``), no regroup (a
        choice of this rank alone: it changes only where its received rows sit)."""
        with self.workspace.dropped_on_error():  # a failed exchange may leave transfers of this rank in flight
            sent, rows = self.channel.end(pending)
        try:
            return self._plan(pending, sent, rows, layout, C, hidden, pieces, expert_fn), None
        except Exception as err:  # noqa: BLE001 - the transfers still go out: plans without the regroup pass
            if self.sync_free:
                raise
            return self._plan(pending, sent, rows, layout, C, hidden, pieces, None, regroup=False), err

    def _plan(self, pending, sent, rows, layout, C: int, hidden: int, pieces: int, expert_fn,
              regroup: bool = True) -> DispatchHandle:
        """The chunk plans and transport of a call from its control exchange (``sent``, ``rows``: int64 host arrays
        [W, words], see ``Channel.end``). ``regroup`` False: no regroup index (the sizes alone, for a rank that
        failed after the exchange)."""
        W, e = self.world_size, self.num_local_experts
        base = HEADER_WORDS + MESSAGE_WORDS
        C *= pieces
        rank_rows = layout if isinstance(layout, ops.RankRows) else None
        row_bytes = int(rows[0, Word.ROW_BYTES]) if self.dispatch_dtype is None else self._wire_width(hidden)
        # the rows' device: a gloo group's exchange is on the CPU while the rows may be on CUDA; every index and count
        # the kernels and the experts read must be where the rows are
        recv_counts_WCe = to_device(pending.recv_WX[:, base:base + C * e].reshape(W, C, e), layout_device(layout))
        slots_sent_WCe = sent[:, base:base + C * e].reshape(W, C, e)
        slots_recv_WCe = rows[:, base:base + C * e].reshape(W, C, e)
        if rank_rows is not None:  # one copy per rank: rows per (rank, chunk) after the slots; one all-to-all
            layout = rank_rows.layout
            rows_at = slice(base + C * e, base + C * e + C)
            send_WCe, recv_WCe = sent[:, rows_at, None], rows[:, rows_at, None]
            kind = AllToAll
            chunks = build_chunk_plans(send_WCe, recv_WCe, recv_counts_WCe, regroup=False, call=pending.call,
                                       recv_slots_WCe=slots_recv_WCe)
            chunks = group_pieces(chunks, pieces)
            self._stream = send_rows.streams(int(rows[:, Word.ROWS].max()) * row_bytes)
        else:
            send_WCe, recv_WCe = slots_sent_WCe, slots_recv_WCe
            kind = choose(W, e, C, rows[:, Word.ROWS].tolist(), row_bytes, self.direct_min_bytes)  # host sync: none
            regroup = regroup and kind.regroups and e > 1
            if regroup and expert_fn is not None:
                block_rows = float(recv_WCe.sum()) / (W * e * C)
                rank_major = rank_major_pays(expert_fn, block_rows, layout.dest_row_TK.device)  # the rows' device
            else:
                rank_major = False
            chunks = build_chunk_plans(send_WCe, recv_WCe, recv_counts_WCe, regroup=regroup and not rank_major,
                                       call=pending.call, rank_major=rank_major)
        layout.set_num_rows(int(send_WCe.sum()))
        self.last_transport = kind.name
        # Small calls close each phase inside its last transfer (no closing exchange): decided from numbers every
        # rank holds alike (the settings, the transport, every rank's rows), so all ranks decide the same.
        carry = (kind is AllToAll and self.end_check == "eager" and not self.sync_free and row_bytes > 0
                 and int(rows[:, Word.ROWS].sum()) * row_bytes <= self.carry_max_bytes)  # host sync: none, numpy
        return DispatchHandle(layout=layout, chunks=chunks, call=pending.call, hidden_size=hidden,
                              transport=self.transport(kind), owner=id(self), rank_rows=rank_rows,
                              slots_sent=int(slots_sent_WCe.sum()), carry=carry)

    def _exchange_status(self, phase: Phase, handle: DispatchHandle, error: Optional[BaseException] = None,
                         failed: Failure = Failure.NONE, chunk: int = -1, row_bytes: int = -1, dtype: int = -1,
                         deferrable: bool = False, meanwhile=None, read_group: bool = False):
        """A control exchange without counts (end of a phase, combine, a backward): raises on every rank
        when any rank failed or is elsewhere; ``deferrable`` end-of-phase exchanges are only issued when
        ``end_check="deferred"`` (read with the next one); in sync-free mode every one is. One process:
        only this rank's own error. Returns the exchange when its read is deferred, else None.
        ``meanwhile()``: work done while the exchange travels (waiting for the phase's last transfers, whose
        outcome on this rank is already in it); it may raise only CollectiveError (the group is then poisoned).
        ``read_group`` with end_check="deferred": read every deferred exchange of the group's Dispatchers with this
        one (and carry this rank's failures held for another Dispatcher's next exchange in it)."""
        if self.world_size == 1:
            if meanwhile is not None:
                meanwhile()
            if error is not None:
                raise error
            return
        hdr = self._header(phase, handle.call, len(handle.chunks), row_bytes, dtype)
        hdr[Word.CHUNK] = chunk
        read_group = read_group and self.channel.reads_with_group
        if read_group:
            self.channel.adopt_late()
        with self.workspace.dropped_on_error():
            pending = self.channel.begin(phase, hdr, local_error=error, failed=failed, call_dev=handle.call_dev)
            if meanwhile is not None:
                meanwhile()
            if self.sync_free or (deferrable and self.end_check == "deferred"):
                self.channel.defer(pending)
                return pending
            if read_group:
                self.channel.read_group(pending)
            else:
                self.channel.end(pending)

    def _carried_status(self, phase: Phase, handle: DispatchHandle, error: Optional[BaseException], chunk: int,
                        words: int):
        """This rank's status of a phase that closes inside its last transfer (``handle.carry``): the rows of the
        end-of-phase exchange ``_exchange_status`` would issue, ``words`` wide, not issued (``Channel.carried``)."""
        hdr = self._header(phase, handle.call, len(handle.chunks))
        hdr[Word.CHUNK] = chunk
        return self.channel.carried(phase, hdr, words, local_error=error,
                                    failed=Failure.NONE if error is None else Failure.RAISED)

    def _read_carried(self, pending, error: Optional[BaseException], lost=None) -> None:
        """Read a status that came in the phase's last transfer (complete): raises on every rank alike, as the
        end-of-phase exchange would. When this rank could not unpack it (the transfer's rows arrived, the status
        copy failed) but sent "no failure", its peers return: its next exchange carries the error, so every rank
        raises there. With a backward to come (``lost``: NaN-fills this rank's output) that exchange is this call's
        backward check-in, and the rank returns those rows so that its backward runs with its peers' (as
        ``last_step``); without one it raises now."""
        if pending.recv_WX is None:
            err = error or RuntimeError(f"moe_comm: EP rank {self.rank}: the status rows of {pending.where} "
                                        "could not be read")
            if pending.failed == Failure.NONE:  # what its peers read; a failure it sent, they raise already
                self.channel.carry(kept(err), f"the end of {pending.where}")
                if lost is not None:
                    lost()
                    return
            raise err
        with self.workspace.dropped_on_error():
            self.channel.end(pending)
        if error is not None:  # not reached: the read raises this rank's own failure
            raise error

    @contextlib.contextmanager
    def alone(self, where: str):
        """Work after a phase's last exchange: an error here is raised on this rank alone (its peers already
        returned) and carried by this rank's next exchange, where every rank raises naming it."""
        try:
            yield
        except _STOP_RECOMPUTE:  # non-reentrant checkpointing ends its recompute here on every rank: no failure
            raise
        except Exception as err:  # noqa: BLE001
            if not as_collective_error(err):
                self.channel.carry(err, where)
            raise

    def last_step(self, where: str, y_NH: torch.Tensor, shape, fn) -> torch.Tensor:
        """``fn()``: a call's work after its last exchange (the final unpermute of the pipeline's output ``y_NH``).
        A failure here is this rank's alone: its next exchange carries it and every rank raises there, naming
        it. With a backward to come (``y_NH`` requires grad) that exchange is this call's backward check-in:
        the rank returns NaN rows of ``shape`` attached to ``y_NH``, so that its backward runs with its peers'
        and all raise in the same step; without one it raises now (its peers raise at the next call)."""
        try:
            return fn()
        except _STOP_RECOMPUTE:
            raise
        except Exception as err:  # noqa: BLE001
            if as_collective_error(err):
                raise
            self.channel.carry(kept(err), where)
            if self.world_size == 1 or not y_NH.requires_grad:
                raise
            return y_NH.sum() * 0 + y_NH.new_full(shape, float("nan"))
