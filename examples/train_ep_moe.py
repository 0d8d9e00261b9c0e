"""Train a small MoE transformer as EP x DP with FSDP2, checkpoint it with torch.distributed.checkpoint
mid-run, resume at another EP size, and compare the whole loss curve with the same model trained in one
process.

Shapes legend: B sequences per rank, L sequence length, T = B x L tokens per rank, D input features,
O outputs, H hidden size, E experts (global), EP / DP expert- / data-parallel sizes, N = EP x DP ranks.

Task: sequences of tokens, each from one of E clusters (centre mu_c); the target of token t is its
cluster's own nonlinear map of its offset from the centre plus a linear read of the mean of the tokens
up to t: ``y_t = B_c tanh(A_c (x_t - mu_c)) + P (mean_{s<=t} x_s)``. The experts can specialise by
cluster; the causal attention is needed for the context term. Every rank draws its own sequences.

Model: in_proj [D -> H] -> layers x (x + Attention(RMSNorm(x)); x + MoELayer(RMSNorm(x))) -> RMSNorm ->
head [H -> O]. The objective is the mean over the N ranks of each rank's loss (MSE + the router's aux
loss on its own tokens).

Run (4 gloo ranks on this CPU, about 30 s here):
    python examples/train_ep_moe.py                   # EP 2 x DP 2, then resumed at EP 4 x DP 1
    python examples/train_ep_moe.py --resume-ep 1     # ... resumed at EP 1 x DP 4
    python examples/train_ep_moe.py --fp8-dispatch    # FP8 rows to the experts (add --dedup: one copy per rank)
    torchrun --nproc-per-node 8 examples/train_ep_moe.py --ep 4   # NCCL on cuda:LOCAL_RANK if CUDA

What it does, every rank:
1. builds the model with ``MoELayer(cfg, ep_group=mesh)`` on the ('dp', 'ep') DeviceMesh and wraps it with
   ``moe_comm.parallel.fully_shard_moe`` (FSDP2: replicated weights sharded, experts kept out of FSDP
   and their gradients summed over the DP group / N);
2. trains ``--steps`` / 2 steps, then ``dcp.save(get_state_dict(model, optimizer))``: every rank writes its
   own experts and Adam state (nothing gathered);
3. builds a FRESH model on an EP ``--resume-ep`` grid, ``dcp.load`` + ``set_state_dict``, trains the rest.
Rank 0 (in the launching process) also trains the same model in one process on the union of the ranks'
batches and prints both curves. Exits 1 unless the curves agree to ``--tolerance`` (relative; fp32
rounding differs between the two: other summation orders) and the loss fell.

Wire options (the EP x DP model only; the one-process reference keeps fp32 rows):
    --dedup          one copy per (token, rank): ``MoEConfig(dedup=True)``; only the summation order
                     changes, so the curve is still checked to ``--tolerance``.
    --fp8-dispatch   FP8 rows to the experts: ``MoEConfig(dispatch_dtype=torch.float8_e4m3fn)`` (one fp32
                     scale per 128 elements; combine and backward stay fp32). Every expert input is rounded
                     to 3 mantissa bits, so the curve is not compared step by step: the run passes when its
                     final loss is within ``--fp8-tolerance`` (default 2%) of the fp32 one-process run's.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:
    import moe_comm
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import moe_comm
from moe_comm import parallel
from moe_comm.tools.launch import launched_by_torchrun, run_ranks

IN_FEATURES = 16   # D
OUT_FEATURES = 8   # O
TASK_WIDTH = 32    # inner width of each cluster's target map


# ------------------------------------------------------------------------------------------ task
class SequenceTask:
    """The synthetic task: identical in every process (built from ``seed``); ``sample(rank, step)`` is
    rank ``rank``'s batch of step ``step``, the same whichever process draws it."""

    def __init__(self, num_clusters: int, seq_len: int, seqs_per_rank: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        C, D, M = num_clusters, IN_FEATURES, TASK_WIDTH
        self.C, self.L, self.B, self.seed = C, seq_len, seqs_per_rank, seed
        self.mu_CD = torch.randn(C, D, generator=g) * 2.0
        self.A_CMD = torch.randn(C, M, D, generator=g) * (1.5 / math.sqrt(D))
        self.B_COM = torch.randn(C, OUT_FEATURES, M, generator=g) / math.sqrt(M)
        self.P_OD = torch.randn(OUT_FEATURES, D, generator=g) / math.sqrt(D)

    def sample(self, rank: int, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """-> x [B, L, D], y [B, L, O] float32 (CPU)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + rank)
        c_BL = torch.randint(0, self.C, (self.B, self.L), generator=g)
        off = torch.randn(self.B, self.L, IN_FEATURES, generator=g)
        x = self.mu_CD[c_BL] + off
        h = torch.tanh(torch.einsum("blmd,bld->blm", self.A_CMD[c_BL], off))
        ctx = x.cumsum(1) / torch.arange(1, self.L + 1).view(1, -1, 1)
        y = torch.einsum("blom,blm->blo", self.B_COM[c_BL], h) + 0.5 * ctx @ self.P_OD.T
        return x, y


# ----------------------------------------------------------------------------------------- model
class Attention(nn.Module):
    """Causal multi-head self-attention: [B, L, H] -> [B, L, H]."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x_BLH: torch.Tensor) -> torch.Tensor:
        B, L, H = x_BLH.shape
        q, k, v = self.qkv(x_BLH).view(B, L, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, H))


class Block(nn.Module):
    def __init__(self, cfg: moe_comm.MoEConfig, heads: int, seed: int, **layer_kwargs):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden_size)
        self.attn = Attention(cfg.hidden_size, heads)
        self.moe_norm = nn.RMSNorm(cfg.hidden_size)
        self.moe = moe_comm.MoELayer(cfg, seed=seed, **layer_kwargs)

    def forward(self, x_BLH: torch.Tensor) -> torch.Tensor:
        x_BLH = x_BLH + self.attn(self.attn_norm(x_BLH))
        return x_BLH + self.moe(self.moe_norm(x_BLH))


class MoETransformer(nn.Module):
    """in_proj -> layers x Block -> RMSNorm -> head. ``forward`` returns (y [B, L, O], aux loss)."""

    def __init__(self, cfg: moe_comm.MoEConfig, layers: int, heads: int, seed: int, **layer_kwargs):
        super().__init__()
        torch.manual_seed(seed)  # the dense weights: the same in every process whatever the grid
        self.in_proj = nn.Linear(IN_FEATURES, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg, heads, seed + 1000 * i, **layer_kwargs) for i in range(layers))
        self.out_norm = nn.RMSNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, OUT_FEATURES)

    def forward(self, x_BLD: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        h = self.in_proj(x_BLD)
        for block in self.blocks:
            h = block(h)
        return self.head(self.out_norm(h)), sum(block.moe.aux_loss for block in self.blocks)


def make_model(args: argparse.Namespace, wire: bool = True, **layer_kwargs) -> MoETransformer:
    """wire: apply --dedup / --fp8-dispatch (False: the fp32 reference)."""
    cfg = moe_comm.MoEConfig(hidden_size=args.hidden, ffn_hidden_size=2 * args.hidden, num_experts=args.experts,
                             top_k=args.top_k, aux_loss_coeff=1e-2, dedup=wire and args.dedup,
                             dispatch_dtype=torch.float8_e4m3fn if wire and args.fp8_dispatch else None)
    return MoETransformer(cfg, args.layers, args.heads, args.seed, **layer_kwargs)


def rank_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    pred, aux = model(x)
    return F.mse_loss(pred, y) + aux


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    # foreach=False: FSDP2's DTensor parameters and the plain expert parameters share one param group.
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, foreach=False)


# ------------------------------------------------------------------------------- one-process run
def train_one_process(args: argparse.Namespace, world_size: int) -> List[float]:
    """The reference: every expert in one process; each step the mean over the ranks' losses."""
    task = SequenceTask(args.experts, args.seq_len, args.seqs, args.seed)
    model = make_model(args, wire=False, allow_single_process=True)
    opt = make_optimizer(model, args)
    losses = []
    for step in range(args.steps):
        loss = sum(rank_loss(model, *task.sample(r, step)) for r in range(world_size)) / world_size
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


# --------------------------------------------------------------------------------- EP x DP ranks
def grid(ep: int, world_size: int, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device_type, (world_size // ep, ep), mesh_dim_names=("dp", "ep"))


def train_phase(args, rank: int, world_size: int, ep: int, steps: range, device: torch.device,
                load_from: Optional[str] = None, save_to: Optional[str] = None) -> List[float]:
    """Build the model on an EP x DP grid (FSDP2), optionally load a DCP checkpoint, train ``steps``,
    optionally save one. Returns the mean loss over the ranks of every step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = grid(ep, world_size, device.type)
    with torch.device(device):
        model = make_model(args, ep_group=mesh)
    parallel.fully_shard_moe(model, mesh, blocks=list(model.blocks))
    opt = make_optimizer(model, args)
    if load_from is not None:
        msd, osd = get_state_dict(model, opt)  # this grid's own keys (its experts) to fill
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=load_from)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    task = SequenceTask(args.experts, args.seq_len, args.seqs, args.seed)
    losses = []
    for step in steps:
        moe_comm.set_step(step)  # every rank checks that all are at this step (a skipped step raises at once)
        x, y = (t.to(device) for t in task.sample(rank, step))
        loss = rank_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean = loss.detach().reshape(1).clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world_size)  # host sync: the printed curve
    if save_to is not None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=save_to)
    parallel.check_expert_replicas(model)  # the DP replicas of every expert are still bit-identical
    return losses


def _rank(rank: int, world_size: int, args: argparse.Namespace, ckpt: str) -> dict:
    # FSDP2 warns that the root's output is a view (nn.Linear on [B, L, H]); nothing here writes into it.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    on_cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    half = args.steps // 2
    t0 = time.perf_counter()
    first = train_phase(args, rank, world_size, args.ep, range(half), device, save_to=ckpt)
    t1 = time.perf_counter()
    second = train_phase(args, rank, world_size, args.resume_ep, range(half, args.steps), device, load_from=ckpt)
    return {"losses": first + second, "seconds": (t1 - t0, time.perf_counter() - t1)}


# -------------------------------------------------------------------------------------- report
def report(args, world_size: int, ref: List[float], dist_run: dict, ckpt: str) -> bool:
    got, half = dist_run["losses"], args.steps // 2
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref)]
    shown = sorted({0, half - 1, half, args.steps - 1} | set(range(0, args.steps, max(1, args.steps // 8))))
    a_grid = f"EP {args.ep} x DP {world_size // args.ep}"
    b_grid = f"EP {args.resume_ep} x DP {world_size // args.resume_ep}"
    print(f"{'step':>5s}  {'one process':>12s}  {'EP x DP ranks':>13s}  {'rel. diff':>9s}  grid")
    for s in shown:
        print(f"{s + 1:>5d}  {ref[s]:>12.6f}  {got[s]:>13.6f}  {rel[s]:>9.1e}  {a_grid if s < half else b_grid}")
    files = sorted(f for f in os.listdir(ckpt) if f.endswith(".distcp"))
    print(f"checkpoint: dcp.save after step {half} at {a_grid} ({len(files)} files, one per rank), "
          f"dcp.load + set_state_dict into a fresh model at {b_grid}")
    print(f"time: {dist_run['seconds'][0]:.1f} s at {a_grid}, {dist_run['seconds'][1]:.1f} s at {b_grid} "
          f"(incl. building, checkpoint I/O)")
    worst = max(rel)
    fell = got[-1] < got[0]
    if args.fp8_dispatch:  # every expert input rounded to e4m3: the curves part, the final loss is what counts
        ok_curve = rel[-1] <= args.fp8_tolerance
        print(f"curve vs one process (fp32 rows): max relative difference {worst:.2e} over {args.steps} steps "
              f"(not checked: FP8 dispatch)")
        print(f"fp8 dispatch: final loss {got[-1]:.6f} vs fp32 one process {ref[-1]:.6f}: relative difference "
              f"{rel[-1]:.2e} (tolerance {args.fp8_tolerance:.0e}): {'OK' if ok_curve else 'FAILED'}")
    else:
        ok_curve = worst <= args.tolerance
        print(f"curve vs one process: max relative difference {worst:.2e} over {args.steps} steps "
              f"(tolerance {args.tolerance:.0e}): {'OK' if ok_curve else 'FAILED'}")
    print(f"final: loss first {got[0]:.4f} -> last {got[-1]:.4f} "
          f"({got[0] / got[-1]:.1f}x lower)" if fell else f"final: loss first {got[0]:.4f} -> last {got[-1]:.4f}: "
          f"FAILED, the loss did not fall")
    return ok_curve and fell


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", type=int, default=4, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--ep", type=int, default=2, help="EP size of the first half (DP = world / EP)")
    p.add_argument("--resume-ep", type=int, default=4, help="EP size after the checkpoint")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8, help="global experts; divisible by both EP sizes")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--seqs", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-4, help="max relative difference of the curves")
    p.add_argument("--dedup", action="store_true", help="one copy per (token, rank) on the wire (MoEConfig.dedup)")
    p.add_argument("--fp8-dispatch", action="store_true",
                   help="FP8 (e4m3, fp32 block scales) rows to the experts (MoEConfig.dispatch_dtype)")
    p.add_argument("--fp8-tolerance", type=float, default=2e-2,
                   help="with --fp8-dispatch: max relative difference of the final loss vs the fp32 one-process run")
    p.add_argument("--checkpoint", type=str, default=None, help="DCP directory (default: a temporary one)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait")
    args = p.parse_args(argv)
    W = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else args.world_size
    for name in ("ep", "resume_ep"):
        v = getattr(args, name)
        if v < 1 or W % v or args.experts % v:
            p.error(f"--{name.replace('_', '-')} must divide the world size ({W}) and --experts "
                    f"({args.experts}), got {v}")
    if not 1 <= args.top_k <= args.experts:
        p.error(f"--top-k must be in [1, --experts={args.experts}], got {args.top_k}")
    if args.hidden % args.heads:
        p.error(f"--hidden must be divisible by --heads, got {args.hidden} and {args.heads}")
    for name, low in (("steps", 2), ("layers", 1), ("seq_len", 1), ("seqs", 1)):
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    args.world = W
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    ckpt = args.checkpoint or tempfile.mkdtemp(prefix="moe_comm_dcp_")
    try:
        print(f"moe_comm {moe_comm.__version__}: {args.world} ranks, {args.layers} blocks (attention + MoE), "
              f"H={args.hidden}, E={args.experts}, K={args.top_k}, {args.seqs}x{args.seq_len} tokens per rank "
              f"and step; FSDP2 via moe_comm.parallel.fully_shard_moe", flush=True)
        wire = [w for w, on in (("one copy per (token, rank)", args.dedup),
                                ("FP8 e4m3 rows to the experts (fp32 block scales)", args.fp8_dispatch)) if on]
        if wire:
            print(f"wire (EP x DP model; the one-process reference keeps fp32 rows): {', '.join(wire)}", flush=True)
        dist_run = run_ranks(_rank, args.world_size, args, ckpt, timeout=args.timeout)
        if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
            return 0  # torchrun: rank 0 reports
        if dist_run is None:
            print("FAILED: rank 0 returned no result")
            return 1
        ref = train_one_process(args, args.world)
        return 0 if report(args, args.world, ref, dist_run, ckpt) else 1
    finally:
        if args.checkpoint is None:
            shutil.rmtree(ckpt, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
