"""Megatron-Core interop: moe_comm as the token dispatcher of Megatron-Core's ``MoELayer`` (tested with 0.16.1).

Shapes legend: S sequence, B micro-batch, T = S x B tokens of this rank, H hidden, E experts (global), e = E / W
experts on this rank, K top-k (``moe_router_topk``), W EP world size, R rows received by this rank.

    from moe_comm.integrations.megatron import use_moe_comm
    model = GPTModel(config, get_gpt_layer_local_spec(num_experts=E, ...), ...)   # built as usual
    n = use_moe_comm(model)                            # every MoELayer's token_dispatcher -> moe_comm, in place
    n = use_moe_comm(model, dispatch_dtype=torch.float8_e4m3fn)                  # FP8 dispatch

Megatron-Core 0.16.1 picks its dispatcher with an if/elif on ``config.moe_token_dispatcher_type`` inside
``MoELayer.__init__`` (allgather | alltoall | flex; any other value raises there), so a new type cannot be
registered without editing the library. ``use_moe_comm`` instead replaces the ``token_dispatcher`` attribute
of every built ``MoELayer`` with a ``MoeCommTokenDispatcher`` (a ``MoETokenDispatcher`` subclass with the
alltoall dispatcher's constructor signature): the router, the experts (SequentialMLP, GroupedMLP,
TEGroupedMLP), the shared experts and every parameter stay as Megatron built them, so state-dict keys and
checkpoints are unchanged and load both ways.

How the layer's seven dispatcher steps map onto moe_comm's ``Dispatcher``:

    dispatch_preprocess(hidden [S, B, H], routing_map [T, E] bool, probs [T, E])
        -> topk_idx_TK (each token's chosen experts in ascending id order, -1 for a slot the router dropped)
           and topk_weight_TK = probs at those experts
    token_dispatch     -> Dispatcher.dispatch(x_TH, topk_idx_TK): rows [R, H] expert-major, counts [e]
    dispatch_postprocess -> (rows, tokens_per_expert [e] int64 on the host, ones [R])
    experts            -> Megatron's own, on those rows; their per-row probability is 1 ...
    combine_preprocess -> identity
    token_combine      -> Dispatcher.combine(expert_out, topk_weight_TK, handle): ... the K weights are
                          applied here, summed in slot order (Megatron scales the activation before fc2, and
                          fc2's bias with it: the same function, linear in the weight; equal to rounding)
    combine_postprocess -> y [S, B, H]

``dispatch()``/``combine()`` (not the pipelined call): Megatron's layer calls its experts itself between
``token_dispatch`` and ``token_combine``, so the dispatcher cannot run them chunk by chunk. ``use_moe_comm``
therefore also guards the layer's ``routed_experts_compute`` (dispatch_postprocess -> experts ->
combine_preprocess): an exception there is held, a placeholder goes on, and ``token_combine`` sends it in
combine's control exchange (``Dispatcher.combine(failed=)``): every rank raises at once, the failing one its
own error, the others ``PeerFailed`` naming it. An exception in the experts' backward is not covered (see
docs/megatron.md).

Supported: softmax / sigmoid scores, pre-softmax, group-limited routing, expert bias (aux-loss-free), top-k
scaling factor, aux / seq-aux / global-aux / z losses (all in Megatron's router, untouched), dropless and
capacity dropping (``moe_expert_capacity_factor`` with either ``moe_token_drop_policy``: dropped slots move
no row), shared experts computed by the layer (``moe_shared_expert_overlap=False``), ``moe_apply_probs_on_input``
(K = 1: the token is scaled before it is sent), any expert class, any dtype, FP8 dispatch (``dispatch_dtype``).
Raises (ValueError naming the config field, on every EP rank alike): expert tensor parallelism
(``expert_tensor_parallel_size`` > 1), ``moe_shared_expert_overlap``, ``moe_pad_expert_input_to_capacity``,
``moe_router_padding_for_quantization``, ``overlap_moe_expert_parallel_comm`` and CUDA graphs over the MoE
dispatch (``cuda_graph_scope`` with moe / moe_preprocess); see ``_unsupported``.

Importing this module imports megatron.core (the class subclasses its ``MoETokenDispatcher``); ``import
moe_comm`` never does. The core never imports this module.
"""
from __future__ import annotations

import types
import warnings
from typing import Iterable, List, Optional, Tuple, Union

import torch
from torch import nn

from moe_comm.comm.agree import agree
from moe_comm.comm.wire import Phase
from moe_comm.dispatch.dispatcher import Dispatcher

with warnings.catch_warnings():  # megatron.core warns at import when Transformer Engine / Apex are absent
    warnings.filterwarnings("ignore", message=r".*Apex (is|are) not installed")
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_layer import MoELayer as MegatronMoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

__all__ = ["MoeCommTokenDispatcher", "use_moe_comm", "OPTIONS"]

# Dispatcher arguments a user may set (the rest follow from the layer: E, the EP group).
OPTIONS = ("dispatch_dtype", "dispatch_scales", "backend", "strict", "timeout", "direct_min_bytes")


_SHARED_OVERLAP = ("moe_shared_expert_overlap=True is not supported: it runs the shared experts inside Megatron's "
                   "alltoall dispatcher on CUDA streams; set it False (the MoELayer then computes the shared experts "
                   "itself, which works)")


def _unsupported(config, tp_size: int) -> Optional[str]:
    """Why this config cannot run through moe_comm (None: it can). The same on every rank for the same config."""
    if tp_size != 1:
        return (f"expert_tensor_parallel_size must be 1, got {tp_size}: moe_comm moves rows over the EP group only "
                "(no all-gather / reduce-scatter over expert tensor-parallel ranks)")
    if getattr(config, "moe_shared_expert_overlap", False):
        return _SHARED_OVERLAP
    if getattr(config, "moe_pad_expert_input_to_capacity", False):
        return ("moe_pad_expert_input_to_capacity=True is not supported: moe_comm sends exactly the routed rows "
                "(the router's capacity drops apply), never padding rows to a fixed capacity; set it False")
    if getattr(config, "moe_router_padding_for_quantization", False):
        return ("moe_router_padding_for_quantization=True is not supported: it routes padding slots beyond the "
                "top-k, which moe_comm's [T, K] routing cannot hold; set it False")
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        return ("overlap_moe_expert_parallel_comm=True is not supported: its 1F1B schedule drives the flex "
                "dispatcher's internals; set it False")
    scopes = {getattr(s, "name", str(s)) for s in (getattr(config, "cuda_graph_scope", None) or [])}
    if getattr(config, "cuda_graph_impl", "none") != "none" and ({"moe", "moe_preprocess"} & scopes or not scopes):
        return ("cuda_graph_scope covering the MoE dispatch (moe / moe_preprocess) is not supported: dispatch() "
                "reads the received row counts on the host; keep CUDA graphs to attention / moe_router")
    return None


def _topk_of(routing_map_TE: torch.Tensor, probs_TE: torch.Tensor, top_k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """routing_map [T, E] bool (at most K per row), probs [T, E] -> topk_idx_TK int64 (chosen experts in
    ascending id order; -1 pads a row with fewer than K, i.e. capacity-dropped slots), topk_weight_TK (probs
    there, differentiable). E.g. K = 2, row [F, T, F, T] -> [1, 3]; row [F, F, T, F] -> [2, -1]."""
    T, E = routing_map_TE.shape
    K = min(top_k, E)
    chosen_TE = routing_map_TE.to(torch.int8)
    _, order_TE = torch.sort(chosen_TE, dim=1, descending=True, stable=True)  # chosen first, by expert id
    idx_TK = order_TE[:, :K]
    kept_TK = chosen_TE.gather(1, idx_TK).bool()
    weight_TK = probs_TE.gather(1, idx_TK)
    idx_TK = torch.where(kept_TK, idx_TK, torch.full_like(idx_TK, -1))
    return idx_TK, weight_TK


class MoeCommTokenDispatcher(MoETokenDispatcher):
    """Megatron-Core token dispatcher whose rows move through ``moe_comm.Dispatcher`` (dispatch / combine).

    Args (those of ``MoEAlltoAllTokenDispatcher``):
        num_local_experts: e, experts on this EP rank.
        local_expert_indices: their global ids, ``[ep_rank * e, (ep_rank + 1) * e)`` (moe_comm's placement:
            expert g on EP rank g // e, as Megatron's).
        config: the layer's ``TransformerConfig`` (read at every call: a flag turned on later raises then).
        pg_collection: process groups; ``ep`` is the EP group moe_comm runs on, ``expt_tp`` must have size 1.
        options: ``moe_comm.Dispatcher`` arguments (see ``OPTIONS``): ``dispatch_dtype`` (None or
            torch.float8_e4m3fn: FP8 dispatch, combine and backward stay in the tokens' dtype),
            ``dispatch_scales``, ``backend``, ``strict``, ``timeout``, ``direct_min_bytes``.
    Construction is collective over the EP group (every rank builds its dispatchers in the same order); an
    unsupported config or a bad option raises on every rank (ValueError / TypeError naming it).
    """

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config,
                 pg_collection: Optional[ProcessGroupCollection] = None, **options):
        super().__init__(config=config, pg_collection=pg_collection)
        who = "MoeCommTokenDispatcher"
        error = None
        try:  # local checks; a rank that fails still joins the agreement below: every rank raises
            unknown = sorted(set(options) - set(OPTIONS))
            if unknown:
                raise TypeError(f"{who}: unknown option(s) {unknown}; expected some of {list(OPTIONS)}")
            reason = _unsupported(config, self.tp_size)
            if reason is not None:
                raise ValueError(f"{who}: {reason}")
            E = config.num_moe_experts
            if E is None or num_local_experts * self.ep_size != E:
                raise ValueError(f"{who}: num_local_experts ({num_local_experts}) x EP size ({self.ep_size}) must "
                                 f"equal config.num_moe_experts ({E})")
            ep_rank = self.ep_group.rank() if self.ep_size > 1 else 0
            want = list(range(ep_rank * num_local_experts, (ep_rank + 1) * num_local_experts))
            if list(local_expert_indices) != want:
                raise ValueError(f"{who}: local_expert_indices must be {want} (expert g on EP rank g // e), got "
                                 f"{list(local_expert_indices)}")
        except (TypeError, ValueError) as err:
            error = err
        group = self.ep_group  # a one-rank group at EP 1: W = 1, no collectives (never WORLD)
        agree(group, {"num_moe_experts": config.num_moe_experts, "moe_router_topk": config.moe_router_topk},
              what=who, local_error=error, timeout=options.get("timeout"))
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        # One Dispatcher per layer; its construction checks the options (a bad one raises on every rank).
        self.dispatcher = Dispatcher(self.num_experts, group, **options)
        self._call = None  # (hidden shape, topk_weight_TK, handle) between dispatch_preprocess and token_combine
        self._experts_error: Optional[BaseException] = None  # held by the guarded routed_experts_compute

    def hold_experts_error(self, error: BaseException) -> bool:
        """Keep ``error`` (the layer's experts raised between token_dispatch and token_combine) for
        token_combine to send in combine's control exchange. False when no dispatch is open (the caller
        re-raises it: nothing would carry it to the peers)."""
        if self._call is None or self._call[3] is None:
            return False
        self._experts_error = error
        return True

    def _fail(self, error: BaseException) -> None:
        """Join the dispatch's control exchange with ``error``: every rank raises (this one re-raises it)."""
        pending, _ = self.dispatcher._open(Phase.DISPATCH, None, None, 1, local_error=error)
        self.dispatcher.channel.end(pending)
        raise error  # one process: end() re-raised it already

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """hidden_states [S, B, H] (or [T, H]), routing_map [T, E] bool, probs [T, E] -> (x_TH, topk_weight_TK).
        A rejected input or config raises on every EP rank (through the dispatch's control exchange)."""
        try:
            reason = _unsupported(self.config, self.tp_size)
            if reason is not None:
                raise ValueError(f"MoeCommTokenDispatcher: {reason}")
            H = hidden_states.shape[-1]
            T = hidden_states.numel() // max(H, 1)
            E = self.num_experts
            if routing_map.dtype != torch.bool or tuple(routing_map.shape) != (T, E):
                raise ValueError(f"routing_map must be [T, E] = [{T}, {E}] bool, got {tuple(routing_map.shape)} "
                                 f"{routing_map.dtype}")
            if tuple(probs.shape) != (T, E) or not probs.is_floating_point():
                raise ValueError(f"probs must be [T, E] = [{T}, {E}] float, got {tuple(probs.shape)} {probs.dtype}")
            x_TH = hidden_states.reshape(T, H)
            idx_TK, weight_TK = _topk_of(routing_map, probs, self.config.moe_router_topk)
        except (TypeError, ValueError) as err:
            self._fail(err)
        if self.config.moe_apply_probs_on_input:  # K = 1 (Megatron checks): the expert sees prob * x
            x_TH = (weight_TK[:, :1] * x_TH).to(x_TH.dtype)
            weight_TK = torch.ones_like(weight_TK).detach()
        self._call = (hidden_states.shape, idx_TK, weight_TK, None)
        return x_TH, weight_TK

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """x_TH -> (rows [R, H] expert-major, ones [R]): moe_comm's dispatch (one host sync: the counts)."""
        shape, idx_TK, weight_TK, _ = self._call
        out = self.dispatcher.dispatch(hidden_states, idx_TK)
        self._call = (shape, None, weight_TK, out)
        ones_R = torch.ones(out.tokens.shape[0], dtype=probs.dtype, device=out.tokens.device)
        return out.tokens, ones_R

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """-> (rows [R, H], tokens_per_expert [e] int64 on the host (known: no sync), per-row probability 1)."""
        out = self._call[3]
        return hidden_states, torch.tensor(out.counts, dtype=torch.int64), probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """expert outputs [R, H] -> y_TH: moe_comm's combine, the K routing weights applied (slot order).
        After the experts raised on this rank (held by the guarded routed_experts_compute; hidden_states is
        then a placeholder, not read) combine carries that error: every rank raises here."""
        shape, _, weight_TK, out = self._call
        failed, self._experts_error = self._experts_error, None
        self._call = (shape, None, None, None)
        return self.dispatcher.combine(hidden_states, weight_TK, out.handle, failed=failed)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = self._call[0]
        self._call = None
        return hidden_states.view(shape)

    def set_shared_experts(self, shared_experts) -> None:
        raise ValueError(f"MoeCommTokenDispatcher: {_SHARED_OVERLAP}")


def _moe_layers(model: Union[nn.Module, Iterable[nn.Module]]) -> List[Tuple[str, MegatronMoELayer]]:
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    if not all(isinstance(c, nn.Module) for c in chunks):
        raise TypeError(f"use_moe_comm: model must be an nn.Module or a list of them (model chunks), got "
                        f"{type(model).__name__}")
    return [(f"{i}.{name}" if len(chunks) > 1 else name, m) for i, c in enumerate(chunks)
            for name, m in c.named_modules() if isinstance(m, MegatronMoELayer)]


def _guarded_routed_experts_compute(layer: MegatronMoELayer, hidden_states: torch.Tensor, probs: torch.Tensor):
    """``MoELayer.routed_experts_compute`` (dispatch_postprocess -> experts -> combine_preprocess), bound to a
    layer by ``use_moe_comm``. An exception there, while moe_comm's dispatch is open, is held by the token
    dispatcher and a placeholder (zeros like the rows [R, H], no bias: Megatron's MoELayer asserts None) goes
    on to token_combine, which sends the error in combine's control exchange: every rank raises there."""
    try:
        return type(layer).routed_experts_compute(layer, hidden_states, probs)
    except Exception as err:  # noqa: BLE001 - held for the collective raise in token_combine
        td = layer.token_dispatcher
        if not isinstance(td, MoeCommTokenDispatcher) or not td.hold_experts_error(err):
            raise
        return torch.zeros_like(hidden_states), None


_GUARD = "routed_experts_compute"


def _ep_group_ranks(group) -> Optional[List[int]]:
    import torch.distributed as dist
    return None if group is None else dist.get_process_group_ranks(group)


def use_moe_comm(model: Union[nn.Module, Iterable[nn.Module]], *, ep_group=None, **options) -> int:
    """Make moe_comm the token dispatcher of every Megatron-Core ``MoELayer`` in ``model``, in place.

    Args:
        model: a Megatron-Core model (e.g. ``GPTModel``), a list of model chunks, or one ``MoELayer``; every
            rank of the EP group calls this with the same structure (dispatcher construction is collective).
        ep_group: the EP ProcessGroup, for a rank whose chunks hold no MoE layer (a pipeline stage of dense
            layers) to join the agreement its EP peers make; None (default): the layers' own group, else
            Megatron's global EP group (``parallel_state``) when initialised. A rank with no MoE layer and
            no group returns 0 without a collective. With layers, it must be theirs.
        options: ``moe_comm.Dispatcher`` arguments for every layer (see ``OPTIONS`` and
            ``MoeCommTokenDispatcher``).
    Returns: the number of MoE layers switched (0 when there is none).
    Each layer keeps its router, experts, shared experts and parameters (state-dict keys unchanged); its
    ``token_dispatcher`` becomes a ``MoeCommTokenDispatcher`` on the layer's EP group, and its
    ``routed_experts_compute`` is guarded (an instance attribute): an exception in the experts raises on
    every EP rank at token_combine (``PeerFailed`` on the others) instead of leaving the peers waiting. An
    unsupported config, a bad option, or MoE layers that differ across the EP group raise on every rank
    before any layer changes: the message names the field and the reason.
    """
    who = "use_moe_comm"
    layers = _moe_layers(model)
    group = layers[0][1].token_dispatcher.ep_group if layers else ep_group
    if group is None:
        from megatron.core import parallel_state
        group = parallel_state.get_expert_model_parallel_group(check_initialized=False)
    error = None
    try:
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"{who}: unknown option(s) {unknown}; expected some of {list(OPTIONS)}")
        for name, layer in layers:
            reason = _unsupported(layer.config, layer.token_dispatcher.tp_size)
            if reason is not None:
                raise ValueError(f"{who}: MoE layer {name!r}: {reason}")
            if _GUARD in layer.__dict__ and getattr(layer.__dict__[_GUARD], "__func__", None) \
                    is not _guarded_routed_experts_compute:
                raise ValueError(f"{who}: MoE layer {name!r}: its {_GUARD} is replaced on the instance; moe_comm "
                                 f"guards the class's {_GUARD} and would bypass that replacement")
        if layers and ep_group is not None and _ep_group_ranks(ep_group) != _ep_group_ranks(group):
            raise ValueError(f"{who}: ep_group holds ranks {_ep_group_ranks(ep_group)} but the MoE layers' EP "
                             f"group holds {_ep_group_ranks(group)}; pass theirs or None")
    except (TypeError, ValueError) as err:
        error = err
    if group is None:  # no layer and no EP group known: nothing to agree on (nothing to switch)
        if error is not None:
            raise error
        return 0
    # Every rank, with layers or none, learns of another's failure and will build as many dispatchers.
    agree(group, {"MoE layers": [name for name, _ in layers]}, what=who, local_error=error,
          timeout=options.get("timeout"))
    built = []
    for _, layer in layers:  # every dispatcher first (each construction collective): a failure switches none
        old = layer.token_dispatcher
        pgs = ProcessGroupCollection(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
        built.append(MoeCommTokenDispatcher(layer.num_local_experts, layer.local_expert_indices, layer.config, pgs,
                                            **options))
    for (_, layer), td in zip(layers, built):
        layer.token_dispatcher = td
        setattr(layer, _GUARD, types.MethodType(_guarded_routed_experts_compute, layer))
    return len(layers)
