"""GPU check: the Triton permutation kernels on CUDA against the torch reference, and their bandwidth.

Shapes legend: T tokens, K top-k slots, N routed rows (T*K when nothing is dropped), H hidden size,
E experts.

The one script to run on a CUDA machine (sized for an H200: well under 4 minutes).
  (a) correctness at realistic shapes, T in {4096, 16384} x H in {2048, 7168} x K in {2, 8} x
      E in {16, 256} x {bf16, fp32}, routing from ``moe_comm.ops.layout.make_layout``; plus a case with
      dropped slots and experts without tokens, and one with N*H > 2^31 (int64 offsets).
      permute (plain and scaled) must be bit-identical to the reference; unpermute (weighted and plain)
      and the weight gradient must be close (the GPU may fuse multiply-add; the reference does not).
  (b) bandwidth of permute and of weighted unpermute: bytes read + written / median time
      (``triton.testing.do_bench``: CUDA events, L2 flushed before each run), next to a device-to-device
      ``dst.copy_(src)`` moving the same number of bytes; "of copy" is the ratio of the two GB/s.
  (c) a sweep of the column block (bytes per program) on the largest shapes, to tune
      ``triton_ops._BLOCK_BYTES``; then a compact table, and JSON with ``--json PATH``.

Bytes counted: permute reads N*H and writes N*H elements (+ 8 B per row index); unpermute reads N*H,
writes T*H elements (+ 12 B per slot for index and weight).

    python benchmarks/gpu_check.py --json /tmp/gpu_check.json
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --dry-run-cpu   # tiny shapes, interpreter, no GPU

Exit status: 0 every check passed; 1 a correctness check failed (or raised); 2 no CUDA device (or no
triton, or kernels interpreted on a CUDA run).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32"}
SWEEP_BLOCK_BYTES = (1024, 2048, 4096, 8192, 16384)


@dataclass
class Case:
    T: int
    H: int
    K: int
    E: int
    dtype: str  # "bf16" | "fp32"
    drop: float = 0.0  # fraction of slots dropped (topk_idx = -1)
    used_experts: Optional[int] = None  # route only to the first few experts: the rest get no rows
    label: str = ""
    wide: bool = False  # the int64-offset case: permute + plain unpermute only, no weight grad

    @property
    def name(self) -> str:
        s = f"T={self.T} H={self.H} K={self.K} E={self.E} {self.dtype}"
        return s + (f" [{self.label}]" if self.label else "")


@dataclass
class CaseResult:
    case: Dict
    name: str
    N: int = 0
    checks: Dict[str, Dict] = field(default_factory=dict)  # op -> {ok, max_abs_err, detail}
    bandwidth: Dict[str, Dict] = field(default_factory=dict)  # op -> {ms, gbps, copy_gbps, of_copy}
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and all(c["ok"] for c in self.checks.values())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-' for stdout)")
    p.add_argument("--dry-run-cpu", action="store_true",
                   help="tiny shapes on CPU under TRITON_INTERPRET=1: exercises the script without a GPU")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="skip the remaining bandwidth measurements once this many seconds have passed "
                        "(correctness always runs to the end); default 200")
    p.add_argument("--no-bench", action="store_true", help="correctness only")
    p.add_argument("--no-sweep", action="store_true", help="skip the column-block sweep")
    return p.parse_args(argv)


def full_cases() -> List[Case]:
    cases = [Case(T, H, K, E, dt) for dt in ("bf16", "fp32") for T in (4096, 16384) for H in (2048, 7168)
             for K in (2, 8) for E in (16, 256)]
    cases += [Case(4096, 7168, 8, 256, dt, drop=0.1, used_experts=64, label="10% dropped, 192 empty")
              for dt in ("bf16", "fp32")]
    cases.append(Case(8192, 65600, 4, 16, "bf16", label="N*H > 2^31", wide=True))
    return cases


def dry_run_cases() -> List[Case]:
    cases = [Case(T, H, K, E, dt) for dt in ("bf16", "fp32") for T in (8, 24) for H in (16, 40)
             for K in (2, 3) for E in (4, 8)]
    cases += [Case(24, 40, 3, 8, dt, drop=0.2, used_experts=3, label="20% dropped, 5 empty")
              for dt in ("bf16", "fp32")]
    cases.append(Case(8, 2100, 2, 4, "bf16", label="wide rows", wide=True))
    return cases


def tolerances(torch, dtype):
    """(rtol, atol) for unpermute outputs: fp32 FMA vs mul-then-add, or 1 ulp of a bf16 result."""
    return (1e-5, 1e-5) if dtype == torch.float32 else (2 ** -7, 1e-5)


def main(argv=None) -> int:
    args = parse_args(argv)
    # TRITON_INTERPRET is read when the kernels are decorated, i.e. when triton_ops is imported: set it first
    if args.dry_run_cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("gpu_check: ignoring TRITON_INTERPRET=1 (it would run the interpreter, not the compiled kernels)")
        os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, REPO_ROOT)  # test this checkout, not an installed copy

    import torch

    if not args.dry_run_cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False). Run this on a CUDA "
              "machine, or use --dry-run-cpu to exercise the script on CPU.", file=sys.stderr)
        return 2
    from moe_comm.kernels import reference, triton_ops
    from moe_comm.ops.layout import make_layout
    if not triton_ops.available():
        print("gpu_check: triton cannot be imported; the Triton kernels cannot run.", file=sys.stderr)
        return 2
    if not args.dry_run_cpu and triton_ops._interpreting():
        print("gpu_check: triton was imported in interpreter mode; unset TRITON_INTERPRET.", file=sys.stderr)
        return 2
    import triton

    device = torch.device("cpu" if args.dry_run_cpu else "cuda")
    t_start = time.perf_counter()
    env = {
        "device": "cpu (TRITON_INTERPRET=1 dry run)" if args.dry_run_cpu else torch.cuda.get_device_name(0),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "block_bytes": triton_ops._BLOCK_BYTES, "dry_run": args.dry_run_cpu,
    }
    print(f"gpu_check on {env['device']} | torch {env['torch']} | triton {env['triton']} | "
          f"block {env['block_bytes']} B")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def bench_ms(fn: Callable[[], object]) -> float:
        """Median milliseconds of ``fn``: do_bench (CUDA events, L2 flushed) or, on the dry run, wall time."""
        if device.type == "cuda":
            return float(triton.testing.do_bench(fn, warmup=10, rep=50, quantiles=[0.5, 0.2, 0.8])[0])
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    copy_cache: Dict[int, float] = {}

    def copy_gbps(nbytes: int) -> float:
        """GB/s of ``dst.copy_(src)`` moving ``nbytes`` in total (nbytes / 2 read, nbytes / 2 written)."""
        half = max(nbytes // 2, 1)
        if half not in copy_cache:
            src = torch.empty(half, dtype=torch.uint8, device=device).fill_(1)
            dst = torch.empty_like(src)
            copy_cache[half] = 2 * half / (bench_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9
            del src, dst
        return copy_cache[half]

    def routing(case: Case, seed: int):
        g = torch.Generator(device=device).manual_seed(seed)
        scores_TE = torch.rand(case.T, case.E, generator=g, device=device)
        if case.used_experts is not None:
            scores_TE[:, case.used_experts:] = -1.0
        topk_idx_TK = scores_TE.topk(case.K, dim=1).indices
        if case.drop:
            topk_idx_TK[torch.rand(case.T, case.K, generator=g, device=device) < case.drop] = -1
        backend = "torch" if args.dry_run_cpu else "auto"  # the dry run must not build the C++ kernels
        layout = make_layout(topk_idx_TK, num_experts=case.E, backend=backend)
        if not case.drop:
            layout.set_num_rows(case.T * case.K)  # nothing dropped: N = T*K, no host sync
        return layout.token_N, layout.dest_row_TK, layout.num_rows  # host sync only when slots were dropped

    def check(res: CaseResult, op: str, got, want, rtol=None, atol=None):
        """Bitwise when rtol is None, else allclose; records the max abs error either way."""
        if got.shape != want.shape or got.dtype != want.dtype:
            res.checks[op] = {"ok": False, "max_abs_err": None,
                              "detail": f"got {tuple(got.shape)} {got.dtype}, "
                                        f"expected {tuple(want.shape)} {want.dtype}"}
            return
        # in row chunks of ~2^27 elements: the wide case has N*H > 2^31 and float64 copies would be huge
        rows = max(1, (1 << 27) // max(got.shape[-1], 1))
        max_err, close = 0.0, True
        for r0 in range(0, got.shape[0], rows):
            a, b = got[r0:r0 + rows].double(), want[r0:r0 + rows].double()
            if a.numel():
                max_err = max(max_err, float((a - b).abs().max()))
                if rtol is not None:
                    close = close and bool(torch.allclose(a, b, rtol=rtol, atol=atol))
        ok = bool(torch.equal(got, want)) if rtol is None else close
        res.checks[op] = {"ok": ok, "max_abs_err": max_err,
                          "detail": "bitwise" if rtol is None else f"rtol={rtol:g} atol={atol:g}"}

    def run_case(case: Case, seed: int, bench: bool) -> CaseResult:
        res = CaseResult(case=asdict(case), name=case.name)
        dtype = getattr(torch, DTYPE_NAMES[case.dtype])
        T, H, K = case.T, case.H, case.K
        g = torch.Generator(device=device).manual_seed(seed + 1)
        token_N, row_TK, N = routing(case, seed)
        res.N = N
        x_TH = torch.randn(T, H, generator=g, device=device).to(dtype)
        scale_N = torch.rand(N, generator=g, device=device) * 2
        weight_TK = torch.rand(T, K, generator=g, device=device)

        # (a) correctness
        x_NH = triton_ops.permute_rows(x_TH, token_N)
        check(res, "permute", x_NH, reference.permute_rows(x_TH, token_N))
        if not case.wide:
            xs_NH = triton_ops.permute_rows(x_TH, token_N, scale_N)
            check(res, "permute*scale", xs_NH, reference.permute_rows(x_TH, token_N, scale_N))
            del xs_NH
        rtol, atol = tolerances(torch, dtype)
        if N > 0:  # the reference cannot index an empty y_NH
            if not case.wide:
                check(res, "unpermute*w", triton_ops.unpermute_rows(x_NH, row_TK, weight_TK),
                      reference.unpermute_rows(x_NH, row_TK, weight_TK), rtol, atol)
            check(res, "unpermute", triton_ops.unpermute_rows(x_NH, row_TK),
                  reference.unpermute_rows(x_NH, row_TK), rtol, atol)
            if not case.wide:
                grad_TH = torch.randn(T, H, generator=g, device=device).to(dtype)
                check(res, "weight_grad", triton_ops.unpermute_weight_grad(grad_TH, x_NH, row_TK),
                      reference.unpermute_weight_grad(grad_TH, x_NH, row_TK), 1e-4, 1e-6 * H)
                del grad_TH
        sync()

        # (b) bandwidth, into reused output buffers (the persistent-workspace case)
        if bench and not case.wide:
            es = x_TH.element_size()
            out_NH = torch.empty_like(x_NH)
            out_TH = torch.empty_like(x_TH)
            ops = {
                "permute": (lambda: triton_ops.permute_rows(x_TH, token_N, out=out_NH), 2 * N * H * es + 8 * N),
                "unpermute*w": (lambda: triton_ops.unpermute_rows(x_NH, row_TK, weight_TK, out=out_TH),
                                N * H * es + T * H * es + 12 * T * K),
            }
            for op, (fn, nbytes) in ops.items():
                ms = bench_ms(fn)
                gbps = nbytes / (ms * 1e-3) / 1e9
                cg = copy_gbps(nbytes)
                res.bandwidth[op] = {"ms": ms, "bytes": nbytes, "gbps": gbps, "copy_gbps": cg, "of_copy": gbps / cg}
            del out_NH, out_TH
        return res

    cases = dry_run_cases() if args.dry_run_cpu else full_cases()
    results: List[CaseResult] = []
    for i, case in enumerate(cases):
        bench = not args.no_bench and time.perf_counter() - t_start < args.budget_s
        try:
            res = run_case(case, seed=1000 + i, bench=bench)
        except Exception as exc:  # a failing kernel must not hide the other cases
            res = CaseResult(case=asdict(case), name=case.name, error=f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        results.append(res)
        print(format_case(res), flush=True)

    sweep = []
    if not (args.no_bench or args.no_sweep):
        sweep = run_sweep(torch, triton_ops, routing, bench_ms, copy_gbps, device, args, t_start)

    ok = all(r.ok for r in results)
    wall = time.perf_counter() - t_start
    print_summary(results, sweep, ok, wall)
    if args.json:
        payload = {"env": env, "ok": ok, "wall_s": wall, "cases": [asdict(r) | {"ok": r.ok} for r in results],
                   "sweep": sweep}
        text = json.dumps(payload, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
            print(f"wrote {args.json}")
    return 0 if ok else 1


def run_sweep(torch, triton_ops, routing, bench_ms, copy_gbps, device, args, t_start) -> List[Dict]:
    """GB/s of permute and weighted unpermute for each column block size, on the largest shapes."""
    shapes = [Case(24, 40, 3, 8, "bf16"), Case(24, 40, 3, 8, "fp32")] if args.dry_run_cpu else \
        [Case(16384, 7168, 8, 256, "bf16"), Case(16384, 7168, 8, 256, "fp32"), Case(4096, 2048, 8, 256, "bf16")]
    rows = []
    for j, case in enumerate(shapes):
        if time.perf_counter() - t_start > args.budget_s:
            print(f"sweep: budget of {args.budget_s:.0f} s spent, skipping {case.name}")
            continue
        dtype = getattr(torch, DTYPE_NAMES[case.dtype])
        token_N, row_TK, N = routing(case, 7 + j)
        x_TH = torch.randn(case.T, case.H, device=device).to(dtype)
        weight_TK = torch.rand(case.T, case.K, device=device)
        x_NH = torch.empty(N, case.H, dtype=dtype, device=device)
        out_TH = torch.empty_like(x_TH)
        es = x_TH.element_size()
        p_bytes = 2 * N * case.H * es + 8 * N
        u_bytes = N * case.H * es + case.T * case.H * es + 12 * case.T * case.K
        seen = set()
        for block_bytes in SWEEP_BLOCK_BYTES:
            bh, nw = triton_ops._block_config(case.H, es, block_bytes)
            if (bh, nw) in seen:  # H smaller than the block: same launch as a smaller block_bytes
                continue
            seen.add((bh, nw))
            p_ms = bench_ms(lambda x=x_TH, o=x_NH, b=block_bytes: triton_ops._launch_permute(x, token_N, None, o, b))
            u_ms = bench_ms(lambda y=x_NH, o=out_TH, b=block_bytes: triton_ops._launch_unpermute(y, row_TK, weight_TK,
                                                                                                    o, b))
            p_gbps, u_gbps = p_bytes / p_ms / 1e6, u_bytes / u_ms / 1e6
            rows.append({"case": case.name, "block_bytes": block_bytes, "BLOCK_H": bh, "num_warps": nw,
                         "permute_gbps": p_gbps, "permute_of_copy": p_gbps / copy_gbps(p_bytes),
                         "unpermute_gbps": u_gbps, "unpermute_of_copy": u_gbps / copy_gbps(u_bytes)})
        del x_TH, x_NH, out_TH
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def format_case(res: CaseResult) -> str:
    if res.error:
        return f"FAIL  {res.name:<52} error: {res.error}"
    parts = []
    for op, c in res.checks.items():
        err = "n/a" if c["max_abs_err"] is None else f"{c['max_abs_err']:.1e}"
        parts.append(f"{op} {'ok' if c['ok'] else 'FAIL'}({err})")
    return f"{'PASS' if res.ok else 'FAIL'}  {res.name:<52} N={res.N:<7} " + " ".join(parts)


def print_summary(results: List[CaseResult], sweep: List[Dict], ok: bool, wall: float) -> None:
    bench = [r for r in results if r.bandwidth]
    if bench:
        print("\nbandwidth (GB/s, median; 'copy' = dst.copy_(src) of the same bytes)")
        print(f"{'case':<52} {'permute':>8} {'copy':>7} {'frac':>5} | "
              f"{'unperm*w':>8} {'copy':>7} {'frac':>5}")
        for r in bench:
            p, u = r.bandwidth.get("permute"), r.bandwidth.get("unpermute*w")
            cols = []
            for b in (p, u):
                cols.append(f"{b['gbps']:8.1f} {b['copy_gbps']:7.1f} {b['of_copy']:5.2f}" if b
                            else f"{'-':>8} {'-':>7} {'-':>5}")
            print(f"{r.name:<52} {cols[0]} | {cols[1]}")
    if sweep:
        print("\ncolumn-block sweep (GB/s and fraction of copy)")
        print(f"{'case':<34} {'bytes':>6} {'BLOCK_H':>7} {'warps':>5} "
              f"{'permute':>8} {'frac':>5} {'unperm*w':>8} {'frac':>5}")
        for s in sweep:
            print(f"{s['case']:<34} {s['block_bytes']:>6} {s['BLOCK_H']:>7} {s['num_warps']:>5} "
                  f"{s['permute_gbps']:8.1f} {s['permute_of_copy']:5.2f} "
                  f"{s['unpermute_gbps']:8.1f} {s['unpermute_of_copy']:5.2f}")
    n_checks = sum(len(r.checks) for r in results)
    failed = [r.name for r in results if not r.ok]
    print(f"\n{'PASS' if ok else 'FAIL'}: {len(results) - len(failed)}/{len(results)} cases, {n_checks} checks, "
          f"{wall:.1f} s"
          + (f"; failed: {failed[:5]}" + (f" and {len(failed) - 5} more" if len(failed) > 5 else "")
             if failed else ""))


if __name__ == "__main__":
    sys.exit(main())
