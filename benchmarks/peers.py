"""moe_comm against other libraries' expert-parallel MoE layers, on CPU gloo ranks, in one run.

Runs whichever peers are installed (it installs nothing; each adapter in ``benchmarks/peer_adapters/`` names
its pip line): torchtitan, DeepSpeed-MoE, Megatron-Core; and "framework + moe_comm" rows next to "framework
alone": the framework's own MoE module with its dispatch replaced by moe_comm's (``moe_comm.integrations``),
cross-checked like every layer, timed, not judged against the goal (an adapter with ``WITH_MOE_COMM = True``).
Every layer gets the weights of one moe_comm layer (softmax top-k routing, renormalised, dropless, SwiGLU
experts, float32; moe_comm with its defaults, C = 1), so all compute the same function:
- cross-check: each peer's output and input gradient against moe_comm's on the same tokens (max |difference|
  over every rank / max |moe_comm's value|); above 1e-5 the peer computes another function: it is marked
  MISMATCH and the run exits 1;
- timing: forward + backward steps, interleaved (one step of every layer per repeat, so machine noise hits
  all alike), each bracketed by barriers; plus the bare expert GEMMs forward + backward on this rank's
  received rows, which every layer runs.
- overhead = step - bare GEMMs of the same repeat: routing, permutation, communication and bookkeeping
  (and, for a peer whose experts run padded rows, that padding). The verdict is moe_comm's median overhead /
  each peer's (goal <= 0.5). The order of the layers rotates from one repeat to the next.
- the communication floor: the same rows moved by four plain ``all_to_all_single`` calls (to the experts and
  back, forward and backward), timed in the same rotation. Every dropless layer moves at least these bytes at
  C = 1, so "floor" = that time / a peer's overhead is the lowest ours/theirs any such layer could reach.
- the plain layer (``peer_adapters/plain_torch.py``, always run and cross-checked): plain PyTorch with the fewest
  passes over the rows and nothing else (no checks, failure protocol, timeline or monitor); "plain" = its
  overhead / a peer's is where a minimal layer stands against that peer, and ours/plain what moe_comm's own
  work costs on top.
- "moe_comm, end exchanges": moe_comm with an end-of-forward and end-of-backward exchange of their own, as
  every call had before small calls carried their status in their last transfer (no verdict; what that saves).
- the failure protocol's price: the control exchanges a moe_comm step makes beyond the plain layer's collectives
  (counted: its collectives per step - the plain layer's; [W, width] int64 ``all_to_all_single``: the backward's
  check-in, and the end of the forward and of the backward unless the call is small enough to carry its status in its
  last transfer), timed alone in the same rotation; "+checks" = (the plain layer's overhead + that) / a peer's is
  where a plain layer would stand with moe_comm's exchanges added and all of its other work at zero. An estimate, not
  a bound: inside a step the exchanges partly overlap other ranks' work (at W = 4 on 2 cores moe_comm once read below
  it), and their host-side reads are left out.
- the protocol floor, measured (``peer_adapters/protocol_floor.py``, always run and cross-checked, no verdict): the
  plain layer with moe_comm's protocol on the wire for a small eager call (the control exchange carrying the counts,
  the status rows carried in each phase's last transfer, the backward's check-in, every header read and checked)
  and nothing else; "+protocol" = its overhead / a peer's is the lowest ours/theirs a layer with moe_comm's
  guarantees reaches here, and ours/its what moe_comm's other work (checks, monitor, schedule) costs on top.

    python benchmarks/peers.py                                   # W = 2 and 4, default shapes
    python benchmarks/peers.py --world-sizes 2 --shapes 1024x512x256x8x2 --json out.json
Shapes are TxHxFxExK: tokens per rank, hidden, ffn, experts, top-k. The DeepSpeed adapter takes K = 2 only.
``--peers`` also takes dotted module paths: your own adapter, with the four names that
``peer_adapters/__init__.py`` describes.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import moe_comm  # noqa: E402
from moe_comm.tools.bench import timed  # noqa: E402
from moe_comm.tools.slow_link import json_worker_main, run_json_worker  # noqa: E402
from peer_adapters import plain_torch, protocol_floor  # noqa: E402

# The adapters --peers tries by default, one per line; a "framework + moe_comm" adapter (WITH_MOE_COMM = True)
# follows its framework's.
ADAPTERS = (
    "torchtitan_moe",
    "torchtitan_moe_comm",
    "deepspeed_moe",
    "megatron_moe",
    "megatron_moe_comm",
)
GOAL = 0.5  # moe_comm's overhead <= 0.5 x each peer's
BARE, RAW, PLAIN, FLOOR = "bare GEMMs", "4 x raw all-to-all", "plain torch", protocol_floor.NAME
CLOSING = "moe_comm, end exchanges"  # moe_comm without the carried status (Dispatcher.carry_max_bytes -1)
CONTROL = "control exchange"  # what moe_comm's failure protocol adds to the plain layer's collectives per step
HOST_STEPS = 30  # steps timed for the main thread's CPU time per step (work counts)
AGREE = 1e-5  # max |difference| / max |moe_comm's value|, output and input gradient: above it, no timing verdict


def _adapter(name):
    """A known adapter by name, or any importable module (dotted path) with the same four names."""
    return importlib.import_module(name if "." in name else f"peer_adapters.{name}")


def _max_over_ranks(v: float) -> float:
    t = torch.tensor([v], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _step(layer, x):
    layer(x).square().mean().backward()


class _OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched while active (below autograd: what the layer really runs)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _work_counts(layer, x) -> dict:
    """One warm fwd + bwd step of ``layer``, counted: aten ops of the forward and of the backward, Python
    function calls and calls into C (built-ins, torch bindings) of the whole step, and the collectives it issued
    (c10d calls). Run on every rank at once (the step is collective); counts are this rank's."""
    _step(layer, x)  # warm: caches, first-call agreements
    with _OpCount() as fwd:
        y = layer(x).square().mean()
    with _OpCount() as bwd:
        y.backward()
    calls = {"call": 0, "c_call": 0, "collectives": 0}

    def prof(frame, event, arg):
        if event in ("call", "c_call"):
            calls[event] += 1
            if event == "c_call" and getattr(arg, "__module__", "") == "torch._C._distributed_c10d" \
                    and arg.__name__ in _COLLECTIVES:
                calls["collectives"] += 1

    dist.barrier()
    sys.setprofile(prof)
    try:
        _step(layer, x)
    finally:
        sys.setprofile(None)
    # the main thread's CPU time per step: Python and torch ops on the host, without the waits (another
    # thread's work, a peer's lateness) that make the step times noisy on shared cores
    cpu = []
    for _ in range(HOST_STEPS):
        dist.barrier()
        t = time.thread_time()
        _step(layer, x)
        cpu.append(time.thread_time() - t)
    return {"aten_ops_forward": fwd.n, "aten_ops_backward": bwd.n, "python_calls_per_step": calls["call"],
            "c_calls_per_step": calls["c_call"], "collectives_per_step": calls["collectives"],
            "host_cpu_s_per_step": statistics.median(cpu)}


_COLLECTIVES = {"all_to_all_single", "alltoall_base", "allreduce", "all_reduce", "broadcast", "allgather",
                "all_gather", "_allgather_base", "barrier", "batch_isend_irecv", "send", "recv", "isend", "irecv",
                "reduce_scatter", "_reduce_scatter_base", "gather", "scatter"}


def _cross_check(ref, peer, x):
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = ref(xa), peer(xb)
    ya.square().mean().backward()
    yb.square().mean().backward()
    y_rel = _max_over_ranks((ya - yb).abs().max().item()) / _max_over_ranks(ya.abs().max().item())
    dx_rel = _max_over_ranks((xa.grad - xb.grad).abs().max().item()) / _max_over_ranks(xa.grad.abs().max().item())
    return {"y_rel_diff": y_rel, "dx_rel_diff": dx_rel, "agrees": max(y_rel, dx_rel) <= AGREE}


def _shape_main(rank, W, a, shape):
    T, H, F, E, K = shape
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, score_func="softmax",
                             norm_topk_prob=True)
    ref = moe_comm.MoELayer(cfg, seed=1)
    # moe_comm as it closed every phase before small calls carried their status in the last transfer: the same
    # weights (seeded), the end-of-forward and end-of-backward exchanges of their own (what the carry saves)
    closing = moe_comm.MoELayer(cfg, seed=1)
    closing.dispatcher.carry_max_bytes = -1
    layers, skipped = {"moe_comm": ref, CLOSING: closing, PLAIN: plain_torch.build(ref, dist.group.WORLD),
                       FLOOR: protocol_floor.build(ref, dist.group.WORLD)}, {}
    with_moe_comm = {CLOSING}  # moe_comm's own variant and "framework + moe_comm" layers: no verdict
    for name in a["peers"]:
        m = _adapter(name)
        if getattr(m, "WITH_MOE_COMM", False):
            with_moe_comm.add(m.NAME)
        try:  # an adapter refuses a configuration it cannot compute (on every rank, before any collective)
            layers[m.NAME] = m.build(ref, dist.group.WORLD)
        except (ValueError, NotImplementedError) as err:
            skipped[m.NAME] = f"{type(err).__name__}: {err}"
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g)
    checks = {name: _cross_check(ref, layer, x) for name, layer in layers.items() if layer is not ref}
    counts = {name: _work_counts(layers[name], x.clone().requires_grad_(True)) for name in ("moe_comm", PLAIN, FLOOR)}

    # The bare expert GEMMs on this rank's received rows (the same rows every layer's experts get).
    with torch.no_grad():
        handle = ref.dispatcher.dispatch(x, ref.router(x).topk_idx_TK).handle
    plan = handle.chunks[0]
    rows = torch.randn(plan.num_recv, H, requires_grad=True)
    steps = {name: (lambda layer=layer: _step(layer, xs)) for name, layer in layers.items()}
    steps[BARE] = lambda: _step(lambda _x: ref.experts(rows, plan.tokens_per_expert_e, counts=plan.counts_e), None)
    # The communication floor: the same rows moved as every dropless layer moves them at C = 1 (to the
    # experts and back, forward and backward), with nothing else.
    send, recv = torch.randn(plan.num_rows, H), torch.empty(plan.num_recv, H)

    def raw_a2a():
        for _ in range(2):
            dist.all_to_all_single(recv, send, plan.recv_splits_W, plan.send_splits_W)
            dist.all_to_all_single(send, recv, plan.send_splits_W, plan.recv_splits_W)

    steps[RAW] = raw_a2a
    # The failure protocol's price: the control exchanges a step issues beyond the plain layer's collectives (the
    # backward check-in; the ends of forward and backward unless carried in the last transfer), [W, width] int64.
    extra = counts["moe_comm"]["collectives_per_step"] - counts[PLAIN]["collectives_per_step"]
    ctl_send = torch.zeros(W, ref.dispatcher.channel.width, dtype=torch.int64)
    ctl_recv = torch.empty_like(ctl_send)

    def control():
        for _ in range(extra):
            dist.all_to_all_single(ctl_recv, ctl_send)

    steps[CONTROL] = control

    xs = x.clone().requires_grad_(True)
    times = {name: [] for name in steps}
    names = list(steps)
    for i in range(a["warmup"] + a["repeats"]):
        for name in names[i % len(names):] + names[:i % len(names)]:  # rotated: no step always runs first
            t = timed(steps[name], None)
            if i >= a["warmup"]:
                times[name].append(_max_over_ranks(t))
    bare, raw, control_s = times[BARE], statistics.median(times[RAW]), statistics.median(times[CONTROL])
    over = {n: [s - b for s, b in zip(times[n], bare)] for n in layers}
    out = {"shape": {"T": T, "H": H, "F": F, "E": E, "K": K}, "world_size": W, "bare_gemm_s": statistics.median(bare),
           "raw_a2a_s": raw, "control_s": control_s, "control_exchanges": extra, "layers": {}, "skipped": skipped}
    for n in over:
        entry = {"step_s": statistics.median(times[n]), "overhead_s": statistics.median(over[n])}
        if n in counts:  # ops per forward / backward, Python calls and collectives per step (this rank)
            entry["work"] = counts[n]
        if n != "moe_comm":
            entry["check"] = checks[n]
            entry["ours_over_theirs"] = statistics.median(over["moe_comm"]) / statistics.median(over[n])
            entry["floor_ratio"] = raw / statistics.median(over[n])  # the lowest ours/theirs moving these rows
            # the plain layer's overhead / this one's: where a layer with the fewest passes stands against it
            entry["plain_ratio"] = statistics.median(over[PLAIN]) / statistics.median(over[n])
            # the plain layer plus moe_comm's extra control exchanges timed alone (an estimate: in a step they
            # partly overlap other ranks' work)
            entry["protocol_ratio"] = (statistics.median(over[PLAIN]) + control_s) / statistics.median(over[n])
            # measured: the plain layer with moe_comm's protocol on the wire (protocol_floor), over this one's
            entry["protocol_layer_ratio"] = statistics.median(over[FLOOR]) / statistics.median(over[n])
            if n not in (PLAIN, FLOOR) and n not in with_moe_comm:
                entry["pass"] = checks[n]["agrees"] and entry["ours_over_theirs"] <= GOAL
            entry["with_moe_comm"] = n in with_moe_comm
        out["layers"][n] = entry
    return out


def _rank_main(rank, W, a):
    warnings.filterwarnings("ignore")  # peers warn about missing CUDA extensions, CPU autocast, ...
    torch.manual_seed(0)
    return {"shapes": [_shape_main(rank, W, a, tuple(s)) for s in a["shapes"]]}


def _parse_shapes(p, text, world_sizes):
    shapes = []
    for s in text.split(","):
        try:
            parts = [int(v) for v in s.lower().split("x")]
        except ValueError:
            parts = []
        if len(parts) != 5 or min(parts) < 1:
            p.error(f"--shapes: {s!r} is not TxHxFxExK (five positive integers)")
        bad = [W for W in world_sizes if parts[3] % W]
        if bad:
            p.error(f"--shapes: {s!r}: E = {parts[3]} experts do not split over world size {bad[0]}")
        shapes.append(parts)
    return shapes


def _print(results):
    from rich.console import Console
    from rich.table import Table

    t = Table(title="MoE layer fwd+bwd, C = 1: overhead = step - bare expert GEMMs "
                    f"(goal: moe_comm <= {GOAL} x each peer)")
    for col in ("W", "T x H x F x E x K", "layer", "step ms", "overhead ms", "ours/theirs",
                "max |dy| / max |y|", "max |dx| / max |x.grad|"):
        t.add_column(col, justify="right")
    for res in results:
        for s in res["shapes"]:
            sh = "x".join(str(s["shape"][k]) for k in "THFEK")
            t.add_row(str(s["world_size"]), sh, BARE, f"{s['bare_gemm_s'] * 1e3:.1f}", "", "", "", "")
            t.add_row("", "", RAW, f"{s['raw_a2a_s'] * 1e3:.1f}", "", "", "", "")
            t.add_row("", "", f"{s['control_exchanges']} x {CONTROL}", f"{s['control_s'] * 1e3:.1f}", "", "", "", "")
            host = {n: s["layers"][n]["work"]["host_cpu_s_per_step"] * 1e3 for n in ("moe_comm", PLAIN, FLOOR)}
            t.add_row("", "", "main-thread CPU per step", "", "",
                      f"moe_comm {host['moe_comm']:.2f} ms, plain {host[PLAIN]:.2f}, +protocol {host[FLOOR]:.2f}",
                      "", "")
            for n, why in s["skipped"].items():
                t.add_row("", "", n, "-", "-", f"skipped: {why}", "", "")
            for n, e in s["layers"].items():
                c = e.get("check")
                ratio = ""
                if c:
                    verdict = ("MISMATCH" if not c["agrees"] else "" if "pass" not in e
                               else "ok" if e["pass"] else "MISS")
                    plain = "" if n in (PLAIN, FLOOR) else (f", plain {e['plain_ratio']:.2f}, +checks "
                                                            f"{e['protocol_ratio']:.2f}, +protocol "
                                                            f"{e['protocol_layer_ratio']:.2f}")
                    ratio = " ".join(v for v in (f"{e['ours_over_theirs']:.2f}", verdict,
                                                 f"(floor {e['floor_ratio']:.2f}{plain})") if v)
                t.add_row("", "", n, f"{e['step_s'] * 1e3:.1f}", f"{e['overhead_s'] * 1e3:.1f}", ratio,
                          f"{c['y_rel_diff']:.1e}" if c else "", f"{c['dx_rel_diff']:.1e}" if c else "")
    Console(width=200).print(t)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--shapes", default="1024x512x256x8x2,2048x512x512x8x2,1024x1024x512x16x2",
                   help="comma list of TxHxFxExK")
    p.add_argument("--peers", default=",".join(ADAPTERS),
                   help="comma list of adapters to try: known names, or dotted module paths of your own adapters "
                        "(see benchmarks/peer_adapters/__init__.py)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: W,outfile
    a = p.parse_args(argv)
    try:
        world_sizes = [int(w) for w in a.world_sizes.split(",")]
    except ValueError:
        world_sizes = []
    if a.repeats < 1 or a.warmup < 0:
        p.error(f"--repeats must be >= 1 and --warmup >= 0, got {a.repeats} and {a.warmup}")
    if not world_sizes or min(world_sizes) < 2:
        p.error(f"--world-sizes: {a.world_sizes!r} is not a comma list of integers >= 2")
    params = {"shapes": _parse_shapes(p, a.shapes, world_sizes), "warmup": a.warmup, "repeats": a.repeats,
              "peers": [n for n in a.peers.split(",") if n]}
    if a.worker:
        return json_worker_main(a.worker, _rank_main, params)
    unknown = [n for n in params["peers"] if n not in ADAPTERS and "." not in n]
    if unknown:
        p.error(f"--peers: unknown {unknown}; known: {', '.join(ADAPTERS)}, or a dotted module path")
    ready = []
    for name in params["peers"]:
        m = _adapter(name)
        why = m.missing()
        if why:
            print(f"skipping {m.NAME}: {why}\n  to run it: {m.INSTALL}")
        else:
            ready.append(name)
    if not ready:
        print("no peer is installed: nothing to compare", file=sys.stderr)
        return 1
    argv = [v for v in (argv if argv is not None else sys.argv[1:])]
    argv = _without(argv, "--peers") + ["--peers", ",".join(ready)]
    results = []
    for W in world_sizes:
        try:
            results.append(run_json_worker(__file__, argv, W, "loopback"))
        except RuntimeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    _print(results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": results, "goal_ours_over_theirs": GOAL, "agree_tolerance": AGREE}, f, indent=1)
    bad = sorted({n for res in results for s in res["shapes"] for n, e in s["layers"].items()
                  if "check" in e and not e["check"]["agrees"]})
    if bad:
        print(f"error: {', '.join(bad)} computed another function than moe_comm (relative difference above "
              f"{AGREE:g}): their timings compare nothing", file=sys.stderr)
        return 1
    return 0


def _without(argv, flag):
    """argv without ``flag`` and its value (either ``--flag v`` or ``--flag=v``)."""
    out, skip = [], False
    for v in argv:
        if skip:
            skip = False
        elif v == flag:
            skip = True
        elif not v.startswith(flag + "="):
            out.append(v)
    return out


if __name__ == "__main__":
    sys.exit(main())
