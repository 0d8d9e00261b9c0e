"""Tier 2 (2 gloo ranks): swapped ``transformers`` models at EP = 2 against the unswapped model.

Every rank builds the same tiny model (same seed), runs the HF original on its own batch, then swaps with
``ep_group`` = WORLD (each rank keeps half of the experts) and runs the same batch. fp32: the logits and the
loss (with the model's own load-balancing loss) within 1e-5; gradients: the expert gradients of a rank equal
the sum over ranks of the HF model's gradients for those experts, the replicated parameters' gradients
summed over ranks equal the HF ones summed (each rank's HF run sees its own batch). bf16: within HF's own
bf16 noise, with bf16 weights and under ``torch.autocast``. Greedy ``generate`` gives the same tokens, and
``to_hf`` gathers every expert on every rank.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import _models  # noqa: E402
from _models import FAMILIES, grads_by_hf_name, loss_of, max_rel  # noqa: E402

from moe_comm import hf  # noqa: E402


def _rank_parity(rank, world_size, family):
    import torch.distributed as dist
    ids = _models.tokens(batch=2, seq=6, seed=10 + rank)  # each rank its own batch
    ref = _models.model(family).train()
    with torch.no_grad():
        ref_logits = ref(ids).logits
    ref_loss = loss_of(ref, ids)
    ref_loss.backward()
    model = _models.model(family).train()
    assert hf.swap_moe_blocks(model, dist.group.WORLD) == 2
    moe = next(m.moe for m in model.modules() if isinstance(m, hf._SwappedBlock))
    assert moe.world_size == world_size and moe.experts.w1.shape[0] == moe.cfg.num_experts // world_size
    with torch.no_grad():
        logits = model(ids).logits
    loss = loss_of(model, ids)
    loss.backward()
    out = {"logits": max_rel(logits, ref_logits), "loss": abs(float(loss) - float(ref_loss)) / float(ref_loss)}

    want = grads_by_hf_name(ref, swapped=False)
    got = grads_by_hf_name(model, swapped=True)
    assert got.keys() == want.keys()
    local = moe.local_expert_ids
    worst = 0.0
    for name in sorted(want):  # the same order on every rank: the all_reduces pair up
        w = want[name].clone()
        dist.all_reduce(w)  # the HF gradient of the whole (2-rank) batch
        g = got[name]
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            w = w[local]  # this rank's experts already hold every rank's tokens' gradient
        else:
            g = g.clone()
            dist.all_reduce(g)  # replicated: each rank holds its own tokens' part
        worst = max(worst, max_rel(g, w))
    out["grad"] = worst
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("family", FAMILIES)
def test_ep2_fp32_logits_loss_and_gradients_match(ranks, family):
    for r in ranks(2).run(_rank_parity, family):
        assert r["logits"] <= 1e-5 and r["loss"] <= 1e-5 and r["grad"] <= 1e-5, r


def _rank_bf16_generate_to_hf(rank, world_size, family):
    import torch.distributed as dist
    ids = _models.tokens(batch=2, seq=6, seed=20 + rank)
    with torch.no_grad():
        exact = _models.model(family)(ids).logits
        model = _models.model(family, dtype=torch.bfloat16)
        theirs = model(ids).logits
        hf.swap_moe_blocks(model, dist.group.WORLD)
        mine = model(ids).logits
        bf16 = _models.within_bf16_noise(mine, theirs, exact)

        model = _models.model(family)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            theirs = model(ids).logits
        kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)  # the same steps on every rank
        gen_theirs = model.generate(ids, **kw)
        block = next(m for m in model.modules() if type(m).__name__ in hf._FAMILIES)
        hf.swap_moe_blocks(model, dist.group.WORLD)
        gen_mine = model.generate(ids, **kw)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mine = model(ids).logits
        amp = _models.within_bf16_noise(mine, theirs, exact)

        swapped = next(m for m in model.modules() if isinstance(m, hf._SwappedBlock))
        for p in swapped.moe.experts.parameters():
            p.add_(1.0)  # every expert moves; to_hf must gather the other rank's too
        target = _models.model(family)
        target_block = next(m for m in target.modules() if type(m).__name__ in hf._FAMILIES)
        hf.to_hf(swapped, target_block)
        full = block.experts.gate_up_proj + 1.0
    return bf16, amp, torch.equal(gen_mine, gen_theirs), torch.equal(target_block.experts.gate_up_proj, full)


@pytest.mark.multirank
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_ep2_bf16_autocast_generate_and_to_hf(ranks, family):
    for bf16, amp, same_tokens, gathered in ranks(2).run(_rank_bf16_generate_to_hf, family):
        assert bf16 and amp  # bf16 weights; fp32 weights under autocast
        assert same_tokens
        assert gathered
