"""The timelines of a whole model: each named by its layer's module path, all gathered in one exchange.

    tls = model_timelines(model, enabled=True)    # {"layers.0.moe": Timeline, "layers.1.moe": Timeline}
    ...one warm-up step...; for tl in tls.values(): tl.reset()
    ...the steps to measure...
    print(format_report(overlap_report(gather_spans(tls))))   # rows named layers.0.moe, layers.1.moe

Any module with a ``timeline`` attribute holding a ``Timeline`` (``MoELayer``) counts as a layer.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Union

import torch.distributed as dist

from moe_comm.profiling.timeline import Span, Timeline

__all__ = ["model_timelines", "gather_spans"]


def model_timelines(model, *, enabled: Optional[bool] = None) -> Dict[str, Timeline]:
    """Every layer's Timeline in ``model`` (a ``torch.nn.Module``), keyed by the layer's module path.

    Each timeline is named after that path (``Timeline.name``, stamped on its spans) and numbered by its
    place in ``model.named_modules()`` (``Timeline.layer`` = 0, 1, ...), so ``overlap_report`` keeps the
    layers apart and ``format_report`` prints their paths.
    Args:
        model: the module to walk; a model that is itself a layer gives {"": its timeline} (named "").
        enabled: set every timeline's ``enabled`` (None: leave them as they are).
    Raises ValueError when two layers share one Timeline (their spans could not be told apart) or the
    model holds no layer with a timeline.
    """
    if not hasattr(model, "named_modules"):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found: Dict[str, Timeline] = {}
    owner: Dict[int, str] = {}
    for path, module in model.named_modules():
        tl = getattr(module, "timeline", None)
        if not isinstance(tl, Timeline):
            continue
        if id(tl) in owner:
            raise ValueError(f"model_timelines: {owner[id(tl)]!r} and {path!r} share one Timeline; give each layer "
                             f"its own (the default) so their spans can be told apart")
        owner[id(tl)] = path
        found[path] = tl
    if not found:
        raise ValueError(f"model_timelines: {type(model).__name__} holds no module with a Timeline "
                         f"(an MoELayer has one as .timeline)")
    for index, (path, tl) in enumerate(found.items()):
        tl.name, tl.layer = path, index
        if enabled is not None:
            tl.enabled = bool(enabled)
    return found


def gather_spans(timelines: Union[Mapping[str, Timeline], Iterable[Timeline]],
                 group: Optional[dist.ProcessGroup] = None, timeout: float = 10.0) -> List[Span]:
    """Every rank's spans of all ``timelines`` (a ``model_timelines`` dict or any iterable), on every rank,
    sorted by (rank, start), in one ``all_gather_object``. Collective on ``group`` (every rank calls it,
    enabled or not); no process group initialised: this rank's spans. Pending spans are waited for up to
    ``timeout`` seconds per timeline (``Timeline.spans``)."""
    tls = list(timelines.values()) if isinstance(timelines, Mapping) else list(timelines)
    for tl in tls:
        if not isinstance(tl, Timeline):
            raise TypeError(f"timelines must hold Timeline objects, got {type(tl).__name__}")
    local = [s for tl in tls for s in tl.spans(timeout)]
    if dist.is_available() and dist.is_initialized():
        out: List[Optional[List[Span]]] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, local, group=group)
        local = [s for part in out for s in (part or [])]
    return sorted(local, key=lambda s: (s.rank, s.start, s.end))
