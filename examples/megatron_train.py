"""Train a tiny Megatron-Core GPT with MoE layers, its token dispatch through moe_comm, at EP = W.

Every rank builds the same ``GPTModel`` (Megatron-Core 0.16.1, local spec: no Transformer Engine; hidden 32,
2 layers, each an MoE layer of E = 2W experts, top-2; tensor / pipeline parallel 1, expert parallel = W, so
each rank holds E / W experts and the rest is replicated). It trains ``--steps`` steps twice from the same
weights and the same batches: once with Megatron's own alltoall dispatcher, once after
``moe_comm.integrations.megatron.use_moe_comm(model)``. Each rank its own batch of a toy next-token task
(token t+1 = token t + 3 mod V); loss = the mean over ranks; replicated parameters' gradients are summed
over the ranks (each rank back-propagates loss / W), experts already get every rank's tokens' gradient
through the all-to-all. Checks (exit 1 when one fails):
  - every step's loss equal between the two runs within 1e-5 relative;
  - the loss falls;
  - checkpoints (one file per rank, ``model.state_dict()``) have the same keys, and each run's checkpoint
    loaded into the other run's model gives the same loss on a held-out batch (1e-5 relative).

Run:
    python examples/megatron_train.py                     # 2 gloo ranks on this CPU
    python examples/megatron_train.py --world-size 4 --steps 10
    torchrun --nproc-per-node 2 examples/megatron_train.py
Needs megatron-core 0.16.1 (``pip install -e ".[megatron]"``). On a machine without CUDA the few CUDA calls
Megatron makes are answered for the CPU (``_cpu_stubs``: the example's, not the library's).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    import moe_comm  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_comm.tools.launch import run_ranks

VOCAB, SEQ, BATCH, STRIDE = 64, 16, 4, 3
_NO_APEX = r".*Apex (is|are) not installed"


def _cpu_stubs():
    """CPU only: what Megatron-Core 0.16.1 reaches for that has no CPU path (none of it is moe_comm's).
    ``torch.cuda.current_device`` -> cpu (the router and the all-to-all mapping allocate there); the alltoall
    dispatcher's CUDA side stream -> a placeholder, and its device-to-host copy -> Python lists at the same
    point; the CUDA RNG tracker's fork (around attention dropout, 0 here) -> no-op;
    ``moe_utils.te_general_gemm`` = None when Transformer Engine is absent (Megatron's own fallback)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    torch.cuda.current_device = lambda: torch.device("cpu")
    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()

    def host_dtoh(self, point, tokens_per_expert=None):
        if point == self.cuda_dtoh_point and not self.drop_and_pad:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                if torch.is_tensor(getattr(self, name)):
                    setattr(self, name, getattr(self, name).tolist())
        return tokens_per_expert

    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = host_dtoh
    tracker = tensor_parallel.get_cuda_rng_tracker()  # core attention forks the CUDA RNG around its dropout
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # (p = 0 here: it draws nothing)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_model(world_size: int, layers: int, hidden: int):
    """The tiny GPTModel, weights from seed 0 (replicated parameters equal on every rank), expert weights
    from their global expert id."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_APEX)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.transformer_config import TransformerConfig

    E = 2 * world_size
    cfg = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=2 * hidden,
        moe_ffn_hidden_size=hidden, num_moe_experts=E, moe_router_topk=2, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
        moe_permute_fusion=False, moe_router_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        expert_model_parallel_size=world_size, add_bias_linear=False, gated_linear_unit=True,
        activation_func=F.silu, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        use_cpu_initialization=True, init_method_std=0.05, cuda_graph_scope=[])
    me = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    world = dist.group.WORLD
    pgs = ProcessGroupCollection(tp=me, cp=me, pp=me, ep=world, tp_ep=world, expt_tp=me, expt_dp=me, tp_cp=me,
                                 tp_dp_cp=me, dp=world, dp_cp=world, embd=None, pos_embd=None)
    from megatron.core import parallel_state
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # core attention's scratch buffer (initialize_model_parallel
        parallel_state._set_global_memory_buffer()      # makes it; no global groups are set up here)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_APEX)
        model = GPTModel(cfg, get_gpt_layer_local_spec(num_experts=E), vocab_size=VOCAB, max_sequence_length=SEQ,
                         pg_collection=pgs)
    with torch.no_grad():
        for name, p in model.named_parameters():  # expert weights: one seed per (global expert, tensor)
            if ".experts.local_experts." in name:
                layer = int(name.split(".layers.")[1].split(".")[0])
                local = int(name.split(".local_experts.")[1].split(".")[0])
                g = dist.get_rank() * (E // world_size) + local
                gen = torch.Generator().manual_seed(10_000 * layer + 10 * g + name.endswith("fc2.weight"))
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def batch(rank: int, step: int):
    """Token ids [B, S] and next-token labels of this rank's toy batch (token t+1 = token t + STRIDE mod V)."""
    gen = torch.Generator().manual_seed(1_000 * rank + step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
    ids = (start + STRIDE * torch.arange(SEQ + 1)) % VOCAB
    return ids[:, :-1], ids[:, 1:]


def loss_of(model, rank: int, step: int) -> torch.Tensor:
    ids, labels = batch(rank, step)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)  # True: masked (causal)
    logits = model(ids, pos, mask)  # [B, S, V] (Megatron's vocab-parallel loss needs its global TP group)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def train(model, rank: int, W: int, steps: int, lr: float):
    expert = {n for n, _ in model.named_parameters() if ".experts." in n}
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(model, rank, step)
        (loss / W).backward()
        for n, p in model.named_parameters():
            if n not in expert and p.grad is not None:  # replicated: the sum over the ranks' losses / W
                dist.all_reduce(p.grad)
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / W)
    return losses


def run(rank: int, W: int, args) -> dict:
    if not torch.cuda.is_available():
        _cpu_stubs()
    from moe_comm.integrations.megatron import use_moe_comm

    ref = build_model(W, args.layers, args.hidden)
    ours = build_model(W, args.layers, args.hidden)
    switched = use_moe_comm(ours)
    assert switched == args.layers, switched
    ref_losses = train(ref, rank, W, args.steps, args.lr)
    our_losses = train(ours, rank, W, args.steps, args.lr)
    worst = max(abs(a - b) / abs(b) for a, b in zip(our_losses, ref_losses))

    # checkpoints: one file per rank (each holds its own experts), written by one run, loaded by the other
    own = args.checkpoint_dir is None
    folder = tempfile.mkdtemp(prefix="moe_comm_megatron_") if own else args.checkpoint_dir  # own folder: no clash
    paths = {k: os.path.join(folder, f"megatron_train_{k}_rank{rank}.pt") for k in ("alltoall", "moe_comm")}
    torch.save(ref.state_dict(), paths["alltoall"])
    torch.save(ours.state_dict(), paths["moe_comm"])
    same_keys = sorted(ref.state_dict()) == sorted(ours.state_dict())
    held_out = 10_000
    cross = {}
    for writer, reader_kind in (("alltoall", "moe_comm"), ("moe_comm", "alltoall")):
        reader = build_model(W, args.layers, args.hidden)
        if reader_kind == "moe_comm":
            use_moe_comm(reader)
        reader.load_state_dict(torch.load(paths[writer], weights_only=False))
        writer_model = ref if writer == "alltoall" else ours
        with torch.no_grad():
            a = float(loss_of(reader, rank, held_out))
            b = float(loss_of(writer_model, rank, held_out))
        cross[f"{writer} -> {reader_kind}"] = abs(a - b) / abs(b)
    result = dict(world_size=W, alltoall=ref_losses, moe_comm=our_losses, max_rel_loss_diff=worst,
                  same_state_dict_keys=same_keys, checkpoint_cross_load_rel=cross,
                  checkpoint_files=sorted(paths.values()))
    failures = dist.all_gather_object  # every rank checks its own cross-load; rank 0 reports all
    mine = max(cross.values())
    everyone = [None] * W
    failures(everyone, mine)
    result["checkpoint_cross_load_rel_worst_rank"] = max(everyone)
    result["rank"] = rank
    if own:
        shutil.rmtree(folder, ignore_errors=True)
        result["checkpoint_files"] = []  # removed with their temp folder
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks to spawn (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpoint-dir", default=None,
                   help="where the per-rank checkpoints go (default: a new temp folder per rank)")
    args = p.parse_args(argv)
    r = run_ranks(run, args.world_size, args)
    ok = (r["max_rel_loss_diff"] <= 1e-5 and r["same_state_dict_keys"]
          and r["checkpoint_cross_load_rel_worst_rank"] <= 1e-5 and r["moe_comm"][-1] < r["moe_comm"][0])
    if r["rank"] != 0:  # under torchrun every rank returns its own result; rank 0 reports
        return 0 if ok else 1
    print(f"EP = {r['world_size']}, {len(r['alltoall'])} steps")
    for i, (a, b) in enumerate(zip(r["alltoall"], r["moe_comm"])):
        print(f"  step {i}: loss alltoall {a:.6f}  moe_comm {b:.6f}  rel diff {abs(a - b) / abs(a):.2e}")
    print(f"max rel loss diff {r['max_rel_loss_diff']:.2e}; state-dict keys equal: {r['same_state_dict_keys']}; "
          f"checkpoint cross-load rel diff (worst rank) {r['checkpoint_cross_load_rel_worst_rank']:.2e}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
