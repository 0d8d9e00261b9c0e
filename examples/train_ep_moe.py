"""Train a small stack of expert-parallel MoE layers on a synthetic clustered regression task.

Shapes legend: T tokens on this rank, D input features, O outputs, H hidden size, E experts (global),
W EP world size.

Task: every token comes from one of ``--clusters`` clusters (centre mu_c in R^D); its target is that
cluster's own random nonlinear map of the token's offset from the centre,
``y = B_c tanh(A_c (x - mu_c)) + o_c``. A router that learns the clusters can hand each one to its own
experts, so the experts help. The task (centres, maps) is the same on every rank; each rank samples
its own tokens (its own seed, and uneven batch sizes).

Model: in_proj [D -> H] -> layers x (x + MoELayer(RMSNorm(x))) -> RMSNorm -> head [H -> O].
Replicated parameters (in/out projections, norms, router weights) get their gradients averaged over
the group before the step, so they stay identical on every rank; expert weights are local to their
rank (their gradient already sums every rank's tokens through the all-to-all backward).

Run:
    python examples/train_ep_moe.py --world-size 4             # spawns 4 gloo ranks on this CPU
    torchrun --nproc-per-node 8 examples/train_ep_moe.py       # NCCL on cuda:LOCAL_RANK if CUDA
Exits 1 when the final held-out loss is not below the initial one (usable as a smoke test), or when
the replicated parameters differ between ranks at the end.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

try:
    import moe_comm
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import moe_comm
from moe_comm.modules.checkpoint import full_state_dict
from moe_comm.tools.launch import run_ranks

IN_FEATURES = 16   # D
OUT_FEATURES = 8   # O
TASK_WIDTH = 32    # inner width of each cluster's target map
EVAL_TOKENS = 512  # held-out tokens per rank


# ------------------------------------------------------------------------------------------ task
class ClusteredTask:
    """The synthetic task: identical on every rank (built from ``seed``), sampled per rank.

    Attributes: mu_CD [C, D] centres, A_CWD [C, 32, D] and B_COW [C, O, 32] the per-cluster maps,
    o_CO [C, O] offsets; targets are scaled to unit variance.
    """

    def __init__(self, num_clusters: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        C, D, O, M = num_clusters, IN_FEATURES, OUT_FEATURES, TASK_WIDTH
        self.num_clusters = C
        self.mu_CD = torch.randn(C, D, generator=g) * 2.0  # well separated: |mu_a - mu_b| ~ 11 vs noise ~ 4
        self.A_CMD = torch.randn(C, M, D, generator=g) * (1.5 / math.sqrt(D))
        self.B_COM = torch.randn(C, O, M, generator=g) / math.sqrt(M)
        self.o_CO = torch.randn(C, O, generator=g)
        self.scale = 1.0
        _, y = self.sample(4096, torch.Generator().manual_seed(seed + 1))
        self.scale = float(y.std())

    def sample(self, num_tokens: int, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        """-> x_TD [T, D], y_TO [T, O] float32 (CPU)."""
        c_T = torch.randint(0, self.num_clusters, (num_tokens,), generator=g)
        off_TD = torch.randn(num_tokens, IN_FEATURES, generator=g)
        x_TD = self.mu_CD[c_T] + off_TD
        h_TM = torch.tanh(torch.einsum("tmd,td->tm", self.A_CMD[c_T], off_TD))
        y_TO = torch.einsum("tom,tm->to", self.B_COM[c_T], h_TM) + self.o_CO[c_T]
        return x_TD, y_TO / self.scale


# ----------------------------------------------------------------------------------------- model
class MoEBlock(nn.Module):
    def __init__(self, cfg: moe_comm.MoEConfig, seed: int, device):
        super().__init__()
        self.norm = nn.RMSNorm(cfg.hidden_size, device=device)
        self.moe = moe_comm.MoELayer(cfg, seed=seed, device=device)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        return x_TH + self.moe(self.norm(x_TH))


class MoEStack(nn.Module):
    """in_proj -> num_layers x MoEBlock -> RMSNorm -> head. ``forward`` returns (y_TO, aux_loss)."""

    def __init__(self, cfg: moe_comm.MoEConfig, num_layers: int, seed: int, device):
        super().__init__()
        H = cfg.hidden_size
        self.in_proj = nn.Linear(IN_FEATURES, H, device=device)
        self.blocks = nn.ModuleList(MoEBlock(cfg, seed + 1000 * i, device) for i in range(num_layers))
        self.out_norm = nn.RMSNorm(H, device=device)
        self.head = nn.Linear(H, OUT_FEATURES, device=device)

    def forward(self, x_TD: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        h_TH = self.in_proj(x_TD)
        for block in self.blocks:
            h_TH = block(h_TH)
        aux = sum(block.moe.aux_loss for block in self.blocks)
        return self.head(self.out_norm(h_TH)), aux


def split_params(model: nn.Module) -> Tuple[List[nn.Parameter], List[nn.Parameter]]:
    """-> (replicated, expert): expert weights are those of GroupedExperts modules."""
    expert_ids = {id(p) for m in model.modules() if isinstance(m, moe_comm.GroupedExperts)
                  for p in m.parameters()}
    replicated = [p for p in model.parameters() if id(p) not in expert_ids]
    experts = [p for p in model.parameters() if id(p) in expert_ids]
    return replicated, experts


def sync_grads(replicated: List[nn.Parameter], experts: List[nn.Parameter], stats: torch.Tensor,
               world_size: int) -> torch.Tensor:
    """Average the replicated gradients (and the scalar ``stats``) over the group in one all-reduce.

    The objective is the mean over ranks of each rank's mean loss. A replicated gradient holds this
    rank's term only, so it is averaged; an expert gradient already sums the terms of every rank
    whose tokens reached the expert (the all-to-all backward brings them), so it is divided by W.
    Returns the averaged stats.
    """
    if world_size == 1:
        return stats
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in replicated]
    flat = torch.cat([g.reshape(-1) for g in grads] + [stats.reshape(-1)])
    dist.all_reduce(flat)
    flat.div_(world_size)
    offset = 0
    for p in replicated:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n
    for p in experts:
        if p.grad is not None:
            p.grad.div_(world_size)
    return flat[offset:]


def replicated_max_diff(replicated: List[nn.Parameter], world_size: int) -> float:
    """Largest elementwise difference of the replicated parameters between any two ranks."""
    if world_size == 1:
        return 0.0
    flat = torch.cat([p.detach().reshape(-1) for p in replicated])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return float((hi - lo).abs().max())


@torch.no_grad()
def evaluate(model: nn.Module, x_TD: torch.Tensor, y_TO: torch.Tensor, world_size: int) -> float:
    """Held-out MSE averaged over ranks (collective: every rank calls it)."""
    pred_TO, _ = model(x_TD)
    loss = torch.nn.functional.mse_loss(pred_TO, y_TO).reshape(1)
    if world_size > 1:
        dist.all_reduce(loss)
        loss /= world_size
    return float(loss)


# -------------------------------------------------------------------------------------- training
def rank_batch(batch: int, rank: int, world_size: int) -> int:
    """Uneven on purpose: rank r gets batch * (1 - r / 2W) tokens (256, 224, 192, 160 for W = 4)."""
    return max(1, batch - (rank * batch) // (2 * world_size))


def train(args: argparse.Namespace, rank: int, world_size: int, device: torch.device) -> dict:
    """The training loop, run by every rank. Returns the (group-wide) results."""
    log = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(args.seed)  # same replicated init on every rank (the layer also broadcasts its router)
    cfg = moe_comm.MoEConfig(hidden_size=args.hidden, ffn_hidden_size=args.ffn or 2 * args.hidden,
                             num_experts=args.experts, top_k=args.top_k, aux_loss_coeff=1e-2)
    model = MoEStack(cfg, args.layers, args.seed, device)
    replicated, experts = split_params(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(  # cosine from lr to lr / 10
        opt, lambda s: 0.1 + 0.45 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))

    task = ClusteredTask(args.clusters or args.experts, args.seed)
    g_train = torch.Generator().manual_seed(args.seed * 7919 + 1 + rank)
    x_eval, y_eval = (t.to(device) for t in task.sample(EVAL_TOKENS, torch.Generator().manual_seed(
        args.seed * 7919 + 100_003 + rank)))
    T_r = rank_batch(args.batch, rank, world_size)
    global_tokens = sum(rank_batch(args.batch, r, world_size) for r in range(world_size))
    n_rep = sum(p.numel() for p in replicated)
    n_exp = sum(p.numel() for p in experts)
    group = dist.get_backend() if world_size > 1 else "no group"
    log(f"moe_comm {moe_comm.__version__}: W={world_size} on {device.type} ({group}), "
        f"{args.layers} layers, H={cfg.hidden_size}, F={cfg.ffn_hidden_size}, E={cfg.num_experts} "
        f"({cfg.num_experts // world_size}/rank), K={cfg.top_k}, tokens/step {global_tokens} "
        f"(rank 0: {T_r}); params/rank: {n_rep} replicated + {n_exp} expert")

    first = evaluate(model, x_eval, y_eval, world_size)
    log(f"step {0:>5d}  eval loss {first:.4f}")
    log_every = args.log_every or max(1, args.steps // 12)
    t0, tokens_since, train_losses = time.perf_counter(), 0, []
    for step in range(1, args.steps + 1):
        x_TD, y_TO = (t.to(device) for t in task.sample(T_r, g_train))
        pred_TO, aux = model(x_TD)
        loss = torch.nn.functional.mse_loss(pred_TO, y_TO)
        opt.zero_grad(set_to_none=True)
        (loss + aux).backward()
        stats = sync_grads(replicated, experts, torch.stack([loss.detach(), aux.detach().to(loss.dtype)]),
                           world_size)
        opt.step()
        sched.step()
        tokens_since += global_tokens
        if step % log_every == 0 or step == args.steps:
            mean_loss, mean_aux = stats.tolist()  # host sync: the printed numbers (also times the step on CUDA)
            dt = time.perf_counter() - t0
            log(f"step {step:>5d}  loss {mean_loss:.4f}  aux {mean_aux:.4f}  "
                f"tok/s {tokens_since / dt:,.0f}  lr {sched.get_last_lr()[0]:.2e}")
            train_losses.append(mean_loss)
            t0, tokens_since = time.perf_counter(), 0

    last = evaluate(model, x_eval, y_eval, world_size)
    diff = replicated_max_diff(replicated, world_size)
    log(f"replicated parameters: max difference between ranks {diff:.3g}")
    if args.save:
        state = full_state_dict(model)  # collective: every rank takes part
        if rank == 0:
            torch.save(state, args.save)
            log(f"saved {len(state)} tensors (all {cfg.num_experts} experts) to {args.save}")
    ok = last < first and diff == 0.0
    ratio = first / last if last > 0 else float("inf")
    log(f"final: held-out loss first {first:.4f} -> last {last:.4f} ({ratio:.1f}x lower)"
        if last < first else
        f"final: held-out loss first {first:.4f} -> last {last:.4f}: FAILED, the loss did not fall")
    if diff != 0.0:
        log(f"FAILED: replicated parameters differ between ranks (max difference {diff:.3g})")
    return {"first": first, "last": last, "replicated_max_diff": diff, "ok": ok}


# ---------------------------------------------------------------------------------------- launch
def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    """One rank (spawned gloo rank, or a torchrun rank: NCCL on cuda:LOCAL_RANK when CUDA exists)."""
    on_cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    return train(args, rank, world_size, device)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", type=int, default=4, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=None, help="expert FFN size (default 2 * hidden)")
    p.add_argument("--experts", type=int, default=8, help="global experts; divisible by the world size")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--clusters", type=int, default=None, help="task clusters (default: --experts)")
    p.add_argument("--batch", type=int, default=256, help="tokens per step on rank 0 (fewer on later ranks)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=None, help="default: steps / 12")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait")
    p.add_argument("--save", type=str, default=None, help="save moe_comm.modules.checkpoint.full_state_dict here")
    args = p.parse_args(argv)
    W = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else args.world_size
    if W < 1:
        p.error(f"--world-size must be >= 1, got {W}")
    if args.experts % W:
        p.error(f"--experts must be divisible by the world size ({W}), got {args.experts}")
    if not 1 <= args.top_k <= args.experts:
        p.error(f"--top-k must be in [1, --experts={args.experts}], got {args.top_k}")
    for name in ("steps", "layers", "hidden", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


if __name__ == "__main__":
    _args = parse_args()
    # Spawns --world-size gloo ranks, or joins the group torchrun launched; rank 0's result decides.
    _result = run_ranks(_rank, _args.world_size, _args, timeout=_args.timeout)
    sys.exit(0 if _result is None or _result["ok"] else 1)
