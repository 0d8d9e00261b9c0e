"""Tier 1 (one process): ``moe_comm.hf`` on tiny random-init ``transformers`` models of every supported family.

Per family: the whole model's logits before and after ``swap_moe_blocks`` (fp32: 1e-5 relative; bf16 and
under ``torch.autocast``: within the noise of Hugging Face's own bf16 run, block by block and whole), the router
logits and the load-balancing loss of ``output_router_logits=True``, the gradient of every parameter, and
greedy ``generate``. Then ``from_hf`` / ``to_hf`` round trips, the families checked at block level only,
and the errors for what MoEConfig cannot express.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import _models  # noqa: E402
from _models import FAMILIES, grads_by_hf_name, loss_of, max_rel  # noqa: E402

from moe_comm import MoELayer, hf  # noqa: E402

NUM_MOE_LAYERS = 2


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_router_logits_and_aux_loss_match(family):
    ids = _models.tokens(batch=2, seq=8)
    model = _models.model(family)
    ref = _logits(model, ids, labels=ids, output_router_logits=True)
    assert hf.swap_moe_blocks(model) == NUM_MOE_LAYERS
    assert sum(isinstance(m, MoELayer) for m in model.modules()) == NUM_MOE_LAYERS
    out = _logits(model, ids, labels=ids, output_router_logits=True)
    assert max_rel(out.logits, ref.logits) <= 1e-5
    assert len(out.router_logits) == len(ref.router_logits) == NUM_MOE_LAYERS
    for mine, theirs in zip(out.router_logits, ref.router_logits):
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
        assert max_rel(mine, theirs) <= 1e-6
    if getattr(ref, "aux_loss", None) is not None:  # DeepSeek-V3 has no load-balancing loss in HF
        assert float(ref.aux_loss) > 0
        assert abs(float(out.aux_loss) - float(ref.aux_loss)) <= 1e-5 * float(ref.aux_loss)
    assert abs(float(out.loss) - float(ref.loss)) <= 1e-5 * float(ref.loss)
    # Without output_router_logits the model still runs (and returns no router logits).
    plain = _logits(model, ids)
    assert max_rel(plain.logits, ref.logits) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_gradients_of_every_parameter_match(family):
    ids = _models.tokens(batch=2, seq=8, seed=1)
    ref = _models.model(family).train()
    loss_of(ref, ids).backward()
    model = _models.model(family).train()
    hf.swap_moe_blocks(model)
    loss_of(model, ids).backward()
    want, got = grads_by_hf_name(ref, swapped=False), grads_by_hf_name(model, swapped=True)
    assert got.keys() == want.keys()
    worst = max((max_rel(got[k], want[k]), k) for k in want)
    assert worst[0] <= 1e-5, worst


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_and_autocast_stay_within_bf16_noise(family):
    """bf16 weights, and an fp32 model under torch.autocast(cpu, bf16). Block level, on the very inputs
    the HF block saw: no further from the block in float64 than the HF block itself (x2, + 1e-3). Whole
    model: within HF's own bf16 noise (``_models.within_bf16_noise``)."""
    ids = _models.tokens(batch=2, seq=8, seed=2)
    exact = _logits(_models.model(family), ids).logits
    for dtype, autocast in ((torch.bfloat16, False), (torch.float32, True)):
        model = _models.model(family, dtype=dtype)
        blocks = [m for m in model.modules() if type(m).__name__ in hf._FAMILIES]
        seen = {}

        def record(mod, args, out):
            seen.setdefault(mod, (args[0], out))  # the first call; returns None: the output stays

        hooks = [b.register_forward_hook(record) for b in blocks]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            theirs = _logits(model, ids).logits
        for h in hooks:
            h.remove()
        for block in blocks:
            x, y_theirs = seen[block]
            exact_block = copy.deepcopy(block).double()
            exact_block.experts.config._experts_implementation = "eager"  # grouped_mm has no float64
            with torch.no_grad():
                y_exact = exact_block(x.double())
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    y_mine = hf.from_hf(block)(x)
            assert y_mine.dtype == y_theirs.dtype
            assert max_rel(y_mine, y_exact) <= 2 * max_rel(y_theirs, y_exact) + 1e-3, (dtype, autocast)
        hf.swap_moe_blocks(model)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            mine = _logits(model, ids).logits
        assert mine.dtype == theirs.dtype
        assert _models.within_bf16_noise(mine, theirs, exact), (dtype, autocast)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_gives_the_same_tokens(family):
    ids = _models.tokens(batch=2, seq=5, seed=3)
    model = _models.model(family)
    kw = dict(max_new_tokens=6, do_sample=False, min_new_tokens=6)
    with torch.no_grad():
        theirs = model.generate(ids, **kw)
        hf.swap_moe_blocks(model)
        mine = model.generate(ids, **kw)
    assert theirs.shape == (2, 11)
    assert torch.equal(mine, theirs)


# ------------------------------------------------------------------------------------------ block level
def _first_block(model):
    return next(m for m in model.modules() if type(m).__name__ in hf._FAMILIES)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_to_hf_writes_back_trained_weights(family):
    block = _first_block(_models.model(family))
    layer = hf.from_hf(block)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # "training": every tensor of the layer moves
        for p in list(layer.parameters()) + [layer.router.expert_bias]:
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    target = copy.deepcopy(block)
    with torch.no_grad():
        for p in list(target.parameters()) + list(target.buffers()):
            p.zero_()
    if family == "qwen2_moe":  # no selection bias in the HF block: a trained one cannot be dropped silently
        with pytest.raises(ValueError, match="expert_bias .* is non-zero but Qwen2MoeSparseMoeBlock has no"):
            hf.to_hf(layer, target)
        layer.router.expert_bias.zero_()
    assert hf.to_hf(layer, target) is target
    x = torch.randn(2, 5, block.gate.weight.shape[1], generator=g)
    with torch.no_grad():
        assert max_rel(target(x), layer(x)) <= 1e-6


def _block_of(config_name: str, **kw):
    import transformers as tf
    cls = {"qwen3_next": ("Qwen3NextConfig", "qwen3_next", "Qwen3NextSparseMoeBlock"),
           "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock"),
           "glm4_moe": ("Glm4MoeConfig", "glm4_moe", "Glm4MoeMoE")}[config_name]
    cfg = getattr(tf, cls[0])(hidden_size=32, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                              num_experts=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                              n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, **kw)
    module = __import__(f"transformers.models.{cls[1]}.modeling_{cls[1]}", fromlist=[cls[2]])
    torch.manual_seed(0)
    block = getattr(module, cls[2])(cfg)
    with torch.no_grad():
        for p in list(block.parameters()) + list(block.buffers()):
            p.copy_(torch.randn(p.shape) * 0.1)
    return block


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "glm4_moe"])
def test_block_level_families(family):
    """Families whose blocks are copies of the ones above: the swapped block against the HF block."""
    block = _block_of(family)
    layer = hf.from_hf(block)
    assert layer.hf_family == family
    x = torch.randn(3, 4, 32)
    with torch.no_grad():
        assert max_rel(layer(x), block(x)) <= 1e-5


def test_fp32_router_next_to_bf16_experts():
    """DeepSeek-V3 keeps its gate in fp32 in a bf16 model; router_dtype=float32 gives Mixtral the same."""
    ds = _first_block(_models.model("deepseek_v3", dtype=torch.bfloat16))
    layer = hf.from_hf(ds)
    assert layer.router.weight.dtype == torch.float32 and layer.experts.w1.dtype == torch.bfloat16
    mx = _first_block(_models.model("mixtral", dtype=torch.bfloat16))
    assert hf.from_hf(mx).router.weight.dtype == torch.bfloat16  # as HF: the router in the model dtype
    layer = hf.from_hf(mx, router_dtype=torch.float32)
    assert layer.router.weight.dtype == torch.float32 and layer.experts.w1.dtype == torch.bfloat16
    x = torch.randn(2, 6, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        y, routing = layer(x, return_routing=True)
    assert y.dtype == torch.bfloat16 and routing.logits_TE.dtype == torch.float32
    assert routing.topk_weight_TK.dtype == torch.float32


# ------------------------------------------------------------------------------------------------ errors
def test_unsupported_blocks_and_options_raise_naming_what_is_missing():
    import transformers as tf

    cfg = _models.config("mixtral")
    cfg.router_jitter_noise = 0.1
    jittery = tf.MixtralForCausalLM(cfg)
    with pytest.raises(ValueError, match="router jitter is not supported.*jitter_noise=0.1"):
        hf.swap_moe_blocks(jittery)
    assert not any(isinstance(m, MoELayer) for m in jittery.modules())  # nothing swapped

    block = _first_block(_models.model("mixtral"))
    with pytest.raises(ValueError, match=r"\['top_k'\] are read from the block"):
        hf.from_hf(block, top_k=1)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['jitter'\]"):
        hf.from_hf(block, jitter=0.0)

    class MyMoeBlock(nn.Module):  # an unknown class: not guessed, unless the user names its family
        def __init__(self, inner):
            super().__init__()
            self.gate, self.experts = inner.gate, inner.experts

    mine = MyMoeBlock(block)
    with pytest.raises(ValueError, match="MyMoeBlock is not a supported sparse MoE block.*pass family="):
        hf.from_hf(mine)
    host = nn.Sequential(mine)
    with pytest.raises(ValueError, match="swap_moe_blocks: 0: MyMoeBlock is not a supported"):
        hf.swap_moe_blocks(host)
    assert hf.swap_moe_blocks(host, family="mixtral") == 1 and isinstance(host[0].moe, MoELayer)
    with pytest.raises(ValueError, match="family must be one of"):
        hf.from_hf(mine, family="llama")

    gelu = copy.deepcopy(block)
    gelu.experts.act_fn = nn.GELU()
    with pytest.raises(ValueError, match="experts.act_fn must be SiLU.*got GELU"):
        hf.from_hf(gelu)


def test_a_model_without_moe_blocks_swaps_nothing():
    assert hf.swap_moe_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU())) == 0


def test_import_moe_comm_does_not_import_transformers():
    code = "import sys, moe_comm, moe_comm.hf; print('transformers' in sys.modules)"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"
