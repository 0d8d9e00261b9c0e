"""A Dispatcher's control channel: the fixed-size exchange that opens (and closes) every phase of a call.

Shapes legend: W EP world size, S slots (max chunks x local experts), X = header + message + S words.

``Channel.begin`` issues one ``all_to_all_single`` of [W, X] int64 on the group's device (header words,
this rank's error message if it failed, and per-destination slots: the counts of rows it will send);
``Channel.end`` waits, reads it (the host sync of the phase), checks every rank's header and raises
the same error on every rank when anything disagrees or failed. See ``moe_comm.comm.wire``.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from moe_comm.comm.agree import RemoteError, agreements, disagreement, with_context
from moe_comm.comm.collectives import (REBUILD, CollectiveError, GroupTable, check_usable, group_device, group_rank,
                                       group_size, issuing, poison, record_arrival, wait_work)
from moe_comm.comm.wire import (HEADER_WORDS, MAGIC, MESSAGE_WORDS, PHASE_TEXT, Failure, Phase, ProtocolError, Word,
                                decode_message, describe_position, dtype_name, encode_message, positions, step_text)

__all__ = ["Channel", "Pending", "PeerFailed", "next_index", "MAX_DEFERRED", "read_deferred", "kept"]

EARLIER = -2  # Word.CHUNK of a failure carried from an earlier call (after that call's last exchange)
IN_LEVEL = -3  # Word.CHUNK of a failure inside a level of a two-level call (dispatch.hierarchy), reported at its close
MAX_DEFERRED = 64  # unread exchanges a Channel keeps; older ones are checked on the device (Channel.defer)
MAX_HEADER_ROWS = 64  # device header rows a Channel caches (device calls; a handful in use: one per phase)
# Header words of the fast path of ``_check`` as plain ints: indexing by a Word costs ~70 ns (2.1 us a W=2 read, 0.55)
_MAGIC_AT, _FAILED_AT, _BAD_IDS_AT, _NONFINITE_AT, _TOP_K_AT = map(int, (Word.MAGIC, Word.FAILED, Word.BAD_IDS,
                                                                         Word.NONFINITE, Word.TOP_K))

def next_index(group: Optional[dist.ProcessGroup]) -> int:
    """Construction index of a Dispatcher on ``group``: the number of the agreement its construction makes
    next (``agreements``: counted alike on every rank, failed agreements included, so a construction that
    raised leaves no rank behind; a group rebuilt after ``destroy_process_group`` starts again at 0, in a
    surviving process as in a replacement one). Unique per Dispatcher on the group."""
    return agreements(group)


class PeerFailed(RuntimeError):
    """Raised on every other rank when one rank failed mid-call (its expert_fn, side_fn, a kernel or its
    expert backward raised); names the rank, where, and its error. No rank returns a value from the call."""


@dataclass
class Pending:
    """A control exchange in flight (between ``Channel.begin`` and ``Channel.end``)."""

    phase: Phase
    send_WX: torch.Tensor
    recv_WX: Optional[torch.Tensor]  # None until issued (or, carried, until its transfer completed)
    work: object
    where: str
    local_error: Optional[BaseException]
    failed: Failure
    call: int
    start: object = None
    waited: bool = False
    read: int = HEADER_WORDS + MESSAGE_WORDS  # the words of each row the host reads: header, message, used slots
    call_dev: Optional[torch.Tensor] = None  # the call number on the device (device calls)
    bad_W: Optional[torch.Tensor] = None  # ``Channel._bad_W``, once computed (device calls check it twice)
    carried: bool = False  # the phase's status came inside its last transfer (``Channel.carried``): no span of its own


class _GroupReads:
    """What the first backward check-in after a forward reads on one group (end_check="deferred"): the channels
    that issued an exchange since the last such read (held until it; ``Channel.reads_with_group``), and whether
    a forward opened since (``Channel.opens_backward``)."""

    def __init__(self):
        self.active: Dict[int, "Channel"] = {}  # id -> channel: a constant-time add on every exchange
        self.fresh = False


_READS = GroupTable()  # group -> _GroupReads


class Channel:
    """The control exchanges of one Dispatcher on ``group``.

    Args:
        group: the EP process group (None: one process; exchanges are local).
        index: the Dispatcher's construction index on the group (the same on every rank).
        slots: S words per destination (max chunks x local experts): the counts area.
        timeout: seconds to wait for an exchange (None: the process group's timeout).
    """

    def __init__(self, group: Optional[dist.ProcessGroup], index: int, slots: int, timeout: Optional[float],
                 summed: int = 0):
        self.group, self.index, self.slots, self.timeout = group, index, slots, timeout
        self.world, self.rank = group_size(group), group_rank(group)
        self.device = group_device(group)
        self.summed = summed  # float64 words at the end of a row, summed over the group at the receiver
        self.width = HEADER_WORDS + MESSAGE_WORDS + slots + summed
        self.call = 0  # advanced by the Dispatcher once per call, identically on every rank
        self.timeline = None  # the owner's Timeline: exchanges are comm spans "counts" / "control"
        self.deferred: List[Pending] = []  # exchanges read with the next one (end_check="deferred", sync-free mode)
        # exchanges checked on the device: (int64 [W] flag per rank, int64 first failed call (-1: none),
        # first call, last call)
        self.folded = None
        # A failure on this rank after a phase's closing exchange (the final unpermute, a placeholder-rows
        # path): raised here alone, and carried by this rank's next exchange so that every rank raises there.
        self.late: Optional[Tuple[BaseException, str]] = None  # (error, where)
        self.late_call = -1  # the call whose last step failed (``carry``)
        # Sync-free mode (every exchange deferred): a read that finds this rank's forward paired with a peer's
        # backward (this rank skipped a backward its peers ran, so its collectives lag theirs by one phase) calls
        # ``resync`` to issue a placeholder backward, so every rank's collectives pair again. Set by the owner.
        self.resync: Optional[Callable[[], None]] = None
        self._owed = False
        self.last_read_words = 0  # int64 words the last read brought to the host (all its exchanges)
        self.reads_with_group = False  # end_check="deferred" (set by the owner): see read_group
        # Device calls (the sync-free mode after its first call, ``start_device_calls``): the call number lives on
        # the device (``call_dev``, advanced there: ``next_call``), header rows come from a device cache, and each
        # exchange is checked on the device as it is deferred, into ``sticky`` (the first failed exchange's rows
        # and ranks, kept until a read): per call nothing on the host changes and nothing is copied to the device,
        # so a CUDA graph can capture the calls and replay them.
        self.call_dev: Optional[torch.Tensor] = None
        self._rows: Dict[tuple, torch.Tensor] = {}
        self.sticky: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # (any, bad_W, rows_WB)
        self.sticky_error: Optional[BaseException] = None  # this rank's own error in that exchange (a failure only)

    def carry(self, error: BaseException, where: str) -> None:
        """Send ``error`` (this rank's alone, in ``where``, after that call's last exchange) with this rank's next
        exchange: every rank raises there, this one with ``error``."""
        if self.world > 1 and self.late is None:
            self.late, self.late_call = (kept(error), where), self.call

    def start_device_calls(self, device: torch.device) -> None:
        """From now on the call number lives on the exchanges' device (one process: ``device``, the rows'; a gloo
        group with CUDA rows: the CPU, where its exchanges are built), see ``call_dev``."""
        if self.call_dev is None:
            W, B, dev = self.world, HEADER_WORDS + MESSAGE_WORDS, self.device
            self.call_dev = torch.full((), self.call, dtype=torch.int64, device=dev if W > 1 else device)
            if W > 1:  # one process defers nothing
                i64 = dict(dtype=torch.int64, device=dev)
                self.sticky = (torch.zeros((), dtype=torch.bool, device=dev), torch.zeros(W, **i64),
                               torch.zeros(W, B, **i64))

    def next_call(self) -> Optional[torch.Tensor]:
        """Advance the call number (once per call, identically on every rank): on the host, or with device calls
        on the device, returning this call's number there (a device scalar; None without device calls)."""
        if self.call_dev is None:
            self.call += 1
            return None
        self.call_dev.add_(1)
        return self.call_dev.clone()

    def set_call(self, call: int) -> None:
        """Resynchronise the call number (a read found the ranks at different calls)."""
        self.call = call
        if self.call_dev is not None:
            self.call_dev.fill_(call)

    def _header_row(self, hdr: List[int], message: Optional[str], dev: torch.device,
                    call_dev: Optional[torch.Tensor]) -> torch.Tensor:
        """[HEADER_WORDS + MESSAGE_WORDS] int64 on ``dev``. With device calls and no message, from a cache keyed by
        the header without its call number, which ``call_dev`` fills in (no host -> device copy)."""
        key = None
        if call_dev is not None and message is None:  # CALL and STEP are written over the row (see begin)
            key = (tuple(hdr[:Word.CALL] + [-1] + hdr[Word.CALL + 1:Word.STEP] + [-1] + hdr[Word.STEP + 1:]), dev)
            row = self._rows.get(key)
            if row is not None:
                return row
        if message is None:  # the common case: header and an empty message, one host tensor (numpy: 1.5 us, not 5)
            row = torch.from_numpy(np.array(hdr + _NO_MESSAGE, dtype=np.int64))
        else:
            row = torch.cat([torch.from_numpy(np.array(hdr, dtype=np.int64)), encode_message(message)])
        if dev.type == "cuda":  # from pinned memory the copy is asynchronous; from pageable memory it may block
            row = row.pin_memory()
        row = row.to(dev, non_blocking=True)
        if key is not None and len(self._rows) < MAX_HEADER_ROWS:  # kept while a captured graph may read them
            self._rows[key] = row
        return row

    def begin(self, phase: Phase, hdr: List[int], *, dynamic: Optional[torch.Tensor] = None,
              slots_WS: Optional[torch.Tensor] = None, local_error: Optional[BaseException] = None,
              failed: Failure = Failure.NONE, summed_X: Optional[torch.Tensor] = None,
              call_dev: Optional[torch.Tensor] = None) -> Pending:
        """Issue the exchange. hdr: ``wire.header(...)`` (host ints); dynamic: optional int64 [3] device tensor
        (BAD_IDS, NONFINITE, ROWS) computed on the device; slots_WS: optional [W, <=S] int64 per-destination
        counts; local_error / failed: this rank's failure, sent to every peer with its message; call_dev: the
        call number on the device (device calls), written over hdr's."""
        W = self.world
        pending = self._compose(phase, hdr, self.width, dynamic, slots_WS, local_error, failed, summed_X, call_dev)
        if W == 1:
            pending.recv_WX = pending.send_WX
            return pending
        record_arrival(self.group, pending.where)
        pending.recv_WX = torch.empty_like(pending.send_WX)
        with issuing(self.group, f"{PHASE_TEXT[phase]} control exchange", self.rank, pending.where):
            pending.work = dist.all_to_all_single(pending.recv_WX, pending.send_WX, group=self.group, async_op=True)
        return pending

    def carried(self, phase: Phase, hdr: List[int], words: int, *, local_error: Optional[BaseException] = None,
                failed: Failure = Failure.NONE) -> Pending:
        """The status of a phase that travels inside the phase's last transfer instead of an exchange of its own
        (``Transport.to_tokens(..., status=)``): ``send_WX`` [W, words >= header + message] is what this rank sends
        every peer (zeros after the message); the transport fills ``recv_WX`` once the transfer completed, then
        ``end`` reads its header and message as any exchange's."""
        pending = self._compose(phase, hdr, words, None, None, local_error, failed, None, None)
        pending.waited, pending.carried = True, True
        return pending

    def _compose(self, phase: Phase, hdr: List[int], width: int, dynamic, slots_WS, local_error, failed, summed_X,
                 call_dev) -> Pending:
        """This rank's rows [W, width] of an exchange (what ``begin`` issues), in a Pending not yet issued."""
        check_usable(self.group, self.rank)
        W, dev = self.world, self.device
        hdr = list(hdr)
        if self.reads_with_group:
            reads = self.group_reads
            reads.fresh = reads.fresh or phase in (Phase.FORWARD, Phase.DISPATCH)
            reads.active.setdefault(id(self), self)
        message = None if local_error is None else f"{type(local_error).__name__}: {local_error}"
        carries = self.late is not None
        if carries:  # this exchange carries it (with this rank's own failure, if any, first)
            late, where = self.late
            late_text = f"{type(late).__name__} in {where}: {late}"
            if local_error is None:
                local_error, message = late, late_text
                failed, hdr[Word.CHUNK] = Failure.RAISED, EARLIER
            else:
                message = f"{message}; earlier, {late_text}"
        if W == 1 and dynamic is not None:
            dev = dynamic.device  # one process: no collective; stay on the rows' device (no copy to the host)
        hdr[Word.FAILED] = int(failed)
        B = HEADER_WORDS + MESSAGE_WORDS
        S = 0 if slots_WS is None else slots_WS.shape[1]
        if dev.type == "cpu" and call_dev is None:  # host rows, composed in numpy (a torch setitem costs ~3 us)
            send = np.zeros((W, width), dtype=np.int64)
            send[:, :HEADER_WORDS] = hdr
            if message is not None:
                send[:, HEADER_WORDS:B] = encode_message(message).numpy()  # host sync: none, host ints
            # rows on CUDA with a gloo group: .to(dev) copies them to the host, as a torch setitem would (a sync)
            if dynamic is not None:
                dynamic_host = dynamic.to(dev, torch.int64)
                send[:, Word.BAD_IDS:Word.ROWS + 1] = dynamic_host.numpy()  # host sync: none, on the host (line above)
            if S:
                slots_host_WS = slots_WS.to(dev)
                send[:, B:B + S] = slots_host_WS.numpy()  # host sync: none, on the host (line above)
            send_WX = torch.from_numpy(send)
        else:
            send_WX = torch.zeros(W, width, dtype=torch.int64, device=dev)
            send_WX[:, :B] = self._header_row(hdr, message, dev, call_dev)
            if call_dev is not None:
                send_WX[:, Word.CALL] = call_dev
                send_WX[:, Word.STEP] = hdr[Word.STEP]  # a fill (under a CUDA graph: the step at capture)
            if dynamic is not None:
                send_WX[:, Word.BAD_IDS:Word.ROWS + 1] = dynamic.to(dev, torch.int64)
            if S:
                send_WX[:, B:B + S] = slots_WS
        if summed_X is not None:  # the same words to every rank, as int64 bits
            send_WX[:, self.width - self.summed:] = summed_X.to(dev, torch.float64).contiguous().view(torch.int64)
        call = "" if call_dev is not None else f" of call {hdr[Word.CALL]}"  # device calls: not on the host
        where = f"{PHASE_TEXT[phase]}{call} (dispatcher {self.index})"
        pending_start = self.timeline.mark() if self.timeline is not None else None
        # the host reads the slots this call used (C x its words per chunk), not the whole counts area
        read = B + S
        if carries:  # taken once the rows that carry it exist (a compose that raised keeps it for the next)
            self.late = None
        return Pending(phase, send_WX, None, None, where, local_error, failed, hdr[Word.CALL], pending_start,
                       read=read, call_dev=call_dev)

    def end(self, pending: Optional[Pending]) -> Tuple[np.ndarray, np.ndarray]:
        """Wait for the exchange and check it. Returns (sent, received): int64 host arrays [W, pending.read], row w
        of sent what this rank sent to rank w, row w of received what rank w sent here (header, message, the
        slots this call used). Raises on every rank alike (see ``_check``). Deferred end-of-phase exchanges are
        waited for and checked first, in the same host read. ``pending`` None: only the deferred ones."""
        taken = self._take(pending)
        flat = _gather(taken[2]) if taken[2] else torch.zeros(0, dtype=torch.int64)
        host = flat.cpu()  # host sync: the phase's one read
        self.last_read_words = host.numel()
        try:
            return self._verify(taken, host.numpy())  # host sync: none, copied to the host above
        finally:
            self.settle()

    @property
    def group_reads(self) -> _GroupReads:
        return _READS.setdefault(self.group, _GroupReads())  # looked up, not held: a deep copy shares it too

    def opens_backward(self) -> bool:
        """Whether a backward check-in now is the first on this group since a forward opened (then no longer):
        the one read at once, with every deferred exchange of the group (``read_group``)."""
        reads = self.group_reads
        fresh, reads.fresh = reads.fresh, False
        return fresh

    def read_group(self, pending: Pending) -> None:
        """Read ``pending`` and the deferred exchanges of every channel on this group that issued one since the
        last such read (in construction order; the same on every rank) in one host read; raises the first
        failure on every rank alike. Call ``adopt_late`` before issuing ``pending``."""
        reads = self.group_reads
        reads.active.setdefault(id(self), self)
        channels, reads.active = reads.active, {}
        read_deferred(sorted(channels.values(), key=lambda c: c.index), pending=pending, owner=self)

    def adopt_late(self) -> None:
        """Carry a failure another channel of the group read holds for its next exchange in this one's next."""
        for c in self.group_reads.active.values():
            if self.late is None and c is not self and c.late is not None:
                self.late, self.late_call, c.late = c.late, c.late_call, None

    def settle(self) -> None:
        """Issue the placeholder backward a read found owed (see ``resync``)."""
        if self._owed and self.resync is not None:
            self._owed = False
            self.resync()
        self._owed = False

    def _take(self, pending: Optional[Pending]):
        """Everything the next read checks: (pending, deferred ones, parts, folded flag); parts: (tensor, words)
        pairs on the exchanges' device, read in order (``_gather``)."""
        earlier, self.deferred = self.deferred, []
        todo = earlier + ([] if pending is None else [pending])
        for p in todo:
            self.wait(p)
        if self.timeline is not None and pending is not None and not pending.carried:
            span = "counts" if pending.phase in (Phase.FORWARD, Phase.DISPATCH) else "control"
            self.timeline.comm(span, None, direction=_direction(pending.phase), start=pending.start)
        folded, self.folded = self.folded, None
        flat = [(t, p.read) for p in todo for t in (p.send_WX, p.recv_WX)]
        if folded is not None:
            flat += [(folded[0], None), (folded[1].reshape(1), None)]
        sticky = None
        if self.sticky is not None:  # read it, then clear it in place (the next reads start afresh)
            sticky = torch.cat([self.sticky[2].reshape(-1), self.sticky[0].reshape(1).to(torch.int64)])
            flat.append((sticky, None))
            for t in self.sticky:
                t.zero_()
        return pending, earlier, flat, (folded, sticky is not None)

    def _verify(self, taken, values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        pending, earlier, _, (folded, sticky) = taken
        todo = earlier + ([] if pending is None else [pending])
        if sticky:  # device calls: the first failed exchange since the last read, its rows as it received them
            B = HEADER_WORDS + MESSAGE_WORDS
            failed_any = int(values[-1])
            rows = values[-1 - self.world * B:-1].reshape(self.world, B).tolist()  # host sync: none, numpy
            values = values[:-1 - self.world * B]
            if failed_any:
                self._raise_sticky(rows)
        if folded is not None:
            bad_call, bad_W = int(values[-1]), values[-1 - self.world:-1].tolist()  # host sync: none, numpy
            values = values[:-1 - self.world]
            if bad_call >= 0:
                first, last = folded[2], folded[3]
                ranks = [r for r, b in enumerate(bad_W) if b]
                raise PeerFailed(
                    f"moe_comm: EP rank {self.rank}: EP rank(s) {ranks} failed, or disagreed with this rank, in call "
                    f"{bad_call} (dispatcher {self.index}; the first such call among calls {first}..{last}, which were "
                    f"checked on the device because more than {MAX_DEFERRED} exchanges went unread: their messages are "
                    "lost; read sooner with check()). Every rank raised; the calls since returned placeholder rows on "
                    "every rank: discard their outputs")
        W, at, both = self.world, 0, []
        for p in todo:  # each exchange's sent and received rows, p.read words each
            both.append((values[at:at + W * p.read].reshape(W, p.read),
                         values[at + W * p.read:at + 2 * W * p.read].reshape(W, p.read)))
            at += 2 * W * p.read
        for i, p in enumerate(todo):
            try:
                rows = both[i][1][:, :HEADER_WORDS + MESSAGE_WORDS].tolist()  # host sync: none, numpy
                self._check(p, rows, deferred=i < len(earlier))
            except Exception:
                if i < len(earlier) and pending is not None:
                    # A deferred failure raised at this later exchange: ranks may stand at different calls
                    # here (the failing one left its call early); all continue from the furthest.
                    self.set_call(max(self.call, int(both[-1][1][:, Word.CALL].max())))
                raise
        return both[-1] if both else (values[:0].reshape(W, 0), values[:0].reshape(W, 0))

    def sum_of(self, pending: Pending) -> torch.Tensor:
        """[summed] float64: the ``summed_X`` every rank sent in exchange ``pending``, summed over the group (a rank
        that sent none counts zeros). Device ops after the exchange completed (``wait``): no host read."""
        self.wait(pending)
        return pending.recv_WX[:, self.width - self.summed:].contiguous().view(torch.float64).sum(0)

    def wait(self, pending: Pending) -> None:
        """Wait for the exchange without reading it (on NCCL the compute stream waits: no host sync)."""
        if not pending.waited:
            wait_work(pending.work, PHASE_TEXT[pending.phase], timeout=self.timeout, rank=self.rank,
                      direction=_direction(pending.phase), what="control exchange", group=self.group,
                      where=pending.where)
            pending.waited, pending.work = True, None  # no Work outlives its wait (one left at exit may abort)

    def defer(self, pending: Pending) -> None:
        """Check this exchange with the next read instead of now (no host sync of its own). With device calls it
        is checked on the device now (``sticky``). Otherwise at most MAX_DEFERRED stay unread; older ones are
        checked on the device and folded into one flag (read with the next read), so a run that never reads
        holds a fixed amount of memory."""
        kept(pending.local_error)
        if self.sticky is not None:
            self._stick(pending)
            return
        self.deferred.append(pending)
        if len(self.deferred) > MAX_DEFERRED:
            self._fold(self.deferred.pop(0))

    def _stick(self, p: Pending) -> None:
        """Device calls: check exchange ``p`` on the device now (a stream wait, no host read) and keep the first
        failed one's rows and ranks in ``sticky``, in place, until a read."""
        bad_W = self._bad_W(p)
        any_, first_W, rows_WB = self.sticky
        first = bad_W.any() & ~any_
        first_W.copy_(torch.where(first, bad_W.to(torch.int64), first_W))
        rows_WB.copy_(torch.where(first, p.recv_WX[:, :HEADER_WORDS + MESSAGE_WORDS], rows_WB))
        any_ |= first
        if p.local_error is not None and self.sticky_error is None:  # a failure: the host knows it already
            self.sticky_error = p.local_error

    def failed_flag(self, p: Pending) -> torch.Tensor:
        """0-dim bool on the device: any rank failed or disagreed in exchange ``p`` (waits for it: on NCCL a
        stream wait, no host read). Its read stays deferred."""
        return self._bad_W(p).any()

    def _bad_W(self, p: Pending) -> torch.Tensor:
        """[W] bool on the device: the ranks whose row in ``p`` shows a failure, a foreign row or a
        disagreement with this rank's own row (what it sent). A fixed dozen device ops whatever W."""
        if p.bad_W is not None:
            return p.bad_W
        self.wait(p)
        rows, own = p.recv_WX[:, :HEADER_WORDS], p.send_WX[0, :HEADER_WORDS]
        differs = rows != own
        sized = slice(Word.CHUNKS, Word.CONFIG + 1)  # these and TOP_K: -1 where a rank does not know its value
        bad = differs[:, Word.MAGIC:Word.PHASE + 1].any(1) | differs[:, Word.STEP]  # magic, dispatcher, call, phase
        bad |= (differs[:, sized] & (rows[:, sized] >= 0) & (own[sized] >= 0)).any(1)
        bad |= differs[:, Word.TOP_K] & (rows[:, Word.TOP_K] >= 0) & (own[Word.TOP_K] >= 0)
        bad |= (rows[:, Word.FAILED] != Failure.NONE) | (rows[:, Word.BAD_IDS] > 0) | (rows[:, Word.NONFINITE] > 0)
        p.bad_W = bad
        return bad

    def _fold(self, p: Pending) -> None:
        """Device-side check of one exchange: the ranks that failed or disagreed, and the first call that had any."""
        bad = self._bad_W(p)
        bad_W = bad.to(torch.int64)
        call = torch.where(bad.any(), p.call, -1)
        if self.folded is None:
            self.folded = (bad_W, call, p.call, p.call)
        else:  # the ranks of the first failed call; its number
            first_W, first = self.folded[0], self.folded[1]
            keep = first >= 0
            self.folded = (torch.where(keep, first_W, bad_W), torch.where(keep, first, call), self.folded[2], p.call)

    def _raise_sticky(self, rows: List[List[int]]) -> None:
        """Raise the failure of the first failed exchange kept on the device (device calls), on every rank alike."""
        own = rows[self.rank]
        err, self.sticky_error = self.sticky_error, None
        if own[Word.FAILED] == Failure.NONE:  # this rank's own (later) failure is not the one kept
            err = None
        p = Pending(Phase(own[Word.PHASE]), None, None, None, describe_position(own), err, Failure.NONE, own[Word.CALL])
        self._check(p, rows, deferred=True)
        raise PeerFailed(f"moe_comm: EP rank {self.rank}: a rank failed or disagreed in {describe_position(own)} "
                         "(checked on the device); every rank raised at this later read: discard the outputs since "
                         "the last read")

    def _check(self, pending: Pending, rows: List[List[int]], deferred: bool = False) -> None:
        rank = self.rank
        own = rows[rank]
        # Fast path, the every-call case: every row's header equals this rank's (magic, position, step, sizes,
        # dtype, settings), no failure, no bad id or non-finite row. Nothing below would raise then.
        if own[_MAGIC_AT] == MAGIC and own[_FAILED_AT] == Failure.NONE:
            same, tail = own[:_BAD_IDS_AT], own[_TOP_K_AT:HEADER_WORDS]
            for row in rows:
                if row[:_BAD_IDS_AT] != same or row[_TOP_K_AT:HEADER_WORDS] != tail or row[_BAD_IDS_AT] > 0 \
                        or row[_NONFINITE_AT] > 0:
                    break
            else:
                return
        bad = [r for r, row in enumerate(rows) if row[Word.MAGIC] != MAGIC]
        if bad:
            reason = f"EP rank(s) {bad} sent a control row that is not a moe_comm header"
            poison(self.group, reason)
            raise ProtocolError(f"moe_comm: EP rank {rank}: {reason} (another collective of the same size ran on "
                                f"this group at the same time, or stale bytes); {REBUILD}")
        at = positions(rows)
        if len(at) > 1:
            # Every rank saw the same rows: all resynchronise on the furthest call, so the next call can work.
            self.set_call(max(row[Word.CALL] for row in rows) + 1)
            ahead = (Phase.FORWARD, Phase.FORWARD_END)
            self._owed = rows[rank][Word.PHASE] in ahead and any(
                row[Word.PHASE] in (Phase.BACKWARD, Phase.BACKWARD_END) for row in rows)
            failed = [r for r, row in enumerate(rows) if row[Word.FAILED] != Failure.NONE]
            msg = HEADER_WORDS, HEADER_WORDS + MESSAGE_WORDS
            why = "".join(f" EP rank {r} reported: {decode_message(rows[r][msg[0]:msg[1]])}." for r in failed)
            raise ProtocolError(
                f"moe_comm: EP rank {rank}: the EP ranks are not in the same call: "
                + "; ".join(f"ranks {rs} in {pos}" for pos, rs in at.items())
                + f".{why} Every rank must run the same layers in the same order, forward and backward (a rank that "
                "skipped a backward or a layer, or raised alone, causes this). Every rank raised; the next call works "
                "when every rank makes it (a rank whose loop went on to its next step stays a step apart: with "
                "moe_comm.set_step every call raises until the ranks skip a step together or none).")
        text = disagreement("the training step (moe_comm.set_step)", [row[Word.STEP] for row in rows], step_text)
        if text:
            raise ProtocolError(
                f"moe_comm: EP rank {rank}: in {describe_position(rows[rank])}, {text}. A rank that skipped a step "
                "(an exception caught outside moe_comm, a `continue`) would pair its calls with its peers' calls of "
                "another step. Every rank raised in this call, and raises again in every call until the ranks are at "
                "the same step: skip a step on every rank or none.")
        failed = [r for r, row in enumerate(rows) if row[Word.FAILED] != Failure.NONE]
        if failed:
            self._raise_failure(pending, rows, failed, deferred)
        outcome = ("every rank raised at this later read; that call ran with placeholder rows on every rank: "
                   "discard what it returned (and the gradients of its step)" if deferred else
                   "every rank raised, no rows were sent")
        for word, what, fmt in ((Word.WORLD, "EP world size", str), (Word.EXPERTS, "num_experts", str),
                                (Word.CHUNKS, "num_chunks of this call (x the pieces its rows stream in)", str),
                                (Word.ROW_BYTES, "row bytes (H x element size)", str),
                                (Word.TOP_K, "top_k (the routing's slots per token)", str),
                                (Word.DTYPE, "dtype", dtype_name),
                                (Word.CONFIG, "Dispatcher settings (hash of its arguments and carry_max_bytes)", hex)):
            known = [(r, row[word]) for r, row in enumerate(rows) if row[word] >= 0 or word == Word.CONFIG]
            text = disagreement(what, [v for _, v in known], fmt)
            if text:
                raise ValueError(f"moe_comm: {text.replace(' differs across the EP group:', ':')}; {outcome}")
        E = rows[0][Word.EXPERTS]
        for word, text in ((Word.BAD_IDS, f"topk_idx_TK holds expert ids outside [-1, {E})"),
                           (Word.NONFINITE, "x_TH holds non-finite (NaN/Inf) rows (strict=True)")):
            bad = [r for r, row in enumerate(rows) if row[word] > 0]
            if bad:
                raise ValueError(f"moe_comm: {text} on EP rank(s) {bad} "
                                 f"({', '.join(str(rows[r][word]) for r in bad)}); {outcome}")

    def _raise_failure(self, pending: Pending, rows: List[List[int]], failed: List[int], deferred: bool) -> None:
        err = pending.local_error
        # This rank's own error leads the message: not repeated for the ranks that sent the same text (a
        # misuse every rank detects alike, e.g. a DDP wrapper over the experts); equal texts of peers once.
        own = None if err is None else encode_message(f"{type(err).__name__}: {err}").tolist()  # host sync: none, CPU
        by_text: Dict[Tuple[str, str], List[int]] = {}
        for r in failed:
            chunk = rows[r][Word.CHUNK]
            where = ("after its call's last exchange, carried here" if chunk == EARLIER else
                     "inside a level of the call" if chunk == IN_LEVEL else
                     "before any rows moved" if chunk < 0 else f"at chunk {chunk}")
            words = rows[r][HEADER_WORDS:HEADER_WORDS + MESSAGE_WORDS]
            msg = "this same error" if words == own else decode_message(words)
            by_text.setdefault((where, msg), []).append(r)
        lines = [f"EP rank {rs[0]} ({where}): {msg}" if len(rs) == 1 else f"EP ranks {rs} ({where}): {msg}"
                 for (where, msg), rs in by_text.items()]
        ctx = (f"[{describe_position(rows[self.rank])}: EP rank(s) {failed} failed: " + "; ".join(lines)
               + ("; every rank raised at this later read: that call returned placeholder rows on every rank, "
                  "discard what it produced]" if deferred else "; every rank raised, no rank returns a value from "
                  "this call]"))
        if err is not None:
            if type(err) in (TypeError, ValueError, RuntimeError):
                raise with_context(err, f"{err} {ctx}") from None
            if hasattr(err, "add_note"):  # any other type is re-raised as it is, with the context as a note
                err.add_note(f"moe_comm: {ctx}")
            raise err
        if all(rows[r][Word.FAILED] == Failure.REJECTED for r in failed):
            raise RemoteError(f"moe_comm: EP rank(s) {failed} rejected their input {ctx}")
        raise PeerFailed(f"moe_comm: EP rank(s) {failed} failed mid-call {ctx}")


_NO_MESSAGE = [0] * MESSAGE_WORDS  # the message words of a row without an error


def kept(error: Optional[BaseException]) -> Optional[BaseException]:
    """``error`` without its traceback, for a failure kept to be raised at a later read: its frames hold the
    call's tensors, whose autograd graph holds the failure again - a cycle the garbage collector cannot see
    through, so every failed call would stay in memory. Where it was raised stays, as a note."""
    tb = None if error is None else error.__traceback__
    if tb is not None:
        error.add_note("moe_comm: first raised at (most recent call last):\n" + "".join(traceback.format_tb(tb)[-4:]))
        error.__traceback__ = None
    return error


def _gather(parts: List[Tuple[torch.Tensor, Optional[int]]]) -> torch.Tensor:
    """One 1-D int64 tensor, on the parts' device, of ``parts``: (tensor, words) pairs, ``words`` the columns read of
    a [rows, columns] tensor (None: all of it). No read: the caller copies it to the host."""
    if parts[0][0].device.type == "cpu":  # numpy views: no torch op per part (a slice and a reshape: ~3 us each)
        arrays = [x.numpy() if w is None else x.numpy()[:, :w] for x, w in parts]  # host sync: none, on the host
        return torch.from_numpy(np.concatenate(arrays, axis=None))
    return torch.cat([x.reshape(-1) if w is None else x[:, :w].reshape(-1) for x, w in parts])


def _direction(phase: Phase) -> str:
    return "bwd" if phase in (Phase.BACKWARD, Phase.BACKWARD_END, Phase.DISPATCH_BWD, Phase.COMBINE_BWD) else "fwd"


def as_collective_error(err: BaseException) -> bool:
    """True for errors after which the group cannot be trusted (the transport failed)."""
    return isinstance(err, (CollectiveError, ProtocolError))


def read_deferred(channels: List["Channel"], pending: Optional[Pending] = None, owner: Optional["Channel"] = None
                  ) -> None:
    """Check the deferred exchanges of several channels with one host read (per device), and ``pending`` of
    ``owner`` (one of them) last among its own; raises the first failure, in channel order, on every rank alike.
    Used by ``moe_comm.check`` and ``Channel.read_group``."""
    taken = [c._take(pending if c is owner else None) for c in channels]
    by_device: Dict[torch.device, List[Tuple[torch.Tensor, Optional[int]]]] = {}
    for t in taken:
        for x in t[2]:
            by_device.setdefault(x[0].device, []).append(x)
    values = {dev: _gather(xs).cpu() for dev, xs in by_device.items()}  # host sync: the phase's one read (per device)
    if owner is not None:
        owner.last_read_words = sum(v.numel() for v in values.values())
    at = dict.fromkeys(values, 0)
    first = None
    for c, t in zip(channels, taken):  # every channel is read (each may owe a placeholder backward) ...
        if not t[2]:
            continue
        dev, n = t[2][0][0].device, sum(x.numel() if w is None else x.shape[0] * w for x, w in t[2])
        try:
            c._verify(t, values[dev][at[dev]:at[dev] + n].numpy())  # host sync: none, copied to the host above
        except Exception as err:  # noqa: BLE001 - the first is raised below, on every rank alike
            first = first or err
        at[dev] += n
    for c in channels:  # ... then the placeholders go out in channel order, as the peers' phases were issued
        c.settle()
    if first is not None:
        raise first
