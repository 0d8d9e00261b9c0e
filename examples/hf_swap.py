"""Swap the MoE blocks of a tiny Hugging Face model for moe_comm's MoELayer, check parity, train at EP = W.

Every rank builds the same random-init model (no download: a tiny config, hidden 32, 2 layers, 8 experts),
runs it on its own batch, calls ``moe_comm.hf.swap_moe_blocks(model, WORLD)`` (each rank keeps E / W
experts) and runs the batch again: the logits must agree to 1e-5 (fp32). Then it trains a few steps on a
toy next-token task (token t+1 = token t + stride mod V) with the model's own loss, load-balancing loss
included (``output_router_logits=True``): replicated parameters get their gradients averaged over the
ranks, experts already hold every rank's tokens' gradient (divided by W here, for the mean). At the end the
trained weights go back into a fresh HF model with ``moe_comm.hf.to_hf`` (collective: the experts are
gathered), and that model must give the swapped model's logits again.

Run:
    python examples/hf_swap.py                            # 2 gloo ranks on this CPU, Qwen2-MoE
    python examples/hf_swap.py --family mixtral --steps 30 --world-size 4
    torchrun --nproc-per-node 2 examples/hf_swap.py
Needs ``transformers`` (``pip install -e ".[hf]"``). Exits 1 when a parity check fails or the loss does
not fall.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import torch
import torch.distributed as dist

try:
    import moe_comm
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import moe_comm
from moe_comm import hf
from moe_comm.tools.launch import run_ranks

VOCAB = 64
BLOCKS = {"mixtral": "MixtralSparseMoeBlock", "qwen2_moe": "Qwen2MoeSparseMoeBlock",
          "qwen3_moe": "Qwen3MoeSparseMoeBlock", "olmoe": "OlmoeSparseMoeBlock", "deepseek_v3": "DeepseekV3MoE"}


def tiny_model(family: str, seed: int):
    """A random-init causal LM of ``family``: hidden 32, 2 layers, 8 experts, top-2 (identical per seed)."""
    import transformers as tf
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False, num_experts_per_tok=2, output_router_logits=True)
    if family == "mixtral":
        cfg = tf.MixtralConfig(**common, intermediate_size=48, num_local_experts=8, router_jitter_noise=0.0)
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**common, intermediate_size=64, moe_intermediate_size=24,
                                shared_expert_intermediate_size=40, num_experts=8, decoder_sparse_step=1)
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=24, head_dim=8, num_experts=8,
                                decoder_sparse_step=1, norm_topk_prob=True)
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(**common, intermediate_size=24, num_experts=8)
    else:
        cfg = tf.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, intermediate_size=64,
                                  moe_intermediate_size=24, n_shared_experts=1, n_routed_experts=8, n_group=4,
                                  topk_group=2, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=24,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(cfg)


def batch(rank: int, step: int, size: int, seq: int, stride: int) -> torch.Tensor:
    """[size, seq] token ids: arithmetic sequences (t, t + stride, ...) mod V, from random starts; each
    rank and step its own."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    starts = torch.randint(3, VOCAB, (size, 1), generator=g)
    return (starts + stride * torch.arange(seq)) % VOCAB


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())


def run(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    group = dist.group.WORLD

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    def worst(x: float) -> float:  # the largest value over the ranks
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    model = tiny_model(args.family, args.seed).eval()
    ids = batch(rank, -1, args.batch, args.seq, args.stride)
    with torch.no_grad():
        ref = model(ids).logits
    n = hf.swap_moe_blocks(model, group)
    layers = [m for m in model.modules() if isinstance(m, moe_comm.MoELayer)]
    with torch.no_grad():
        before = worst(rel(model(ids).logits, ref))
    log(f"{args.family}: swapped {n} MoE blocks; EP = {world_size}, {layers[0].experts.w1.shape[0]} of "
        f"{layers[0].cfg.num_experts} experts per rank")
    log(f"parity before training: max relative logit difference {before:.2e} (over {world_size} ranks)")

    experts = {id(p) for layer in layers for p in layer.experts.parameters()}
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr)
    model.train()
    first = last = None
    for step in range(args.steps):
        x = batch(rank, step, args.batch, args.seq, args.stride)
        out = model(x, labels=x, output_router_logits=True)  # HF's loss + its load-balancing loss
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        for p in params:
            if p.grad is None:
                continue
            if id(p) in experts:
                p.grad.div_(world_size)  # already the sum over every rank's tokens: make it the mean
            else:
                dist.all_reduce(p.grad)  # replicated: average the ranks' gradients (as DDP)
                p.grad.div_(world_size)
        opt.step()
        loss = torch.tensor([float(out.loss.detach())], dtype=torch.float64)
        dist.all_reduce(loss)
        loss = float(loss) / world_size
        first = loss if first is None else first
        last = loss
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            log(f"step {step:>3d}  loss {loss:.4f}  (load-balancing loss {float(out.aux_loss.detach()):.4f} on rank 0)")

    # The trained weights back into a fresh HF model: non-MoE weights by name, MoE blocks with to_hf.
    model.eval()
    fresh = tiny_model(args.family, args.seed + 1).eval()
    state = {k: v for k, v in model.state_dict().items() if ".moe." not in k}
    missing = fresh.load_state_dict(state, strict=False).missing_keys
    blocks = [m for m in fresh.modules() if type(m).__name__ == BLOCKS[args.family]]
    swapped = [m for m in model.modules() if hasattr(m, "moe") and isinstance(m.moe, moe_comm.MoELayer)]
    for theirs, mine in zip(blocks, swapped):
        hf.to_hf(mine, theirs)
    assert all(".mlp." in k for k in missing), missing  # everything else came by name
    with torch.no_grad():
        after = worst(rel(model(ids).logits, fresh(ids).logits))
    log(f"parity after training, weights written back with to_hf: max relative logit difference {after:.2e}")
    ok = before <= 1e-5 and after <= 1e-5 and last < first
    log(f"final: loss {first:.4f} -> {last:.4f}; " + ("OK" if ok else "FAILED"))
    return {"before": before, "after": after, "first": first, "last": last, "ok": ok}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--family", choices=sorted(BLOCKS), default="qwen2_moe")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--stride", type=int, default=7, help="the toy task: token t+1 = token t + stride mod V")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if 8 % args.world_size:
        p.error(f"--world-size must divide the 8 experts, got {args.world_size}")
    return args


if __name__ == "__main__":
    _args = parse_args()
    _result = run_ranks(run, _args.world_size, _args)
    sys.exit(0 if _result is None or _result["ok"] else 1)
