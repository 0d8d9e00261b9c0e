"""Collectives: all-to-all with uneven splits and autograd, the counts exchange, point-to-point row
segments, group helpers.

Shapes legend: R rows, H hidden size, W EP world size.
Rows travel as raw bytes (a uint8 view), so every dtype works on every backend (gloo has no
bfloat16 reductions, but an all-to-all needs no arithmetic).
"""
from __future__ import annotations

import atexit
import datetime
import os
import queue
import threading
import time
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["resolve_group", "group_size", "group_rank", "group_device", "all_to_all_v", "all_to_all_v_async",
           "exchange_counts", "exchange_counts_async", "issue_segments", "CollectiveError", "wait_work", "poison",
           "check_usable", "record_arrival", "arrivals", "REBUILD", "issuing", "GroupTable"]


REBUILD = ("the process group can no longer be trusted: rebuild it (dist.destroy_process_group(), "
           "dist.init_process_group(...) on every rank) and the layers from their state_dict")


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a dead or stuck peer), or the group was poisoned by an earlier
    one; names the phase, the chunk and, when known, the peers that did not arrive."""


class GroupTable:
    """A value per process group OBJECT, not per group name: ``destroy_process_group`` resets torch's group
    counter, so the groups built after it reuse the names "0", "1", ... of the destroyed ones. Keyed by a
    weak reference (a destroyed group's entry goes with it); ``None`` (one process) is a key too."""

    def __init__(self):
        self._weak: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._other: Dict[object, object] = {}

    def _table(self, group):
        if group is None:
            return self._other, None
        try:
            weakref.ref(group)
        except TypeError:  # an object without weak references: by identity, kept alive by the table
            return self._other, group
        return self._weak, group

    def get(self, group, default=None):
        table, key = self._table(group)
        return table.get(key, default)

    def setdefault(self, group, value):
        table, key = self._table(group)
        return table.setdefault(key, value)

    def __setitem__(self, group, value) -> None:
        table, key = self._table(group)
        table[key] = value


# Groups on which a collective failed or timed out (group -> what happened). Work issued on such a group may
# still be pending in the backend (gloo pairs collectives by order), so nothing more is issued on it. A
# group rebuilt after ``destroy_process_group`` is a new object: it starts usable.
_POISONED = GroupTable()


def _group_key(group: Optional[dist.ProcessGroup]) -> str:
    """The group's name (the same on every rank; for store keys and messages)."""
    if group is None:
        return "<single process>"
    return getattr(group, "group_name", None) or str(id(group))


def poison(group: Optional[dist.ProcessGroup], reason: str) -> None:
    """Mark ``group`` unusable for moe_comm: every later call on it raises CollectiveError at once (until the
    process group is rebuilt: a new group object is usable)."""
    _POISONED.setdefault(group, reason)


def check_usable(group: Optional[dist.ProcessGroup], rank: int = 0) -> None:
    """Raise CollectiveError when an earlier collective on ``group`` failed (see ``poison``)."""
    reason = _POISONED.get(group)
    if reason is not None:
        raise CollectiveError(f"moe_comm: EP rank {rank}: an earlier collective on this group failed ({reason}); "
                              f"{REBUILD}")


def _store():
    try:  # the default store of the process group (TCPStore / FileStore); set ~5-10 us here
        return dist.distributed_c10d._get_default_store()
    except Exception:  # not initialised through init_process_group, or a torch without it
        return None


ARRIVAL_DELAY_S = 0.005  # the writer waits this long after a record, so a step's records go out in one wake-up
ARRIVAL_DRAIN_S = 2.0  # at exit, the most the interpreter waits for the writer's last records


class _ArrivalWriter:
    """Writes arrival records to the store from a daemon thread: a TCPStore set is a round trip (0.1-0.3 ms
    here, longer behind bulk data on a slow link) that would otherwise sit before every transfer. Only the
    newest record per key is written; a peer reads them after a timeout (seconds), long after they land.
    TCPStore serialises its client's operations with a lock, so the main thread may use the store meanwhile.
    ``put`` is one SimpleQueue put (a C call): no Python lock on a transfer's path."""

    def __init__(self):
        self.queue: "queue.SimpleQueue" = queue.SimpleQueue()  # (store, key, where), or a drain's threading.Event
        self.thread: Optional[threading.Thread] = None
        self.start_lock = threading.Lock()
        self.latest: Dict[str, str] = {}  # key -> the newest record put (its store entry may lag ARRIVAL_DELAY_S)

    def put(self, store, key: str, where: str) -> None:
        self.latest[key] = where
        self.queue.put((store, key, where))
        if self.thread is None:
            with self.start_lock:  # two threads' first records start one writer
                if self.thread is None:
                    self.thread = threading.Thread(target=self._run, name="moe_comm-arrivals", daemon=True)
                    self.thread.start()

    def _run(self) -> None:
        q = self.queue
        while True:
            todo = [q.get()]
            # Coalesce: records of the next few ms replace this one (a step records 6 per layer), so the writer
            # wakes and sets once per burst instead of per record; on 2 shared cores each wake-up took ~0.1 ms of
            # the step. A record lands at most ARRIVAL_DELAY_S late; it is read after a timeout (seconds).
            time.sleep(ARRIVAL_DELAY_S)
            while True:
                try:
                    todo.append(q.get_nowait())
                except queue.Empty:
                    break
            newest = {t[1]: t for t in todo if isinstance(t, tuple)}
            for store, key, where in newest.values():
                try:
                    store.set(key, where)
                except Exception:  # noqa: BLE001 - the store may be gone (rank 0 died); a diagnosis, not a duty
                    pass
            for t in todo:
                if isinstance(t, threading.Event):  # a drain: every record queued before it is written
                    t.set()

    def drain(self) -> None:
        """Wait (at most ARRIVAL_DRAIN_S) until every record put so far is written: at interpreter exit a daemon
        thread caught inside a store call aborts the process ("terminate called without an active exception";
        with the 5 ms wait most failure tests' ranks did, before this ran at exit). A marker goes through the
        queue behind them (first in, first out); the writer sets it once the sets before it returned."""
        if self.thread is None:
            return
        done = threading.Event()
        self.queue.put(done)
        done.wait(ARRIVAL_DRAIN_S)

    def reset_after_fork(self) -> None:
        self.__init__()


_ARRIVALS = _ArrivalWriter()
atexit.register(_ARRIVALS.drain)
if hasattr(os, "register_at_fork"):  # a forked child (DataLoader worker) has no writer thread: start afresh
    os.register_at_fork(after_in_child=_ARRIVALS.reset_after_fork)


def record_arrival(group: Optional[dist.ProcessGroup], where: str) -> None:
    """Note in the group's store that this rank reached ``where`` (read when a peer times out). Written by a
    background thread: returns at once."""
    if group is None:
        return
    got = _ARRIVAL_KEYS.get(group)
    if got is None:  # per group object (a rebuilt group is a new one): its store, name and this rank are fixed
        store = _store()
        got = _ARRIVAL_KEYS[group] = (store, None if store is None else
                                      f"moe_comm/arrival/{_group_key(group)}/{dist.get_rank()}")
    store, key = got
    if store is not None:
        _ARRIVALS.put(store, key, where)


_ARRIVAL_KEYS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


ARRIVALS_READ_S = 2.0  # the most a timed-out rank waits to read its peers' records (the store may be unreachable)


def arrivals(group: Optional[dist.ProcessGroup]) -> Optional[Dict[int, str]]:
    """EP rank -> the last place that rank recorded (ranks that recorded nothing are left out). Read by a daemon
    thread for at most ARRIVALS_READ_S: a store behind a dead link blocks for its own timeout (minutes); None
    when it could not be read by then."""
    store = _store()
    out: Dict[int, str] = {}
    if store is None or group is None:
        return out
    ranks = dist.get_process_group_ranks(group)
    name = _group_key(group)

    def read() -> None:
        for r, g in enumerate(ranks):
            key = f"moe_comm/arrival/{name}/{g}"
            try:
                if store.check([key]):
                    out[r] = store.get(key).decode()
            except Exception:  # noqa: BLE001 - the store itself may be gone with a dead rank 0
                break

    reader = threading.Thread(target=read, name="moe_comm-arrivals-read", daemon=True)
    reader.start()
    reader.join(ARRIVALS_READ_S)
    return None if reader.is_alive() else dict(out)


class issuing:
    """``with issuing(group, what, rank, where):`` around issuing a collective, which can fail at once (a peer's
    socket closed): CollectiveError, and poison the group. where: this rank's position (``record_arrival`` text):
    the peers recorded elsewhere are named. A class, not a @contextmanager generator: entered for every
    transfer, at a quarter of the cost."""

    __slots__ = ("group", "what", "rank", "where")

    def __init__(self, group: Optional[dist.ProcessGroup], what: str, rank: int = 0, where: Optional[str] = None):
        self.group, self.what, self.rank, self.where = group, what, rank, where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> bool:
        if kind is None or not issubclass(kind, RuntimeError) or isinstance(e, CollectiveError):
            return False
        stuck = _peers_elsewhere(self.group, self.rank, self.where)
        poison(self.group, f"issuing the {self.what} on EP rank {self.rank}: {e}")
        raise CollectiveError(f"moe_comm: EP rank {self.rank}: issuing the {self.what} failed; a peer rank may have "
                              f"died.{stuck} {REBUILD}. Cause: {e}") from e


def _peers_elsewhere(group: Optional[dist.ProcessGroup], rank: int, where: Optional[str]) -> str:
    """The sentence naming the peers not at this exchange, from the group's arrival records ('' when all are here
    or ``where`` is None; a sentence saying so when the store does not answer)."""
    if where is None:
        return ""
    seen = arrivals(group)
    if seen is None:
        return (f" The group's store did not answer within {ARRIVALS_READ_S:g} s (the link to it, or the rank "
                "holding it, is down): where the peers are is unknown.")
    # this rank's latest record (transfers of later chunks may be issued), as put: its store entry may not be
    # written yet (a peer that died fails this rank's transfer at once, within the writer's delay)
    got = _ARRIVAL_KEYS.get(group) if group is not None else None
    here = seen[rank] = (got is not None and _ARRIVALS.latest.get(got[1])) or seen.get(rank, where)
    behind = {r: w for r, w in seen.items() if w != here}
    missing = [r for r in range(group_size(group)) if r not in seen]
    if not (behind or missing):
        return ""
    return " Peers not at this exchange: " + "; ".join(
        [f"EP rank {r} last at {w}" for r, w in sorted(behind.items())]
        + [f"EP rank {r} never arrived" for r in missing]) + "."


def wait_work(work, phase: str, chunk: int = -1, *, timeout: Optional[float] = None, rank: int = 0,
              direction: str = "fwd", what: str = "all-to-all", group: Optional[dist.ProcessGroup] = None,
              where: Optional[str] = None) -> None:
    """``work.wait()`` that turns a failure or timeout into a CollectiveError naming where it happened,
    and poisons ``group`` (a pending collective would pair with the next one).

    timeout: seconds (None: the process group's own timeout). what: the kind of transfer, for the message.
    where: this rank's position (``record_arrival`` text): peers recorded elsewhere are named as stuck.
    """
    if work is None:
        return
    try:
        if timeout is None or group_device(group).type != "cpu":
            # NCCL: wait() only makes the current stream wait; wait(timeout) would block the host until the
            # collective finished. The process group's own timeout (its watchdog) bounds it there instead.
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        at = phase if chunk < 0 else f"{phase} of chunk {chunk}"
        stuck = _peers_elsewhere(group, rank, where)
        # where peers are elsewhere or never arrived, the likely cause is a call some ranks did not make
        hint = (" Every rank of the group must make the same calls: an MoE layer that dispatches through moe_comm "
                "(MoELayer, a torchtitan or Megatron-Core MoE after apply_moe_comm / use_moe_comm) is collective, so "
                "every rank of its EP group must call it (forward, and backward when training), also in eval mode "
                "and under torch.no_grad(); a layer called on some ranks only waits here, as do its peers when one "
                "rank raised before the layer's call (in the framework's own code, e.g. its router)."
                if "Peers not at" in stuck else "")
        poison(group, f"the {at} {what} ({direction}) on EP rank {rank}: {e}")
        raise CollectiveError(f"moe_comm: EP rank {rank}: the {at} {what} ({direction}) failed or timed out; a "
                              f"peer rank may have died or stalled.{stuck}{hint} {REBUILD}. Cause: {e}") from e


def _launched_processes() -> int:
    """WORLD_SIZE a launcher (torchrun, SLURM scripts, mpirun wrappers) set for this process, else 1."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 1
    try:
        return int(os.environ["WORLD_SIZE"])
    except ValueError:
        return 1


def resolve_group(ep_group, *, dim: str = "ep", name: str = "ep_group",
                  allow_single_process: bool = True) -> Optional[dist.ProcessGroup]:
    """The process group to run on, from what a user passed.

    Args:
        ep_group: a ProcessGroup; a 1-D ``DeviceMesh`` (its group); a 2-D DeviceMesh with named dims (the
            group of its dim ``dim``, e.g. ``init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "ep"))``);
            or None: the WORLD group when torch.distributed is initialised, else None (one process, W = 1).
        dim: the mesh dim to take from a 2-D mesh ("ep", or "dp" for the data-parallel group).
        name: the argument's name, for error messages.
        allow_single_process: with None and no initialised process group, whether a process that a
            launcher started as one of several (RANK and WORLD_SIZE > 1 in the environment, as torchrun
            sets them) may run alone. False raises ValueError: such a process would silently train its
            own copy of the model.
    Returns the ProcessGroup, or None for one process. Raises ValueError naming ``name``.
    """
    if ep_group is None:
        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        launched = _launched_processes()
        if launched > 1 and not allow_single_process:
            raise ValueError(f"{name} is None and torch.distributed is not initialised, but this process was "
                             f"launched as rank {os.environ['RANK']} of WORLD_SIZE={launched} (RANK/WORLD_SIZE "
                             f"are set, as torchrun does): call torch.distributed.init_process_group(...) before "
                             f"building the layer, or pass allow_single_process=True to run this process alone")
        return None
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{name} was given but torch.distributed is not initialised")
    if isinstance(ep_group, dist.ProcessGroup):
        return ep_group
    from torch.distributed.device_mesh import DeviceMesh  # torch.distributed is initialised: importable
    if isinstance(ep_group, DeviceMesh):
        if ep_group.ndim == 1:
            return ep_group.get_group()
        names = tuple(ep_group.mesh_dim_names or ())
        if dim not in names:
            raise ValueError(f"{name}: a {ep_group.ndim}-D DeviceMesh must name its dims, one of them {dim!r} "
                             f"(e.g. mesh_dim_names=('dp', 'ep')), got mesh_dim_names={ep_group.mesh_dim_names}")
        return ep_group[dim].get_group()
    raise TypeError(f"{name} must be a torch.distributed ProcessGroup, a DeviceMesh or None, "
                    f"got {type(ep_group).__name__}")


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    if group is None:
        return 1
    # the ProcessGroup's own method: one C call (dist.get_world_size: several Python calls; asked several times per
    # call); anything else (NON_GROUP_MEMBER) as torch.distributed answers it
    return group.size() if isinstance(group, dist.ProcessGroup) else dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    if group is None:
        return 0
    return group.rank() if isinstance(group, dist.ProcessGroup) else dist.get_rank(group)


def _as_bytes(x_RH: torch.Tensor) -> torch.Tensor:
    """[R, row bytes] uint8 view of the rows (contiguous first)."""
    x_RH = x_RH.contiguous()
    if x_RH.dim() == 2:  # the common case: the dtype view alone gives [R, H * element size]
        return x_RH.view(torch.uint8)
    return x_RH.view(torch.uint8).reshape(x_RH.shape[0], x_RH.shape[1:].numel() * x_RH.element_size())


def _a2a_raw(x_RH: torch.Tensor, out_splits: List[int], in_splits: List[int], group,
             out_RH: Optional[torch.Tensor] = None) -> torch.Tensor:
    if out_RH is None:
        out_RH = x_RH.new_empty((sum(out_splits),) + tuple(x_RH.shape[1:]))
    if x_RH.shape[1:].numel() == 0:
        return out_RH  # zero-width rows: nothing to move, every rank skips alike (H is shared)
    dist.all_to_all_single(_as_bytes(out_RH), _as_bytes(x_RH), out_splits, in_splits, group=group)
    return out_RH


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RH, out_splits, in_splits, group, out_RH):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _a2a_raw(x_RH, out_splits, in_splits, group, out_RH)

    @staticmethod
    def backward(ctx, grad_RH):
        out_splits, in_splits = ctx.splits
        # The gradient flows back along the reverse route: swap the split lists.
        return _a2a_raw(grad_RH, in_splits, out_splits, ctx.group), None, None, None, None


def all_to_all_v(x_RH: torch.Tensor, out_splits: List[int], in_splits: List[int],
                 group: Optional[dist.ProcessGroup], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Differentiable all-to-all with uneven splits.

    Args:
        x_RH: [sum(in_splits), ...] rows; the first in_splits[0] go to rank 0, and so on.
        out_splits: rows received from each rank (host ints, length W).
        in_splits: rows sent to each rank (host ints, length W).
        group: process group; None means W = 1 (the input is returned as is).
        out: optional contiguous [sum(out_splits), ...] buffer to receive into (a workspace).
    Returns: [sum(out_splits), ...] rows ordered by source rank.
    """
    if group is None or group_size(group) == 1:
        return x_RH
    return _AllToAllV.apply(x_RH, list(out_splits), list(in_splits), group, out)


def exchange_counts_async(send_WX: torch.Tensor, group: Optional[dist.ProcessGroup]):
    """Issue the counts exchange: row w of ``send_WX`` goes to rank w. Returns (recv_WX, Work):
    row w of recv_WX comes from rank w once the Work completed (Work None with one rank)."""
    if group is None or group_size(group) == 1:
        return send_WX, None
    recv_WX = torch.empty_like(send_WX)
    return recv_WX, dist.all_to_all_single(recv_WX, send_WX.contiguous(), group=group, async_op=True)


def exchange_counts(send_WX: torch.Tensor, group: Optional[dist.ProcessGroup], *,
                    timeout: Optional[float] = None) -> torch.Tensor:
    """Row w of ``send_WX`` goes to rank w; returns [W, X] with row w received from rank w.

    One ``all_to_all_single`` of int64 counts; no host sync here (the caller reads the result once).
    """
    recv_WX, work = exchange_counts_async(send_WX, group)
    wait_work(work, "counts exchange", timeout=timeout, rank=group_rank(group))
    return recv_WX


def issue_segments(out_RH: torch.Tensor, x_NH: torch.Tensor, sends: List[Tuple[int, int, int, int]],
                   recvs: List[Tuple[int, int, int, int]], group: Optional[dist.ProcessGroup]) -> list:
    """Start moving row segments between ranks with point-to-point sends, straight into their final rows.

    sends / recvs: (peer rank in group, tag, first row, rows) of ``x_NH`` / ``out_RH``. Between two
    ranks, the k-th send with a tag meets the k-th receive with that tag, so both sides list a
    pair's segments in the same order; empty segments are skipped on both sides alike. Segments a
    rank sends to itself are copied now, the i-th self send into the i-th self receive. Returns the
    Works to wait for (one ``batch_isend_irecv``). Both tensors contiguous, same row width and dtype.
    """
    me = group_rank(group)
    if x_NH.shape[1:].numel() == 0:
        return []  # zero-width rows: nothing to move (H is shared, every rank skips alike)
    xb, ob = _as_bytes(x_NH), _as_bytes(out_RH)
    world = group is None or group is dist.group.WORLD

    def peer_of(r: int) -> int:
        return r if world else dist.get_global_rank(group, r)

    ops = [dist.P2POp(dist.irecv, ob[s:s + n], peer_of(p), group, tag) for p, tag, s, n in recvs if p != me and n]
    ops += [dist.P2POp(dist.isend, xb[s:s + n], peer_of(p), group, tag) for p, tag, s, n in sends if p != me and n]
    works = dist.batch_isend_irecv(ops) if ops else []
    own_sends = [(s, n) for p, _, s, n in sends if p == me and n]
    own_recvs = [(s, n) for p, _, s, n in recvs if p == me and n]
    for (s, n), (r, m) in zip(own_sends, own_recvs, strict=True):  # while the peers' rows travel
        ob[r:r + m].copy_(xb[s:s + n])
    return works


def group_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where this group's collectives take their tensors: the current CUDA device for NCCL, else CPU."""
    if group is not None and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_to_all_v_async(out_RH: torch.Tensor, x_RH: torch.Tensor, out_splits: List[int], in_splits: List[int],
                       group: Optional[dist.ProcessGroup]):
    """Issue an all-to-all into ``out_RH`` without waiting; returns the Work (None when W = 1 or when
    there is nothing to move: then ``out_RH`` is already filled). ``out_RH`` and ``x_RH`` must be
    contiguous (row slices of a contiguous buffer are)."""
    if group is None or group_size(group) == 1:
        if out_RH.data_ptr() != x_RH.data_ptr() or out_RH.numel() != x_RH.numel():
            out_RH.copy_(x_RH)
        return None
    if x_RH.shape[1:].numel() == 0:
        return None
    return dist.all_to_all_single(_as_bytes(out_RH), _as_bytes(x_RH), out_splits, in_splits, group=group,
                                  async_op=True)
