"""Reports of a LoadMonitor: its JSON file and its plot (matplotlib, imported only when plotting).

Shapes legend: E experts (global), W EP world size, S window steps.
Both read the monitor through ``LoadMonitor.read_state`` / ``summary`` / ``history`` (the host sync).
The plot names its layer: ``model_monitors(model)`` names every layer's monitor by its module path
(``monitor.name``), or pass ``layer=`` to ``plot_load``.
"""
from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Dict, List, Optional, Union

import torch

if TYPE_CHECKING:
    from moe_comm.monitor.load import LoadMonitor

__all__ = ["write_json", "plot_load", "load_figure", "model_monitors", "json_safe", "BALANCEDNESS"]

BALANCEDNESS = ("balancedness = mean / max tokens per expert, summed over the window "
                "(1: even; 1/E: one expert takes all)")


def model_monitors(model) -> Dict[str, "LoadMonitor"]:
    """Every layer's LoadMonitor in ``model`` (a ``torch.nn.Module``; layers without one are skipped), keyed by
    the layer's module path from ``model.named_modules()``; each is named after it (``monitor.name``), which
    its plot's title shows. Raises ValueError when two layers share one monitor or none has one."""
    from moe_comm.monitor.load import LoadMonitor

    if not hasattr(model, "named_modules"):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found: Dict[str, LoadMonitor] = {}
    for path, module in model.named_modules():
        mon = getattr(module, "monitor", None)
        if not isinstance(mon, LoadMonitor):
            continue
        for other, seen in found.items():
            if seen is mon:
                raise ValueError(f"model_monitors: {other!r} and {path!r} share one LoadMonitor; give each layer its "
                                 f"own (the default) so their loads can be told apart")
        found[path] = mon
    if not found:
        raise ValueError(f"model_monitors: {type(model).__name__} holds no module with a LoadMonitor (an MoELayer "
                         f"has one as .monitor unless built with monitor=False)")
    for path, mon in found.items():
        mon.name = path
    return found


def json_safe(value):
    """``value`` with every non-finite float (NaN, +-Infinity: not JSON) replaced by None, recursively
    through dicts, lists and tuples. Example: {"a": [1.0, nan], "b": inf} -> {"a": [1.0, None], "b": None}."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(monitor: "LoadMonitor", path: Union[str, os.PathLike], history: bool = True) -> str:
    """Host sync. Write ``monitor.summary()`` (plus ``history()`` under "history" when asked) to ``path`` as
    strict JSON: an undefined figure (NaN, Infinity) is written as null."""
    data = monitor.summary()
    if history:
        data["history"] = monitor.history()
    with open(path, "w") as f:
        json.dump(json_safe(data), f, indent=1, allow_nan=False)
    return os.fspath(path)


def _runs(mask_ES: torch.Tensor) -> List[tuple]:
    """(row, start, length) of every run of True along dim 1 of a bool [E, S] mask."""
    out = []
    for g, row in enumerate(mask_ES.tolist()):  # host sync: read side
        start = None
        for i, v in enumerate(row + [False]):
            if v and start is None:
                start = i
            elif not v and start is not None:
                out.append((g, start, i - start))
                start = None
    return out


def plot_load(monitor: "LoadMonitor", path: Union[str, os.PathLike], title: Optional[str] = None,
              dpi: int = 120, *, layer: Optional[str] = None) -> str:
    """Host sync. Save ``load_figure(monitor, title, layer=layer)`` as a PNG (any format matplotlib infers
    from ``path``). Needs matplotlib (``pip install moe_comm[plot]``)."""
    fig = load_figure(monitor, title, layer=layer)
    fig.savefig(path, dpi=dpi)
    return os.fspath(path)


def load_figure(monitor: "LoadMonitor", title: Optional[str] = None, *, layer: Optional[str] = None):
    """Host sync. A matplotlib Figure of ``monitor`` with three panels:

    - heatmap experts x steps of load / mean load of the step (diverging colormap, white = 1 = even,
      red = hotter, blue = colder), rank boundaries as lines, hot periods outlined in black and the
      experts hot now marked with a triangle on the right;
    - rank max/mean per step under it, on the same step axis (the all-to-all straggler factor);
    - tokens per rank (mean per step over the window) as bars, whiskers from the least to the most
      loaded step, the mean as a dashed line (a drifting hot spot can average out over the window
      while every single step has a straggler: the whiskers and the middle panel show it).
    The title names the layer (``layer``, else ``monitor.name`` set by ``model_monitors``; "unnamed layer"
    otherwise) and its balancedness, defined at the foot of the figure (BALANCEDNESS). ``title`` replaces
    the title's first line. Needs matplotlib (``pip install moe_comm[plot]``).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import TwoSlopeNorm
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
        import matplotlib as mpl
    except ImportError as exc:
        raise ImportError("LoadMonitor.plot needs matplotlib: pip install moe_comm[plot] "
                          "(or pip install matplotlib)") from exc
    st = monitor.read_state()
    n = st["counts_SE"].shape[0]
    if n == 0:
        raise RuntimeError("LoadMonitor.plot: nothing observed yet")
    E, W = monitor.num_experts, monitor.num_ranks
    placed = monitor.placement
    e = E // W
    first, last = monitor._read_done - n, monitor._read_done - 1  # the steps read_state() held
    counts_SE = st["counts_SE"].to(torch.float64)
    step_mean_S = counts_SE.mean(1, keepdim=True)
    rel_ES = (counts_SE / step_mean_S.where(step_mean_S > 0, torch.tensor(float("nan")))).T.numpy()
    hot_now = st["hot_E"].nonzero().flatten().tolist()  # host sync: read side
    rank_SW = monitor.rank_load(counts_SE)
    rank_mom_S = (rank_SW.max(1).values / rank_SW.mean(1)).numpy()
    rank_W = (rank_SW.sum(0) / n).numpy()

    fig = Figure(figsize=(12, 9), layout="constrained")
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(3, 2, height_ratios=[3.2, 1.0, 1.6], width_ratios=[40, 1])
    ax_h = fig.add_subplot(gs[0, 0])
    ax_s = fig.add_subplot(gs[1, 0], sharex=ax_h)
    ax_b = fig.add_subplot(gs[2, 0])
    cax = fig.add_subplot(gs[0, 1])

    finite = rel_ES[~(rel_ES != rel_ES)]  # drop NaN (steps with no tokens)
    vmax = max(2.0, monitor.hot_threshold * 1.25, float(finite.max()) if finite.size else 2.0)
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax)
    cmap = mpl.colormaps["RdBu_r"].with_extremes(bad="0.8")  # grey: a step with no tokens
    extent = (first - 0.5, last + 0.5, E - 0.5, -0.5)
    im = ax_h.imshow(rel_ES, aspect="auto", cmap=cmap, norm=norm, extent=extent, interpolation="nearest")
    cb = fig.colorbar(im, cax=cax)
    cb.set_label("load / mean expert load of the step")
    cb.ax.axhline(monitor.hot_threshold, color="k", lw=1.5)
    for g, run_start, run_len in _runs(st["hot_SE"].T):  # outline each hot period of each expert
        ax_h.add_patch(Rectangle((first + run_start - 0.5, g - 0.5), run_len, 1.0, fill=False, ec="k", lw=1.3))
    for r in range(1, W if placed is None else 1):  # a placement scatters experts: no bands
        ax_h.axhline(r * e - 0.5, color="0.3", lw=0.8, ls=":")
    if W > 1 and placed is None:
        sec = ax_h.secondary_yaxis("right")
        sec.set_yticks([r * e + (e - 1) / 2 for r in range(W)], labels=[f"rank {r}" for r in range(W)])
        sec.tick_params(length=0, pad=14)  # room for the hot-now markers
    for g in hot_now:
        ax_h.plot([last + 0.5], [g], marker="<", color="k", ms=8, clip_on=False)
    ax_h.set_ylabel("expert")
    ax_h.set_title(f"Load per expert and step (hot: > {monitor.hot_threshold:g}x mean for "
                   f"{monitor.hot_persistence} steps, outlined; \u25c0 hot now)")
    ax_h.tick_params(labelbottom=False)
    if E <= 32:
        ax_h.set_yticks(range(E))

    ax_s.plot(range(first, last + 1), rank_mom_S, color="C3", lw=1.2, drawstyle="steps-mid")
    ax_s.axhline(1.0, color="0.5", lw=0.8, ls="--")
    ax_s.set_ylabel("rank max/mean")
    ax_s.set_xlabel("step")
    ax_s.set_ylim(bottom=min(0.95, float(rank_mom_S.min()) if rank_mom_S.size else 0.95))
    ax_s.set_title("Straggler factor per step: max / mean tokens per rank", fontsize="medium")

    mean_rank = float(rank_W.mean())
    rel_W = rank_W / mean_rank if mean_rank > 0 else rank_W * 0 + 1
    lo_W, hi_W = rank_SW.min(0).values.numpy(), rank_SW.max(0).values.numpy()
    bars = ax_b.bar(range(W), rank_W, color=[cmap(norm(v)) for v in rel_W], edgecolor="0.2",
                    yerr=[rank_W - lo_W, hi_W - rank_W], ecolor="0.35", capsize=4)
    ax_b.bar_label(bars, labels=[f"{v:.2f}x" for v in rel_W], label_type="center", fontsize="small")
    ax_b.axhline(mean_rank, color="k", ls="--", lw=1.2)
    ax_b.set_xticks(range(W), labels=[str(r) for r in range(W)])
    ax_b.set_xlabel("EP rank")
    ax_b.set_ylabel("tokens per step")
    ax_b.set_ylim(top=float(hi_W.max()) * 1.08 if hi_W.max() > 0 else 1.0)
    mom = float(rank_W.max()) / mean_rank if mean_rank > 0 else float("nan")
    ax_b.set_title(f"Tokens per rank, mean over steps {first}-{last} (max/mean {mom:.2f}); "
                   f"whiskers: min-max of a step; dashed: mean {mean_rank:.1f}", fontsize="medium")

    load_E = counts_SE.sum(0)
    bal = float(load_E.mean() / load_E.max()) if load_E.max() > 0 else float("nan")
    hot_txt = ", ".join(f"{g} (r{monitor.rank_of(g)})" for g in hot_now[:8]) + (" ..." if len(hot_now) > 8 else "")
    placed_txt = "" if placed is None else \
        f" (placed: {len(placed)} slots, rank views use this placement for every step)"
    name = layer if layer is not None else getattr(monitor, "name", "")
    if title is None:
        title = f"Layer {name}" if name else "Unnamed layer (name it: model_monitors(model))"
    fig.suptitle(f"{title}\n{E} experts on {W} ranks{placed_txt}, steps {first}-{last} | balancedness {bal:.2f} | "
                 f"hot now: {hot_txt or 'none'}", fontsize="large")
    fig.supxlabel(BALANCEDNESS, fontsize="medium")
    return fig
