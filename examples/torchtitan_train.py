"""A few training steps of torchtitan's own Qwen3-MoE model (tiny dims) with expert parallelism on CPU gloo ranks:
torchtitan's all-to-all token dispatch against moe_comm's (``apply_moe_comm``), and a torchtitan DCP checkpoint
written by each loaded by the other.

    torchrun --nproc-per-node 2 examples/torchtitan_train.py            # EP = 2
    torchrun --nproc-per-node 4 examples/torchtitan_train.py --steps 3 --num-chunks 2

What it does, on every rank:
1. builds the model twice from torchtitan's Qwen3-MoE builders (2 layers, D = 32, E = 8, K = 2) on the meta
   device, EP sharding configs set as torchtitan's trainer sets them; ``apply_moe_comm`` on the second, then
   torchtitan's ``model.parallelize(parallel_dims)`` on both (experts sharded Shard(0) over the EP mesh);
2. initialises the first (torchtitan's init), saves it with ``torch.distributed.checkpoint`` and loads that
   checkpoint into the moe_comm model: both start from the same weights;
3. trains both on the same batches (AdamW; replicated gradients averaged over the ranks, as data parallelism
   does): the losses must agree within 1e-5 relative at every step;
4. saves the moe_comm model and loads it into a fresh torchtitan-dispatch model: the next loss must agree.
Prints one JSON line (rank 0) and exits 1 when a figure is above 1e-5, or when a moe_comm Dispatcher made no
call or moved no bytes (equal losses alone would not show that moe_comm ran: torchtitan's dispatch gives them
too). The line carries each Dispatcher's call count and last call's bytes (``moe_comm_dispatchers``).

Changes to torchtitan (this example's, named; the library patches nothing): its mesh setup takes the device type
"cpu" (``parallel_dims.device_type``; it assumes an accelerator); attention runs torchtitan's
``ScaledDotProductAttention`` (causal; FlexAttention has no CPU backward); SPMD backend "partial_dtensor"; the
experts are ``Fp32GroupedExperts``: torchtitan's GroupedExperts without its casts to bfloat16 (same parameters,
same ``torch._grouped_mm``), so that the two runs agree to float32 rounding. With torchtitan's bf16 experts the
first step's loss is identical and later steps drift by ~3e-5 (float32-rounding differences of the gradients,
moved across bf16 rounding boundaries by AdamW): measured at W = 2, 4 steps.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moe_comm.integrations.torchtitan import apply_moe_comm  # noqa: E402

VOCAB, DIM, HEAD_DIM, E, K = 64, 32, 8, 8, 2
TOLERANCE = 1e-5


def _fp32_experts_class():
    from torch.distributed.tensor import DTensor
    from torchtitan.models.common.moe import GroupedExperts

    class Fp32GroupedExperts(GroupedExperts):
        """torchtitan's GroupedExperts computing in the weights' dtype (no casts to bfloat16)."""

        def forward(self, x_RD, num_tokens_per_expert_E):
            w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                          for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
            offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            h_RF = F.silu(torch._grouped_mm(x_RD, w1.transpose(-2, -1), offs=offs))
            h_RF = h_RF * torch._grouped_mm(x_RD, w3.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(h_RF, w2.transpose(-2, -1), offs=offs).type_as(x_RD)

    return Fp32GroupedExperts


def model_config(layers: int):
    """torchtitan's Qwen3-MoE config (its own builders; qwen3's debugmodel_moe with tiny dims), EP sharding on."""
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    cfg = qwen3.Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=qwen3._qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=layers, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=HEAD_DIM, moe_hidden_dim=16,
            num_experts=E, top_k=K, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=256, theta=10000.0)))
    for layer in cfg.layers:  # CPU patch: causal SDPA (FlexAttention has no CPU backward)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=True)  # as the trainer's update_from_config does
    return cfg


def build(cfg, parallel_dims, moe_comm_options):
    """The model on the meta device, [moe_comm applied], parallelized by torchtitan, materialised on the CPU."""
    with torch.device("meta"):
        model = cfg.build()
    fp32 = _fp32_experts_class()
    for m in model.modules():
        if type(m).__name__ == "GroupedExperts":
            m.__class__ = fp32  # see the module docstring
    changed = None
    if moe_comm_options is not None:  # where a parallelize function applies EP: right before model.parallelize
        changed = apply_moe_comm(model, parallel_dims.get_mesh("ep"), **moe_comm_options)
    model.parallelize(parallel_dims)
    model.to_empty(device="cpu")
    with torch.no_grad():  # torchtitan's init: weights (a checkpoint overwrites them), RoPE cache, MoE counters
        model.init_states(buffer_device=torch.device("cpu"))
    return model, changed


def batch(step: int, rank: int, batch_size: int, seq: int):
    g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own tokens
    tokens = torch.randint(0, VOCAB, (batch_size, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, inputs, labels):
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def average_gradients(model, world_size: int) -> None:
    """Data-parallel averaging of the global loss (mean over ranks): replicated parameters all_reduce their
    gradient; sharded experts already hold every rank's tokens' gradient (the all-to-all brought them)."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if p.grad is None:
            continue
        if not isinstance(p.grad, DTensor):
            dist.all_reduce(p.grad)
        p.grad.div_(world_size)


def global_mean(v: torch.Tensor) -> float:
    t = v.detach().double().reshape(1).clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--num-chunks", type=int, default=2, help="moe_comm's pipelined chunks C")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--ckpt-dir", default=None, help="shared directory for the DCP checkpoints (default: a temp dir)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.layers < 1 or a.batch < 1 or a.seq < 1:
        p.error("--steps, --layers, --batch and --seq must be >= 1")
    warnings.filterwarnings("ignore")  # torchtitan's fp32 router autocast on CPU, DCP's single-file notes
    dist.init_process_group("gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    if E % W:
        p.error(f"the world size ({W}) must divide the {E} experts")

    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")
    tt_parallel_dims.device_type = "cpu"  # CPU patch: its mesh setup assumes an accelerator
    torch.manual_seed(0)
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=W, cp=1, tp=1, pp=1, ep=W, world_size=W,
                                 spmd_backend="partial_dtensor")
    parallel_dims.build_mesh()
    cfg = model_config(a.layers)
    theirs, _ = build(cfg, parallel_dims, None)
    mine, changed = build(cfg, parallel_dims, {"num_chunks": a.num_chunks})
    assert sorted(theirs.state_dict()) == sorted(mine.state_dict())  # apply_moe_comm keeps every key

    ckpt = [a.ckpt_dir or (tempfile.mkdtemp(prefix="moe_comm_tt_") if rank == 0 else None)]
    dist.broadcast_object_list(ckpt)
    dcp.save(theirs.state_dict(), checkpoint_id=os.path.join(ckpt[0], "torchtitan_dispatch"))
    state = mine.state_dict()
    dcp.load(state, checkpoint_id=os.path.join(ckpt[0], "torchtitan_dispatch"))  # moe_comm model <- torchtitan's
    mine.load_state_dict(state)

    opts = [torch.optim.AdamW(m.parameters(), lr=a.lr, foreach=False) for m in (theirs, mine)]
    losses, worst = [], 0.0
    for step in range(a.steps):
        inputs, labels = batch(step, rank, a.batch, a.seq)
        pair = []
        for model, opt in zip((theirs, mine), opts):
            opt.zero_grad()
            loss = loss_of(model, inputs, labels)
            loss.backward()
            average_gradients(model, W)
            opt.step()
            pair.append(global_mean(loss))
        rel = abs(pair[1] - pair[0]) / abs(pair[0])
        worst = max(worst, rel)
        losses.append({"step": step, "torchtitan": pair[0], "moe_comm": pair[1], "rel": rel})

    # moe_comm model -> checkpoint -> a fresh model with torchtitan's dispatch: the same next loss.
    dcp.save(mine.state_dict(), checkpoint_id=os.path.join(ckpt[0], "moe_comm_dispatch"))
    fresh, _ = build(cfg, parallel_dims, None)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=os.path.join(ckpt[0], "moe_comm_dispatch"))
    fresh.load_state_dict(state)
    inputs, labels = batch(a.steps, rank, a.batch, a.seq)
    with torch.no_grad():
        after = [global_mean(loss_of(m, inputs, labels)) for m in (mine, fresh)]
    reload_rel = abs(after[1] - after[0]) / abs(after[0])
    # Evidence that moe_comm carried the moe_comm model's tokens: every Dispatcher's forward calls (a training
    # step and the reload's no-grad forward each make one) and its last call's bytes (this rank's, logical /
    # handed to the all-to-alls).
    ran = [{"module": name, "calls": m.moe_comm_dispatcher.channel.call,
            "dispatch_logical_bytes": m.moe_comm_dispatcher.last_bytes.get("dispatch_logical", 0),
            "dispatch_wire_bytes": m.moe_comm_dispatcher.last_bytes.get("dispatch_wire", 0)}
           for name, m in mine.named_modules() if hasattr(m, "moe_comm_dispatcher")]
    ran_ok = len(ran) == a.layers and all(r["calls"] == a.steps + 1 and r["dispatch_wire_bytes"] > 0 for r in ran)
    ok = worst <= TOLERANCE and reload_rel <= TOLERANCE and changed == a.layers and ran_ok
    if rank == 0:
        print(json.dumps({"world_size": W, "moe_modules_changed": changed, "num_chunks": a.num_chunks,
                          "moe_comm_dispatchers": ran, "steps": losses, "max_loss_rel_diff": worst,
                          "reloaded_loss": after, "reload_rel_diff": reload_rel, "tolerance": TOLERANCE,
                          "ok": ok}))
    dist.barrier()  # every rank is done with the checkpoints
    if rank == 0 and not a.ckpt_dir:
        shutil.rmtree(ckpt[0], ignore_errors=True)  # the temp folder made above
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
