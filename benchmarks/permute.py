"""Permute / unpermute bandwidth: the native C++ kernels on CPU (and the Triton kernels on CUDA when a
GPU is present) next to a plain copy of the same bytes and torch's own paths.

Shapes legend: T tokens, K top-k slots, N routed rows (T*K here: nothing is dropped), H hidden size,
E experts.

Bytes counted per call (read + written): permute reads N*H and writes N*H elements; unpermute reads
N*H and writes T*H. The limit each kernel chases is a plain memcpy moving the same number of bytes
(``dst.copy_(src)`` into an already-touched buffer; on CUDA a device-to-device copy); "of copy" is GB/s
over that copy's GB/s.
Every kernel is timed writing into a reused ``out=`` buffer (the persistent-workspace case) and into a
freshly allocated output (torch's paths page-fault it on first touch; the native launchers take it from
their output cache), and on CPU the user-facing ``ops.permute`` / ``ops.unpermute`` plain calls (autograd
op, backend "auto", no ``out=``). Times are medians over ``--repeats`` rounds after ``--warmup`` untimed
calls each; each round runs every kernel once (interleaved, so machine noise hits all alike). "faults" is
the median count of minor page faults per call (CPU; 16384 for a fresh 64 MB output in 4 KB pages).

    python benchmarks/permute.py --json /tmp/permute.json
    python benchmarks/permute.py --tokens 4096 --hidden 4096 --dtype bfloat16 --threads 1
    python benchmarks/permute.py --threads 1 --cache-freed-memory --warmup 0 --repeats 8   # early calls
    python benchmarks/permute.py --devices cuda        # CUDA only (Triton kernels vs device copy)
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch

from moe_comm import ops
from moe_comm.kernels import native, reference, triton_ops
from moe_comm.ops.layout import make_layout

try:
    import resource
except ImportError:  # not POSIX: no fault counts
    resource = None

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
WARMUP = 3


def minor_faults() -> int:
    """Minor page faults of this process so far (-1 where unknown)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else -1


def interleaved_times(fns: List[Callable[[], object]], repeats: int, sync: Callable[[], None],
                      warmup: int = WARMUP) -> Tuple[List[List[float]], List[List[int]]]:
    """Wall times and minor page faults of each call of each fn: ``warmup`` untimed calls each, then
    ``repeats`` rounds calling every fn once per round, so a noisy neighbour slows all kernels alike
    instead of whichever ran at the time. A result is kept until that fn's next call (as ``y = f(x)`` in
    a loop does), so a fresh output is allocated while the previous one is alive.
    ``sync`` waits for the device (CUDA: torch.cuda.synchronize; CPU: nothing to wait for)."""
    kept: List[object] = [None] * len(fns)
    for i, fn in enumerate(fns):
        for _ in range(warmup):
            kept[i] = fn()
    times: List[List[float]] = [[] for _ in fns]
    faults: List[List[int]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            sync()
            f0 = minor_faults()
            t0 = time.perf_counter()
            result = fn()
            sync()  # host sync: benchmark timing
            times[i].append(time.perf_counter() - t0)
            faults[i].append(minor_faults() - f0)
            kept[i] = result
    return times, faults


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="T")
    p.add_argument("--hidden", type=int, default=2048, help="H")
    p.add_argument("--topk", type=int, default=2, help="K")
    p.add_argument("--experts", type=int, default=16, help="E")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=WARMUP, help="untimed calls of each kernel first")
    p.add_argument("--cache-freed-memory", action="store_true",
                   help="call moe_comm.tools.launch.cache_freed_memory() first, as the README tells CPU ranks")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--devices", default="cpu,cuda",
                   help="comma list; cuda is skipped when no GPU is present (CPU: native C++, CUDA: Triton)")
    p.add_argument("--json", default=None, metavar="PATH", help="write all numbers here")
    return p.parse_args(argv)


def run(args: argparse.Namespace, device: str = "cpu") -> Dict[str, object]:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    impl, kname = (native, "native") if device == "cpu" else (triton_ops, "triton")
    if not impl.available():
        raise SystemExit(f"{kname} kernels unavailable on {device}; nothing to benchmark")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    copy = "memcpy" if device == "cpu" else "device copy"
    T, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    dtype = DTYPES[args.dtype]
    elt = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(args.seed)
    # Uniform random routing: K distinct experts per token, every expert equally likely.
    topk_idx_TK = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    weight_TK = torch.rand(T, K, generator=gen).softmax(dim=1)
    layout = make_layout(topk_idx_TK, E, backend="native" if device == "cpu" else "torch")
    token_N, row_TK = layout.token_N.to(device), layout.dest_row_TK.to(device)
    N = token_N.numel()
    weight_N = weight_TK.reshape(-1)[layout.src_slot_N].to(device)  # weight of each permuted row, for index_add_
    weight_TK = weight_TK.to(device)

    x_TH = torch.randn(T, H, generator=gen).to(dtype).to(device)
    y_NH = torch.randn(N, H, generator=gen).to(dtype).to(device)
    perm_out_NH = torch.ones(N, H, dtype=dtype, device=device)  # reused buffers, already touched
    unperm_out_TH = torch.ones(T, H, dtype=dtype, device=device)

    permute_bytes = 2 * N * H * elt
    unpermute_bytes = (N + T) * H * elt
    # memcpy moving the same bytes: half of them read, half written.
    copy_src = {op: torch.randn(b // (2 * elt)).to(dtype).to(device) for op, b in
                (("permute", permute_bytes), ("unpermute", unpermute_bytes))}
    copy_dst = {op: torch.ones_like(src) for op, src in copy_src.items()}

    cases = [  # (op, name, fn); fns return their output, kept until their next call
        ("permute", f"{copy} (dst.copy_(src))", lambda: copy_dst["permute"].copy_(copy_src["permute"])),
        ("permute", "torch index_select, fresh", lambda: x_TH.index_select(0, token_N)),
        ("permute", "torch index_select, out=", lambda: torch.index_select(x_TH, 0, token_N, out=perm_out_NH)),
        ("permute", f"{kname}, out=", lambda: impl.permute_rows(x_TH, token_N, out=perm_out_NH)),
        ("permute", f"{kname}, fresh", lambda: impl.permute_rows(x_TH, token_N)),
        ("unpermute", f"{copy} (dst.copy_(src))", lambda: copy_dst["unpermute"].copy_(copy_src["unpermute"])),
        ("unpermute", "torch reference, fresh", lambda: reference.unpermute_rows(y_NH, row_TK, weight_TK)),
        ("unpermute", "torch index_add_, out=",
         lambda: unperm_out_TH.zero_().index_add_(0, token_N, y_NH * weight_N.to(dtype)[:, None])),
        ("unpermute", f"{kname}, out=", lambda: impl.unpermute_rows(y_NH, row_TK, weight_TK, out=unperm_out_TH)),
        ("unpermute", f"{kname}, fresh", lambda: impl.unpermute_rows(y_NH, row_TK, weight_TK)),
    ]
    if device == "cpu":  # the user-facing calls: autograd op, backend "auto", output allocated inside
        cases.insert(5, ("permute", "ops.permute, plain call", lambda: ops.permute(x_TH, layout)))
        cases.append(("unpermute", "ops.unpermute, plain call", lambda: ops.unpermute(y_NH, layout, weight_TK)))
    all_times, all_faults = interleaved_times([fn for _, _, fn in cases], args.repeats, sync, args.warmup)
    results = []
    memcpy_gbps = {}
    for (op, name, _), times, faults in zip(cases, all_times, all_faults):
        med = statistics.median(times)
        nbytes = permute_bytes if op == "permute" else unpermute_bytes
        gbps = nbytes / med / 1e9
        if name.startswith(copy):
            memcpy_gbps[op] = gbps
        results.append({"op": op, "name": name, "bytes": nbytes, "median_s": med, "min_s": min(times),
                        "gbps": gbps, "frac_memcpy": gbps / memcpy_gbps[op], "times_s": times,
                        "median_faults": statistics.median(faults), "faults": faults})
    config = {"device": device, "tokens": T, "hidden": H, "topk": K, "experts": E, "rows": N, "dtype": args.dtype,
              "repeats": args.repeats, "warmup": args.warmup, "threads": torch.get_num_threads(), "seed": args.seed,
              "cache_freed_memory": args.cache_freed_memory, "torch": torch.__version__}
    return {"config": config, "results": results}


def print_table(report: Dict[str, object]) -> None:
    cfg = report["config"]
    title = (f"permute / unpermute on {cfg['device']}, "
             f"T={cfg['tokens']} H={cfg['hidden']} K={cfg['topk']} E={cfg['experts']} "
             f"{cfg['dtype']}, {cfg['threads']} threads, median of {cfg['repeats']}")
    if cfg.get("cache_freed_memory"):
        title += ", cache_freed_memory"
    header = ("op", "kernel", "ms", "GB/s", "of copy", "faults")
    rows = [(r["op"], r["name"], f"{r['median_s'] * 1e3:.2f}", f"{r['gbps']:.2f}", f"{r['frac_memcpy']:.0%}",
             f"{r['median_faults']:.0f}") for r in report["results"]]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        for row in (header, *rows):
            print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
        return
    table = Table(title=title)
    for i, h in enumerate(header):
        table.add_column(h, justify="right" if i >= 2 else "left")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.cache_freed_memory:
        from moe_comm.tools.launch import cache_freed_memory
        if not cache_freed_memory():
            print("cache_freed_memory: mallopt unavailable (not glibc); continuing without it")
    devices = [d for d in args.devices.split(",") if d]
    bad = [d for d in devices if d not in ("cpu", "cuda")]
    if bad:
        raise SystemExit(f"--devices takes cpu and/or cuda, got {bad}")
    reports = []
    for device in devices:
        if device == "cuda" and not torch.cuda.is_available():
            print("cuda: no GPU present, skipped")
            continue
        reports.append(run(args, device))
        print_table(reports[-1])
    report = reports[0] if len(reports) == 1 else {"runs": reports}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
