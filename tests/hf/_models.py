"""Tiny random-init ``transformers`` models of every family ``moe_comm.hf`` supports (no downloads).

Hidden 32, 2 layers, 4-8 experts, vocabulary 96: a whole forward and backward takes milliseconds.
"""
from __future__ import annotations

import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")
VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, initializer_range=0.05, tie_word_embeddings=False, pad_token_id=0,
               bos_token_id=1, eos_token_id=2)


def config(family: str):
    """The tiny config of ``family``: 2 MoE layers, top-2 routing."""
    import transformers as tf
    if family == "mixtral":
        return tf.MixtralConfig(**_COMMON, intermediate_size=48, num_key_value_heads=2, num_local_experts=4,
                                num_experts_per_tok=2, router_jitter_noise=0.0)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**_COMMON, intermediate_size=64, moe_intermediate_size=24,
                                 shared_expert_intermediate_size=40, num_key_value_heads=2, num_experts=6,
                                 num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                                 mlp_only_layers=[])
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**_COMMON, intermediate_size=64, moe_intermediate_size=24, head_dim=8,
                                 num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                 decoder_sparse_step=1, mlp_only_layers=[])
    if family == "olmoe":
        return tf.OlmoeConfig(**_COMMON, intermediate_size=24, num_key_value_heads=4, num_experts=4,
                              num_experts_per_tok=2, norm_topk_prob=False)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(**_COMMON, intermediate_size=64, moe_intermediate_size=24, num_key_value_heads=4,
                                   n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                   topk_group=2, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=24,
                                   qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5,
                                   norm_topk_prob=True)
    raise ValueError(f"unknown family {family!r}")


def model(family: str, seed: int = 0, dtype=torch.float32):
    """A random-init causal LM of ``family`` (eval mode, eager attention and experts); identical for the
    same seed.
    DeepSeek-V3's selection bias gets random values so that it matters."""
    import transformers as tf
    torch.manual_seed(seed)
    cfg = config(family)
    cfg._attn_implementation = "eager"
    # HF's per-expert loop (F.linear): autocast runs it in bf16 as it runs ours. The default on CPU,
    # "grouped_mm", is not on autocast's list and stays fp32 under autocast.
    cfg._experts_implementation = "eager"
    m = tf.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for mod in m.modules():
            bias = getattr(getattr(mod, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.rand(bias.shape, generator=g) * 0.1)
    return m


def tokens(batch: int = 2, seq: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token loss plus the model's own load-balancing loss (where the family has one): the
    training objective of an HF MoE model, through ``output_router_logits=True``."""
    out = model(ids, labels=ids, output_router_logits=True)
    return out.loss


def grads_by_hf_name(model, swapped: bool, expert_ids=None) -> dict:
    """Every parameter's gradient under its Hugging Face name. For a swapped model the MoELayer's tensors
    are mapped back: router -> gate.weight, [w1; w3] -> experts.gate_up_proj, w2 -> experts.down_proj,
    shared experts -> the shared MLP's gate/up/down_proj, shared_expert_gate -> shared_expert_gate.weight.
    Expert gradients hold this rank's experts only; for an unswapped model ``expert_ids`` selects the same
    rows."""
    from moe_comm import hf

    def grad(p):
        return torch.zeros_like(p) if p.grad is None else p.grad

    out = {name: grad(p) for name, p in model.named_parameters() if not swapped or ".moe." not in name}
    if not swapped:
        if expert_ids is not None:
            for name in list(out):
                if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    out[name] = out[name][expert_ids]
        return out
    for name, mod in model.named_modules():
        if not isinstance(mod, hf._SwappedBlock):
            continue
        moe, fam = mod.moe, hf._BY_NAME[mod.family]
        out[f"{name}.gate.weight"] = grad(moe.router.weight)
        out[f"{name}.experts.gate_up_proj"] = torch.cat([grad(moe.experts.w1), grad(moe.experts.w3)], dim=1)
        out[f"{name}.experts.down_proj"] = grad(moe.experts.w2)
        if fam.shared is not None:
            for mine, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                out[f"{name}.{fam.shared}.{theirs}.weight"] = grad(getattr(moe.shared_experts, mine))
        if fam.shared_gate is not None:
            out[f"{name}.{fam.shared_gate}.weight"] = grad(moe.shared_expert_gate.weight)
    return out


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (b the reference), in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def token_errors(a: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Per token position: max over the vocabulary of |a - exact| / max |exact|, [B * S] float64."""
    a, exact = a.detach().double(), exact.detach().double()
    return ((a - exact).abs().amax(-1) / exact.abs().max()).flatten()


def within_bf16_noise(mine: torch.Tensor, theirs: torch.Tensor, exact: torch.Tensor) -> bool:
    """A low-precision run (mine) is within the noise of HF's own (theirs), both against the fp32 model
    (exact): the median per-token error at most 2x HF's (+ 1e-3). The median, because a token whose top-K
    choice sits on a near-tie flips under bf16 rounding in either run, at random, and then differs by far
    more than rounding; a wrong weight or a missing term moves every token."""
    return float(token_errors(mine, exact).median()) <= 2 * float(token_errors(theirs, exact).median()) + 1e-3
