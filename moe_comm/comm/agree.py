"""Every rank agrees, or every rank raises naming the ranks.

One helper for every collective decision of the library: the MoELayer config check, the Dispatcher's
construction, ``apply_placement``, the checkpoint and data-parallel checks, and (through
``disagreement``) the per-call header words. A rank whose own arguments were rejected still joins the
exchange with its error, so its peers raise too instead of waiting in a later collective.

Every agreement on a group is numbered (``agreements``: the same count on every rank, failed agreements
included; a group rebuilt after ``destroy_process_group`` starts again at 0). The number and what is
being agreed (``what``: "MoELayer", "Dispatcher", ...) travel with the values, so ranks that build
different things in the same exchange (a MoELayer on one rank, a Dispatcher on another) are named.
"""
from __future__ import annotations

import math
import pickle
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from moe_comm.comm.collectives import (CollectiveError, GroupTable, check_usable, group_device, issuing, poison,
                                       record_arrival, wait_work)

__all__ = ["agree", "agree_ep_dp", "agreements", "disagreement", "RemoteError", "with_context"]

_MAGIC = "moe_comm.agree/1"
_MISSING = "<not given>"  # a field one rank sends and another does not

# group -> agreements made on it by this process (the same number on every rank of the group)
_COUNTS = GroupTable()


class RemoteError(ValueError):
    """Raised on the ranks whose own input was fine when another rank rejected its input."""


def with_context(err: BaseException, text: str) -> BaseException:
    """A new ``type(err)`` whose message is ``text`` (err's own message plus what the group knows), carrying
    err's traceback and notes. Raise it ``from None``: a chained cause would print err's message a second
    time in the traceback."""
    new = type(err)(text).with_traceback(err.__traceback__)
    for note in getattr(err, "__notes__", ()):
        new.add_note(note)
    return new


def agreements(group: Optional[dist.ProcessGroup]) -> int:
    """How many ``agree`` calls this process made on ``group`` (the number the next one carries). Every rank
    of the group counts alike, failed agreements included; a new group object (after a rebuild) starts at 0."""
    return _COUNTS.get(group, 0)


def disagreement(what: str, values_by_rank: Sequence[Any], fmt: Callable[[Any], str] = str) -> Optional[str]:
    """None when every rank holds an equal value (compared with ``==``, so 1 == 1.0), else a message
    '<what> differs across the EP group: A on ranks [0, 2], B on ranks [1]'."""
    groups: List[List] = []  # [value, ranks]
    for r, v in enumerate(values_by_rank):
        for g in groups:
            if _equal(g[0], v):
                g[1].append(r)
                break
        else:
            groups.append([v, [r]])
    if len(groups) <= 1:
        return None
    try:
        groups.sort(key=lambda g: g[0])  # by value where values order (numbers, strings)
    except TypeError:
        pass
    return f"{what} differs across the EP group: " + ", ".join(f"{fmt(v)} on ranks {rs}" for v, rs in groups)


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. tensors of different shapes: unequal
        return False


def _all_gather_bytes(group: dist.ProcessGroup, payload: bytes, *, phase: str, rank: int,
                      timeout: Optional[float]) -> List[bytes]:
    """Every rank's ``payload``, by rank: two async ``all_gather``s (the lengths, then the bytes padded to
    the longest), each waited with ``timeout`` (``wait_work``: CollectiveError naming the ranks that did not
    arrive, and the group poisoned)."""
    device, W = group_device(group), dist.get_world_size(group)
    record_arrival(group, phase)
    n_1 = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(n_1) for _ in range(W)]
    with issuing(group, phase, rank):
        work = dist.all_gather(sizes, n_1, group=group, async_op=True)
    wait_work(work, phase, timeout=timeout, rank=rank, what="all_gather of the payload sizes", group=group,
              where=phase)
    lengths = torch.cat(sizes).tolist()  # host sync: construction-time agreement, sizes the payload exchange
    if min(lengths) < 1 or max(lengths) > 1 << 31:
        poison(group, f"the {phase} on EP rank {rank}: payload sizes {lengths}")
        raise CollectiveError(f"moe_comm: EP rank {rank}: the {phase} received payload sizes {lengths}, not those "
                              f"of a moe_comm agreement (a mis-paired collective)")
    mine = torch.zeros(max(lengths), dtype=torch.uint8, device="cpu")  # explicit: also under torch.device("meta")
    mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    mine = mine.to(device)
    every = [torch.empty_like(mine) for _ in range(W)]
    with issuing(group, phase, rank):
        work = dist.all_gather(every, mine, group=group, async_op=True)
    wait_work(work, phase, timeout=timeout, rank=rank, what="all_gather of the payloads", group=group, where=phase)
    return [bytes(t[:n].cpu().numpy().tobytes()) for t, n in zip(every, lengths)]  # host sync: construction only


def _decode(blob: bytes, r: int, group, phase: str, rank: int):
    try:
        got = pickle.loads(blob)  # noqa: S301 - the peers of this job, as all_gather_object does
        if isinstance(got, tuple) and len(got) == 5 and got[0] == _MAGIC:
            return got[1:]
    except Exception:  # noqa: BLE001 - anything else is not an agreement
        pass
    poison(group, f"the {phase} on EP rank {rank}: rank {r} sent something else")
    raise CollectiveError(f"moe_comm: EP rank {rank}: the {phase}: what rank {r} sent is not a moe_comm agreement "
                          f"(a mis-paired collective)")


def agree(group: Optional[dist.ProcessGroup], values: Dict[str, Any], *, what: str,
          local_error: Optional[BaseException] = None, timeout: Optional[float] = None) -> None:
    """Collective: every rank passes its ``values`` (a dict of picklable fields) and its own argument error,
    if any. Returns on every rank when no rank failed and every field is equal everywhere; otherwise raises
    on every rank:

    - ranks agreeing on different things (``what`` or the agreement number differ: a construction order
      that differs across ranks): ``ValueError`` naming which rank is building what;
    - the failing rank re-raises its own error, with the list of failing ranks appended;
    - the others raise ``RemoteError`` naming the failing ranks and their messages;
    - a field that differs: ``ValueError`` naming the field and which ranks hold which value.

    timeout: seconds to wait for the other ranks (None: the process group's own timeout). A value that is not
    a finite number > 0 counts as None, so that callers pass their own ``timeout=`` argument as given (they
    reject a bad one in their local checks: it travels as their ``local_error``). A rank that does
    not arrive in time (stalled, dead, or raised before reaching its agreement) makes the waiting ranks
    raise ``CollectiveError`` naming it; the group is then poisoned (rebuild it). A poisoned group raises
    ``CollectiveError`` at once. Exchange: two async ``all_gather``s of pickled payloads on the group's
    device (one host sync each; construction time only).
    With ``group`` None or one rank it only re-raises ``local_error``.
    """
    number = agreements(group)
    _COUNTS[group] = number + 1
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        timeout = None
    if group is None or dist.get_world_size(group) == 1:
        if local_error is not None:
            raise local_error
        return
    rank = dist.get_rank(group)
    try:
        check_usable(group, rank)
    except CollectiveError as err:
        if local_error is not None:
            err.add_note(f"{what}: this rank's own arguments were rejected too: {local_error}")
        raise
    error_text = None if local_error is None else f"{type(local_error).__name__}: {local_error}"
    try:
        payload = pickle.dumps((_MAGIC, what, number, values if local_error is None else None, error_text))
    except Exception as err:  # noqa: BLE001 - an unpicklable value: this rank's error, raised on every rank
        local_error = local_error or TypeError(f"{what}: the values to agree on must be picklable: {err}")
        error_text = f"{type(local_error).__name__}: {local_error}"
        payload = pickle.dumps((_MAGIC, what, number, None, error_text))
    phase = f"{what} agreement #{number}"
    every = [_decode(b, r, group, phase, rank)
             for r, b in enumerate(_all_gather_bytes(group, payload, phase=phase, rank=rank, timeout=timeout))]
    failed = [r for r, (_, _, _, err) in enumerate(every) if err is not None]
    reasons = "; ".join(f"rank {r}: {every[r][3]}" for r in failed)
    order = disagreement(f"{what}: what each rank is building (agreement number on this group)",
                         [f"{w} (#{n})" for w, n, _, _ in every])
    if order is not None:
        raise ValueError(f"{order}. Every rank must build its MoELayers and Dispatchers (and run every other "
                         f"collective step: load_state_dict, apply_placement, ...) on a group in the same order"
                         + (f"; also rejected: {reasons}" if failed else "")) from local_error
    if failed:
        if local_error is not None:
            raise with_context(local_error, f"{local_error} [{what}: EP rank {rank}; rank(s) {failed} rejected "
                                            "their arguments, every rank raised]") from None
        raise RemoteError(f"{what}: EP rank(s) {failed} rejected their arguments, every rank raised ({reasons})")
    names = list(values) + [k for _, _, v, _ in every for k in v if k not in values]
    diffs = [d for d in (disagreement(f"{what}: {name}", [v.get(name, _MISSING) for _, _, v, _ in every], repr)
                         for name in dict.fromkeys(names)) if d]
    if diffs:
        raise ValueError("; ".join(diffs))


def agree_ep_dp(ep_group: Optional[dist.ProcessGroup], dp_group: Optional[dist.ProcessGroup], values: Dict[str, Any],
                *, what: str, dp_values: Optional[Dict[str, Any]] = None, local_error: Optional[BaseException] = None,
                timeout: Optional[float] = None) -> None:
    """``agree`` over every rank of an EP x DP grid: over the EP group, then (with data parallelism, DP > 1)
    over the DP group carrying the first one's outcome, so that a failure in one EP group reaches every EP
    group through the DP groups. ``dp_values`` (default ``values``) are compared over the DP group, as
    "<what> (data-parallel replicas)". Raises as ``agree`` on every rank of the grid."""
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        agree(ep_group, values, what=what, local_error=local_error, timeout=timeout)
        return
    outcome = None
    try:
        agree(ep_group, values, what=what, local_error=local_error, timeout=timeout)
    except (TypeError, ValueError, RuntimeError) as err:  # CollectiveError too: the DP peers learn of it
        outcome = err
    agree(dp_group, values if dp_values is None else dp_values, what=f"{what} (data-parallel replicas)",
          local_error=outcome, timeout=timeout)
