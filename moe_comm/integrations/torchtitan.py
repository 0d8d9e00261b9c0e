"""moe_comm as the expert-parallel token dispatch of a torchtitan (0.3.0) model.

Shapes legend: B batch, L sequence, D hidden, T = B x L tokens of this rank, K top-k, E experts (global),
e = E / W experts on this rank, W EP world size, R rows received by this rank's experts.

    n = apply_moe_comm(model, ep_mesh, num_chunks=2)   # before model.parallelize(parallel_dims)

Each torchtitan ``MoE`` keeps its router (``TokenChoiceTopKRouter``: every routing option, the expert bias
and torchtitan's load counting), its experts (``routed_experts.inner_experts``, called as torchtitan calls
them: ``(rows_RD, tokens_per_local_expert_e) -> [R, D]``) and its shared experts. What changes is the
region between them: ``routed_experts`` runs moe_comm's ``Dispatcher`` pipelined call (dispatch -> experts ->
combine over ``num_chunks`` chunks) instead of torchtitan's token dispatcher. The module is the same object
(its class becomes a subclass of ``RoutedExperts``, as ``fully_shard`` does), so parameter and buffer names
are unchanged and torchtitan's DCP checkpoints load in either direction.

Where it goes: in a parallelize function (e.g. torchtitan's ``parallelize_qwen3``), right before
``model.parallelize(parallel_dims)`` with ``ep_mesh = parallel_dims.get_mesh("ep")``, when EP is on
(``expert_parallel_degree`` > 1; with EP off torchtitan's local dispatch moves no tokens between ranks and
there is nothing for moe_comm to do: ``ep_mesh=None`` raises). torchtitan's ``parallelize`` then shards the
experts over the EP mesh (global expert g on EP rank g // e, the layout moe_comm dispatches to) and wraps the
forward in its ``local_map`` region, which now runs moe_comm. A model that is not parallelized by torchtitan
works too when each rank's experts hold its e experts (pass its EP group).

``torchtitan`` is imported by this module: ``import moe_comm`` never loads it.
"""
from __future__ import annotations

import inspect
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from moe_comm._recompute import in_backward
from moe_comm.comm.agree import agree
from moe_comm.comm.collectives import group_size, resolve_group
from moe_comm.dispatch.dispatcher import Dispatcher, check_options
from moe_comm.modules.layer_load import make_monitor
from moe_comm.monitor.load import LoadMonitor

try:
    from torch.distributed.tensor import DTensor
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher
except ImportError as _err:  # noqa: F841 - re-raised with the install line
    raise ImportError(f"moe_comm.integrations.torchtitan needs torchtitan 0.3.0 ({_err}); install it with "
                      "`pip install 'moe_comm[torchtitan]'`") from _err

__all__ = ["apply_moe_comm", "MoeCommRoutedExperts", "DISPATCHER_OPTIONS"]

# Dispatcher arguments apply_moe_comm passes through (the same for every MoE module).
DISPATCHER_OPTIONS = ("num_chunks", "backend", "strict", "timeout", "direct_min_bytes", "max_chunks",
                      "end_check", "dedup", "dispatch_dtype", "dispatch_scales")
_OPTIONS = DISPATCHER_OPTIONS + ("monitor",)
# Options whose values change the collectives a call issues (agreed across the EP group by apply_moe_comm;
# the Dispatcher agrees on its resolved settings too): the rest (backend, timeout) are local.
_AGREED = ("num_chunks", "strict", "max_chunks", "end_check", "dedup", "dispatch_dtype", "dispatch_scales",
           "direct_min_bytes")
_DEFAULTS = {k: p.default for k, p in inspect.signature(Dispatcher.__init__).parameters.items() if k in _AGREED}
# torchtitan's dispatchers moe_comm takes the place of (exact classes: a subclass may compute another function)
_REPLACEABLE = (LocalTokenDispatcher, AllToAllTokenDispatcher)
_WHY_NOT = {
    "TorchAOTokenDispatcher": "it pads each expert's rows to a multiple for quantized (FP8/MXFP8) grouped GEMMs; "
                              "moe_comm hands the experts unpadded rows",
    "HybridEPTokenDispatcher": "it is another transport (HybridEP kernels; with non_blocking_capacity_factor it "
                               "drops tokens, moe_comm is dropless)",
    "DeepEPTokenDispatcher": "it is another transport (DeepEP kernels)",
    "MinimalAsyncEPTokenDispatcher": "it is another transport (symmetric-memory kernels)",
}


class MoeCommRoutedExperts(RoutedExperts):
    """torchtitan's ``RoutedExperts`` with dispatch and combine through moe_comm (``apply_moe_comm`` makes a
    module one of these in place). Attributes it adds: ``moe_comm_dispatcher`` (the Dispatcher) and
    ``moe_comm_monitor`` (a ``LoadMonitor`` or None). ``token_dispatcher`` stays (torchtitan's ``parallelize``
    wires its mesh) and is not called."""

    moe_comm_dispatcher: Dispatcher
    moe_comm_monitor: Optional[LoadMonitor]

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor, topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """The same contract as ``RoutedExperts.forward`` (argument names included: torchtitan's sharding
        config refers to them): tokens, their top-K routing weights and global expert ids, this rank's
        routed slots per expert [E] (the monitor's counts) -> the routed experts' output [B, L, D], x's dtype.

        Collective over the EP group. A failure on any rank (this module's checks, the experts raising)
        raises on every rank (moe_comm's failure protocol), naming the rank."""
        d = self.moe_comm_dispatcher
        if d.sync_free:  # agreed when the Dispatcher was built: every rank raises here alike
            raise ValueError("MoeCommRoutedExperts: moe_comm_dispatcher is in the sync-free mode "
                             "(max_tokens_per_rank), which apply_moe_comm does not build; use its Dispatcher")
        error = _local_experts_error(self.inner_experts, d.num_local_experts, d.num_experts)
        if error is None:
            error = _inputs_error(x_BLD, topk_scores_BLK, topk_expert_ids_BLK)
        if error is not None:
            d.fail(error)  # joins the call's control exchange: every rank raises, naming this one
            raise error  # not reached: fail() returns only in the sync-free mode, refused above
        B, L, D = x_BLD.shape
        K = topk_expert_ids_BLK.shape[-1]
        x_TD = x_BLD.reshape(B * L, D)
        recompute = in_backward()  # activation checkpointing's recompute: the load was counted in the first pass
        monitor = self.moe_comm_monitor if self.training and not recompute else None
        try:
            y_TD = d(x_TD, topk_expert_ids_BLK.reshape(B * L, K), topk_scores_BLK.reshape(B * L, K),
                     self.inner_experts)
        except Exception:
            # This rank failed alone after the call's last exchange (its final unpermute): its peers returned
            # and issue the monitor's all_reduce; issue it too (zero counts) so the collectives stay paired. The
            # failure reaches the peers with the next exchange.
            channel = d.channel
            if monitor is not None and channel.late is not None and channel.late_call == channel.call:
                monitor.observe(torch.zeros_like(num_local_tokens_per_expert_E), group=d.group, timeout=d.timeout)
            raise
        if monitor is not None:  # every rank returned from the call: every rank issues the all_reduce
            monitor.observe(num_local_tokens_per_expert_E.detach(), group=d.group, timeout=d.timeout)
        return y_TD.view(B, -1, D)

    def parallelize(self, parallel_dims) -> None:
        """torchtitan's ``parallelize`` (experts sharded over the EP mesh, its local_map region), then a check
        that its EP mesh is the group moe_comm dispatches over."""
        super().parallelize(parallel_dims)
        mesh = parallel_dims.get_optional_mesh("ep")
        d = self.moe_comm_dispatcher
        theirs = None if mesh is None else dist.get_process_group_ranks(mesh.get_group())
        ours = None if d.group is None else dist.get_process_group_ranks(d.group)
        if theirs is None and d.world_size > 1:  # the same parallel_dims on every rank: every rank raises
            raise ValueError(f"apply_moe_comm: ep_mesh holds ranks {ours} but torchtitan's EP is off "
                             "(parallel_dims has no EP mesh: expert_parallel_degree 1, the experts are not "
                             "sharded); its local dispatch moves no tokens between ranks: do not call "
                             "apply_moe_comm, or turn EP on and pass ep_mesh=parallel_dims.get_mesh('ep')")
        if theirs is not None and theirs != ours:
            raise ValueError(f"apply_moe_comm: ep_mesh holds ranks {ours} but torchtitan's parallel_dims EP mesh "
                             f"holds {theirs}; pass ep_mesh=parallel_dims.get_mesh('ep')")


def _inputs_error(x_BLD, topk_scores_BLK, topk_expert_ids_BLK) -> Optional[ValueError]:
    """The shapes the forward reshapes by (checked before the call's control exchange, so that a wrong one on
    one rank raises on every rank instead of leaving its peers in the exchange); the Dispatcher checks the rest
    (dtypes, devices, expert ids)."""
    for name, t in (("x_BLD", x_BLD), ("topk_scores_BLK", topk_scores_BLK),
                    ("topk_expert_ids_BLK", topk_expert_ids_BLK)):
        if not isinstance(t, torch.Tensor):
            return ValueError(f"MoeCommRoutedExperts: {name} must be a tensor, got {type(t).__name__}")
    if x_BLD.dim() != 3:
        return ValueError(f"MoeCommRoutedExperts: x_BLD must be [B, L, D] (3-D, as torchtitan's MoE passes it), "
                          f"got shape {tuple(x_BLD.shape)}")
    want = tuple(x_BLD.shape[:2])
    if topk_expert_ids_BLK.dim() != 3 or tuple(topk_expert_ids_BLK.shape[:2]) != want:
        return ValueError(f"MoeCommRoutedExperts: topk_expert_ids_BLK must be [B, L, K] with B, L = {want} "
                          f"(x_BLD's), got shape {tuple(topk_expert_ids_BLK.shape)}")
    if topk_scores_BLK.shape != topk_expert_ids_BLK.shape:
        return ValueError(f"MoeCommRoutedExperts: topk_scores_BLK must have topk_expert_ids_BLK's shape "
                          f"{tuple(topk_expert_ids_BLK.shape)}, got {tuple(topk_scores_BLK.shape)}")
    return None


def _local_shape(p: torch.Tensor) -> Tuple[int, ...]:
    return tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape)


def _local_experts_error(experts: nn.Module, e: int, E: int) -> Optional[ValueError]:
    """The inner experts must hold this rank's e experts (dim 0 of every parameter, DTensors by their local
    shard): moe_comm hands them rows and counts of e experts."""
    for name, p in experts.named_parameters():
        n = _local_shape(p)[0] if p.dim() else None
        if n != e:
            return ValueError(
                f"apply_moe_comm: routed_experts.inner_experts.{name} holds {n} experts on this rank, moe_comm "
                f"sends it the rows of E / W = {E} / {E // e} = {e}: shard the experts over the EP mesh (torchtitan's "
                "model.parallelize(parallel_dims) does, after apply_moe_comm), or build them with e experts")
    return None


def _split_options(options: dict) -> Tuple[dict, object]:
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"apply_moe_comm: unknown option(s) {unknown}; options are {sorted(_OPTIONS)} "
                        "(routing, dropless dispatch and shared experts are the torchtitan model's own)")
    monitor = options.get("monitor", False)
    if isinstance(monitor, LoadMonitor):
        raise TypeError("apply_moe_comm: monitor must be True, False/None or a dict of LoadMonitor options "
                        "(one monitor per MoE module is built from it), got a LoadMonitor instance")
    return {k: v for k, v in options.items() if k in DISPATCHER_OPTIONS}, monitor


def _find(model: nn.Module) -> List[Tuple[str, RoutedExperts]]:
    """The routed-experts region of every torchtitan MoE module; raises naming what moe_comm cannot take."""
    found = []
    for name, m in model.named_modules():
        if not isinstance(m, MoE):
            continue
        r = m.routed_experts
        where = f"{name}.routed_experts" if name else "routed_experts"
        if isinstance(r, MoeCommRoutedExperts):
            raise ValueError(f"apply_moe_comm: {where} already dispatches through moe_comm (applied twice)")
        if type(r) is not RoutedExperts:
            raise ValueError(f"apply_moe_comm: {where} is a {type(r).__name__}, not torchtitan's RoutedExperts "
                             "(a subclass may dispatch another way; fully_shard before apply_moe_comm makes one too)")
        if r.__dict__.get("_parallelized") or "forward" in r.__dict__:
            raise ValueError(f"apply_moe_comm: {where} is already parallelized (torchtitan wrapped its forward in "
                             "model.parallelize); call apply_moe_comm before model.parallelize(parallel_dims)")
        td = r.token_dispatcher
        if type(td) not in _REPLACEABLE:
            why = _WHY_NOT.get(type(td).__name__, "moe_comm replaces only the all-to-all and local dispatchers")
            raise ValueError(f"apply_moe_comm: {where}.token_dispatcher is a {type(td).__name__}: {why}. Configure "
                             "the standard dispatcher (comm_backend='standard': AllToAllTokenDispatcher); moe_comm "
                             "then takes its place")
        owner = next((c for c in type(r.inner_experts).__mro__ if "_grouped_mm" in c.__dict__), None)
        if isinstance(r.inner_experts, GroupedExperts) and owner is not GroupedExperts:
            raise ValueError(f"apply_moe_comm: {where}.inner_experts is a {type(r.inner_experts).__name__} whose "
                             f"_grouped_mm is {owner.__name__}'s, not torchtitan's GroupedExperts' (a quantization "
                             "converter's: its FP8/MXFP8 grouped GEMM needs each expert's rows padded to a multiple, "
                             "as TorchAOTokenDispatcher pads them); moe_comm hands the experts unpadded rows")
        if td.num_experts != m.router.num_experts:
            raise ValueError(f"apply_moe_comm: {where}: the token dispatcher has num_experts={td.num_experts}, "
                             f"the router {m.router.num_experts}")
        found.append((where, r))
    return found


def apply_moe_comm(model: nn.Module, ep_mesh=None, **options) -> int:
    """Make every torchtitan MoE module of ``model`` dispatch its tokens through moe_comm, in place.

    Args:
        model: a torchtitan model (or one ``MoE`` module), on any device including meta; every rank of the EP
            group calls this with the same model structure (construction is collective).
        ep_mesh: the EP mesh: a 1-D ``DeviceMesh`` (``parallel_dims.get_mesh("ep")``) or a ProcessGroup.
            Global expert g lives on its rank g // (E / W), as torchtitan's EP sharding (Shard(0)) puts it.
            None only in one process without torch.distributed (W = 1); with torch.distributed initialised
            it raises ValueError: it is what ``parallel_dims.get_optional_mesh("ep")`` returns when EP is off,
            where torchtitan's local dispatch moves no tokens between ranks (nothing for moe_comm to do).
        options: Dispatcher arguments, the same for every MoE module: ``num_chunks`` (C, int or "auto":
            the pipelined call overlaps chunk c's experts with the other chunks' transfers), ``backend``,
            ``strict``, ``timeout``, ``direct_min_bytes``, ``max_chunks``, ``end_check``, ``dedup``,
            ``dispatch_dtype`` (torch.float8_e4m3fn: FP8 dispatch), ``dispatch_scales``; and ``monitor``
            (False default; True or a dict of ``LoadMonitor`` options: one monitor per module,
            ``routed_experts.moe_comm_monitor``, fed torchtitan's per-expert counts in every training forward,
            summed over the EP group with one async all_reduce). See ``moe_comm.Dispatcher``. Whether a
            monitor is on and the options that change the collectives (all but ``backend``, ``timeout``)
            must be equal on every rank: a difference raises ValueError on every rank, naming the option.
    Returns: the number of MoE modules changed (0 for a model without torchtitan MoE modules).
    Raises on every rank of the EP group (none waits for another): TypeError for an unknown option,
    ValueError naming the argument for a bad value (Dispatcher's checks) or the module and the reason for
    what moe_comm cannot honour: a token dispatcher other than torchtitan's all-to-all / local one
    (TorchAO's padded rows, DeepEP / HybridEP / MinimalAsyncEP transports), a RoutedExperts subclass, a
    module already parallelized by torchtitan (apply before ``model.parallelize``), inner experts with a
    quantization converter's ``_grouped_mm`` (it needs padded rows), a 2-D ``ep_mesh``, ``ep_mesh=None`` with
    torch.distributed initialised (EP off).
    Nothing is changed when anything raises.
    """
    who = "apply_moe_comm"
    if getattr(ep_mesh, "ndim", 1) != 1:  # the same object on every rank: every rank raises here alike
        raise ValueError(f"{who}: ep_mesh must be a 1-D DeviceMesh (parallel_dims.get_mesh('ep')), a ProcessGroup "
                         f"or None, got a {ep_mesh.ndim}-D DeviceMesh")
    if ep_mesh is None and dist.is_available() and dist.is_initialized():  # the same on every rank (EP config)
        raise ValueError(f"{who}: ep_mesh is None: EP is off (parallel_dims.get_optional_mesh('ep') is None at "
                         "expert_parallel_degree 1): torchtitan's local dispatch moves no tokens between ranks, "
                         "nothing for moe_comm to do; leave the model as it is, or turn EP on and pass "
                         "parallel_dims.get_mesh('ep') (or the EP ProcessGroup of a model torchtitan does not "
                         "parallelize)")
    group = resolve_group(ep_mesh, name=f"{who}: ep_mesh")
    W = group_size(group)
    local_error, found, dispatcher_opts, monitor = None, [], {}, False
    try:  # local checks; a rank that fails here still joins the agreement below: every rank raises
        if not isinstance(model, nn.Module):
            raise TypeError(f"{who}: model must be a torch.nn.Module, got {type(model).__name__}")
        dispatcher_opts, monitor = _split_options(options)
        found = _find(model)
        for where, r in found:
            E = r.token_dispatcher.num_experts
            if E % W:
                raise ValueError(f"{who}: {where}: num_experts ({E}) must be divisible by the EP world size ({W})")
            make_monitor(monitor, E, W)  # checks the options before any construction
            # a bad value is named as that on its rank (its peers: RemoteError), not as a difference between ranks
            check_options(E, W, **{k: v for k, v in dispatcher_opts.items() if k != "strict"})
    except (TypeError, ValueError) as err:
        local_error = err
    # Collective: every rank learns of a rank's error and raises; every rank builds as many Dispatchers and
    # issues the same collectives (a monitor adds an all_reduce per training forward).
    values = {"MoE modules": [where for where, _ in found], "monitor": not (monitor is None or monitor is False)}
    values.update({k: dispatcher_opts.get(k, _DEFAULTS[k]) for k in _AGREED})
    agree(group, values, what=who, local_error=local_error, timeout=options.get("timeout"))
    built = []
    for where, r in found:  # each Dispatcher construction is collective (its own agreement on the options)
        E = r.token_dispatcher.num_experts
        built.append((Dispatcher(E, group, **dispatcher_opts), make_monitor(monitor, E, W)))
    for (where, r), (d, mon) in zip(found, built):  # nothing changes until every Dispatcher was built
        r.__class__ = MoeCommRoutedExperts
        r.moe_comm_dispatcher = d
        r.moe_comm_monitor = mon
    return len(found)
