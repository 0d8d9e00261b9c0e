"""``moe_comm.hf.to_hf(swapped_model, hf_model)``: a whole swapped model written back into a Hugging Face model.

Tier 1 (one process): a tiny model of a family is swapped, trains one SGD step (every tensor moves;
DeepSeek-V3's selection bias by hand), and is written into a freshly built HF model of other weights. Every
tensor of the HF model must then equal the trained swapped model's exactly (MoE blocks mapped back: router ->
gate.weight, [w1; w3] -> gate_up_proj, w2 -> down_proj, shared experts, gate, selection bias); swapping the
written model again must give the trained model's logits bit for bit, and the written HF model's own logits
agree to 1e-5 (HF's expert loop rounds otherwise). Structures that differ raise ValueError naming the module
path (or key), and nothing is written.
Tier 2 (2 gloo ranks, EP = 2): every rank's HF model receives every expert, rank by rank the trained ones.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import _models  # noqa: E402
from _models import loss_of, max_rel  # noqa: E402

from moe_comm import hf  # noqa: E402


def _hf_view(model) -> dict:
    """The swapped model's tensors under the Hugging Face names (this rank's experts only)."""
    out = {k: v for k, v in model.state_dict().items() if ".moe." not in k}
    for name, mod in model.named_modules():
        if not isinstance(mod, hf._SwappedBlock):
            continue
        moe, fam = mod.moe, hf._BY_NAME[mod.family]
        out[f"{name}.gate.weight"] = moe.router.weight
        out[f"{name}.experts.gate_up_proj"] = torch.cat([moe.experts.w1, moe.experts.w3], dim=1)
        out[f"{name}.experts.down_proj"] = moe.experts.w2
        if fam.grouped:
            out[f"{name}.gate.e_score_correction_bias"] = moe.router.expert_bias
        if fam.shared is not None:
            for mine, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                out[f"{name}.{fam.shared}.{theirs}.weight"] = getattr(moe.shared_experts, mine)
        if fam.shared_gate is not None:
            out[f"{name}.{fam.shared_gate}.weight"] = moe.shared_expert_gate.weight
    return {k: v.detach() for k, v in out.items()}


def _train_step(model, ids, average=None) -> None:
    """One SGD step of the HF objective (lr 0.1: every tensor moves visibly). ``average``: called on the
    replicated parameters' gradients first (data parallelism)."""
    loss_of(model, ids).backward()
    if average is not None:
        average(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_whole_model_to_hf_after_a_training_step_is_exact(family):
    ids = _models.tokens(batch=2, seq=8)
    model = _models.model(family).train()
    before = {k: v.clone() for k, v in _hf_view(_models.model(family)).items()}
    assert hf.swap_moe_blocks(model) == 2
    _train_step(model, ids)
    with torch.no_grad():  # the selection bias (DeepSeek-V3) has no gradient: moved as aux-loss-free balancing does
        for m in model.modules():
            if isinstance(m, hf._SwappedBlock) and hf._BY_NAME[m.family].grouped:
                m.moe.router.expert_bias.add_(torch.linspace(-0.01, 0.01, m.moe.cfg.num_experts))
    model.eval()
    want = _hf_view(model)
    assert [k for k in want if torch.equal(want[k], before[k])] == []  # every tensor moved

    target = _models.model(family, seed=3)  # other weights: everything must be overwritten
    assert hf.to_hf(model, target) is target
    got = target.state_dict()
    assert got.keys() == want.keys()
    for key in got:
        assert torch.equal(got[key], want[key]), key

    with torch.no_grad():
        trained = model(ids).logits
        assert max_rel(target(ids).logits, trained) <= 1e-5
        again = copy.deepcopy(target)
        hf.swap_moe_blocks(again)
        assert torch.equal(again(ids).logits, trained)


def _untouched(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_structures_that_differ_raise_naming_the_path_and_write_nothing():
    model = _models.model("qwen2_moe")
    hf.swap_moe_blocks(model)

    fewer = _models.model("qwen2_moe", seed=3)
    fewer.model.layers = fewer.model.layers[:1]
    saved = _untouched(fewer)
    with pytest.raises(ValueError, match=r"MoE block at 'model\.layers\.1\.mlp', the HF model .* has no module there"):
        hf.to_hf(model, fewer)
    assert all(torch.equal(v, saved[k]) for k, v in fewer.state_dict().items())

    dense = _models.model("qwen2_moe", seed=3)
    dense.model.layers[1].mlp = nn.Linear(32, 32)
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp', the HF model has a Linear there"):
        hf.to_hf(model, dense)

    other = _models.model("olmoe", seed=3)  # 4 experts where the swapped model has 6
    saved = _untouched(other)
    with pytest.raises(ValueError, match=r"to_hf: model\.layers\.0\.mlp: .*num_experts is 4, the layer's is 6"):
        hf.to_hf(model, other)
    assert all(torch.equal(v, saved[k]) for k, v in other.state_dict().items())

    extra = _models.model("qwen2_moe", seed=3)
    with pytest.raises(ValueError, match=r"the HF model has sparse MoE blocks at \['model\.layers\.1\.mlp'\] where the "
                                         r"swapped model has none"):
        hf.to_hf(_without_block(model, 1), extra)

    renamed = _models.model("qwen2_moe", seed=3)
    renamed.model.norm = nn.LayerNorm(32)  # a bias the swapped model does not have
    with pytest.raises(ValueError, match=r"in the HF model only \['model\.norm\.bias'\]"):
        hf.to_hf(model, renamed)

    with pytest.raises(ValueError, match="holds swapped blocks .* swap_moe_blocks works in place"):
        hf.to_hf(model, model)
    with pytest.raises(ValueError, match="holds no MoELayer and no swapped block"):
        hf.to_hf(_models.model("qwen2_moe"), fewer)
    with pytest.raises(TypeError, match="block must be the HF model"):
        hf.to_hf(model, "model.safetensors")


def _without_block(model, i: int):
    """A copy of the swapped ``model`` whose block ``i`` is a plain MLP again (the swapped model lacks it)."""
    out = copy.deepcopy(model)
    out.model.layers[i].mlp = nn.Identity()
    return out


# ------------------------------------------------------------------------------------------------ tier 2
def _average_replicated(model) -> None:
    """Mean over the ranks of every replicated parameter's gradient (what DDP does); the experts' gradients
    already hold every rank's tokens."""
    import torch.distributed as dist

    from moe_comm.parallel import expert_parameters
    experts = {id(p) for _, p in expert_parameters(model)}
    for _, p in model.named_parameters():
        if id(p) not in experts and p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())


def _rank_whole_model(rank, world_size, family):
    import torch.distributed as dist
    ids = _models.tokens(batch=2, seq=6, seed=40 + rank)
    model = _models.model(family).train()
    hf.swap_moe_blocks(model, dist.group.WORLD)
    _train_step(model, ids, _average_replicated)
    model.eval()
    target = hf.to_hf(model, _models.model(family, seed=3))
    with torch.no_grad():
        trained = model(ids).logits
        again = copy.deepcopy(target)
        hf.swap_moe_blocks(again, dist.group.WORLD)
        same_logits = torch.equal(again(ids).logits, trained)
    ids_by_block = {n: m.moe.local_expert_ids for n, m in model.named_modules() if isinstance(m, hf._SwappedBlock)}
    return target.state_dict(), _hf_view(model), ids_by_block, same_logits


@pytest.mark.multirank
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_ep2_whole_model_to_hf_gathers_every_trained_expert(ranks, family):
    res = ranks(2).run(_rank_whole_model, family)
    first = res[0][0]
    for rank, (state, mine, ids_by_block, same_logits) in enumerate(res):
        assert same_logits, rank
        assert state.keys() == first.keys() == mine.keys(), rank
        for key, value in state.items():
            assert torch.equal(value, first[key]), (rank, key)  # every rank's HF model holds every expert
            block = next((b for b in ids_by_block if key.startswith(b + ".experts.")), None)
            want = value[ids_by_block[block]] if block is not None else value
            assert torch.equal(want, mine[key]), (rank, key)  # rank by rank, its trained experts
