"""Hugging Face interop: moe_comm's MoELayer as a drop-in for the sparse MoE blocks of ``transformers`` models.

Shapes legend: H hidden, F expert FFN size, Fs shared-expert FFN size, E experts (global), e = E / W experts
on this rank, K top-k, T tokens, W EP world size.

    n = moe_comm.hf.swap_moe_blocks(model, ep_group)   # every sparse MoE block -> an MoELayer, in place
    layer = moe_comm.hf.from_hf(model.model.layers[0].mlp, ep_group)   # one block
    moe_comm.hf.to_hf(layer, block)                    # weights back into an HF block (collective)
    moe_comm.hf.to_hf(model, hf_model)                 # a whole swapped model back into an HF model (collective)

Supported blocks (``transformers`` >= 5, the layout with fused ``gate_up_proj [E, 2F, H]``), each read
from the block alone (router, experts, shared experts), so any checkpoint and any dtype:

    family        block class                  routing                                    shared experts
    mixtral       MixtralSparseMoeBlock        softmax, top-K, renormalised               -
    qwen2_moe     Qwen2MoeSparseMoeBlock       softmax, top-K, norm_topk_prob             1, sigmoid-gated
    qwen3_moe     Qwen3MoeSparseMoeBlock       softmax, top-K, norm_topk_prob             -
    olmoe         OlmoeSparseMoeBlock          softmax, top-K, norm_topk_prob             -
    deepseek_v3   DeepseekV3MoE                sigmoid, group-limited, bias, scale; fp32  n_shared_experts
    qwen3_next    Qwen3NextSparseMoeBlock      as qwen2_moe                               1, sigmoid-gated
    qwen3_5_moe   Qwen3_5MoeSparseMoeBlock     softmax, top-K, renormalised               1, sigmoid-gated
    glm4_moe      Glm4MoeMoE                   as deepseek_v3                             n_shared_experts

The router runs as the HF block runs it: logits in the router weight's dtype (the model dtype), scores in
float32; DeepSeek-V3 and GLM-4-MoE keep an fp32 router (``router_dtype=torch.float32``). The HF model's own
``forward(..., output_router_logits=True)`` keeps working after a swap: the swapped block hands its router
logits to transformers' output recorder, so the model's load-balancing loss is computed as before.

``transformers`` is imported lazily (only by ``swap_moe_blocks``): ``import moe_comm`` never loads it.
The core never imports this module (it sits on top, beside tools/ and testing/).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from moe_comm.comm.agree import agree_ep_dp
from moe_comm.comm.collectives import resolve_group
from moe_comm.config import MoEConfig
from moe_comm.modules.checkpoint import full_state_dict
from moe_comm.modules.layer import MoELayer

__all__ = ["from_hf", "to_hf", "swap_moe_blocks"]


@dataclass(frozen=True)
class _Family:
    """How one HF family's sparse MoE block maps onto MoEConfig. Attribute names are the block's."""

    name: str
    score_func: str
    fp32_router: bool = False                 # logits in float32 whatever the model dtype (DeepSeek-V3)
    norm_topk_prob: Optional[bool] = None     # None: read ``gate.norm_topk_prob``
    grouped: bool = False                     # gate.num_group / topk_group / routed_scaling_factor / bias
    shared: Optional[str] = None              # the shared-expert MLP (gate_proj, up_proj, down_proj)
    shared_gate: Optional[str] = None         # Linear(H, 1): shared output * sigmoid(x @ w.T)
    jitter: Optional[str] = None              # a router-jitter attribute that must be 0


_SOFTMAX = dict(score_func="softmax")
_DEEPSEEK = dict(score_func="sigmoid", fp32_router=True, grouped=True, shared="shared_experts")
_QWEN2 = dict(score_func="softmax", shared="shared_expert", shared_gate="shared_expert_gate")
_FAMILIES: Dict[str, _Family] = {  # block class name -> family
    "MixtralSparseMoeBlock": _Family("mixtral", norm_topk_prob=True, jitter="jitter_noise", **_SOFTMAX),
    "Qwen2MoeSparseMoeBlock": _Family("qwen2_moe", **_QWEN2),
    "Qwen3MoeSparseMoeBlock": _Family("qwen3_moe", **_SOFTMAX),
    "OlmoeSparseMoeBlock": _Family("olmoe", **_SOFTMAX),
    "DeepseekV3MoE": _Family("deepseek_v3", **_DEEPSEEK),
    "Qwen3NextSparseMoeBlock": _Family("qwen3_next", **_QWEN2),
    "Qwen3_5MoeSparseMoeBlock": _Family("qwen3_5_moe", norm_topk_prob=True, **_QWEN2),
    "Glm4MoeMoE": _Family("glm4_moe", **_DEEPSEEK),
}
_BY_NAME = {f.name: f for f in _FAMILIES.values()}

# Options: MoEConfig fields the block does not fix, and MoELayer arguments. The block fixes the rest.
_CONFIG_OPTIONS = ("num_chunks", "aux_loss_coeff", "z_loss_coeff", "capacity_factor", "router_dtype")
_LAYER_OPTIONS = ("backend", "seed", "monitor", "bias_update_rate", "strict", "timeout")


def _family(block: nn.Module, family: Optional[str], who: str) -> _Family:
    cls = type(block).__name__
    if cls in _FAMILIES:
        return _FAMILIES[cls]
    if family is not None:
        if family not in _BY_NAME:
            raise ValueError(f"{who}: family must be one of {sorted(_BY_NAME)}, got {family!r}")
        return _BY_NAME[family]
    raise ValueError(
        f"{who}: {cls} is not a supported sparse MoE block (supported: {', '.join(sorted(_FAMILIES))}). If its "
        f"router, experts and shared experts work exactly as one of {sorted(_BY_NAME)}, pass family=<name>; "
        "otherwise MoEConfig cannot express its routing")


def _attr(module: nn.Module, name: str, who: str, what: str):
    if not hasattr(module, name):
        raise ValueError(f"{who}: {type(module).__name__} has no attribute {name!r} ({what})")
    return getattr(module, name)


def _check_silu(act: nn.Module, where: str, who: str) -> None:
    """The experts' activation must be SiLU (SwiGLU); checked on values, whatever its class."""
    probe = torch.linspace(-6.0, 6.0, 25)
    try:
        ok = torch.allclose(act(probe), F.silu(probe), rtol=1e-6, atol=1e-7)
    except Exception:  # noqa: BLE001 -- an activation that cannot run on a probe is not SiLU either
        ok = False
    if not ok:
        raise ValueError(f"{who}: {where} must be SiLU (moe_comm's experts are SwiGLU), got {type(act).__name__}")


def _read_block(block: nn.Module, fam: _Family, who: str) -> Tuple[dict, dict]:
    """The block's routing as MoEConfig fields, and its tensors by role. Raises naming what MoEConfig lacks."""
    gate = _attr(block, "gate", who, "the router")
    experts = _attr(block, "experts", who, "the routed experts")
    w_EH = _attr(gate, "weight", who, "router weight [E, H]")
    E, H = w_EH.shape
    gate_up = _attr(experts, "gate_up_proj", who, "fused expert weights [E, 2F, H]")
    down = _attr(experts, "down_proj", who, "expert down projections [E, H, F]")
    layout = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
              "has_post_expert_norm": False}
    for name, want in layout.items():
        got = getattr(experts, name, want)
        if got != want:
            raise ValueError(f"{who}: experts.{name} must be {want} (moe_comm's experts are bias-free SwiGLU "
                             f"with [E, 2F, H] gate|up weights), got {got}")
    F_ = down.shape[-1]
    if tuple(gate_up.shape) != (E, 2 * F_, H) or tuple(down.shape) != (E, H, F_):
        raise ValueError(f"{who}: expert weights must be gate_up_proj [E, 2F, H] = {[E, 2 * F_, H]} and down_proj "
                         f"[E, H, F] = {[E, H, F_]}, got {list(gate_up.shape)} and {list(down.shape)}")
    _check_silu(_attr(experts, "act_fn", who, "the expert activation"), "experts.act_fn", who)
    if fam.jitter is not None and float(getattr(block, fam.jitter, 0.0) or 0.0) > 0:
        raise ValueError(f"{who}: router jitter is not supported (moe_comm's router has no jitter), got "
                         f"{fam.jitter}={getattr(block, fam.jitter)}; set router_jitter_noise=0 in the config")
    norm = fam.norm_topk_prob
    if norm is None:
        norm = bool(_attr(gate, "norm_topk_prob", who, "whether the top-K weights are renormalised"))
    cfg = dict(hidden_size=H, ffn_hidden_size=F_, num_experts=E, top_k=int(_attr(gate, "top_k", who, "K")),
               score_func=fam.score_func, norm_topk_prob=norm,
               router_dtype=torch.float32 if fam.fp32_router else w_EH.dtype)
    tensors = {"router": w_EH, "gate_up": gate_up, "down": down}
    if fam.grouped:
        n_group, topk_group = int(_attr(gate, "num_group", who, "n_group")), int(_attr(gate, "topk_group", who,
                                                                                        "topk_group"))
        if n_group > 1:
            cfg.update(num_groups=n_group, topk_groups=topk_group)
        cfg["route_scale"] = float(_attr(gate, "routed_scaling_factor", who, "routed_scaling_factor"))
        tensors["bias"] = _attr(gate, "e_score_correction_bias", who, "the selection bias [E]")
    if fam.shared is not None:
        mlp = _attr(block, fam.shared, who, "the shared experts")
        projs = [_attr(mlp, n, who, "shared-expert projection") for n in ("gate_proj", "up_proj", "down_proj")]
        if any(getattr(p, "bias", None) is not None for p in projs):
            raise ValueError(f"{who}: shared-expert projections with a bias are not supported (moe_comm's shared "
                             "experts are bias-free SwiGLU)")
        _check_silu(_attr(mlp, "act_fn", who, "the shared-expert activation"), f"{fam.shared}.act_fn", who)
        cfg.update(num_shared_experts=1, shared_ffn_hidden_size=projs[0].weight.shape[0])
        tensors.update(shared_w1=projs[0].weight, shared_w3=projs[1].weight, shared_w2=projs[2].weight)
        if fam.shared_gate is not None:
            sgate = _attr(block, fam.shared_gate, who, "the shared-expert gate Linear(H, 1)")
            if getattr(sgate, "bias", None) is not None:
                raise ValueError(f"{who}: a shared-expert gate with a bias is not supported")
            cfg["shared_expert_gate"] = True
            tensors["shared_gate"] = sgate.weight
    return cfg, tensors


def _agree_grid(ep_group, what: str, values: dict, error: Optional[BaseException], options: dict, who: str) -> None:
    """Collective: ``agree`` on ``values`` over the EP group, then the DP group of a 2-D mesh (as ``MoELayer``
    does), carrying this rank's ``error``. A rank whose own checks failed thus takes part in the agreement
    its peers are in: every rank raises, none waits for it (one process: ``error`` is raised)."""
    ep = resolve_group(ep_group, name=f"{who}: ep_group", allow_single_process=True)
    dp = None
    if getattr(ep_group, "ndim", 1) == 2 and hasattr(ep_group, "mesh_dim_names"):
        dp = resolve_group(ep_group, dim="dp", name=f"{who}: ep_group")
    agree_ep_dp(ep, dp, values, what=what, local_error=error, timeout=options.get("timeout"))


def _split_options(options: dict, who: str) -> Tuple[Optional[str], dict, dict]:
    options = dict(options)
    family = options.pop("family", None)
    cfg_opts = {k: options.pop(k) for k in _CONFIG_OPTIONS if k in options}
    layer_opts = {k: options.pop(k) for k in _LAYER_OPTIONS if k in options}
    fixed = [f.name for f in dataclasses.fields(MoEConfig) if f.name in options]
    if fixed:
        raise ValueError(f"{who}: {fixed} are read from the block and cannot be options; options are "
                         f"{sorted(('family',) + _CONFIG_OPTIONS + _LAYER_OPTIONS)}")
    if options:
        raise TypeError(f"{who}: unknown option(s) {sorted(options)}; expected some of "
                        f"{sorted(('family',) + _CONFIG_OPTIONS + _LAYER_OPTIONS)}")
    return family, cfg_opts, layer_opts


@torch.no_grad()
def from_hf(block: nn.Module, ep_group=None, **options) -> MoELayer:
    """An MoELayer computing what ``block`` (a ``transformers`` sparse MoE block) computes, holding only this
    rank's experts.

    Args:
        block: an HF sparse MoE block (see the module docstring), with all E experts; every EP rank passes
            the same weights (as ``from_pretrained`` or a shared seed gives). Not modified.
        ep_group: EP process group (None: WORLD if torch.distributed is initialised, else one process).
            Collective: every rank of the group calls ``from_hf`` with the same block structure.
        options: ``family`` (treat an unlisted block class as one of the listed families: only when its
            routing is exactly that family's); MoEConfig fields the block does not fix: ``num_chunks``,
            ``aux_loss_coeff``, ``z_loss_coeff``, ``capacity_factor`` (drops tokens: no longer exact),
            ``router_dtype`` (default: the block's, e.g. torch.float32 for an fp32 router next to bf16
            experts); MoELayer arguments: ``backend``, ``seed`` (default 0: the global RNG is not touched),
            ``monitor``, ``bias_update_rate``, ``strict``, ``timeout``.
    Returns: the MoELayer on the block's device, in the experts' dtype; global expert g lives on EP rank
    g // e. ``layer(x)`` for x [..., H] equals ``block(x)`` (fp32: to rounding).
    Raises ValueError naming what is missing for a block MoEConfig cannot express (an unknown class, router
    jitter, a non-SiLU activation, biases, another weight layout) or for an option the block fixes.
    """
    who = "from_hf"
    try:  # local checks; a rank that fails here still joins the MoELayer's agreement: every rank raises
        family, cfg_opts, layer_opts = _split_options(options, who)
        fam = _family(block, family, who)
        cfg_fields, t = _read_block(block, fam, who)
        cfg = MoEConfig(**{**cfg_fields, **cfg_opts})
    except (TypeError, ValueError) as err:  # the MoELayer agreement its peers are in: every rank raises
        _agree_grid(ep_group, "MoELayer", {}, err, options, who)
        raise AssertionError("unreachable: the agreement raises the error") from err
    layer_opts.setdefault("seed", 0)  # weights are overwritten below; do not draw from the global RNG
    device, dtype = t["gate_up"].device, t["gate_up"].dtype
    layer = MoELayer(cfg, ep_group, device=device, dtype=dtype, **layer_opts)
    F_ = cfg.ffn_hidden_size
    ids = torch.tensor(layer.local_expert_ids, device=device)
    layer.router.weight.copy_(t["router"])
    if "bias" in t:
        layer.router.expert_bias.copy_(t["bias"])
    gate_up = t["gate_up"].index_select(0, ids)
    layer.experts.w1.copy_(gate_up[:, :F_])
    layer.experts.w3.copy_(gate_up[:, F_:])
    layer.experts.w2.copy_(t["down"].index_select(0, ids))
    if "shared_w1" in t:
        for name in ("w1", "w3", "w2"):
            getattr(layer.shared_experts, name).copy_(t[f"shared_{name}"])
    if "shared_gate" in t:
        layer.shared_expert_gate.weight.copy_(t["shared_gate"])
    layer.hf_family = fam.name
    return layer


@torch.no_grad()
def to_hf(layer, block: nn.Module) -> nn.Module:
    """Write ``layer``'s weights into ``block`` (an HF sparse MoE block of the same shape): all E experts,
    gathered across the EP group, plus the router, its selection bias and the shared experts. Or, for a whole
    model, every swapped block into the HF model's block at the same module path and every other tensor too.

    Args:
        layer: an MoELayer (from ``from_hf``), or a block that ``swap_moe_blocks`` put in a model (its
            ``.moe`` is the layer); or a whole model that ``swap_moe_blocks`` swapped (any other module:
            its swapped blocks and MoELayers, found by module path; a DDP wrapper's ``.module`` is taken).
        block: the HF block to overwrite, on any device and dtype (values are cast to its tensors'); for a
            whole model, the HF model to overwrite (e.g. ``from_config`` of the original's config, or the
            original reloaded): the same modules, with the HF sparse MoE block where ``layer`` has a swapped
            one. Checked before anything is written or gathered: a path that is missing, an MoE block on one
            side only, a block of another shape, or another tensor that is missing, extra or of another
            shape raises ValueError naming the module path or key, on every rank (an agreement over the first
            layer's EP x DP grid); nothing is written then.
    Collective over the layer's EP group (``moe_comm.checkpoint.full_state_dict(..., rank0_only=False)``, once
    per block, in module order): every rank calls it; every rank's block receives every expert. Returns
    ``block``. The model's other tensors (embeddings, attention, norms, head: replicated) are copied from this
    rank's model as they are.
    """
    who = "to_hf"
    if isinstance(layer, nn.Module) and not isinstance(layer, (MoELayer, _SwappedBlock)):
        return _model_to_hf(layer, block)
    layer = getattr(layer, "moe", layer)
    if not isinstance(layer, MoELayer):
        raise TypeError(f"{who}: layer must be an MoELayer, a swapped block or a swapped model, got "
                        f"{type(layer).__name__}")
    t = _target_tensors(layer, block, who)
    _write_block(layer, block, t, who)
    return block


def _target_tensors(layer: MoELayer, block: nn.Module, who: str) -> dict:
    """The HF block's tensors by role (``_read_block``), once its family and shape are checked against the
    layer's (local: no collective)."""
    fam = _family(block, getattr(layer, "hf_family", None), who)
    cfg_fields, t = _read_block(block, fam, who)
    cfg = layer.cfg
    for name in ("hidden_size", "ffn_hidden_size", "num_experts", "top_k", "num_shared_experts", "shared_expert_gate"):
        want = cfg_fields.get(name, getattr(MoEConfig, name, None))
        if getattr(cfg, name) != want:
            raise ValueError(f"{who}: the block's {name} is {want}, the layer's is {getattr(cfg, name)}")
    return t


def _write_block(layer: MoELayer, block: nn.Module, t: dict, who: str) -> None:
    """Gather the layer's experts (collective over its EP group) and write everything into ``t``."""
    full = full_state_dict(layer, layer.ep_group if layer.world_size > 1 else None, rank0_only=False)
    E = layer.cfg.num_experts

    def experts(name: str) -> torch.Tensor:
        return torch.stack([full[f"experts.{name}.{g}"] for g in range(E)])

    if "bias" not in t and bool(full["router.expert_bias"].ne(0).any()):
        raise ValueError(f"{who}: the layer's router.expert_bias (aux-loss-free balancing) is non-zero but "
                         f"{type(block).__name__} has no selection bias to hold it (e_score_correction_bias)")
    t["router"].copy_(full["router.weight"])
    if "bias" in t:
        t["bias"].copy_(full["router.expert_bias"])
    t["gate_up"].copy_(torch.cat([experts("w1"), experts("w3")], dim=1))
    t["down"].copy_(experts("w2"))
    if "shared_w1" in t:
        for name in ("w1", "w3", "w2"):
            t[f"shared_{name}"].copy_(full[f"shared_experts.{name}"])
    if "shared_gate" in t:
        t["shared_gate"].copy_(full["shared_expert_gate.weight"])


def _is_moe_block(module: nn.Module) -> bool:
    """A supported HF sparse MoE block, or a module that looks like one (``experts`` and a ``gate`` / ``router``
    submodule): ``swap_moe_blocks`` swaps (or names as unsupported) exactly these."""
    if type(module).__name__ in _FAMILIES:
        return True
    return isinstance(getattr(module, "experts", None), nn.Module) and \
        isinstance(getattr(module, "gate", getattr(module, "router", None)), nn.Module)


def _swapped_layers(model: nn.Module) -> List[Tuple[str, MoELayer]]:
    """(module path, MoELayer) of every swapped block (``_SwappedBlock``: the path is the block's) and every
    MoELayer outside one, in module order."""
    out: List[Tuple[str, MoELayer]] = []
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") for p, _ in out):
            continue
        if isinstance(m, _SwappedBlock):
            out.append((name, m.moe))
        elif isinstance(m, MoELayer):
            out.append((name, m))
    return out


def _under(key: str, prefixes: List[str]) -> bool:
    return any(key.startswith(p + ".") for p in prefixes)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2) as the whole tensor (collective over its mesh: every rank reads the same keys in the
    same order); any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _model_to_hf(model: nn.Module, hf_model: nn.Module) -> nn.Module:
    """``to_hf`` of a whole swapped model (see ``to_hf``)."""
    who = "to_hf"
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(model, DistributedDataParallel):
        model = model.module
    layers = _swapped_layers(model)
    if not layers:
        raise ValueError(f"{who}: {type(model).__name__} holds no MoELayer and no swapped block (swap_moe_blocks "
                         "puts them in); pass a swapped model, or an MoELayer and its HF block")
    targets: List[Tuple[MoELayer, nn.Module, dict]] = []
    local_error = None
    try:  # every check before the first gather: a rank that fails still joins the agreement below
        if not isinstance(hf_model, nn.Module):
            raise TypeError(f"{who}: for a swapped model, block must be the HF model (an nn.Module), got "
                            f"{type(hf_model).__name__}")
        if hf_model is model or any(isinstance(m, (_SwappedBlock, MoELayer)) for m in hf_model.modules()):
            raise ValueError(f"{who}: the HF model to write into holds swapped blocks (is it the swapped model "
                             "itself? swap_moe_blocks works in place): pass a fresh HF model, e.g. "
                             "AutoModelForCausalLM.from_config(model.config)")
        paths = [p for p, _ in layers]
        for path, layer in layers:
            try:
                block = hf_model.get_submodule(path)
            except AttributeError:
                raise ValueError(f"{who}: the swapped model has an MoE block at {path!r}, the HF model "
                                 f"({type(hf_model).__name__}) has no module there: the two models differ in "
                                 "structure") from None
            if not _is_moe_block(block):
                raise ValueError(f"{who}: the swapped model has an MoE block at {path!r}, the HF model has a "
                                 f"{type(block).__name__} there, not a sparse MoE block")
            targets.append((layer, block, _target_tensors(layer, block, f"{who}: {path}")))
        hf_blocks = [name for name, m in hf_model.named_modules() if name and _is_moe_block(m)]
        hf_blocks = [n for n in hf_blocks if not _under(n, hf_blocks)]
        extra = [n for n in hf_blocks if n not in paths]
        if extra:
            raise ValueError(f"{who}: the HF model has sparse MoE blocks at {extra} where the swapped model has "
                             "none: the two models differ in structure")
        mine = {k: v for k, v in model.state_dict().items() if not _under(k, paths)}
        theirs = {k: v for k, v in hf_model.state_dict().items() if not _under(k, hf_blocks)}
        missing, unknown = [k for k in mine if k not in theirs], [k for k in theirs if k not in mine]
        if missing or unknown:
            raise ValueError(f"{who}: outside the MoE blocks the models differ: in the swapped model only "
                             f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, in the HF model only "
                             f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        for k, v in mine.items():
            if tuple(v.shape) != tuple(theirs[k].shape):
                raise ValueError(f"{who}: {k!r} has shape {list(v.shape)} in the swapped model, "
                                 f"{list(theirs[k].shape)} in the HF model")
    except (TypeError, ValueError) as err:
        local_error = err
    first = layers[0][1]
    agree_ep_dp(first.ep_group, first.dp_group, {"swapped blocks": [p for p, _ in layers]}, what=who,
                local_error=local_error, timeout=first.dispatcher.timeout)
    for layer, block, t in targets:
        _write_block(layer, block, t, who)
    for k, v in mine.items():
        theirs[k].copy_(_full(v))
    return hf_model


class _RouterLogits(nn.Module):
    """Identity on the router logits [T, E]: the module transformers' output recorder hooks, so that
    ``output_router_logits=True`` returns them (it hooked the HF router class before the swap)."""

    def forward(self, logits_TE: torch.Tensor) -> torch.Tensor:
        return logits_TE


class _SwappedBlock(nn.Module):
    """What ``swap_moe_blocks`` puts in place of an HF sparse MoE block: ``forward(hidden_states)`` ->
    the MoELayer's output, same shape and dtype; the router logits go to ``router_logits`` (recorded by
    transformers when the model is asked for them). ``.moe`` is the MoELayer."""

    def __init__(self, layer: MoELayer, family: str):
        super().__init__()
        self.moe = layer
        self.router_logits = _RouterLogits()
        self.family = family

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        y, routing = self.moe(hidden_states, return_routing=True)
        self.router_logits(routing.logits_TE)
        return y

    def extra_repr(self) -> str:
        return f"family={self.family}"


def _install_logits_hook(tap: nn.Module) -> None:
    """Register transformers' own output-capturing hook for "router_logits" on ``tap``."""
    from transformers.utils import output_capturing

    install = getattr(output_capturing, "install_output_capuring_hook", None) or \
        getattr(output_capturing, "install_output_capturing_hook", None)
    if install is None:
        import transformers
        raise ImportError(f"swap_moe_blocks: transformers {transformers.__version__} has no "
                          "transformers.utils.output_capturing.install_output_capuring_hook, which returns the "
                          "router logits of a swapped block; use transformers >= 5.24")
    install(tap, "router_logits", 0)


def _records_router_logits(model: nn.Module) -> bool:
    return any("router_logits" in (getattr(m, "_can_record_outputs", None) or {}) for m in model.modules())


def swap_moe_blocks(model: nn.Module, ep_group=None, **options) -> int:
    """Replace every sparse MoE block of a ``transformers`` model by an MoELayer, in place.

    Args:
        model: a transformers model (e.g. ``MixtralForCausalLM``); every rank of the EP group holds the
            same model and calls this together (each layer's construction is collective).
        ep_group, options: as in ``from_hf`` (the same for every block).
    Returns: the number of blocks replaced (0 for a model without sparse MoE blocks).
    Each block becomes a module whose ``.moe`` is the MoELayer; the model's forward, ``generate`` and
    ``output_router_logits=True`` (and with it the model's load-balancing loss) work as before. With
    W > 1 every rank runs the model together, its own batch each, the same number of forwards (for
    ``generate``: ``min_new_tokens`` = ``max_new_tokens``, so no rank stops early). Replicated parameters
    (everything but the experts) get each rank's own tokens' gradient: average them over the ranks as DDP
    does. Nothing is replaced when any MoE block cannot be expressed: the ValueError names it and what is
    missing.
    """
    who = "swap_moe_blocks"
    found: List[Tuple[str, nn.Module]] = []
    local_error = None
    try:  # every block checked before the first (collective) construction
        family, _, _ = _split_options(options, who)
        for name, module in model.named_modules():
            if _is_moe_block(module):
                _family(module, family, f"{who}: {name}")  # raises for an unsupported block, before any swap
                found.append((name, module))
        for name, module in found:
            _read_block(module, _family(module, family, who), f"{who}: {name}")
    except (TypeError, ValueError) as err:
        local_error = err
    # Collective: every rank learns of a rank's unsupported block (or bad option) and raises, and every rank
    # will build as many layers (none waits in a construction its peer never starts).
    _agree_grid(ep_group, who, {"sparse MoE blocks": [name for name, _ in found]}, local_error, options, who)
    hook = bool(found) and _records_router_logits(model)
    for name, module in found:
        layer = from_hf(module, ep_group, **options)
        swapped = _SwappedBlock(layer, layer.hf_family)
        if hook:
            _install_logits_hook(swapped.router_logits)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, swapped)
    return len(found)
