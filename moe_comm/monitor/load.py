"""LoadMonitor: tokens per expert and per rank over steps, balance metrics, hot experts (its JSON file and
plot are written by ``moe_comm.monitor.report``).

Shapes legend: E experts (global), W EP world size (rank r owns experts r*E/W .. (r+1)*E/W - 1),
T tokens, S window slots (the last ``window`` observed steps, a ring buffer).

``observe`` runs inside the forward on the device and never synchronises with the host: it only adds
into device tensors (the ring of counts, running totals, an EMA, the router entropy and the hot-expert
state machine). With ``group=...`` it sums the counts over the EP group with one asynchronous
all_reduce (and with ``dp_group=...`` then over the data-parallel replicas with one more: the global
batch), whose result is folded in at the next ``observe`` or read. Reading (``summary``,
``hot_experts``, ``poll``, ``to_json``, ``plot``) copies the state to the host: that is the sync, and
it is also when the ``on_hot_change`` callback and the log record fire (for every change since the last
read, in step order, with the step each happened at; at most ``window`` steps back).

Metrics (over the window, the EMA, or the last step):
    balancedness        mean / max expert load (the figure vLLM logs); 1 = perfectly even
    expert_max_over_mean, rank_max_over_mean   max / mean load per expert and per rank
    cv                  coefficient of variation of the expert loads (population std / mean)
    router_entropy      entropy (nats) of the mean router probability, when scores are given
    drop_fraction       dropped / (routed + dropped) slots

Placement: ``set_placement(plan)`` (called by ``MoELayer.apply_placement``) keeps counting LOGICAL experts
and makes the per-rank views split a replicated expert's load evenly over the ranks of its replicas.

Hot experts: an expert becomes hot after ``hot_persistence`` consecutive steps with load >
``hot_threshold`` x the mean expert load of the step, and stops being hot after ``hot_persistence``
consecutive steps at or below it (hysteresis: no flicker around the threshold).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from moe_comm._checks import check_float, check_int, check_int_list
from moe_comm.comm.collectives import wait_work

__all__ = ["load_payload", "LoadMonitor", "HotExpert", "GlobalCounts", "reduce_counts"]

_LOGGER = logging.getLogger(__name__)

HotChangeCallback = Callable[[List[int], List[int], int], None]


@dataclass(frozen=True)
class HotExpert:
    """A hot expert: global id, the EP rank that owns it, its EMA load / EMA mean load, and the step
    at which it last became hot."""

    expert: int
    rank: int
    load_over_mean: float
    since_step: int


class GlobalCounts:
    """Tokens per expert summed over the EP group, possibly still in flight (an async all_reduce).

    ``wait()`` -> [E] float64 device tensor of global counts (integers, exact below 2**53). It orders the
    current stream after the collective (NCCL: no host block; gloo: the CPU waits for its worker thread)
    and may be called any number of times. A collective that fails, or does not finish within
    ``timeout`` seconds (None: the process group's timeout), raises ``moe_comm.comm.CollectiveError``
    naming ``phase`` and this rank. Returned by ``LoadMonitor.observe`` and ``reduce_counts``.
    """

    def __init__(self, counts_E: torch.Tensor, work=None, *, phase: str = "expert load",
                 timeout: Optional[float] = None, rank: int = 0):
        self._counts_E, self._work = counts_E, work
        self.phase, self.timeout, self.rank = phase, timeout, rank

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            work, self._work = self._work, None  # a failed wait raises once; the group is broken after it
            wait_work(work, self.phase, timeout=self.timeout, rank=self.rank, what="all_reduce")
        return self._counts_E


def load_payload(counts_E: torch.Tensor, dropped: torch.Tensor, scores_TE: Optional[torch.Tensor]) -> torch.Tensor:
    """[2E + 2] float64 on counts_E's device: counts [E], dropped slots, probability sums [E] (router scores
    normalised per token; zeros without scores), token count. What a group sums for the monitor (exact for
    counts below 2**53). Device ops only."""
    device, E = counts_E.device, counts_E.shape[0]
    if scores_TE is not None:
        p_TE = scores_TE.detach().to(device=device, dtype=torch.float64)
        p_TE = p_TE / p_TE.sum(-1, keepdim=True).clamp_min(1e-300)  # sigmoid scores: per-token distribution
        probsum_E, ntok = p_TE.sum(0), float(scores_TE.shape[0])
    else:
        probsum_E, ntok = torch.zeros(E, dtype=torch.float64, device=device), 0.0
    return torch.cat([counts_E.detach().to(torch.float64), dropped.detach().to(device, torch.float64).reshape(1),
                      probsum_E, torch.full((1,), ntok, dtype=torch.float64, device=device)])


def _size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce_over(buf_X: torch.Tensor, group: Optional[dist.ProcessGroup], dp_group: Optional[dist.ProcessGroup],
                     *, timeout: Optional[float], phase: str, rank: int):
    """Start summing ``buf_X`` in place over EP x DP: one async all_reduce over ``group`` (EP), then, with
    a ``dp_group`` of more than one rank, one more over it (the replicas of this EP rank). The second
    needs the first's result: its Work is waited first (NCCL: the stream waits, no host block; gloo: the
    CPU waits for the small first reduction). Returns the Work to wait for last (None: nothing issued)."""
    work = None
    if _size(group) > 1:
        work = dist.all_reduce(buf_X, group=group, async_op=True)
    if _size(dp_group) > 1:
        wait_work(work, phase, timeout=timeout, rank=rank, what="all_reduce (EP)", group=group)
        work = dist.all_reduce(buf_X, group=dp_group, async_op=True)
    return work


def reduce_counts(counts_E: torch.Tensor, group: Optional[dist.ProcessGroup] = None, *,
                  dp_group: Optional[dist.ProcessGroup] = None, timeout: Optional[float] = None,
                  phase: str = "expert load") -> GlobalCounts:
    """Start summing [E] integer counts over ``group`` (EP) and ``dp_group`` (the data-parallel replicas:
    the global batch), one async all_reduce per group of more than one rank; no host sync. None or 1-rank
    groups: the counts themselves. ``timeout`` / ``phase``: for ``GlobalCounts.wait`` (seconds; the name a
    CollectiveError gives)."""
    buf_E = counts_E.detach().to(torch.float64)
    if _size(group) == 1 and _size(dp_group) == 1:
        return GlobalCounts(buf_E)
    buf_E = buf_E.clone() if buf_E is counts_E else buf_E
    rank = dist.get_rank(group) if _size(group) > 1 else 0
    work = _all_reduce_over(buf_E, group, dp_group, timeout=timeout, phase=phase, rank=rank)
    return GlobalCounts(buf_E, work, phase=phase, timeout=timeout, rank=rank)


# The device state (``_alloc``) is allocated whole at the first observe. Bound it so that a huge window
# fails here, naming the bytes, instead of in the middle of a training step.
_MAX_STATE_BYTES = 1 << 30


def _state_bytes(num_experts: int):
    """(bytes per window step, bytes independent of the window) of a monitor's device state:
    per step counts int64 [E] + hot bool [E] + dropped int64 + entropy float64; fixed: 7 [E] vectors."""
    return 9 * num_experts + 16, 8 * 7 * num_experts + 8


def _finite_or_none(x: float) -> Optional[float]:
    return float(x) if math.isfinite(x) else None


class LoadMonitor:
    """Per-step expert load statistics, accumulated on the device without host syncs.

    Args:
        num_experts: E, global experts.
        num_ranks: W, EP ranks the experts are spread over (rank r owns experts r*E/W ..); E % W == 0.
        window: S, steps kept for the windowed view, the heatmap and the hot-change replay.
        ema_decay: d in ema = d * ema + (1 - d) * load (the first step initialises the EMA).
        hot_threshold: load / mean above which a step counts as hot (> 1).
        hot_persistence: consecutive steps needed to become hot, and to stop being hot.
        on_hot_change: ``fn(added, removed, step)``, sorted expert ids, called on the host when the
            set of hot experts changes (delivered at the next read or ``poll``).
        logger: receives one INFO record per hot-set change.
        sync_every: None (default) = observe never syncs. An int n makes every n-th observe call
            ``poll()`` (a host sync) so that callbacks fire without an explicit read.

    Example:
        mon = LoadMonitor(64, num_ranks=8)
        mon.observe(counts_E)                 # in the forward: device tensors, no sync
        mon.summary()["window"]["balancedness"], mon.hot_experts()   # host sync here
    """

    def __init__(self, num_experts: int, num_ranks: int = 1, window: int = 100, ema_decay: float = 0.9,
                 hot_threshold: float = 2.0, hot_persistence: int = 5,
                 on_hot_change: Optional[HotChangeCallback] = None,
                 logger: logging.Logger = _LOGGER, *, sync_every: Optional[int] = None):
        self.num_experts = check_int("LoadMonitor: num_experts", num_experts, 1)
        self.num_ranks = check_int("LoadMonitor: num_ranks", num_ranks, 1)
        if num_experts % num_ranks:
            raise ValueError(f"LoadMonitor: num_experts ({num_experts}) must be divisible by num_ranks, "
                             f"got {num_ranks}")
        self.window = check_int("LoadMonitor: window", window, 1)
        per_step, fixed = _state_bytes(num_experts)
        if per_step * window + fixed > _MAX_STATE_BYTES:
            raise ValueError(f"LoadMonitor: window={window} would need {per_step * window + fixed:,} bytes of "
                             f"device state for {num_experts} experts ({per_step} bytes per step); the limit is "
                             f"{_MAX_STATE_BYTES:,} bytes, i.e. window <= {(_MAX_STATE_BYTES - fixed) // per_step:,}")
        self.ema_decay = check_float("LoadMonitor: ema_decay", ema_decay, 0.0, high=1.0)
        if self.ema_decay == 1.0:
            raise ValueError("LoadMonitor: ema_decay must be in [0, 1) (1 would never move the EMA), got 1.0")
        self.hot_threshold = check_float("LoadMonitor: hot_threshold (x the mean load)", hot_threshold, 1.0,
                                         low_open=True)
        self.hot_persistence = check_int("LoadMonitor: hot_persistence", hot_persistence, 1)
        if on_hot_change is not None and not callable(on_hot_change):
            raise TypeError(f"LoadMonitor: on_hot_change must be callable, got {type(on_hot_change).__name__}")
        self.on_hot_change = on_hot_change
        self.logger = logger
        if sync_every is not None:
            check_int("LoadMonitor: sync_every", sync_every, 1)
        self.sync_every = sync_every
        self._rank_share_WE: Optional[torch.Tensor] = None  # set_placement: share of expert g's load on rank r
        self._ranks_of: Optional[List[List[int]]] = None
        self._phys_to_logical: Optional[List[int]] = None
        self.reset()

    def set_placement(self, placement=None) -> None:
        """Make the per-rank views follow a placement of the experts (``MoELayer.apply_placement`` calls it).

        Args:
            placement: a ``moe_comm.placement.Placement`` (or its ``phys_to_logical``: [P] logical expert
                of each physical slot, slot p on rank p // (P / W)); None restores the default (expert g on
                rank g // (E / W)).
        Counts stay per LOGICAL expert. Per-rank figures (tokens_per_rank, rank max/mean, the plot's bars,
        a hot expert's ``rank``) then split a replicated expert's load evenly over its replicas (what the
        layer's round-robin split does, to within a row) and apply to every step in the window, also
        steps observed before the placement changed: "what the ranks carry under this placement".
        A hot expert's ``rank`` is the rank of its first replica.
        """
        if placement is None:
            self._rank_share_WE = self._ranks_of = self._phys_to_logical = None
            return
        p2l = check_int_list("LoadMonitor.set_placement: phys_to_logical",
                             getattr(placement, "phys_to_logical", placement), 0)
        E, W = self.num_experts, self.num_ranks
        if len(p2l) % W or sorted(set(p2l)) != list(range(E)):
            raise ValueError(f"LoadMonitor.set_placement: phys_to_logical must have a multiple of num_ranks={W} "
                             f"entries covering every expert 0..{E - 1}, got {p2l}")
        S = len(p2l) // W
        count = [p2l.count(g) for g in range(E)]
        share = torch.zeros(W, E, dtype=torch.float64)
        ranks_of: List[List[int]] = [[] for _ in range(E)]
        for p, g in enumerate(p2l):
            share[p // S, g] += 1.0 / count[g]
            ranks_of[g].append(p // S)
        self._rank_share_WE, self._ranks_of, self._phys_to_logical = share, ranks_of, p2l

    @property
    def placement(self) -> Optional[List[int]]:
        """phys_to_logical of the placement the per-rank views follow (None: expert g on rank g // (E / W))."""
        return None if self._phys_to_logical is None else list(self._phys_to_logical)

    def rank_load(self, load_XE: torch.Tensor) -> torch.Tensor:
        """[..., E] host loads -> [..., W] per-rank loads under the current placement."""
        if self._rank_share_WE is None:
            return load_XE.reshape(load_XE.shape[:-1] + (self.num_ranks, -1)).sum(-1)
        return load_XE.to(torch.float64) @ self._rank_share_WE.T

    # ------------------------------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget everything observed (buffers are re-created on the next observe's device)."""
        self._device: Optional[torch.device] = None
        # steps folded into the device state: counted on the device (``_done_dev``), so a step changes nothing on
        # the host (a CUDA graph can capture it); read with ``_folded_steps``
        self._pending: List[tuple] = []  # (GlobalCounts, buf_X) of an all_reduce not folded in yet
        self._polled = 0               # steps whose hot changes were delivered
        self._known_hot: List[int] = []
        self._recorded = 0             # steps recorded, counted only with sync_every (it reads every N)
        self._read_done = 0            # steps in the state the last read copied (``_host``)

    @property
    def steps(self) -> int:
        """Host sync. Steps observed so far (including one whose group reduction is still in flight)."""
        return self._folded_steps() + len(self._pending)

    def _folded_steps(self) -> int:
        return 0 if self._device is None else int(self._done_dev.item())  # host sync: read side

    def _alloc(self, device: torch.device) -> None:
        E, S = self.num_experts, self.window
        i64 = dict(dtype=torch.int64, device=device)
        f64 = dict(dtype=torch.float64, device=device)
        self._device = device
        self._counts_SE = torch.zeros(S, E, **i64)
        self._dropped_S = torch.zeros(S, **i64)
        self._entropy_S = torch.full((S,), float("nan"), **f64)
        self._hot_SE = torch.zeros(S, E, dtype=torch.bool, device=device)
        self._total_E = torch.zeros(E, **i64)
        self._total_dropped = torch.zeros((), **i64)
        self._ema_E = torch.zeros(E, **f64)
        self._hot_streak_E = torch.zeros(E, **i64)
        self._cool_streak_E = torch.zeros(E, **i64)
        self._hot_E = torch.zeros(E, dtype=torch.bool, device=device)
        self._hot_since_E = torch.zeros(E, **i64)
        self._done_dev = torch.zeros((), **i64)

    # ---------------------------------------------------------------------------------------- observe
    @torch.no_grad()
    def observe(self, tokens_per_expert_E: torch.Tensor, dropped: Union[torch.Tensor, int] = 0,
                scores_TE: Optional[torch.Tensor] = None, *,
                group: Optional[dist.ProcessGroup] = None, dp_group: Optional[dist.ProcessGroup] = None,
                timeout: Optional[float] = None) -> GlobalCounts:
        """Record one step. No host sync (unless ``sync_every`` asks for one).

        Args:
            tokens_per_expert_E: [E] integer tensor, routed slots per global expert on this rank (or
                already summed over the EP group). ``workloads.count_tokens`` computes it sync-free.
            dropped: [] integer tensor or int, slots dropped by capacity (topk_idx == -1).
            scores_TE: optional [T, E] router probabilities (softmax or sigmoid; normalised per token
                here) for the router entropy; detached.
            group: EP process group. Given (and of size > 1), the counts, dropped slots and score sums
                are summed over it with ONE asynchronous all_reduce: a collective, so every rank of
                the group must call observe with a group, in the same order. num_ranks must equal the
                group size.
            dp_group: the data-parallel group of this EP rank (the ranks holding the same experts, each
                with its own tokens). Given (size > 1), the sums are then also summed over it (one more
                small all_reduce, after the EP one): the monitor sees the GLOBAL batch, identical on
                every rank of EP x DP. Collective over it too.
            timeout: seconds to wait for that all_reduce (at the next observe, a read, or the returned
                handle's ``wait``) before raising ``moe_comm.comm.CollectiveError`` naming the "load
                monitor" phase; None: the process group's timeout.
        Returns: GlobalCounts of this step (the group-summed counts once ``wait()`` ed), so a caller
            that also needs the global load (aux-loss-free balancing) reuses this step's collective.
        """
        W = _size(group)
        if W > 1 and W != self.num_ranks:
            raise ValueError(f"group has {W} ranks but the monitor was built with num_ranks={self.num_ranks}")
        buf_X = self.payload(tokens_per_expert_E, dropped, scores_TE)
        if W > 1 or _size(dp_group) > 1:
            rank = dist.get_rank(group) if W > 1 else 0
            return self.record(buf_X, group, dp_group, timeout=timeout, rank=rank)
        return self.record(buf_X)

    def payload(self, tokens_per_expert_E: torch.Tensor, dropped: Union[torch.Tensor, int] = 0,
                scores_TE: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One step's statistics of this rank as the [2E + 2] float64 buffer a group sums: counts [E], dropped
        slots, probability sums [E], token count (float64 is exact for counts below 2**53). Arguments as in
        ``observe``. No collective, no host sync."""
        if not isinstance(tokens_per_expert_E, torch.Tensor):
            raise TypeError(f"tokens_per_expert_E must be a torch.Tensor, got {type(tokens_per_expert_E).__name__}")
        E = self.num_experts
        if tokens_per_expert_E.shape != (E,):
            raise ValueError(f"tokens_per_expert_E must have shape [{E}], got {tuple(tokens_per_expert_E.shape)}")
        if tokens_per_expert_E.dtype.is_floating_point or tokens_per_expert_E.dtype.is_complex:
            raise TypeError(f"tokens_per_expert_E must be an integer tensor, got {tokens_per_expert_E.dtype}")
        device = tokens_per_expert_E.device
        if self._device is None:
            with torch.inference_mode(False):  # state made in an eval step must stay writable in training
                self._alloc(device)
        elif device != self._device:
            raise ValueError(f"tokens_per_expert_E is on {device}, but the monitor's state is on {self._device}")
        if isinstance(dropped, torch.Tensor):
            if dropped.numel() != 1 or dropped.dtype.is_floating_point:
                raise ValueError(f"dropped must be an int or a one-element integer tensor, got shape "
                                 f"{tuple(dropped.shape)} {dropped.dtype}")
            dropped_t = dropped.detach().reshape(()).to(device=device, dtype=torch.int64)
        elif isinstance(dropped, int) and not isinstance(dropped, bool) and dropped >= 0:
            dropped_t = torch.full((), dropped, dtype=torch.int64, device=device)  # a fill, not a host copy
        else:
            raise ValueError(f"dropped must be an int >= 0 or a tensor, got {dropped!r}")
        if scores_TE is not None and (scores_TE.dim() != 2 or scores_TE.shape[1] != E):
            raise ValueError(f"scores_TE must have shape [T, {E}], got {tuple(scores_TE.shape)}")
        return load_payload(tokens_per_expert_E, dropped_t, scores_TE)

    def record(self, buf_X: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
               dp_group: Optional[dist.ProcessGroup] = None, *, timeout: Optional[float] = None,
               rank: int = 0) -> GlobalCounts:
        """Record one step from a ``payload`` buffer: summed in place over ``group`` (EP) and ``dp_group`` by one
        asynchronous all_reduce each (groups of more than one rank; see ``observe``), or already summed over
        the EP group by the caller (group None: e.g. inside the layer's control exchange in the sync-free
        mode). Returns this step's GlobalCounts."""
        E = self.num_experts
        if buf_X.shape != (2 * E + 2,) or buf_X.dtype != torch.float64:
            raise ValueError(f"buf_X must be a [{2 * E + 2}] float64 payload(), got {tuple(buf_X.shape)} {buf_X.dtype}")
        if self._device is None:
            with torch.inference_mode(False):  # state made in an eval step must stay writable in training
                self._alloc(buf_X.device)
        self._flush()
        if _size(group) > 1 or _size(dp_group) > 1:
            work = _all_reduce_over(buf_X, group, dp_group, timeout=timeout, phase="load monitor", rank=rank)
            handle = GlobalCounts(buf_X[:E], work, phase="load monitor", timeout=timeout, rank=rank)
            self._pending.append((handle, buf_X))
        else:
            self._fold(buf_X[:E].round().to(torch.int64), buf_X[E].round().to(torch.int64), buf_X[E + 1:2 * E + 1],
                       buf_X[2 * E + 1])
            handle = GlobalCounts(buf_X[:E])
        if self.sync_every is not None:
            self._recorded += 1
            if self._recorded % self.sync_every == 0:
                self.poll()  # host sync: opted in with sync_every
        return handle

    def _flush(self) -> None:
        """Fold in a finished group reduction. ``wait`` orders the current stream after the collective
        (NCCL: no host block; gloo: the CPU waits for its worker thread)."""
        E = self.num_experts
        while self._pending:
            handle, buf_X = self._pending.pop(0)
            handle.wait()
            self._fold(buf_X[:E].round().to(torch.int64), buf_X[E].round().to(torch.int64),
                       buf_X[E + 1:2 * E + 1], buf_X[2 * E + 1])

    def _fold(self, counts_E: torch.Tensor, dropped: torch.Tensor, probsum_E: torch.Tensor,
              ntok: torch.Tensor) -> None:
        """Device-side update of every statistic with one step (all device ops, no sync). The step number and the
        window row come from the device counter and every state tensor is updated in place: nothing on the host
        changes (a CUDA graph replays it)."""
        step = self._done_dev
        s = (step % self.window).reshape(1)
        self._counts_SE.index_copy_(0, s, counts_E.reshape(1, -1))
        self._dropped_S.index_copy_(0, s, dropped.reshape(1).to(torch.int64))
        self._total_E += counts_E
        self._total_dropped += dropped
        load_E = counts_E.to(torch.float64)
        self._ema_E.copy_(torch.where(step == 0, load_E, self._ema_E.mul(self.ema_decay).add(load_E,
                                                                                          alpha=1.0 - self.ema_decay)))
        mass = probsum_E.sum()
        p_E = probsum_E / mass.clamp_min(1e-300)
        entropy = -torch.special.xlogy(p_E, p_E).sum()
        self._entropy_S.index_copy_(0, s, torch.where((ntok > 0) & (mass > 0), entropy,
                                                      torch.full_like(entropy, float("nan"))).reshape(1))
        above_E = load_E > self.hot_threshold * load_E.mean()
        self._hot_streak_E.add_(1).mul_(above_E)
        self._cool_streak_E.add_(1).mul_(~above_E)
        new_hot_E = (self._hot_E | (self._hot_streak_E >= self.hot_persistence)) & \
            (self._cool_streak_E < self.hot_persistence)
        self._hot_since_E.copy_(torch.where(new_hot_E & ~self._hot_E, step.expand_as(self._hot_since_E),
                                            self._hot_since_E))
        self._hot_E.copy_(new_hot_E)
        self._hot_SE.index_copy_(0, s, new_hot_E.reshape(1, -1))
        step.add_(1)

    # ------------------------------------------------------------------------------------------- read
    def _host(self) -> Dict[str, torch.Tensor]:
        """Fold pending reductions and copy the state to the host, window rows in step order."""
        self._flush()
        done = self._read_done = self._folded_steps()  # the steps this read's state holds
        n = min(done, self.window)
        order = [(done - n + i) % self.window for i in range(n)]
        if self._device is None:
            E = self.num_experts
            z = torch.zeros(0, E, dtype=torch.int64)
            return dict(counts_SE=z, dropped_S=torch.zeros(0, dtype=torch.int64), entropy_S=torch.zeros(0),
                        hot_SE=z.bool(), total_E=torch.zeros(E, dtype=torch.int64), total_dropped=torch.tensor(0),
                        ema_E=torch.zeros(E, dtype=torch.float64), hot_E=torch.zeros(E, dtype=torch.bool),
                        hot_since_E=torch.zeros(E, dtype=torch.int64))
        idx = torch.tensor(order, dtype=torch.int64, device=self._device)
        state = dict(counts_SE=self._counts_SE[idx], dropped_S=self._dropped_S[idx], entropy_S=self._entropy_S[idx],
                     hot_SE=self._hot_SE[idx], total_E=self._total_E, total_dropped=self._total_dropped,
                     ema_E=self._ema_E, hot_E=self._hot_E, hot_since_E=self._hot_since_E)
        return {k: v.to("cpu", copy=True) for k, v in state.items()}  # host sync: reading the statistics

    def _deliver(self, st: Dict[str, torch.Tensor]) -> None:
        """Replay hot-set changes of the steps not yet delivered, in order (from the window)."""
        first = self._read_done - st["hot_SE"].shape[0]  # step of window row 0
        for step in range(max(self._polled, first), self._read_done):
            now = st["hot_SE"][step - first].nonzero().flatten().tolist()  # host sync: read side
            if now != self._known_hot:
                added = sorted(set(now) - set(self._known_hot))
                removed = sorted(set(self._known_hot) - set(now))
                self._known_hot = now
                fmt = lambda ids: ", ".join(f"{g} (rank {self.rank_of(g)})" for g in ids) or "none"  # noqa: E731
                self.logger.info("moe_comm hot experts changed at step %d: added [%s], removed [%s]; hot now [%s]",
                                 step, fmt(added), fmt(removed), fmt(now))
                if self.on_hot_change is not None:
                    self.on_hot_change(added, removed, step)
        self._polled = self._read_done

    def read_state(self) -> Dict[str, torch.Tensor]:
        """Host sync. The state on the host (window rows oldest first: counts_SE, dropped_S, entropy_S,
        hot_SE; totals total_E, total_dropped; ema_E, hot_E, hot_since_E), after delivering pending
        hot-set changes. What ``summary``, the JSON report and the plot read."""
        st = self._host()
        self._deliver(st)
        return st

    def poll(self) -> List[HotExpert]:
        """Host sync: fire pending hot-change callbacks / log records; returns ``hot_experts()``."""
        st = self.read_state()
        return self._hot_list(st)

    def _hot_list(self, st: Dict[str, torch.Tensor]) -> List[HotExpert]:
        ema_E = st["ema_E"]
        mean = float(ema_E.mean())
        return [HotExpert(expert=g, rank=self.rank_of(g),
                          load_over_mean=float(ema_E[g]) / mean if mean > 0 else float("nan"),
                          since_step=int(st["hot_since_E"][g]))
                for g in st["hot_E"].nonzero().flatten().tolist()]  # host sync: read side

    def hot_experts(self) -> List[HotExpert]:
        """Host sync: the experts hot now, by id, each with its rank (also delivers pending changes)."""
        return self.poll()

    def rank_of(self, expert: int) -> int:
        """EP rank owning global expert ``expert`` (expert // (E / W); after ``set_placement``, the rank of
        its first replica)."""
        if self._ranks_of is not None:
            return self._ranks_of[expert][0]
        return expert // (self.num_experts // self.num_ranks)

    def ranks_of(self, expert: int) -> List[int]:
        """Every EP rank holding a replica of ``expert`` (one rank without a placement)."""
        return [self.rank_of(expert)] if self._ranks_of is None else list(self._ranks_of[expert])

    def load_history(self) -> torch.Tensor:
        """Host sync. [S, E] int64 tokens per expert of the window's steps, oldest first: the input of
        ``moe_comm.placement.plan_placement`` (identical on every rank when observed with a group)."""
        return self._host()["counts_SE"]

    def _view(self, load_E: torch.Tensor, dropped: Optional[float] = None) -> Dict[str, object]:
        load_E = load_E.to(torch.float64)
        rank_W = self.rank_load(load_E)
        mean, mx = float(load_E.mean()), float(load_E.max())
        rmean, rmx = float(rank_W.mean()), float(rank_W.max())
        ratio = lambda a, b: a / b if b > 0 else None  # noqa: E731
        view = {
            "tokens_per_expert": load_E.tolist(),  # host sync: read side
            "tokens_per_rank": rank_W.tolist(),  # host sync: read side
            "balancedness": ratio(mean, mx),
            "expert_max_over_mean": ratio(mx, mean),
            "rank_max_over_mean": ratio(rmx, rmean),
            "rank_balancedness": ratio(rmean, rmx),
            "cv": ratio(float(load_E.std(unbiased=False)), mean),
        }
        if dropped is not None:
            routed = float(load_E.sum())
            view["routed"] = routed
            view["dropped"] = dropped
            view["drop_fraction"] = ratio(dropped, routed + dropped)
        return view

    def summary(self) -> Dict[str, object]:
        """Host sync. A JSON-ready dict:

        ``steps``, ``window_steps``, ``num_experts``, ``num_ranks``, ``config`` (window, ema_decay,
        hot_threshold, hot_persistence); views ``window`` (summed over the last window_steps steps, plus
        ``step_balancedness`` / ``step_rank_max_over_mean``: per-step values averaged), ``ema`` and
        ``last``, each with tokens_per_expert [E], tokens_per_rank [W], balancedness,
        expert_max_over_mean, rank_max_over_mean, rank_balancedness, cv (window/last also routed,
        dropped, drop_fraction); ``total`` (since the start: tokens_per_expert, routed, dropped,
        drop_fraction); ``router_entropy`` (last, window_mean, max = ln E; None without scores);
        ``hot_experts`` (list of {expert, rank, load_over_mean, since_step}); ``placement`` (phys_to_logical)
        only after ``set_placement``. Ratios are None when undefined (no load).
        """
        st = self.read_state()
        n = st["counts_SE"].shape[0]
        out: Dict[str, object] = {
            "num_experts": self.num_experts, "num_ranks": self.num_ranks, "steps": self._read_done, "window_steps": n,
            "config": {"window": self.window, "ema_decay": self.ema_decay, "hot_threshold": self.hot_threshold,
                       "hot_persistence": self.hot_persistence},
        }
        if n:
            win = self._view(st["counts_SE"].sum(0), float(st["dropped_S"].sum()))
            steps = [self._view(c) for c in st["counts_SE"]]
            per_step = lambda key: [v[key] for v in steps if v[key] is not None]  # noqa: E731
            mean_or_none = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
            win["step_balancedness"] = mean_or_none(per_step("balancedness"))
            win["step_rank_max_over_mean"] = mean_or_none(per_step("rank_max_over_mean"))
            out["window"] = win
            out["ema"] = self._view(st["ema_E"])
            out["last"] = self._view(st["counts_SE"][-1], float(st["dropped_S"][-1]))
        else:
            out["window"] = out["ema"] = out["last"] = None
        routed, dropped = int(st["total_E"].sum()), int(st["total_dropped"])
        total_E = st["total_E"].tolist()  # host sync: read side
        out["total"] = {"tokens_per_expert": total_E, "routed": routed, "dropped": dropped,
                        "drop_fraction": dropped / (routed + dropped) if routed + dropped else None}
        ent = st["entropy_S"]
        seen = ent[~ent.isnan()]
        out["router_entropy"] = {"last": _finite_or_none(float(ent[-1])) if n else None,
                                 "window_mean": float(seen.mean()) if seen.numel() else None,
                                 "max": math.log(self.num_experts)}
        out["hot_experts"] = [asdict(h) for h in self._hot_list(st)]
        if self._phys_to_logical is not None:
            out["placement"] = list(self._phys_to_logical)
        return out

    def history(self) -> Dict[str, object]:
        """Host sync. The window step by step: steps [S], tokens_per_expert [S][E], dropped [S],
        router_entropy [S] (None without scores), hot [S] lists of hot expert ids."""
        st = self._host()
        n = st["counts_SE"].shape[0]
        counts, dropped = st["counts_SE"].tolist(), st["dropped_S"].tolist()  # host sync: read side
        return {"steps": list(range(self._read_done - n, self._read_done)), "tokens_per_expert": counts,
                "dropped": dropped,
                "router_entropy": [_finite_or_none(x) for x in st["entropy_S"].tolist()],  # host sync: read side
                "hot": [row.nonzero().flatten().tolist() for row in st["hot_SE"]]}  # host sync: read side

    def to_json(self, path: Union[str, os.PathLike], history: bool = True) -> str:
        """Host sync. Write ``summary()`` (plus ``history()`` under "history" when asked) to ``path`` as strict
        JSON (NaN / Infinity written as null); see ``moe_comm.monitor.report.write_json``."""
        from moe_comm.monitor.report import write_json
        return write_json(self, path, history)

    def plot(self, path: Union[str, os.PathLike], title: Optional[str] = None, dpi: int = 120) -> str:
        """Host sync. Save the load heatmap, the straggler factor per step and the tokens per rank to
        ``path``; see ``moe_comm.monitor.report.plot_load``. Needs matplotlib (``pip install moe_comm[plot]``)."""
        from moe_comm.monitor.report import plot_load
        return plot_load(self, path, title, dpi)
