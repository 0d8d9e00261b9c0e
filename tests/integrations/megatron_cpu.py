"""Test fixture: Megatron-Core 0.16.1's ``MoELayer`` built and run on CPU gloo ranks (no global parallel_state).

Shapes legend: S sequence, B micro-batch, H hidden, F expert FFN size, E experts, e = E / W, K top-k, W EP size.

What Megatron needs stubbed on CPU, here and nowhere in the library (each named, each narrow):
- ``cpu_current_device``: ``torch.cuda.current_device`` -> cpu while a wrapped layer's forward runs and during
  its backward pass (an identity node on the output turns it on, an autograd-engine callback off). Used by
  ``TopKRouter`` (moves its weight to the current device; aux-loss tensors) and by
  ``tensor_parallel.mappings._AllToAll`` (the alltoall dispatcher's output buffers).
- ``no_dtoh_stream``: ``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream`` (class attribute) holds a placeholder
  while a layer is built, so that the alltoall dispatcher's ``__init__`` creates no ``torch.cuda.Stream``.
- ``host_dtoh``: the alltoall dispatcher instance's ``_maybe_dtoh_and_synchronize`` without CUDA streams
  (turns its split sizes into lists at the same point, where Megatron makes numpy arrays on a side stream;
  everything is on the host already).
- ``moe_utils.te_general_gemm = None`` when missing: 0.16.1 defines it only when Transformer Engine imports,
  yet ``RouterGatingLinearFunction`` tests it (NameError without TE); None selects its torch.mm path.
moe_comm's dispatcher needs none of the dispatcher stubs (no streams); the router still needs the first.
"""
from __future__ import annotations

import contextlib
import types
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

_NO_APEX = r".*Apex (is|are) not installed"

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=_NO_APEX)
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None  # the name Megatron's own no-TE fallback expects (see the docstring)

# ---------------------------------------------------------------- cpu_current_device (nesting counted)
_stub = {"depth": 0, "saved": None}


def _cpu(*args, **kwargs):
    return torch.device("cpu")


def stub_on() -> None:
    if _stub["depth"] == 0:
        _stub["saved"] = torch.cuda.current_device
        torch.cuda.current_device = _cpu
    _stub["depth"] += 1


def stub_off() -> None:
    if _stub["depth"] == 0:
        return
    _stub["depth"] -= 1
    if _stub["depth"] == 0:
        torch.cuda.current_device = _stub["saved"]


@contextlib.contextmanager
def cpu_current_device():
    stub_on()
    try:
        yield
    finally:
        stub_off()


class StubInBackward(torch.autograd.Function):
    """Identity; its backward (the first of the wrapped module's) turns the stub on until the pass ends."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        stub_on()
        torch.autograd.Variable._execution_engine.queue_callback(stub_off)
        return g


# ---------------------------------------------------------------- no_dtoh_stream, host_dtoh
@contextlib.contextmanager
def no_dtoh_stream():
    saved = MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
    if saved is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()  # not None: __init__ skips torch.cuda.Stream()
    try:
        yield
    finally:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = saved


def host_dtoh(dispatcher, point, tokens_per_expert=None):
    """Megatron's ``_maybe_dtoh_and_synchronize`` without CUDA streams (split sizes as Python lists, which the
    NCCL-rules test mode reads as well as gloo does)."""
    if point == dispatcher.cuda_dtoh_point and not dispatcher.drop_and_pad:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(dispatcher, name)
            if torch.is_tensor(value):
                setattr(dispatcher, name, value.tolist())  # lists: what all_to_all_single takes
    return tokens_per_expert


def fix_alltoall(layer) -> None:
    """Give a built layer's alltoall dispatcher the stream-free host copy."""
    if isinstance(layer.token_dispatcher, MoEAlltoAllTokenDispatcher):
        layer.token_dispatcher._maybe_dtoh_and_synchronize = types.MethodType(host_dtoh, layer.token_dispatcher)


# ---------------------------------------------------------------- groups and layers
_one_rank = {}


def one_rank_group():
    """This rank's one-rank gloo group (made once per default group)."""
    world = dist.group.WORLD
    if world not in _one_rank:
        _one_rank.clear()
        _one_rank[world] = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return _one_rank[world]


def pg_collection(ep_group):
    one = one_rank_group()
    return ProcessGroupCollection(ep=ep_group, tp_ep=ep_group, tp=one, cp=one, expt_tp=one, expt_dp=one, tp_cp=one,
                                  tp_dp_cp=one)


def config(*, H=16, F_=24, E=4, K=2, W=1, dtype=torch.float32, **overrides) -> TransformerConfig:
    """A small MoE TransformerConfig: SwiGLU experts without bias, no fusions (TE / CUDA kernels), dropless."""
    kw = dict(num_layers=1, hidden_size=H, num_attention_heads=1, ffn_hidden_size=F_, moe_ffn_hidden_size=F_,
              num_moe_experts=E, moe_router_topk=K, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
              moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, moe_permute_fusion=False,
              moe_router_fusion=False, bias_activation_fusion=False, expert_model_parallel_size=W,
              add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, params_dtype=dtype,
              bf16=dtype == torch.bfloat16, fp16=False, use_cpu_initialization=True, perform_initialization=True,
              cuda_graph_scope=[])
    kw.update(overrides)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_APEX)
        return TransformerConfig(**kw)


def build_layer(cfg: TransformerConfig, ep_group, *, grouped: bool = False, seed: int = 0):
    """Megatron's MoELayer (alltoall dispatcher, SequentialMLP or GroupedMLP experts), weights from ``seed``
    (the same router on every rank)."""
    torch.manual_seed(seed)
    with no_dtoh_stream(), cpu_current_device(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_APEX)
        spec = get_moe_module_spec(use_te=False, num_experts=cfg.num_moe_experts, moe_grouped_gemm=grouped)
        layer = build_module(spec, config=cfg, pg_collection=pg_collection(ep_group))
    fix_alltoall(layer)
    return layer


@torch.no_grad()
def distinct_experts(layer, std: float = 0.2) -> None:
    """Every expert its own weights, seeded by its global id (SequentialMLP's ``local_experts.<i>.*``;
    otherwise by the rank's first expert): one seed for the whole build gives every rank the same local
    experts, and at e = 1 all E experts would be equal (the router then gets no gradient)."""
    for j, (name, p) in enumerate(sorted(layer.experts.named_parameters())):
        parts = name.split(".")
        g = layer.local_expert_indices[int(parts[1]) if parts[0] == "local_experts" else 0]
        gen = torch.Generator().manual_seed(1000 + 100 * g + j)
        p.copy_((torch.randn(p.shape, generator=gen) * std).to(p.dtype))


class OnCPU(nn.Module):
    """forward(x [S, B, H]) -> y [S, B, H] through a Megatron MoELayer, with ``cpu_current_device``."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x_SBH):
        with cpu_current_device():
            y, bias = self.layer(x_SBH)
        assert bias is None
        return StubInBackward.apply(y) if y.requires_grad else y
