"""MoELayer: router + dispatcher + experts (+ shared experts), its load monitor, aux-loss-free balancing
and applied rebalance plans.

Shapes legend: T tokens (all leading dims of x flattened), H hidden, K top-k, E logical experts,
e = E / W, R redundant replicas, P = E + R physical slots, S = P / W slots per rank, W EP world size.

One forward: [apply last step's bias update] -> router (logical ids) -> [logical -> physical slot, when a
placement is applied] -> dispatcher (its one host sync) -> experts -> combine -> [monitor / load counts:
device ops and one async all_reduce, no host sync].
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from moe_comm.comm.collectives import group_rank, group_size, resolve_group
from moe_comm.config import MoEConfig
from moe_comm.dispatch.dispatcher import Dispatcher
from moe_comm.modules.experts import GroupedExperts, PlacedExperts, SwiGLU
from moe_comm.monitor.load import GlobalCounts, LoadMonitor, reduce_counts
from moe_comm.placement.apply import (check_placement, move_slots, optimizer_slot_state, physical_topk,
                        replica_tables, sync_replica_grads)
from moe_comm.placement.planner import Placement, plan_placement
from moe_comm.routing import Router, count_tokens

__all__ = ["MoELayer"]


def _check_same_config(cfg: MoEConfig, dtype: torch.dtype, group, **layer_options) -> None:
    """One all_gather_object of the config (and the layer options that decide which collectives a
    forward issues) across the EP group; every rank raises on a mismatch, naming the fields and which
    ranks hold which value (a mismatch would otherwise hang or corrupt)."""
    mine = dict(dataclasses.asdict(cfg), dtype=str(dtype), **layer_options)
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    diffs = []
    for name in mine:
        values = [fp[name] for fp in every]
        if len(set(map(repr, values))) > 1:
            by_value = {}
            for r, v in enumerate(values):
                by_value.setdefault(repr(v), []).append(r)
            diffs.append(f"{name}: " + ", ".join(f"{v} on ranks {rs}" for v, rs in by_value.items()))
    if diffs:
        raise ValueError("MoELayer: the MoEConfig differs across the EP group; " + "; ".join(diffs))


def _make_monitor(monitor, num_experts: int, num_ranks: int) -> Optional[LoadMonitor]:
    if monitor is None or monitor is False:
        return None
    if monitor is True:
        return LoadMonitor(num_experts, num_ranks=num_ranks)
    if isinstance(monitor, dict):
        return LoadMonitor(num_experts, num_ranks=num_ranks, **monitor)
    if isinstance(monitor, LoadMonitor):
        if (monitor.num_experts, monitor.num_ranks) != (num_experts, num_ranks):
            raise ValueError(f"monitor must be built for num_experts={num_experts}, num_ranks={num_ranks} (the "
                             f"layer's E and EP size), got {monitor.num_experts}, {monitor.num_ranks}")
        return monitor
    raise TypeError(f"monitor must be True, False/None, a dict of LoadMonitor options or a LoadMonitor, "
                    f"got {type(monitor).__name__}")


def _finish_bias_update_hook(module: "MoELayer", prefix: str, keep_vars: bool) -> None:
    module.finish_bias_update()  # a saved bias includes the last training forward's step


class MoELayer(nn.Module):
    """A Mixture-of-Experts feed-forward layer with expert parallelism.

    ``y = sum over the K chosen experts of weight * y_e(x)`` (+ shared experts), where global expert g
    lives on EP rank g // e as local expert g % e (until ``apply_placement``). Each rank passes its own
    tokens.

    Args:
        cfg: MoEConfig.
        ep_group: EP process group (any backend). None: WORLD if torch.distributed is initialised,
            else a single process (W = 1).
        backend: permutation kernels, "auto" | "triton" | "native" | "torch".
        seed: initialisation seed; None draws one from torch's default CPU generator (so
            ``torch.manual_seed`` makes it reproducible and consecutive layers differ). Expert g is
            initialised from ``seed + g``: the same experts whatever the EP size.
        device, dtype: of the parameters (x must have the experts' dtype).
        monitor: the layer's LoadMonitor (``layer.monitor``): True (default) builds
            ``LoadMonitor(E, num_ranks=W)``; a dict gives its options (window, hot_threshold, ...); a
            LoadMonitor instance is used as is; False/None disables it (``layer.monitor`` is None). Every
            forward (training or eval) records the tokens per LOGICAL expert of the routing, the dropped
            slots and the router scores, summed over the EP group by one asynchronous all_reduce of
            2E + 2 floats: device ops only, no host sync (reading the monitor is the sync).
        bias_update_rate: aux-loss-free balancing (DeepSeek-V3), 0 (default) disables it. After every
            forward in training mode, ``router.expert_bias`` (added to the scores for top-K selection
            only) moves by ``rate * sign(mean load - load)`` per expert, from the GLOBAL load (tokens per
            logical expert summed over the EP group: the monitor's all_reduce, or one of its own when the
            monitor is off). The update is applied at the start of the next forward (or by
            ``finish_bias_update()``, which ``state_dict()`` calls): no host sync, identical on every rank.
            It counts forwards, not optimizer steps: with gradient accumulation over n micro-batches,
            divide the rate by n. Under activation checkpointing, recomputation is another forward.
        strict, timeout: passed to the Dispatcher: reject NaN/Inf inputs on every rank; seconds before
            a stuck all-to-all raises CollectiveError naming the phase and chunk.

    The router weight is replicated: it is broadcast from EP rank 0 at construction, and its
    gradient holds the local tokens' contribution only; all-reduce it over the data-parallel
    ranks yourself (as DDP does). ``layer.aux_loss`` is the last forward's router loss (a scalar
    that backpropagates); add it to your loss. Every EP rank must call forward and backward
    together (they are collective), even a rank with zero tokens, and must build the layer with the
    same config, monitor on/off and bias_update_rate (checked at construction).

    Rebalancing: ``apply_placement(plan, optimizer)`` re-lays the experts as ``plan`` says (E logical
    experts on P = E + R physical slots, replicas of the hottest); then call ``sync_replica_grads()``
    after every backward pass of a step and before ``optimizer.step()``. See ``apply_placement``.
    """

    def __init__(self, cfg: MoEConfig, ep_group: Optional[dist.ProcessGroup] = None, *, backend: str = "auto",
                 seed: Optional[int] = None, device=None, dtype=None,
                 monitor: Union[bool, dict, LoadMonitor, None] = True, bias_update_rate: float = 0.0,
                 strict: bool = False, timeout: Optional[float] = None):
        super().__init__()
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
        if isinstance(bias_update_rate, bool) or not isinstance(bias_update_rate, (int, float)) \
                or not math.isfinite(bias_update_rate) or bias_update_rate < 0:
            raise ValueError(f"bias_update_rate must be a finite float >= 0, got {bias_update_rate!r}")
        self.cfg = cfg
        self.ep_group = resolve_group(ep_group)
        W, rank = group_size(self.ep_group), group_rank(self.ep_group)
        if cfg.num_experts % W:
            raise ValueError(f"MoEConfig.num_experts ({cfg.num_experts}) must be divisible by the EP world "
                             f"size, got world size {W}")
        e = cfg.num_experts // W
        self.bias_update_rate = float(bias_update_rate)
        self.monitor: Optional[LoadMonitor] = _make_monitor(monitor, cfg.num_experts, W)
        if W > 1:
            _check_same_config(cfg, dtype or torch.get_default_dtype(), self.ep_group,
                               monitor=self.monitor is not None, bias_update_rate=self.bias_update_rate)
        if seed is None:
            seed = int(torch.randint(0, 2 ** 62, ()).item())  # host sync: none, a CPU generator draw
        self.router = Router(cfg, device=device, dtype=dtype)
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            self.router.weight.copy_(torch.randn(self.router.weight.shape, generator=g) * cfg.hidden_size ** -0.5)
        self.experts = GroupedExperts(e, cfg.hidden_size, cfg.ffn_hidden_size, first_expert=rank * e,
                                      seed=seed + 1, device=device, dtype=dtype)
        self.shared_experts = None
        if cfg.num_shared_experts:
            self.shared_experts = SwiGLU(cfg.hidden_size, cfg.shared_ffn_size, seed=seed - 1,
                                         device=device, dtype=dtype)
        self.dispatcher = Dispatcher(cfg.num_experts, self.ep_group, cfg.num_chunks, backend=backend,
                                     strict=strict, timeout=timeout)
        self.aux_loss: Optional[torch.Tensor] = None
        # Placement state (apply_placement): host phys_to_logical, and device tables for the forward.
        self._placement: Optional[Placement] = None
        self._phys_to_logical: Optional[List[int]] = None
        self._max_replicas = 1
        self.register_buffer("_replica_slots_EC", None, persistent=False)
        self.register_buffer("_replica_count_E", None, persistent=False)
        self._pending_load: Optional[GlobalCounts] = None  # global load of the last training forward
        self.register_state_dict_pre_hook(_finish_bias_update_hook)
        if W > 1:
            self._broadcast_replicated()

    @torch.no_grad()
    def _broadcast_replicated(self) -> None:
        src = dist.get_global_rank(self.ep_group, 0)
        params = [self.router.weight] + ([] if self.shared_experts is None else list(self.shared_experts.parameters()))
        for p in params:
            dist.broadcast(p.data, src=src, group=self.ep_group)

    @property
    def timeline(self):
        """The layer's Timeline (disabled by default): ``layer.timeline.enabled = True`` to record spans."""
        return self.dispatcher.timeline

    @property
    def pipeline_plan(self):
        """With num_chunks="auto": the PipelinePlan chosen on the first forward (C, the fit, the reason)."""
        return self.dispatcher.plan

    @property
    def world_size(self) -> int:
        return group_size(self.ep_group)

    @property
    def local_expert_ids(self) -> List[int]:
        """LOGICAL ids of the experts this rank holds, one per local slot in slot order (the rows of
        ``experts.w1``): rank * e ... rank * e + e - 1 without a placement; after ``apply_placement``,
        ``placement.phys_to_logical[rank * S:(rank + 1) * S]`` (a replicated expert appears on several
        ranks, never twice on one with the planner)."""
        return self.experts.expert_ids

    @property
    def local_slot_ids(self) -> List[int]:
        """Global PHYSICAL slot ids of the local slots (equal to ``local_expert_ids`` without a placement)."""
        S = self.experts.num_local_experts
        return list(range(group_rank(self.ep_group) * S, (group_rank(self.ep_group) + 1) * S))

    @property
    def placement(self) -> Optional[Placement]:
        """The Placement applied last (None: the default, expert g on rank g // e, no replicas)."""
        return self._placement

    # ------------------------------------------------------------------------ load: monitor and bias
    def finish_bias_update(self) -> None:
        """Apply the pending aux-loss-free bias step (no-op when none is pending).

        Waits for the last training forward's global-load all_reduce (``work.wait``: the CPU waits for
        gloo's worker; on NCCL the stream waits, no host sync), then
        ``expert_bias += rate * sign(mean(load) - load)``. Runs at the start of every forward, before
        ``apply_placement`` and before ``state_dict()``.
        """
        pending, self._pending_load = self._pending_load, None
        if pending is None:
            return
        with torch.no_grad():
            load_E = pending.wait()  # float64 [E], identical on every rank
            step_E = torch.sign(load_E.mean() - load_E) * self.bias_update_rate
            self.router.expert_bias.add_(step_E.to(self.router.expert_bias.dtype))

    @torch.no_grad()
    def _record_load(self, routing) -> None:
        """Tokens per logical expert of this forward -> the monitor and/or the pending bias update.
        Device ops and at most one async all_reduce; no host sync."""
        update_bias = self.training and self.bias_update_rate > 0
        if self.monitor is None and not update_bias:
            return
        counts_E, dropped = count_tokens(routing.topk_idx_TK, self.cfg.num_experts)
        group = self.ep_group if self.world_size > 1 else None
        if self.monitor is not None:
            handle = self.monitor.observe(counts_E, dropped, routing.scores_TE, group=group)
        else:
            handle = reduce_counts(counts_E, group)
        if update_bias:
            self._pending_load = handle

    # ------------------------------------------------------------------------------------ placement
    def apply_placement(self, placement: Placement, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Collective: re-lay the experts as ``placement`` says, moving weights (and optimizer state).

        Args:
            placement: from ``moe_comm.placement.plan_placement(load_history_LE, W, R)`` (E logical experts
                on P = E + R physical slots, slot p on rank p // S, S = P / W), the same on every rank
                (checked: every rank raises otherwise). ``layer.rebalance(R)`` plans from the monitor.
            optimizer: a torch optimizer whose state is keyed by parameter (Adam/AdamW, SGD, RMSprop, ...)
                holding ``experts.w1/w3/w2`` (whole [e, F, H] tensors). Per-slot state entries (tensors whose
                dim 0 has one row per local slot: exp_avg, exp_avg_sq, momentum_buffer, ...) move with the
                weights, replicas get copies; 0-dim entries (Adam's ``step``) and non-tensors are kept;
                any other tensor entry raises ValueError (before anything moved). The state must have the
                same keys on every rank. Not supported: optimizers that shard or flatten parameters
                (ZeRO, FSDP) and state keyed other than by parameter. None: no state is touched.

        After the call, on rank r: ``experts.w1/w3/w2`` are the SAME Parameter objects with [S, ...] data
        (slot i holds logical expert ``phys_to_logical[r * S + i]``), their ``.grad`` is None (apply between
        optimizer steps), the dispatcher runs over P physical experts, and each token's slot picks one
        replica of its logical expert (round-robin, ``placement.physical_topk``). Outputs and gradients
        equal the unplaced layer's up to rounding. ``state_dict()`` stays keyed by logical id;
        ``load_state_dict`` of a logical checkpoint fills every replica.

        Replica gradients: call ``sync_replica_grads()`` (collective) once per optimizer step, after the
        last backward and before ``optimizer.step()`` (and before gradient clipping): it sums each
        replicated expert's gradient over its replicas so replicas stay identical. It is not a backward
        hook on purpose: the pipeline accumulates expert gradients chunk by chunk, and with gradient
        accumulation a per-backward sum would count earlier micro-batches twice.

        Cost: one all_gather_object (placement and state check), one all_to_all of the moved slots.
        Applying a new placement to a placed layer moves from the current one.
        """
        E, W, rank = self.cfg.num_experts, self.world_size, group_rank(self.ep_group)
        self.finish_bias_update()
        cur_p2l = self._phys_to_logical or list(range(E))
        params = [self.experts.w1, self.experts.w3, self.experts.w2]
        keys, states, signature, new_p2l, local_error = [], [], [], None, None
        try:  # a rank that rejects its input still joins the check below, so every rank raises
            new_p2l = check_placement(placement, E, W)
            if optimizer is not None:
                if not isinstance(optimizer, torch.optim.Optimizer):
                    raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got "
                                    f"{type(optimizer).__name__}")
                keys, states, signature = optimizer_slot_state(optimizer, params, params[0].shape[0])
        except (TypeError, ValueError) as err:
            local_error = err
        if W > 1:  # every rank must agree before anything moves; a mismatch raises everywhere
            every = [None] * W
            dist.all_gather_object(every, (new_p2l, signature, local_error is not None), group=self.ep_group)
            failed = [r for r in range(W) if every[r][2]]
            if local_error is not None:
                raise type(local_error)(f"{local_error} [EP rank {rank}; rank(s) {failed} rejected the call, "
                                        "nothing moved]") from local_error
            if failed:
                raise ValueError(f"apply_placement: EP rank(s) {failed} rejected their arguments (their error "
                                 "says why); every rank raised, nothing moved")
            bad = [r for r in range(W) if every[r][0] != new_p2l]
            if bad:
                raise ValueError(f"apply_placement: the placement differs across the EP group (ranks {bad} "
                                 f"differ from rank {rank}); plan it from the same load history everywhere")
            bad = [r for r in range(W) if every[r][1] != signature]
            if bad:
                raise ValueError(f"apply_placement: the optimizer state of the experts differs across the EP "
                                 f"group (ranks {bad} differ from rank {rank}: {every[bad[0]][1]} vs {signature})")
        elif local_error is not None:
            raise local_error
        moved = move_slots([p.data for p in params] + states, cur_p2l, new_p2l, self.ep_group)
        for p, data in zip(params, moved[:3]):
            p.data = data
            p.grad = None
        for (pi, key), data in zip(keys, moved[3:]):
            optimizer.state[params[pi]][key] = data
        S = len(new_p2l) // W
        self.experts = PlacedExperts(*params, logical_ids=new_p2l[rank * S:(rank + 1) * S], first_slot=rank * S)
        old = self.dispatcher
        self.dispatcher = Dispatcher(len(new_p2l), self.ep_group, old.num_chunks, backend=old.backend,
                                     strict=old.strict, timeout=old.timeout)
        self.dispatcher.timeline = old.timeline
        device = params[0].device
        self._replica_slots_EC, self._replica_count_E, self._max_replicas = replica_tables(new_p2l, E, device)
        self._placement, self._phys_to_logical = placement, new_p2l
        if self.monitor is not None:
            self.monitor.set_placement(placement)

    def rebalance(self, num_replicas: int = 0, optimizer: Optional[torch.optim.Optimizer] = None) -> Placement:
        """Collective: plan a placement from the monitor's window (``plan_placement(monitor.load_history(),
        W, num_replicas)``, identical on every rank since the monitor holds global counts) and apply it.
        Host sync (reads the monitor). Returns the Placement."""
        if self.monitor is None:
            raise ValueError("rebalance needs the layer's monitor (monitor=False was given); plan with "
                             "moe_comm.placement.plan_placement and call apply_placement")
        history_LE = self.monitor.load_history()
        if history_LE.shape[0] == 0:
            raise ValueError("rebalance: the monitor has observed no forward yet")
        plan = plan_placement(history_LE, self.world_size, num_replicas)
        self.apply_placement(plan, optimizer)
        return plan

    def sync_replica_grads(self) -> int:
        """Collective: sum the gradients of replicated experts over their replicas (after the last backward
        of a step, before clipping and ``optimizer.step()``). Every rank must call it. Returns the number
        of replicated logical experts (0 without replicas: then no collective runs on any rank)."""
        if self._phys_to_logical is None:
            return 0
        params = [self.experts.w1, self.experts.w3, self.experts.w2]
        group = self.ep_group if self.world_size > 1 else None
        return sync_replica_grads(params, self.experts.expert_ids, self._phys_to_logical, group)

    # -------------------------------------------------------------------------------------- forward
    def _check_input(self, x) -> Optional[Exception]:
        H = self.cfg.hidden_size
        if not isinstance(x, torch.Tensor):
            return TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != H:
            return ValueError(f"x must have last dimension hidden_size={H}, got shape {tuple(x.shape)}")
        if x.dtype != self.experts.w1.dtype:
            return TypeError(f"x must have the experts' dtype {self.experts.w1.dtype}, got {x.dtype}")
        if x.device != self.experts.w1.device:
            return ValueError(f"x must be on the layer's device {self.experts.w1.device}, got {x.device}")
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., H] -> [..., H], same dtype. Sets ``self.aux_loss``; feeds ``self.monitor``."""
        error = self._check_input(x)
        if error is not None:  # every rank raises with it (through the counts exchange): no hang
            self.dispatcher.fail(error, device=self.experts.w1.device)
        self.finish_bias_update()
        x_TH = x.reshape(-1, self.cfg.hidden_size).contiguous()  # one layout for every view: the same bits as a contiguous x
        with self.timeline.compute("router"):
            routing = self.router(x_TH)
            route_TK = routing.topk_idx_TK
            if self._phys_to_logical is not None:  # logical expert -> one of its physical replicas
                route_TK = physical_topk(route_TK, self._replica_slots_EC, self._replica_count_E,
                                         self._max_replicas, group_rank(self.ep_group))
        self.aux_loss = routing.aux_loss
        if self.shared_experts is None:
            y_TH = self.dispatcher(x_TH, route_TK, routing.topk_weight_TK, self.experts)
        else:  # shared experts compute while the first dispatch is in flight
            y_TH, shared_TH = self.dispatcher(x_TH, route_TK, routing.topk_weight_TK, self.experts,
                                              side_fn=lambda: self.shared_experts(x_TH))
            y_TH = y_TH + shared_TH
        # After the dispatch: its counts exchange already made every rank raise on a bad input, so the
        # monitor's collective is issued by all ranks or by none.
        self._record_load(routing)
        return y_TH.reshape(x.shape)
