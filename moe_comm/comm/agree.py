"""Every rank agrees, or every rank raises naming the ranks.

One helper for every collective decision of the library: the MoELayer config check, the Dispatcher's
construction, ``apply_placement``, and (through ``disagreement``) the per-call header words. A rank
whose own arguments were rejected still joins the exchange with its error, so its peers raise too
instead of waiting in a later collective.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch.distributed as dist

__all__ = ["agree", "disagreement", "RemoteError"]


class RemoteError(ValueError):
    """Raised on the ranks whose own input was fine when another rank rejected its input."""


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


def agree(group: Optional[dist.ProcessGroup], values: Dict[str, Any], *, what: str,
          local_error: Optional[BaseException] = None) -> None:
    """Collective (one ``all_gather_object``): every rank passes its ``values`` (a dict of picklable
    fields) and its own argument error, if any. Returns on every rank when no rank failed and every
    field is equal everywhere; otherwise raises on every rank:

    - the failing rank re-raises its own error, with the list of failing ranks appended;
    - the others raise ``RemoteError`` naming the failing ranks and their messages;
    - a field that differs: ``ValueError`` naming the field and which ranks hold which value.

    With ``group`` None (one process) it only re-raises ``local_error``.
    """
    if group is None or dist.get_world_size(group) == 1:
        if local_error is not None:
            raise local_error
        return
    mine = (values if local_error is None else None,
            None if local_error is None else f"{type(local_error).__name__}: {local_error}")
    every: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    rank = dist.get_rank(group)
    failed = [r for r, (_, err) in enumerate(every) if err is not None]
    if failed:
        if local_error is not None:
            raise type(local_error)(f"{local_error} [{what}: EP rank {rank}; rank(s) {failed} rejected their "
                                    "arguments, every rank raised]") from local_error
        reasons = "; ".join(f"rank {r}: {every[r][1]}" for r in failed)
        raise RemoteError(f"{what}: EP rank(s) {failed} rejected their arguments, every rank raised ({reasons})")
    diffs = [d for d in (disagreement(f"{what}: {name}", [v[name] for v, _ in every], repr) for name in values) if d]
    if diffs:
        raise ValueError("; ".join(diffs))
