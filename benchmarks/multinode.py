"""Multi-node dispatch on an emulated cluster: flat vs one copy per rank vs hierarchical vs node-limited.

Shapes legend: T tokens per rank, H hidden, E experts (global), e = E / W experts per rank, K top-k, W ranks,
L ranks per node, N = W / L nodes.

The cluster: ``--nodes`` network namespaces of ``--ranks-per-node`` gloo ranks each, joined through a bridge by
links shaped with tc to ``--inter-link`` each way (``moe_comm.tools.slow_link.run_on_cluster``: real
multi-node torchrun, c10d rendezvous); ranks of one node talk over its unshaped loopback. Under torchrun
(a real cluster) the script runs as the worker directly on the launched group (NCCL on CUDA).
Default shapes (the issue's): 2 nodes x 2 ranks, H 1024 fp32, top-8 of 32 experts, T 2048 per rank,
1 Gbit/s between nodes. ``--quick``: T 128, H 128, 8 experts, top-2, 1 repeat (a CI smoke run).

Modes (every rank's x and router logits are the same in every mode; the routing differs only with node limits):
- flat: ``Dispatcher(num_experts=E)``: one row per routed slot, straight to the expert's rank.
- flat_dedup: ``Dispatcher(dedup=True)``: one row per (token, destination rank).
- hier: ``Dispatcher(ranks_per_node=L)``: one row per (token, destination node) across nodes, fanned out
  inside the node (the hierarchical transport; skipped, with the reason in the JSON, where this moe_comm
  has no ``ranks_per_node``).
- hier_node_limited: hier with DeepSeek-style group-limited routing, one group per node (E / N consecutive
  experts = the experts of one node's ranks), topk_groups = 1: every token goes to one node.
Routing: ``moe_comm.routing.route`` on randn logits (softmax, top-K, renormalised weights).

Per mode:
- step_s: one training step of the transport alone: ``Dispatcher.__call__`` forward (dispatch -> an expert_fn
  that scales its rows by 0.5 -> combine) + backward, C = ``--chunks`` (1), every call bracketed by barriers
  (``tools.bench.timed``), the modes interleaved ``--repeats`` times after ``--warmup`` rounds; the slowest
  rank's median (``tools.bench.slowest_median``). All of it is dispatch + combine work (permutes, transfers,
  expansion, weighted sums): the experts are a scale. Ratios hier / flat_dedup and hier / flat come from
  the same run.
- rows per token crossing nodes: expected from the routing (mean over all tokens of: remote-node slots
  (flat), distinct remote ranks (dedup), distinct remote nodes (hier)); measured for hier from
  ``last_bytes["rows_inter"]`` (rows this rank sent across nodes) when the transport reports it, else
  ``last_bytes["dispatch_wire_inter"]`` / (H x element size) (then any per-row metadata counts as rows).
  Also "distinct destination nodes per token" (own node included).
- bytes across nodes of one forward call (no_grad): sum over ranks of ``last_bytes`` dispatch + combine
  inter-node wire bytes (hier: the transport's own "*_wire_inter" keys; flat modes: wire bytes x the
  routing's remote share of the rows) vs the tc counters of the shaped links read right before and after
  that call (sum over nodes of bytes sent; Ethernet/IP/TCP headers, ACKs and the call's small control
  exchanges included: ~1% at MTU 9000). Goal: within 5%.
- exact: a float64 ``MoELayer`` with the mode's settings (small: T 32 per rank, H 32) forward + backward vs
  ``moe_comm.testing.reference.dense_moe`` in float64: y, x.grad, router and expert gradients, max relative
  error over the ranks (goal <= 1e-5).

Goals judged (not with --quick, and only where the link is shaped): hier step <= 0.6 x flat_dedup and
<= 0.35 x flat; hier inter rows per token within 2% of the expected remote nodes; tc vs last_bytes within 5%;
exact <= 1e-5 for every mode that ran.

    sudo python benchmarks/multinode.py --json multinode.json
    sudo python benchmarks/multinode.py --quick
    torchrun --nnodes 2 --nproc-per-node 8 ... benchmarks/multinode.py --json out.json   # a real cluster
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

try:
    import moe_comm
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import moe_comm
from moe_comm.tools.launch import launched_by_torchrun, run_ranks

MODES = ("flat", "flat_dedup", "hier", "hier_node_limited")
_LINK_KEYS = ("dispatch_wire_inter", "combine_wire_inter", "dispatch_wire_intra", "combine_wire_intra")
_EXACT_T, _EXACT_H, _EXACT_F = 32, 32, 16


def hierarchical_available() -> bool:
    """Whether this moe_comm's Dispatcher takes ``ranks_per_node`` (the hierarchical transport)."""
    return "ranks_per_node" in inspect.signature(moe_comm.Dispatcher.__init__).parameters


def _settings(mode: str, L: int) -> Dict:
    return {"dedup": mode == "flat_dedup", "ranks_per_node": L if mode.startswith("hier") else None,
            "node_limited": mode == "hier_node_limited"}


def _topo(ranks_per_node: Optional[int]) -> Dict:
    return {} if ranks_per_node is None else {"ranks_per_node": ranks_per_node}


# ------------------------------------------------------------------------------------- counting
def crossing_counts(idx_TK: torch.Tensor, E: int, W: int, L: int, rank: int) -> Dict[str, float]:
    """Sums over this rank's tokens: remote-node slots, distinct remote ranks, distinct remote nodes, distinct
    nodes, and all rows of each kind (slots, distinct ranks), for idx_TK [T, K] (-1 = dropped)."""
    e = E // W
    valid_TK = idx_TK >= 0
    rank_TK = torch.where(valid_TK, idx_TK // e, -1)
    node_TK = torch.where(valid_TK, rank_TK // L, -1)
    remote_TK = valid_TK & (node_TK != rank // L)
    T = idx_TK.shape[0]
    # column 0 collects the dropped slots (-1 + 1) and is cut off
    rank_hit_TW = torch.zeros(T, W + 1, dtype=torch.bool).scatter_(1, rank_TK + 1, True)[:, 1:]
    node_hit_TN = torch.zeros(T, W // L + 1, dtype=torch.bool).scatter_(1, node_TK + 1, True)[:, 1:]
    own = rank // L
    remote_rank_W = torch.tensor([r // L != own for r in range(W)])
    remote_node_N = torch.arange(W // L) != own
    return {"slots": float(valid_TK.sum()), "remote_slots": float(remote_TK.sum()),
            "ranks": float(rank_hit_TW.sum()), "remote_ranks": float((rank_hit_TW & remote_rank_W).sum()),
            "nodes": float(node_hit_TN.sum()), "remote_nodes": float((node_hit_TN & remote_node_N).sum()),
            "tokens": float(idx_TK.shape[0])}


def _sum_over_ranks(values: Dict[str, float]) -> Dict[str, float]:
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def _node_tx_bytes() -> Optional[int]:
    """Bytes this node has sent over its shaped link so far (local rank 0 on the emulated cluster), else None."""
    dev = os.environ.get("MOE_COMM_NODE_IFNAME")
    if not dev or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    from moe_comm.tools.slow_link import read_link_counters

    try:
        return read_link_counters(dev)[0]
    except RuntimeError:
        return None


# --------------------------------------------------------------------------------------- exactness
def exactness(mode: str, rank: int, W: int, L: int, opts: Dict) -> Optional[float]:
    """Max relative error (over ranks) of y, x.grad, the router's and the local experts' gradients of a float64
    MoELayer with the mode's settings vs the dense float64 reference over all ranks' tokens (collective).
    None when neither MoEConfig nor MoELayer takes ``ranks_per_node`` (a hierarchical mode)."""
    from moe_comm.testing.reference import dense_moe

    s, E, K, N = _settings(mode, L), opts["experts"], opts["top_k"], W // L
    groups = dict(num_groups=N, topk_groups=1) if s["node_limited"] else {}
    topo = _topo(s["ranks_per_node"])
    in_cfg = "ranks_per_node" in getattr(moe_comm.MoEConfig, "__dataclass_fields__", {})
    if topo and not in_cfg and "ranks_per_node" not in inspect.signature(moe_comm.MoELayer.__init__).parameters:
        return None  # the same on every rank: no collective is skipped by one rank alone
    if groups and topo and in_cfg and "node_limited" in moe_comm.MoEConfig.__dataclass_fields__:
        groups["node_limited"] = True  # the layer checks that the groups are its nodes
    cfg = moe_comm.MoEConfig(hidden_size=_EXACT_H, ffn_hidden_size=_EXACT_F, num_experts=E, top_k=K,
                             dedup=s["dedup"], **groups, **(topo if in_cfg else {}))
    g = torch.Generator().manual_seed(1234)
    T, H, F = _EXACT_T, _EXACT_H, _EXACT_F
    x = torch.randn(W * T, H, generator=g, dtype=torch.float64)
    rw = torch.randn(E, H, generator=g, dtype=torch.float64) * H ** -0.5
    w1, w3 = (torch.randn(E, F, H, generator=g, dtype=torch.float64) * H ** -0.5 for _ in range(2))
    w2 = torch.randn(E, H, F, generator=g, dtype=torch.float64) * F ** -0.5
    gy = torch.randn(W * T, H, generator=g, dtype=torch.float64)
    layer = moe_comm.MoELayer(cfg, dtype=torch.float64, **({} if in_cfg else topo))
    e = E // W
    local, rows = slice(rank * e, (rank + 1) * e), slice(rank * T, (rank + 1) * T)
    with torch.no_grad():
        layer.router.weight.copy_(rw)
        for name, full in (("w1", w1), ("w3", w3), ("w2", w2)):
            getattr(layer.experts, name).copy_(full[local])
    x_local = x[rows].clone().requires_grad_(True)
    y = layer(x_local)
    (y * gy[rows]).sum().backward()
    ref = [t.clone().requires_grad_(True) for t in (x, rw, w1, w3, w2)]
    # routing is per token: the dense reference over all W * T tokens routes each as its own rank does
    y_ref, _, _ = dense_moe(*ref, cfg)
    (y_ref * gy).sum().backward()

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
    router = layer.router.weight.grad.clone()
    dist.all_reduce(router)  # replicated router: the ranks' gradients sum to the dense one
    errs = [rel(y.detach(), y_ref.detach()[rows]), rel(x_local.grad, ref[0].grad[rows]), rel(router, ref[1].grad)]
    errs += [rel(getattr(layer.experts, n).grad, r.grad[local]) for n, r in (("w1", ref[2]), ("w3", ref[3]),
                                                                                  ("w2", ref[4]))]
    worst = torch.tensor([max(errs)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


# ------------------------------------------------------------------------------------------ worker
def worker(rank: int, W: int, opts: Dict) -> Dict:
    """Every measurement of the module docstring on this rank (collective); returns rank 0's view."""
    from moe_comm.config import MoEConfig
    from moe_comm.routing import route
    from moe_comm.tools.bench import slowest_median, timed

    L = int(os.environ.get("LOCAL_WORLD_SIZE", opts["ranks_per_node"]))
    if W % L:
        raise ValueError(f"ranks per node ({L}) must divide the world size ({W})")
    N, T, H, E, K = W // L, opts["tokens"], opts["hidden"], opts["experts"], opts["top_k"]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    g = torch.Generator().manual_seed(1000 + rank)
    x_TH = torch.randn(T, H, generator=g).to(device)
    logits_TE = torch.randn(T, E, generator=g, dtype=torch.float64)
    gy_TH = torch.randn(T, H, generator=g).to(device)
    base = MoEConfig(hidden_size=H, ffn_hidden_size=H, num_experts=E, top_k=K)
    routings = {False: route(logits_TE, base), True: route(logits_TE, base.replace(num_groups=N, topk_groups=1))}
    modes, skipped = [], {}
    for m in opts["modes"]:
        if m.startswith("hier") and not hierarchical_available():
            skipped[m] = "this moe_comm's Dispatcher has no ranks_per_node (hierarchical transport)"
        else:
            modes.append(m)
    disp = {}
    for m in modes:
        s = _settings(m, L)
        disp[m] = moe_comm.Dispatcher(num_experts=E, dedup=s["dedup"], **_topo(s["ranks_per_node"]))

    def args_of(m):
        r = routings[_settings(m, L)["node_limited"]]
        return r.topk_idx_TK.to(device), r.topk_weight_TK.float().to(device)

    def step(m):
        idx, w = args_of(m)
        xg, wg = x_TH.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = disp[m](xg, idx, wg, lambda rows_RH, counts_e: rows_RH * 0.5, num_chunks=opts.get("chunks", 1))
        y.backward(gy_TH)

    samples = {m: [] for m in modes}
    for i in range(opts["warmup"] + opts["repeats"]):
        for m in modes:  # interleaved: the ratios compare like with like
            t = timed(lambda: step(m), disp[m].group)
            if i >= opts["warmup"]:
                samples[m].append(t)
    result = {"world_size": W, "nodes": N, "ranks_per_node": L, "backend": dist.get_backend(),
              "skipped": skipped, "modes": {}}
    for m in modes:
        d, s = disp[m], _settings(m, L)
        idx, w = args_of(m)
        counts = _sum_over_ranks(crossing_counts(idx.cpu(), E, W, L, rank))
        # one forward call between two reads of the link counters
        dist.barrier()
        tx0 = _node_tx_bytes()
        dist.barrier()
        with torch.no_grad():
            d(x_TH, idx, w, lambda rows_RH, counts_e: rows_RH * 0.5, num_chunks=1)
        dist.barrier()
        tx1 = _node_tx_bytes()
        lb = dict(d.last_bytes)
        mine = idx.cpu()
        own = crossing_counts(mine, E, W, L, rank)
        if s["ranks_per_node"] is not None:
            inter = [lb.get(k, -1) for k in _LINK_KEYS]
            rows_inter = lb.get("rows_inter", lb.get("dispatch_rows_inter", -1))
        else:  # flat: wire bytes x the remote share of this rank's rows (slots, or distinct ranks with dedup)
            share = (own["remote_ranks"] / max(own["ranks"], 1.0)) if s["dedup"] else \
                (own["remote_slots"] / max(own["slots"], 1.0))
            inter = [lb["dispatch_wire"] * share, lb["combine_wire"] * share,
                     lb["dispatch_wire"] * (1 - share), lb["combine_wire"] * (1 - share)]
            rows_inter = -1
        tot = {"tx": float(tx1 - tx0) if tx0 is not None and tx1 is not None else 0.0,
               "tx_nodes": 1.0 if tx0 is not None and tx1 is not None else 0.0,
               "dispatch_wire": float(lb["dispatch_wire"]), "combine_wire": float(lb["combine_wire"]),
               "missing_link_keys": float(any(v < 0 for v in inter)), "rows_inter": float(rows_inter),
               **{k: float(v) for k, v in zip(_LINK_KEYS, inter)}}
        tot = _sum_over_ranks(tot)
        tokens = counts["tokens"]
        expected = {"flat": counts["remote_slots"], "flat_dedup": counts["remote_ranks"]}.get(
            m, counts["remote_nodes"]) / tokens
        measured_rows = None
        if s["ranks_per_node"] is not None and not tot["missing_link_keys"]:
            measured_rows = (tot["rows_inter"] if rows_inter >= 0 else
                             tot["dispatch_wire_inter"] / (H * x_TH.element_size())) / tokens
        lb_inter = tot["dispatch_wire_inter"] + tot["combine_wire_inter"]
        tc_ok = tot["tx_nodes"] == N and not tot["missing_link_keys"]
        result["modes"][m] = {
            "settings": s, "step_s": slowest_median(samples[m], d.group),
            "inter_rows_per_token_expected": expected,
            "inter_rows_per_token_measured": measured_rows,
            "distinct_nodes_per_token": counts["nodes"] / tokens,
            "distinct_remote_nodes_per_token": counts["remote_nodes"] / tokens,
            "distinct_remote_ranks_per_token": counts["remote_ranks"] / tokens,
            "remote_slots_per_token": counts["remote_slots"] / tokens,
            "last_bytes_rank0": lb,
            "wire_bytes_all_ranks": {"dispatch": tot["dispatch_wire"], "combine": tot["combine_wire"],
                                     **({k: tot[k] for k in _LINK_KEYS} if not tot["missing_link_keys"] else {})},
            "inter_bytes_from_last_bytes": lb_inter if not tot["missing_link_keys"] else None,
            "inter_bytes_from": "last_bytes link keys" if s["ranks_per_node"] is not None else
                                "wire bytes x the routing's remote share",
            "tc_sent_bytes_one_call": tot["tx"] if tot["tx_nodes"] == N else None,
            "tc_vs_last_bytes": tot["tx"] / lb_inter if tc_ok and lb_inter > 0 else None,
        }
    for m in modes:  # last: a mode whose layer fails leaves the figures above in the JSON
        result["modes"][m]["exact_max_rel_err"] = None
        if opts["exact"]:
            try:
                result["modes"][m]["exact_max_rel_err"] = exactness(m, rank, W, L, opts)
            except Exception as err:  # noqa: BLE001 - a failed call raises on every rank (moe_comm's protocol)
                result["modes"][m]["exact_error"] = f"{type(err).__name__}: {err}"
    st = {m: r["step_s"] for m, r in result["modes"].items()}
    result["ratios"] = {f"{a}/{b}": st[a] / st[b] for a in ("hier", "hier_node_limited", "flat_dedup")
                        for b in ("flat", "flat_dedup") if a != b and a in st and b in st}
    return result


# -------------------------------------------------------------------------------------- verdicts
def verdicts(res: Dict, judged: bool) -> Dict[str, Dict]:
    """pass / applies per goal (``applies`` False with --quick or without a shaped link)."""
    modes, r = res["modes"], res.get("ratios", {})
    out = {}

    def goal(name, value, ok, applies=True):
        out[name] = {"value": value, "pass": bool(ok) if value is not None else False,
                     "applies": judged and applies and value is not None}
    goal("hier <= 0.6 x flat_dedup step", r.get("hier/flat_dedup"), (r.get("hier/flat_dedup") or 9) <= 0.6)
    goal("hier <= 0.35 x flat step", r.get("hier/flat"), (r.get("hier/flat") or 9) <= 0.35)
    for m in ("hier", "hier_node_limited"):
        if m in modes and modes[m]["inter_rows_per_token_measured"] is not None:
            v = modes[m]["inter_rows_per_token_measured"] / modes[m]["inter_rows_per_token_expected"]
            goal(f"{m} inter rows per token within 2% of expected remote nodes", v, abs(v - 1) <= 0.02)
    for m, v in modes.items():
        if v["tc_vs_last_bytes"] is not None:
            goal(f"{m} tc counters within 5% of last_bytes", v["tc_vs_last_bytes"],
                 abs(v["tc_vs_last_bytes"] - 1) <= 0.05)
        if v.get("exact_error"):
            out[f"{m} exact <= 1e-5"] = {"value": None, "pass": False, "applies": True, "error": v["exact_error"]}
        elif v["exact_max_rel_err"] is not None:
            out[f"{m} exact <= 1e-5"] = {"value": v["exact_max_rel_err"], "pass": v["exact_max_rel_err"] <= 1e-5,
                                         "applies": True}
    return out


def _print(out: Dict) -> None:
    res, p = out["result"], out["params"]
    print(f"multinode: {res['nodes']} nodes x {res['ranks_per_node']} ranks ({res['backend']}), link "
          f"{p['inter_link'] if out.get('cluster') else 'as launched'}, T={p['tokens']} H={p['hidden']} "
          f"E={p['experts']} K={p['top_k']}, {p['repeats']} repeats")
    print(f"{'mode':<18s} {'step ms':>9s} {'/flat':>6s} {'/dedup':>6s} {'x-node rows/tok':>15s} {'expected':>8s} "
          f"{'tc/last_bytes':>13s} {'exact':>8s}")
    st = {m: v["step_s"] for m, v in res["modes"].items()}
    for m, v in res["modes"].items():
        f = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
        print(f"{m:<18s} {st[m] * 1e3:9.1f} {f(st[m] / st['flat'] if 'flat' in st else None, '6.2f')} "
              f"{f(st[m] / st['flat_dedup'] if 'flat_dedup' in st else None, '6.2f')} "
              f"{f(v['inter_rows_per_token_measured'], '15.3f')} {v['inter_rows_per_token_expected']:8.3f} "
              f"{f(v['tc_vs_last_bytes'], '13.3f')} {f(v['exact_max_rel_err'], '8.1e')}")
    for m, v in res["modes"].items():
        if v.get("exact_error"):
            print(f"{m:<18s} exactness check failed: {v['exact_error']}")
    for m, why in res["skipped"].items():
        print(f"{m:<18s} skipped: {why}")
    for name, v in out["verdicts"].items():
        state = ("PASS" if v["pass"] else "FAIL") if v["applies"] else "n/a"
        print(f"  {state:4s} {name}: {v['value'] if v['value'] is None else format(v['value'], '.4g')}")


# ---------------------------------------------------------------------------------------- command line
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (network namespaces)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="L: torchrun ranks per node")
    p.add_argument("--inter-link", default="1gbit", help="tc rate of each node's link, each way")
    p.add_argument("--tokens", type=int, default=2048, help="T per rank")
    p.add_argument("--hidden", type=int, default=1024, help="H (fp32 rows)")
    p.add_argument("--experts", type=int, default=32, help="E")
    p.add_argument("--top-k", type=int, default=8, help="K")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--chunks", type=int, default=1, help="C of every mode's timed step (the pipeline's chunks)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-exact", action="store_true", help="skip the float64 exactness check")
    p.add_argument("--local", action="store_true",
                   help="no namespaces: spawn nodes x ranks-per-node gloo ranks here (plain loopback, no tc; "
                        "the topology is still passed to the transport)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds the whole cluster run may take")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 1 repeat: a smoke run (no goals judged)")
    p.add_argument("--json", default=None, help="write every number and the verdicts here")
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)  # internal: rank 0's result file
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.hidden, a.experts, a.top_k, a.repeats, a.warmup = 128, 128, 8, 2, 1, 1
    a.modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in a.modes if m not in MODES]
    if bad or not a.modes:
        p.error(f"--modes must be a comma list of {', '.join(MODES)}, got {bad or a.modes}")
    for name in ("nodes", "ranks_per_node", "tokens", "hidden", "experts", "top_k", "repeats", "chunks"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    W = a.nodes * a.ranks_per_node
    if a.experts % W:
        p.error(f"--experts ({a.experts}) must be divisible by nodes x ranks-per-node ({W})")
    if a.experts % a.nodes or a.top_k > a.experts // a.nodes:
        p.error(f"--top-k ({a.top_k}) must be <= the experts of one node ({a.experts} // {a.nodes}) for "
                f"node-limited routing")
    return a


def _opts(a) -> Dict:
    return {"tokens": a.tokens, "hidden": a.hidden, "experts": a.experts, "top_k": a.top_k, "modes": a.modes,
            "repeats": a.repeats, "warmup": a.warmup, "exact": not a.no_exact, "ranks_per_node": a.ranks_per_node,
            "chunks": a.chunks}


def _finish(a, res: Dict, cluster: Optional[Dict]) -> int:
    params = {**_opts(a), "nodes": res["nodes"], "inter_link": a.inter_link if cluster else None, "quick": a.quick}
    out = {"params": params, "result": res, "cluster": cluster}
    out["verdicts"] = verdicts(res, judged=not a.quick and (cluster is not None or launched_by_torchrun()))
    _print(out)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if all(v["pass"] for v in out["verdicts"].values() if v["applies"]) else 1


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    if launched_by_torchrun():  # a worker on the emulated cluster, or a real cluster's launch
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
        res = run_ranks(worker, int(os.environ["WORLD_SIZE"]), _opts(a), timeout=a.timeout)
        if int(os.environ["RANK"]) != 0:
            return 0
        if a.worker_out:  # inside the emulated cluster: the launcher reports
            with open(a.worker_out, "w") as f:
                json.dump(res, f)
            return 0
        return _finish(a, res, None)
    if a.local:
        return _finish(a, run_ranks(worker, a.nodes * a.ranks_per_node, _opts(a), timeout=a.timeout), None)
    from moe_comm.tools.slow_link import cluster_available, run_on_cluster

    ok, why = cluster_available()
    if not ok:
        print(f"error: {why} (--local runs the ranks here without namespaces)", file=sys.stderr)
        return 2
    fd, path = tempfile.mkstemp(suffix=".json", prefix="moe_comm_multinode_")
    os.close(fd)
    try:
        inner = [sys.executable, os.path.abspath(__file__), *argv, "--worker-out", path]
        try:
            cl = run_on_cluster(inner, nodes=a.nodes, ranks_per_node=a.ranks_per_node, inter=a.inter_link,
                                timeout=a.timeout)
        except subprocess.TimeoutExpired:
            print(f"error: the cluster run took longer than --timeout {a.timeout:g} s", file=sys.stderr)
            return 1
        if cl.returncode != 0:
            print(f"error: a node failed: exit codes {[n.returncode for n in cl.nodes]}", file=sys.stderr)
            return 1
        with open(path) as f:
            res = json.load(f)
    finally:
        os.unlink(path)
    cluster = {"inter_rate_bits": cl.inter_rate_bits, "seconds": cl.seconds,
               "links_whole_run": [vars(ln) for ln in cl.links]}
    return _finish(a, res, cluster)


if __name__ == "__main__":
    sys.exit(main())
