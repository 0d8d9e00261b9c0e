"""Train a small MoE model across nodes: one script for the emulated cluster (gloo) and a real one (NCCL).

Shapes legend: T tokens per rank, D input features, O outputs, H hidden size, E experts (global), W ranks,
L ranks per node.

Task: every token belongs to one of E clusters; its target is its cluster's own nonlinear map,
``y = B_c tanh(A_c x)``, so the experts can specialise. Every rank draws its own tokens each step.
Model: in_proj [D -> H] -> layers x (x + MoELayer(RMSNorm(x))) -> RMSNorm -> head [H -> O], expert-parallel
over all W ranks (e = E / W experts per rank), the replicated weights data-parallel through
``moe_comm.parallel.wrap_ddp``. Loss: MSE + the router's aux loss. Each step prints the mean loss over the
ranks and the first layer's ``Dispatcher.last_bytes`` of rank 0 (with a hierarchical transport: also the
bytes by link, intra- and inter-node).

Topology (``--ranks-per-node``): "none" = flat (every rank sends straight to every rank); N = N ranks per
node, node k holding ranks k*N .. k*N+N-1; "auto" = from the launcher's LOCAL_WORLD_SIZE. ``--node-limited``
routes each token to the experts of one node only (group-limited routing, one group per node).

Run:
    # 4 gloo ranks in this process tree (no launcher; flat)
    python examples/multinode_train.py
    # emulated cluster: 2 nodes x 2 ranks, 1 Gbit/s between nodes (root; moe_comm/tools/slow_link.py)
    python -m moe_comm.tools.slow_link --nodes 2 --ranks-per-node 2 --inter-link 1gbit -- \\
        python examples/multinode_train.py --ranks-per-node auto
    # a real cluster, on every node k (NCCL on cuda:LOCAL_RANK when CUDA is there):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint NODE0:29400 --rdzv-id job1 \\
        examples/multinode_train.py --ranks-per-node auto --experts 64 --top-k 8
Exit status: 0 when the loss fell, 1 otherwise, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from typing import List, Optional, Union

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


def topology_kwargs(ranks_per_node: Union[None, int, str]) -> dict:
    """Where this moe_comm takes ``ranks_per_node``: {} for flat (None), else {"cfg": {...}} (MoEConfig field)
    or {"layer": {...}} (MoELayer argument). Raises SystemExit when it has no hierarchical transport."""
    if ranks_per_node is None:
        return {}
    if "ranks_per_node" in getattr(moe_comm.MoEConfig, "__dataclass_fields__", {}):
        return {"cfg": {"ranks_per_node": ranks_per_node}}
    if "ranks_per_node" in inspect.signature(moe_comm.MoELayer.__init__).parameters:
        return {"layer": {"ranks_per_node": ranks_per_node}}
    raise SystemExit("error: --ranks-per-node: this moe_comm has no hierarchical transport (no ranks_per_node "
                     "argument in MoEConfig or MoELayer); run with --ranks-per-node none")


def local_world_size(world_size: int, ranks_per_node: Union[None, int, str]) -> int:
    """L: ranks per node, from ``ranks_per_node`` or (auto, and flat too: it still sets the node count of
    --node-limited) from the launcher's LOCAL_WORLD_SIZE; spawned without a launcher: one node."""
    if ranks_per_node is None or ranks_per_node == "auto":
        return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return int(ranks_per_node)


class Task:
    """The synthetic task, identical in every process (from ``seed``); ``sample(rank, step)`` is rank
    ``rank``'s batch of step ``step``."""

    def __init__(self, num_clusters: int, tokens: int, seed: int, width: int = 32):
        g = torch.Generator().manual_seed(seed)
        self.C, self.T, self.seed = num_clusters, tokens, seed
        self.mu_CD = torch.randn(num_clusters, IN_FEATURES, generator=g) * 2.0
        self.A_CMD = torch.randn(num_clusters, width, IN_FEATURES, generator=g) / IN_FEATURES ** 0.5
        self.B_COM = torch.randn(num_clusters, OUT_FEATURES, width, generator=g) / width ** 0.5

    def sample(self, rank: int, step: int):
        """-> x [T, D], y [T, O] float32 (CPU)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + rank)
        c_T = torch.randint(0, self.C, (self.T,), generator=g)
        x_TD = self.mu_CD[c_T] + torch.randn(self.T, IN_FEATURES, generator=g)
        h = torch.tanh(torch.einsum("tmd,td->tm", self.A_CMD[c_T], x_TD - self.mu_CD[c_T]))
        return x_TD, torch.einsum("tom,tm->to", self.B_COM[c_T], h)


class MoEModel(nn.Module):
    def __init__(self, cfg: moe_comm.MoEConfig, layers: int, seed: int, timeout: float, **layer_kwargs):
        super().__init__()
        torch.manual_seed(seed)  # the replicated weights: equal on every rank
        H = cfg.hidden_size
        self.in_proj = nn.Linear(IN_FEATURES, H)
        self.norms = nn.ModuleList(nn.RMSNorm(H) for _ in range(layers))
        self.moes = nn.ModuleList(moe_comm.MoELayer(cfg, seed=seed + 1000 * i, timeout=timeout, **layer_kwargs)
                                  for i in range(layers))
        self.out_norm = nn.RMSNorm(H)
        self.head = nn.Linear(H, OUT_FEATURES)

    def forward(self, x_TD: torch.Tensor):
        h_TH = self.in_proj(x_TD)
        for norm, moe in zip(self.norms, self.moes):
            h_TH = h_TH + moe(norm(h_TH))
        return self.head(self.out_norm(h_TH)), sum(m.aux_loss for m in self.moes)


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> Optional[dict]:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    L = local_world_size(world_size, args.ranks_per_node)
    if world_size % L:
        raise ValueError(f"--ranks-per-node: {L} ranks per node does not divide the world size {world_size}")
    nodes = world_size // L
    where = topology_kwargs(args.ranks_per_node)
    groups = dict(num_groups=nodes, topk_groups=1) if args.node_limited else {}
    if groups and "cfg" in where and "node_limited" in moe_comm.MoEConfig.__dataclass_fields__:
        groups["node_limited"] = True  # the layer checks that the groups are its nodes
    cfg = moe_comm.MoEConfig(hidden_size=args.hidden, ffn_hidden_size=2 * args.hidden, num_experts=args.experts,
                             top_k=args.top_k, aux_loss_coeff=1e-2, dedup=args.dedup, **groups,
                             **where.get("cfg", {}))
    with torch.device(device):
        model = MoEModel(cfg, args.layers, args.seed, args.timeout, **where.get("layer", {}))
    ddp = parallel.wrap_ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    task = Task(args.experts, args.tokens, args.seed)
    if rank == 0:
        print(f"moe_comm {moe_comm.__version__}: W={world_size} ranks = {nodes} node(s) x {L}, backend "
              f"{dist.get_backend()}, device {device.type}; E={args.experts} K={args.top_k} H={args.hidden}, "
              f"T={args.tokens} tokens per rank; topology {args.ranks_per_node or 'flat'}"
              f"{', node-limited routing (1 node per token)' if args.node_limited else ''}"
              f"{', dedup' if args.dedup else ''}", flush=True)
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        moe_comm.set_step(step)
        x, y = (t.to(device) for t in task.sample(rank, step))
        pred, aux = ddp(x)
        loss = F.mse_loss(pred, y) + aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean = loss.detach().reshape(1).clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world_size)  # host sync: the printed curve
        if rank == 0:
            lb = model.moes[0].dispatcher.last_bytes
            links = {k: v for k, v in lb.items() if k.endswith(("_inter", "_intra"))}
            print(f"step {step + 1:3d}  loss {losses[-1]:.5f}  last_bytes {dict(lb)}"
                  + (f"  by link {links}" if links else ""), flush=True)
    return {"losses": losses, "seconds": time.perf_counter() - t0, "nodes": nodes, "ranks_per_node": L}


def _ranks_per_node(v: str) -> Union[None, int, str]:
    if v in ("none", "None", "flat"):
        return None
    if v == "auto":
        return "auto"
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, none or an int >= 1, got {v!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected auto, none or an int >= 1, got {v!r}")
    return n


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", type=int, default=4, help="gloo ranks to spawn (ignored under torchrun)")
    p.add_argument("--ranks-per-node", type=_ranks_per_node, default="none",
                   help="auto (LOCAL_WORLD_SIZE), none (flat) or N ranks per node")
    p.add_argument("--node-limited", action="store_true",
                   help="group-limited routing, one group per node, 1 node per token")
    p.add_argument("--dedup", action="store_true", help="one copy per (token, destination rank)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait")
    args = p.parse_args(argv)
    W = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else args.world_size
    if W < 1 or args.experts % W:
        p.error(f"--experts ({args.experts}) must be divisible by the world size ({W})")
    if not 1 <= args.top_k <= args.experts:
        p.error(f"--top-k must be in [1, --experts={args.experts}], got {args.top_k}")
    L = local_world_size(W, args.ranks_per_node)
    if W % L:
        p.error(f"--ranks-per-node {args.ranks_per_node}: {L} ranks per node must divide the world size {W}")
    if args.node_limited and args.top_k > args.experts // (W // L):
        p.error(f"--node-limited: --top-k ({args.top_k}) must be <= the experts of one node "
                f"({args.experts // (W // L)})")
    for name in ("steps", "layers", "hidden", "tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    topology_kwargs(args.ranks_per_node)  # no hierarchical transport: say so before any rank starts
    out = run_ranks(_rank, args.world_size, args, timeout=args.timeout)
    if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
        return 0  # rank 0 reports
    if out is None:
        print("FAILED: rank 0 returned no result")
        return 1
    first, last = out["losses"][0], out["losses"][-1]
    ok = last < first
    print(f"loss {first:.4f} -> {last:.4f} in {args.steps} steps, {out['seconds']:.1f} s on {out['nodes']} node(s) x "
          f"{out['ranks_per_node']} ranks: {'OK' if ok else 'FAILED, the loss did not fall'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
