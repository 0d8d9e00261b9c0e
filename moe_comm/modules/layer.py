"""MoELayer: router + dispatcher + experts (+ shared experts), its load monitor, aux-loss-free balancing
and applied rebalance plans.

Shapes legend: T tokens (all leading dims of x flattened), H hidden, K top-k, E logical experts,
e = E / W, R redundant replicas, P = E + R physical slots, S = P / W slots per rank, W EP world size.

One forward: [apply last step's bias update] -> router (logical ids) -> [logical -> physical slot, when a
placement is applied] -> dispatcher (its one host sync) -> experts -> combine -> [monitor / load counts:
device ops and one async all_reduce, no host sync].
"""
from __future__ import annotations

import copy
import dataclasses
import weakref
from contextlib import nullcontext as _nullcontext
from typing import Dict, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from moe_comm._checks import check_bool, check_float, check_tensor
from moe_comm.comm.agree import agree_ep_dp
from moe_comm.comm.channel import read_deferred
from moe_comm.comm.collectives import group_device, group_rank, group_size, resolve_group
from moe_comm.config import MoEConfig
from moe_comm.dispatch.dispatcher import Dispatcher
from moe_comm.dispatch.hierarchy import ranks_on_node
from moe_comm.dispatch.sync_free import placeholder_like
from moe_comm.modules.checkpoint import ExpertKeyPath, dcp_fqn_modifiers
from moe_comm.modules.layer_load import LayerLoad, dropping_failed_loads, finish_bias_update_hook, make_monitor
from moe_comm.modules.experts import GroupedExperts, PlacedExperts, SwiGLU, _init_expert_
from moe_comm._recompute import checkpoint_mode, forget_bias, in_backward, input_key
from moe_comm.modules.wrappers import data_parallel_error
from moe_comm.monitor.load import GlobalCounts, LoadMonitor
from moe_comm.placement.apply import physical_topk, relayout_slots, replica_tables, sync_replica_grads
from moe_comm.placement.planner import Placement, plan_placement
from moe_comm.routing import Router

__all__ = ["MoELayer"]

def _check_data_parallel_hook(module: "MoELayer", args) -> None:
    # A DDP / FSDP2 wrapper that mixes different EP ranks' experts: every rank raises (through the
    # Dispatcher's exchange, which every rank reaches) instead of training on overwritten experts.
    # Eager forwards only: under torch.compile the stack walk is not traceable (and not checked).
    if torch.compiler.is_compiling():
        return
    error = data_parallel_error(module)
    if error is not None:
        module.dispatcher.fail(error, device=module.experts.w1.device)


def _broadcast(t: torch.Tensor, src: int, group) -> None:
    """``dist.broadcast`` of ``t`` in place, issued on the group's device (an NCCL group needs CUDA tensors; a
    layer may be built on the CPU and moved later) and copied back when ``t`` lives elsewhere."""
    device = group_device(group)
    if t.device == device:
        dist.broadcast(t, src=src, group=group)
        return
    on_group = t.to(device)
    dist.broadcast(on_group, src=src, group=group)
    t.copy_(on_group)


def _is_2d_mesh(group) -> bool:
    return getattr(group, "ndim", 1) == 2 and hasattr(group, "mesh_dim_names")


def _resolve_dp_group(ep_group, dp_group) -> Optional[dist.ProcessGroup]:
    """The data-parallel group: the "dp" dim of a 2-D ep_group mesh, or dp_group (None: no DP)."""
    if _is_2d_mesh(ep_group):
        if dp_group is not None:
            raise ValueError("MoELayer: ep_group is a 2-D DeviceMesh, whose 'dp' dim is the data-parallel group; "
                             f"dp_group must then be None, got {type(dp_group).__name__}")
        return resolve_group(ep_group, dim="dp", name="MoELayer: ep_group")
    if dp_group is None:
        return None
    return resolve_group(dp_group, dim="dp", name="MoELayer: dp_group")


SUMMED_IN_EXCHANGE_WORDS = 4096  # W x (2E + 2) int64 words: 32 KiB per exchange and rank at most


class MoELayer(LayerLoad, nn.Module):
    """A Mixture-of-Experts feed-forward layer with expert parallelism.

    ``y = sum over the K chosen experts of weight * y_e(x)`` (+ shared experts), where global expert g
    lives on EP rank g // e as local expert g % e (until ``apply_placement``). Each rank passes its own
    tokens.

    Args:
        cfg: MoEConfig.
        ep_group: EP process group (any backend), or a 1-D ``DeviceMesh``, or a 2-D DeviceMesh with dims
            named "dp" and "ep" (``init_device_mesh(dev, (DP, EP), mesh_dim_names=("dp", "ep"))``: the EP
            group is its "ep" dim, the data-parallel group its "dp" dim). None: WORLD if torch.distributed
            is initialised, else a single process (W = 1).
        dp_group: the data-parallel group of this EP rank: the ranks holding the same experts (a replica of
            this layer each, with their own tokens); a ProcessGroup or 1-D DeviceMesh; None: no data
            parallelism (DP = 1). With it, the load statistics (monitor, aux-loss-free bias) count the
            GLOBAL batch over EP x DP, the replicas start equal (broadcast from DP rank 0), and
            ``moe_comm.parallel`` reduces the expert gradients over it.
        allow_single_process: with ``ep_group=None`` and no process group initialised in a process that a
            launcher started as one of several (RANK and WORLD_SIZE > 1 set, as torchrun does), run alone
            instead of raising ValueError (default False: forgetting ``init_process_group`` would train W
            unrelated models).
        backend: permutation kernels, "auto" | "triton" | "native" | "torch".
        seed: initialisation seed; None draws one from torch's default CPU generator (so
            ``torch.manual_seed`` makes it reproducible and consecutive layers differ). Expert g is
            initialised from ``seed + g``: the same experts whatever the EP size.
        device, dtype: of the parameters (x must have the experts' dtype); the router weight has
            ``cfg.router_dtype`` when that is set.
        monitor: the layer's LoadMonitor (``layer.monitor``): True (default) builds
            ``LoadMonitor(E, num_ranks=W)``; a dict gives its options (window, hot_threshold, ...); a
            LoadMonitor instance is used as is; False/None disables it (``layer.monitor`` is None). Every
            forward (training or eval) records the tokens per LOGICAL expert of the routing, the dropped
            slots and the router scores, summed over the EP group inside the forward's control exchange
            (2E + 2 float64 words; W = 1: nothing to sum): no collective of its own, no host sync (reading
            the monitor is the sync). Where W x (2E + 2) > SUMMED_IN_EXCHANGE_WORDS (4096; not in the
            sync-free mode) one async all_reduce of its own instead: the exchange would carry it four times.
        bias_update_rate: aux-loss-free balancing (DeepSeek-V3), 0 (default) disables it. After every
            forward in training mode, ``router.expert_bias`` (added to the scores for top-K selection
            only) moves by ``rate * sign(mean load - load)`` per expert, from the GLOBAL load (tokens per
            logical expert summed over the EP group, in the forward's control exchange). The update is
            applied at the start of the next forward (or by
            ``finish_bias_update()``, which ``state_dict()`` calls): no host sync, identical on every rank.
            It counts forwards, not optimizer steps: with gradient accumulation over n micro-batches,
            divide the rate by n.
        strict, timeout, end_check: passed to the Dispatcher: reject NaN/Inf inputs on every rank; seconds
            before a stuck all-to-all (and the monitor's / bias update's all_reduce) raises CollectiveError
            naming the phase; when the end-of-forward/backward check is read ("eager" on CPU: before the
            forward returns; "deferred" on CUDA: with the next read, keeping one host sync per forward).

    Activation checkpointing (``torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=...)``): the
    recompute inside backward neither records load into the monitor, nor applies or schedules a bias
    step, nor replaces ``aux_loss``; it routes with the bias the original forward used (also with
    gradient accumulation). With ``use_reentrant=True`` the first forward runs under no_grad: the layer
    then runs the router alone with grad enabled, so ``aux_loss`` keeps its gradient (the cost: the
    router's [T, E] activations stay alive until backward, as without checkpointing). Both are detected
    from torch.utils.checkpoint's frames; another checkpoint implementation gets neither (the recompute
    still records nothing).

    The router weight is replicated: it is broadcast from EP rank 0 at construction, and its
    gradient holds the local tokens' contribution only; all-reduce it over the data-parallel
    ranks yourself (as DDP does). ``moe_comm.parallel.wrap_ddp`` / ``fully_shard_moe`` wire DDP / FSDP2
    for EP x DP (experts kept out of the wrapper, their gradients summed over dp_group / N); a plain
    DDP / FSDP2 wrapper that manages the experts over ranks holding other experts makes the forward raise
    on every rank. ``layer.aux_loss`` is the last forward's router loss (a scalar
    that backpropagates); add it to your loss. Every EP rank must call forward and backward
    together (they are collective), even a rank with zero tokens, and must build the layer with the
    same config, dtype, monitor on/off and bias_update_rate. Construction is collective: every rank checks
    its own arguments, then one ``agree`` compares them by value; an error on any rank raises on every
    rank, naming the field and the ranks (never a rank left waiting in a collective).

    Rebalancing: ``apply_placement(plan, optimizer)`` re-lays the experts as ``plan`` says (E logical
    experts on P = E + R physical slots, replicas of the hottest); then call ``sync_replica_grads()``
    after every backward pass of a step and before ``optimizer.step()``. See ``apply_placement``.
    """

    def __init__(self, cfg: MoEConfig, ep_group=None, *, dp_group=None, allow_single_process: bool = False,
                 backend: str = "auto", seed: Optional[int] = None, device=None, dtype=None,
                 monitor: Union[bool, dict, LoadMonitor, None] = True, bias_update_rate: float = 0.0,
                 strict: bool = False, timeout: Optional[float] = None, end_check: Optional[str] = None):
        super().__init__()
        # Without a process group there is no collective: a bad flag raises here (alone, as on every rank).
        # With one, the rank still joins the agreement below, carrying the error: every rank raises.
        flag_error = None
        try:
            check_bool("MoELayer: allow_single_process", allow_single_process)
        except TypeError as err:
            if not (dist.is_available() and dist.is_initialized()):
                raise
            flag_error, allow_single_process = err, False
        self.ep_group = resolve_group(ep_group, name="MoELayer: ep_group", allow_single_process=allow_single_process)
        self.dp_group = _resolve_dp_group(ep_group, dp_group)
        W, rank = group_size(self.ep_group), group_rank(self.ep_group)
        local_error, settings = None, {}
        try:  # everything local first; a rank that fails still joins the agreement: every rank raises
            if flag_error is not None:
                raise flag_error
            if not isinstance(cfg, MoEConfig):
                raise TypeError(f"MoELayer: cfg must be a MoEConfig, got {type(cfg).__name__}")
            check_float("MoELayer: bias_update_rate", bias_update_rate, 0.0)
            if cfg.num_experts % W:
                raise ValueError(f"MoEConfig.num_experts ({cfg.num_experts}) must be divisible by the EP world "
                                 f"size, got world size {W}")
            if cfg.node_limited:  # the routing's groups must be the nodes' expert blocks
                nodes = W // ranks_on_node(cfg.ranks_per_node, self.ep_group, W)
                if cfg.num_groups != nodes:
                    raise ValueError(f"MoEConfig.node_limited: num_groups ({cfg.num_groups}) must equal the number of "
                                     f"nodes, EP size {W} / ranks_per_node = {nodes}, so that each group is one "
                                     "node's experts")
            self._build(cfg, W, rank, seed, device, dtype, monitor, bias_update_rate)
            settings = dict(dataclasses.asdict(cfg), dtype=str(self.experts.w1.dtype), monitor=self.monitor is not None,
                            bias_update_rate=self.bias_update_rate, dp_size=group_size(self.dp_group))
        except Exception as err:  # noqa: BLE001 - any local failure (device="cuda" without CUDA: AssertionError)
            local_error = err
        agree_ep_dp(self.ep_group, self.dp_group, settings, what="MoELayer", local_error=local_error, timeout=timeout,
                    dp_values={**settings, "ep_size": group_size(self.ep_group)})
        # After the agreement, so that every rank gets here: the Dispatcher's own agreement is collective.
        # Sync-free mode: the load statistics travel in the forward's control exchange (no all_reduce of their
        # own), so every phase is the same four fixed-size collectives: a rank that skipped a backward can be
        # realigned (``sync_free.placeholder_backward``) instead of pairing an all_reduce with an all-to-all.
        # Other modes: in the exchange too (one collective less per forward) while that adds at most
        # SUMMED_IN_EXCHANGE_WORDS per rank to each of a step's four exchanges (every exchange of a Dispatcher has
        # one size); above (e.g. E = 256 at W = 64: 263 KB per exchange) the monitor's own all_reduce is cheaper.
        counts_in_exchange = W > 1 and (self.monitor is not None or self.bias_update_rate > 0) and (
            cfg.max_tokens_per_rank is not None or W * (2 * cfg.num_experts + 2) <= SUMMED_IN_EXCHANGE_WORDS)
        self.dispatcher = Dispatcher(cfg.num_experts, self.ep_group, cfg.num_chunks, backend=backend,
                                     strict=strict, timeout=timeout, end_check=end_check,
                                     allow_single_process=allow_single_process,
                                     max_tokens_per_rank=cfg.max_tokens_per_rank, dedup=cfg.dedup,
                                     dispatch_dtype=cfg.dispatch_dtype, dispatch_scales=cfg.dispatch_scales,
                                     summed_words=2 * cfg.num_experts + 2 if counts_in_exchange else 0,
                                     ranks_per_node=cfg.ranks_per_node)
        self.timeline.device = self.experts.w1.device  # the experts' work runs there, whatever the group's device
        if not self.experts.w1.is_meta:  # meta: reset_parameters() after to_empty() makes them equal
            self._broadcast_replicated()
        self.register_forward_pre_hook(_check_data_parallel_hook)

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.cuda()``, ``to_empty()``: the timeline follows the experts' device."""
        out = super()._apply(fn, recurse)
        self.timeline.device = self.experts.w1.device
        return out

    def _build(self, cfg: MoEConfig, W: int, rank: int, seed, device, dtype, monitor, bias_update_rate) -> None:
        """The local part of construction (no collective): modules, monitor, placement and bias state."""
        self.cfg = cfg
        e = cfg.num_experts // W
        self.bias_update_rate = float(bias_update_rate)
        self.monitor: Optional[LoadMonitor] = make_monitor(monitor, cfg.num_experts, W)
        if seed is None:  # a CPU draw (also under ``with torch.device("meta")``): no host sync
            seed = int(torch.randint(0, 2 ** 62, (), device="cpu").item())  # host sync: none, CPU draw
        self._seed = seed
        self._expert_keys = ExpertKeyPath()  # torch.distributed.checkpoint resolves experts.w1.<g> through it
        self.router = Router(cfg, device=device, dtype=dtype)
        self.experts = GroupedExperts(e, cfg.hidden_size, cfg.ffn_hidden_size, first_expert=rank * e,
                                      num_experts=cfg.num_experts, seed=seed + 1, device=device, dtype=dtype)
        self.shared_experts = None
        if cfg.num_shared_experts:
            self.shared_experts = SwiGLU(cfg.hidden_size, cfg.shared_ffn_size, seed=seed - 1,
                                         device=device, dtype=dtype)
        self.shared_expert_gate = None  # Qwen2-MoE: shared output * sigmoid(x @ shared_expert_gate.weight.T)
        if cfg.shared_expert_gate:
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False, device=device, dtype=dtype)
        self._init_replicated()
        self.aux_loss: Optional[torch.Tensor] = None
        # Placement state (apply_placement): host phys_to_logical, and device tables for the forward.
        self._placement: Optional[Placement] = None
        self._phys_to_logical: Optional[List[int]] = None
        self._max_replicas = 1
        self.register_buffer("_replica_slots_EC", None, persistent=False)
        self.register_buffer("_replica_count_E", None, persistent=False)
        self._pending_load: Optional[GlobalCounts] = None  # global load of the last training forward
        # The bias each checkpointed training forward routed with, by input, for its recompute (with
        # bias_update_rate > 0); an entry lives as long as its input tensor.
        self._bias_for_recompute: Dict[tuple, torch.Tensor] = {}
        self.register_state_dict_pre_hook(finish_bias_update_hook)
        self.register_load_state_dict_pre_hook(finish_bias_update_hook)

    @torch.no_grad()
    def _init_replicated(self) -> None:
        """The router weight (and the shared-expert gate) from the layer's seed (CPU draws, so that meta
        construction works too)."""
        H = self.cfg.hidden_size
        g = torch.Generator().manual_seed(self._seed)
        self.router.weight.copy_(torch.randn(self.router.weight.shape, generator=g, device="cpu") * H ** -0.5)
        if self.shared_expert_gate is not None:
            g = torch.Generator().manual_seed(self._seed - 2)
            w = torch.randn(self.shared_expert_gate.weight.shape, generator=g, device="cpu") * H ** -0.5
            self.shared_expert_gate.weight.copy_(w)

    @torch.no_grad()
    def _broadcast_replicated(self) -> None:
        """Collective: make the replicas equal. The router weight (shared experts, gate) from EP rank 0 over
        the EP group; then, with a data-parallel group, every parameter and buffer from DP rank 0 over it
        (this EP rank's experts and their replicas; a rank's own seed may differ). Cost: the layer's local
        parameters once over the DP group."""
        if group_size(self.ep_group) > 1:
            src = dist.get_global_rank(self.ep_group, 0)
            params = [self.router.weight]
            params += [] if self.shared_experts is None else list(self.shared_experts.parameters())
            params += [] if self.shared_expert_gate is None else [self.shared_expert_gate.weight]
            for p in params:
                _broadcast(p.data, src, self.ep_group)
        if group_size(self.dp_group) > 1:
            src = dist.get_global_rank(self.dp_group, 0)
            for t in list(self.parameters()) + list(self.buffers()):
                _broadcast(t.data, src, self.dp_group)

    def reset_parameters(self) -> None:
        """Collective (EP x DP): re-initialise every weight from the layer's seed as at construction (expert g
        from ``seed + 1 + g``), zero the aux-loss-free bias, and make the replicas equal.

        For meta-device construction: ``with torch.device("meta"): layer = MoELayer(cfg, ...)`` (no memory,
        no broadcast), then on every rank ``layer.to_empty(device=...)`` and ``layer.reset_parameters()``.
        Call this method of the layer, not each submodule's own (``GroupedExperts.reset_parameters()``
        without the layer's seed would initialise other experts)."""
        with torch.no_grad():
            self._init_replicated()
            self.experts.reset_parameters(self._seed + 1)
            if self.shared_experts is not None:
                se = self.shared_experts
                _init_expert_(se.w1, se.w3, se.w2, torch.Generator().manual_seed(self._seed - 1))
            self.router.expert_bias.zero_()
        self._pending_load = None
        self._broadcast_replicated()

    def _fqn_modifiers(self) -> Dict[str, str]:
        """For torch.distributed.checkpoint.state_dict: the expert keys ``experts.w1.<g>`` resolve through
        ``self._expert_keys`` (``moe_comm.modules.checkpoint.ExpertKeyPath``)."""
        return dcp_fqn_modifiers("_expert_keys")

    def __deepcopy__(self, memo) -> "MoELayer":
        """``copy.deepcopy`` of the layer (or of a model holding it): parameters, buffers and state are copied;
        the process groups are shared by reference (they cannot be copied, and the copy runs on the same
        ranks). Building or copying layers is not collective, but the copy's forward is: copy on every rank."""
        for group in (self.ep_group, self.dp_group, getattr(self.dispatcher, "group", None)):
            if group is not None:
                memo[id(group)] = group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        return new

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

    def check(self) -> None:
        """Collective: read this layer's deferred exchanges now (one host sync); raises on every rank if any
        rank failed since the last read. With ``end_check="deferred"`` and in the sync-free mode
        (``max_tokens_per_rank``) failures of other ranks surface here or at the next read."""
        with dropping_failed_loads([self]):
            self.dispatcher.check()

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

        Cost: one all_gather_object (``agree``: every rank checks the placement and its optimizer state, then
        all raise or none, nothing moved), one all_to_all of the moved slots (``placement.relayout_slots``).
        Applying a new placement to a placed layer moves from the current one.
        """
        E, W, rank = self.cfg.num_experts, self.world_size, group_rank(self.ep_group)
        self.dispatcher.check()  # a failure not read yet (deferred, sync-free) raises now, on every rank, not lost
        self.finish_bias_update()
        params = [self.experts.w1, self.experts.w3, self.experts.w2]
        new_p2l = relayout_slots(params, placement, self._phys_to_logical or list(range(E)), E,
                                 self.ep_group if W > 1 else None, optimizer)
        S = len(new_p2l) // W
        self.experts = PlacedExperts(*params, logical_ids=new_p2l[rank * S:(rank + 1) * S], first_slot=rank * S,
                                     num_experts=E)
        old = self.dispatcher
        self.dispatcher = Dispatcher(len(new_p2l), self.ep_group, old.num_chunks, backend=old.backend,
                                     strict=old.strict, timeout=old.timeout, end_check=old.end_check,
                                     direct_min_bytes=old.direct_min_bytes, allow_single_process=True,
                                     max_tokens_per_rank=old.max_tokens_per_rank, dedup=old.dedup,
                                     dispatch_dtype=old.dispatch_dtype, dispatch_scales=old.dispatch_scales,
                                     summed_words=old.summed_words, max_chunks=old.max_chunks,
                                     ranks_per_node=old.ranks_per_node)
        self.dispatcher.timeline = old.timeline
        self.dispatcher.carry_max_bytes = old.carry_max_bytes  # a value set on every rank stays
        self._replica_slots_EC, self._replica_count_E, self._max_replicas = replica_tables(new_p2l, E, params[0].device)
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
        return sync_replica_grads(params, self.experts.expert_ids, self._phys_to_logical, group,
                                  timeout=self.dispatcher.timeout)

    # -------------------------------------------------------------------------------------- forward
    def _check_input(self, x) -> Optional[Exception]:
        H = self.cfg.hidden_size
        if not isinstance(x, torch.Tensor):
            return TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != H:
            return ValueError(f"x must have last dimension hidden_size={H}, got shape {tuple(x.shape)}")
        if x.dtype != self.experts.w1.dtype:
            # Short enough (< 256 bytes) to reach the peers whole through the control exchange, fix included.
            want, low = self.experts.w1.dtype, x.dtype in (torch.bfloat16, torch.float16)
            amp = f"; or pass {want} x under torch.autocast(device_type, dtype={x.dtype})" if low else ""
            return TypeError(f"x has dtype {x.dtype}, not the experts' dtype {want}: cast the input, x.to({want}), or "
                             f"the layer, layer.to({x.dtype}){amp}")
        if x.device != self.experts.w1.device:
            return ValueError(f"x must be on the layer's device {self.experts.w1.device}, got {x.device}")
        if x.is_inference() and torch.is_grad_enabled() and not torch.is_inference_mode_enabled() \
                and self.router.weight.requires_grad:
            return RuntimeError("x is an inference tensor (made under torch.inference_mode()) but grad mode is on "
                                "and the layer's parameters require grad, so autograd cannot save it: call the "
                                "layer under torch.inference_mode() / torch.no_grad(), or pass a tensor made "
                                "outside inference mode (x.clone() there)")
        return None

    @staticmethod
    def _check_token_mask(x: torch.Tensor, token_mask) -> Optional[Exception]:
        try:
            check_tensor("token_mask", token_mask, shape=tuple(x.shape[:-1]), shape_from="x's leading dimensions",
                         dtypes=(torch.bool,), device=x.device)
        except (TypeError, ValueError) as err:
            return err
        return None

    def _shared(self, x_TH: torch.Tensor) -> torch.Tensor:
        """Shared experts on every token, scaled by sigmoid(x @ shared_expert_gate.weight.T) when gated."""
        out_TH = self.shared_experts(x_TH)
        if self.shared_expert_gate is not None:
            out_TH = torch.sigmoid(self.shared_expert_gate(x_TH)) * out_TH
        return out_TH

    def _route(self, x: torch.Tensor, recompute: bool, token_mask: Optional[torch.Tensor] = None):
        """Router (+ logical -> physical slots). Returns (routing, route_TK, x_TH).

        recompute: activation checkpointing's recompute inside backward: route with the bias of the
        original forward. Otherwise, under ``torch.utils.checkpoint``, remember that bias for the recompute
        and, with ``use_reentrant=True`` (a no-grad first forward), run the router with grad enabled so that
        the aux loss keeps its gradient."""
        rebias = self.bias_update_rate > 0 and self.training
        has_aux = self.cfg.aux_loss_coeff > 0 or self.cfg.z_loss_coeff > 0
        mode = checkpoint_mode() if self.training and not recompute and (rebias or has_aux) else None
        bias = None  # None: the router's own expert_bias
        if recompute and rebias:
            # The bias the original forward routed with (a recompute may run more than once: not popped).
            # Not found (another checkpoint implementation): the current bias.
            bias = self._bias_for_recompute.get(input_key(x))
        elif mode is not None and rebias:
            key, snapshot = input_key(x), self.router.expert_bias.detach().clone()
            self._bias_for_recompute[key] = snapshot
            weakref.finalize(x, forget_bias, self._bias_for_recompute, key, snapshot)  # lives as long as x
        own_bias = self.router.expert_bias
        try:
            if bias is not None:
                self.router.expert_bias = bias
            with torch.enable_grad() if mode == "reentrant" and has_aux else _nullcontext():
                x_TH = x.reshape(-1, self.cfg.hidden_size).contiguous()  # one layout for every view: the same bits
                routing = self.router(x_TH, None if token_mask is None else token_mask.reshape(-1))
        finally:
            self.router.expert_bias = own_bias
        route_TK = routing.topk_idx_TK
        if self._phys_to_logical is not None:  # logical expert -> one of its physical replicas
            route_TK = physical_topk(route_TK, self._replica_slots_EC, self._replica_count_E,
                                     self._max_replicas, group_rank(self.ep_group))
        return routing, route_TK, x_TH

    def _dispatch(self, x: torch.Tensor, token_mask: Optional[torch.Tensor], recompute: bool):
        """Checks, router, dispatcher (+ shared experts): (y_TH, routing); routing None after a failure
        the sync-free mode deferred (y_TH is then a placeholder of zeros)."""
        error = self._check_input(x)
        if error is None and token_mask is not None:
            error = self._check_token_mask(x, token_mask)
        if error is None:
            try:
                with self.timeline.compute("router"):
                    routing, route_TK, x_TH = self._route(x, recompute, token_mask)
            except Exception as err:  # noqa: BLE001 -- any router failure: every rank raises, naming this one
                error = err
        if error is not None:  # every rank raises with it (through the counts exchange): no hang
            anchor = self.dispatcher.fail(error, device=self.experts.w1.device)  # returns only when deferred
            if not isinstance(x, torch.Tensor):
                raise error
            self.aux_loss = anchor.to(torch.float32)
            return placeholder_like(x, anchor, self.experts.w1.dtype, self.experts.w1.device), None
        if not recompute:
            self.aux_loss = routing.aux_loss
        summed_X = self._load_payload(routing) if self.dispatcher.summed_words and not recompute else None
        if self.shared_experts is None:
            y_TH = self.dispatcher(x_TH, route_TK, routing.topk_weight_TK, self.experts, summed_X=summed_X)
        else:  # shared experts compute while the first dispatch is in flight
            y_TH, shared_TH = self.dispatcher(x_TH, route_TK, routing.topk_weight_TK, self.experts,
                                              side_fn=lambda: self._shared(x_TH), summed_X=summed_X)
            y_TH = y_TH + shared_TH
        return y_TH, routing

    def forward(self, x: torch.Tensor, token_mask: Optional[torch.Tensor] = None, *, return_routing: bool = False):
        """x: [..., H] -> y [..., H], same dtype. Sets ``self.aux_loss``; feeds ``self.monitor``.

        token_mask: optional bool tensor of x's leading shape [...]; False marks a token that is not routed
            (padding): no expert receives it, its routed output is 0 (shared experts still apply), and
            neither the monitor nor the aux / z loss counts it.
        return_routing: return ``(y, routing)``, routing the ``RouterOutput`` of this call (its
            ``logits_TE`` are the router logits a Hugging Face model returns).
        Under ``torch.autocast`` the router keeps its dtype (float32 logits, scores and weights by
        default) and the experts compute in the autocast dtype; y has x's dtype.

        Collective. Any error before rows move (bad x, the router raising on one rank) goes through the
        Dispatcher's exchange: every rank raises, naming the rank, and the group stays usable. In the
        sync-free mode (after its first call) failures are deferred: the failing rank returns zeros shaped
        like x (routing None), issues every collective its peers issue, and all raise at
        ``moe_comm.check``."""
        recompute = in_backward()  # activation checkpointing: this forward already ran once
        if not recompute:
            self.finish_bias_update()
        try:
            y_TH, routing = self._dispatch(x, token_mask, recompute)
        except Exception:
            # Failed on this rank alone after the call's last exchange (the final unpermute; its peers returned and
            # issue the monitor's collective): issue it too, with zero counts, so the collectives stay paired; the
            # failure reaches the peers with this rank's next exchange. A failure every rank raised records nothing.
            channel = self.dispatcher.channel
            if not recompute and channel.late is not None and channel.late_call == channel.call:
                self._record_load(None)
            raise
        # After the dispatch: its counts exchange already made every rank raise on a bad input, so the
        # monitor's collective is issued by all ranks or by none (a sync-free rank that failed records zero
        # counts, as its peers issue theirs). A recompute counts nothing twice.
        if not recompute:
            self._record_load(routing)
        y = y_TH.reshape(x.shape)
        return (y, routing) if return_routing else y


def check(module: nn.Module) -> None:
    """Collective: read the deferred exchanges of every MoELayer in ``module`` with one host read, and raise
    on every rank if any rank failed since the last read (the first failure, in module order). With the
    sync-free mode (``max_tokens_per_rank``) call it once per step, after the forward, before
    ``backward()``: one host sync for the whole model instead of one per layer."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    layers = [m for m in module.modules() if isinstance(m, MoELayer)]
    if not layers:
        return
    with layers[0].dispatcher.workspace.dropped_on_error(), dropping_failed_loads(layers):  # one workspace per process
        read_deferred([m.dispatcher.channel for m in layers])
