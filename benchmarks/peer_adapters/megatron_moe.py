"""Megatron-Core (tested with 0.16.1): ``megatron.core.transformer.moe.moe_layer.MoELayer`` with its
``TopKRouter``, ``MoEAlltoAllTokenDispatcher`` (``moe_token_dispatcher_type="alltoall"``) and
``SequentialMLP`` experts (one local MLP of ColumnParallelLinear/RowParallelLinear per expert: the expert
class that needs neither Transformer Engine (TEGroupedMLP) nor CUDA grouped_gemm and bf16 (GroupedMLP)),
expert-parallel over ``group``, on CPU.

Process groups: no ``parallel_state.initialize_model_parallel`` (no global state: ``build`` can run any
number of times, and EP is exactly ``group``). The layer gets a ``ProcessGroupCollection``: ep and tp_ep
= ``group``; tp, cp, expt_tp, expt_dp, tp_cp, tp_dp_cp = a one-rank group of the default backend (gloo
here), made once per default group with ``new_group([rank], use_local_synchronization=True)``.

Config (``TransformerConfig``), to compute moe_comm's function: softmax scores with
``moe_router_pre_softmax=False`` (top-k of the logits, then softmax over the k chosen: softmax over all E
renormalised over the top k, as ``norm_topk_prob=True``; set after validation, which refuses it at K=1
since the top-1 weight is then always 1 and the router gets no gradient, as in moe_comm at K=1), no
scaling factor, no expert bias, no group limit, ``moe_router_load_balancing_type="none"``,
``moe_aux_loss_coeff=0``, no z-loss, no input jitter, no capacity factor (dropless); no fusions (router,
permute, bias-activation: TE/CUDA kernels); ``gated_linear_unit=True``, ``activation_func=F.silu``,
``add_bias_linear=False``; float32 params, bf16 and fp16 off; ``use_cpu_initialization=True``,
``perform_initialization=False`` (weights are copied); ``cuda_graph_scope=[]`` (the default "full" only
warns that it is deprecated; no CUDA graphs either way). The layer stays in training mode.
Weights (copies): router ``weight`` [E, H] = ref.router.weight; local expert i (global ``rank * e + i``
in Megatron's numbering too) gets ``linear_fc1.weight`` [2F, H] = cat(w1[i], w3[i]) (Megatron's GLU
applies the activation to the first half) and ``linear_fc2.weight`` [H, F] = w2[i]. Megatron scales the
activation by the routing probability before fc2 where moe_comm scales the expert output: equal up to
rounding.

Stubs (what Megatron 0.16.1 reaches for that has no CPU path):
- ``torch.cuda.current_device`` -> ``torch.device("cpu")``, only while this module's forward runs and
  during its backward pass (turned on by an identity node on the output, off by an autograd-engine
  callback at the end of that backward pass). Used by ``TopKRouter.gating`` (moves a CPU router weight to
  the current device) and ``tensor_parallel.mappings._AllToAll`` (allocates the all-to-all output there,
  forward and backward).
- ``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream`` (class attribute): a placeholder while the layer is
  built, restored after, so that ``__init__`` does not create a ``torch.cuda.Stream``.
- ``_maybe_dtoh_and_synchronize`` of this layer's dispatcher instance: Megatron's copies what it needs on
  the host (the all-to-all splits as numpy arrays) on a side CUDA stream and synchronises it; everything
  is on the host here, so the replacement only turns the splits into numpy arrays at the same point
  (``all_to_all_single`` takes no tensor splits), without streams.
- ``megatron.core.transformer.moe.moe_utils.te_general_gemm = None`` when that name is missing: 0.16.1
  defines it only when Transformer Engine imports, yet ``RouterGatingLinearFunction`` tests
  ``te_general_gemm is not None`` (NameError without TE); None selects its torch.mm path. Left in place:
  it only defines the name that module's own fallback expects.
"""
from __future__ import annotations

import types
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

NAME = "Megatron-Core"
INSTALL = "pip install megatron-core==0.16.1"

_NO_APEX = r".*Apex (is|are) not installed"  # UserWarnings of megatron.core imports without TE/Apex


def _import():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_APEX)
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe import moe_utils
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.transformer_config import TransformerConfig
    return types.SimpleNamespace(spec=get_moe_module_spec, PGs=ProcessGroupCollection, moe_utils=moe_utils,
                                 Dispatcher=MoEAlltoAllTokenDispatcher, build_module=build_module,
                                 Config=TransformerConfig)


def missing():
    try:
        mg = _import()
    except Exception as err:  # ImportError, or a dependency failing at import
        return f"megatron-core not importable: {type(err).__name__}: {err}"
    if not hasattr(mg.Dispatcher, "_maybe_dtoh_and_synchronize") or not hasattr(mg.Dispatcher, "cuda_dtoh_stream"):
        return "megatron-core's MoEAlltoAllTokenDispatcher lacks the hooks this adapter stubs (written for 0.16.1)"
    return None


# torch.cuda.current_device stub: on while the layer's forward or backward runs (nesting counted).
_stub = {"depth": 0, "saved": None}


def _cpu_device(*args, **kwargs):
    return torch.device("cpu")


def _stub_on():
    if _stub["depth"] == 0:
        _stub["saved"] = torch.cuda.current_device
        torch.cuda.current_device = _cpu_device
    _stub["depth"] += 1


def _stub_off():
    if _stub["depth"] == 0:
        return
    _stub["depth"] -= 1
    if _stub["depth"] == 0:
        torch.cuda.current_device = _stub["saved"]


class _StubInBackward(torch.autograd.Function):
    """Identity on the layer's output; its backward, the first of the layer's backward, turns the stub on
    until the end of the backward pass."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        _stub_on()
        torch.autograd.Variable._execution_engine.queue_callback(_stub_off)
        return g


def _host_dtoh(dispatcher, point, tokens_per_expert=None):
    """Megatron's _maybe_dtoh_and_synchronize without CUDA streams."""
    if point == dispatcher.cuda_dtoh_point and not dispatcher.drop_and_pad:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(dispatcher, name)
            if torch.is_tensor(value):
                setattr(dispatcher, name, value.numpy())
    return tokens_per_expert


_one_rank = {}  # default group -> this rank's one-rank group


def _one_rank_group():
    world = dist.group.WORLD
    if world not in _one_rank:
        _one_rank.clear()
        _one_rank[world] = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return _one_rank[world]


class MegatronMoE(nn.Module):
    """forward(x_TH) -> y_TH through Megatron's MoELayer, which takes [S, B, H] = [T, 1, H]."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x_TH):
        _stub_on()
        try:
            y_SBH, bias = self.layer(x_TH.unsqueeze(1))
        finally:
            _stub_off()
        assert bias is None
        y_TH = y_SBH.squeeze(1)
        return _StubInBackward.apply(y_TH) if y_TH.requires_grad else y_TH


def build(ref, group) -> nn.Module:
    mg = _import()
    c = ref.cfg
    if not (c.score_func == "softmax" and c.norm_topk_prob and c.num_groups is None and c.capacity_factor is None
            and c.route_scale == 1.0 and c.num_shared_experts == 0 and c.router_dtype in (None, torch.float32)):
        raise ValueError(f"megatron_moe adapter: ref.cfg outside softmax / norm_topk_prob / dropless / float32: {c}")
    group = group.get_group() if hasattr(group, "get_group") else group  # a 1-D DeviceMesh
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    w1, w3, w2 = ref.experts.w1, ref.experts.w3, ref.experts.w2  # [e, F, H], [e, F, H], [e, H, F]
    e, F_, H = w1.shape
    assert c.num_experts == e * W, (c.num_experts, e, W)

    cfg = mg.Config(
        num_layers=1, hidden_size=H, num_attention_heads=1, ffn_hidden_size=F_, moe_ffn_hidden_size=F_,
        num_moe_experts=c.num_experts, moe_router_topk=c.top_k, moe_router_score_function="softmax",
        moe_router_pre_softmax=c.top_k == 1, moe_router_topk_scaling_factor=None, moe_router_enable_expert_bias=False,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
        moe_input_jitter_eps=None, moe_expert_capacity_factor=None, moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False, bias_activation_fusion=False,
        expert_model_parallel_size=W, add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
        params_dtype=torch.float32, bf16=False, fp16=False, use_cpu_initialization=True,
        perform_initialization=False, cuda_graph_scope=[])
    cfg.moe_router_pre_softmax = False  # after validation, which refuses it at K=1 (see the docstring)
    one = _one_rank_group()
    pgs = mg.PGs(ep=group, tp_ep=group, tp=one, cp=one, expt_tp=one, expt_dp=one, tp_cp=one, tp_dp_cp=one)

    saved_stream = mg.Dispatcher.cuda_dtoh_stream
    if saved_stream is None:
        mg.Dispatcher.cuda_dtoh_stream = object()  # not None: __init__ skips torch.cuda.Stream()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_APEX)
            spec = mg.spec(use_te=False, num_experts=c.num_experts, moe_grouped_gemm=False)
            layer = mg.build_module(spec, config=cfg, pg_collection=pgs)
    finally:
        mg.Dispatcher.cuda_dtoh_stream = saved_stream
    layer.token_dispatcher._maybe_dtoh_and_synchronize = types.MethodType(_host_dtoh, layer.token_dispatcher)
    if not hasattr(mg.moe_utils, "te_general_gemm"):
        mg.moe_utils.te_general_gemm = None
    assert layer.local_expert_indices == list(range(rank * e, (rank + 1) * e))

    with torch.no_grad():
        layer.router.weight.copy_(ref.router.weight)
        for i, expert in enumerate(layer.experts.local_experts):
            expert.linear_fc1.weight.copy_(torch.cat([w1[i], w3[i]], dim=0))
            expert.linear_fc2.weight.copy_(w2[i])
    return MegatronMoE(layer)
