"""The one-shot device verdict: moe_comm on one CUDA GPU (sized for an H200, one call of at most 6 minutes),
or every section's logic on CPU with ``--dry-run-cpu`` (tiny shapes, Triton interpreter, gloo) for CI.

Shapes legend: T tokens, K top-k slots, N routed rows (T*K minus dropped), H hidden size, F expert FFN
size, E experts, e local experts, R expert-major rows, C pipeline chunks, W ranks.

Sections, in run order (each in try/except; the JSON file is rewritten after each one):
  env            versions (python, torch, CUDA, cuDNN, NCCL, triton, moe_comm commit), device capability
  kernels        Triton permute, scaled permute (bitwise), weighted and plain unpermute, weight grad (close)
                 vs the torch reference: bf16/fp16/fp32/fp64 and uint8 (permute) at H in {1, 7, 5120, 7168};
                 dropped slots with NaN weights, empty experts, strided inputs and outputs, NaN/Inf rows, N = 0
  kernels_int64  N*H > 2^31 (permute) and T*H > 2^31 (unpermute, weight grad): int64 offsets (CUDA only)
  bandwidth      permute and weighted unpermute GB/s (triton.testing.do_bench: CUDA events, L2 flushed) vs
                 a device-to-device copy of the same bytes, against --min-of-copy; column-block sweep, each
                 block size checked bitwise against the default one
  experts        SwiGLU experts: torch._grouped_mm (where moe_comm uses it: CUDA bf16 sm90/sm100, CPU) vs the
                 per-expert loop vs float64, forward and every gradient, with empty experts; GroupedExperts
                 with NaN padding rows (the sync-free dispatch's input)
  regroup        issue #26 item 11's candidates on the rows an all-to-all delivers (W source blocks):
                 permute + one grouped GEMM + permute back (today), one grouped GEMM per source block, the
                 per-(source, expert) block loop; checked against each other, forward + backward timed
  layer          MoELayer on one device (bf16 and fp32 at C in {1, 4}, shared experts, aux + z loss +
                 capacity, autocast) vs the dense float64 reference (dense_moe): routing, output, aux loss,
                 every gradient; a second forward and backward must be bit-identical
  host_syncs     host syncs of one forward and one backward: torch.cuda.set_sync_debug_mode("warn") on CUDA,
                 moe_comm.testing.syncs.HostSyncs anywhere (on CUDA it also sees host -> device copies; its
                 non_blocking copies from pageable memory are listed apart and FAIL only if measured blocking)
  sync_free      MoEConfig(max_tokens_per_rank=M): no host sync in forward and backward, the dropless
                 layer's output and gradients; a step captured in a CUDA graph and replayed on new tokens
                 (CUDA only: equal to eager dropless steps, call number and monitor step advanced per replay)
  fp8_dispatch   FP8 rows: Triton quantize/dequantize vs the torch reference bit for bit (fp32 and ue8m0
                 scales, NaN/Inf blocks, the e4m3 bound); a layer with dispatch_dtype=float8_e4m3fn near the
                 plain one, host syncs
  nccl_world1    a 1-rank NCCL group in a subprocess: async all_to_all_single, what wait() blocks, a CPU
                 tensor rejected, Dispatcher and MoELayer on the group (gloo with CPU tensors on the dry run)
  two_ranks      2 spawned ranks over gloo with CUDA tensors on the one GPU (CPU tensors on the dry run):
                 MoELayer vs the dense reference, forward and gradients; host syncs at W = 2
  nccl_ranks     W = N NCCL ranks, one GPU each (--nccl-ranks N, default 2): uneven all-to-all, MoELayer vs the
                 reference, host syncs per rank, a mid-call failure (eager and deferred) raised on every rank.
                 NOT COVERED with fewer GPUs than ranks (NCCL refuses two ranks on one device: on one GPU, W >= 2
                 runs only over gloo); ``--dry-run-cpu --nccl-ranks N`` runs it on N gloo ranks on CPU
  timeline       the layer's Timeline on CUDA events (host clock on the dry run): on the layer's device at
                 construction and after the first forward, spans of every phase and chunk, overlap report,
                 Chrome trace
  pytest_gpu     python -m pytest -q -m gpu tests, in a subprocess

A section is PASS when its checks ran and held, FAIL when one did not or the section raised, NOT COVERED
(with the reason) when it cannot run here (no CUDA, a missing module or config field, the time budget).
A section that runs out of --budget seconds is not started: NOT COVERED ("budget").

    python benchmarks/gpu_check.py --json /tmp/gpu_check.json            # on the GPU machine
    python benchmarks/gpu_check.py --dry-run-cpu --json /tmp/dry.json     # CI, no GPU: < 60 s
    python benchmarks/gpu_check.py --nccl-ranks 4 --json /tmp/gpu4.json   # a machine with 4 GPUs: W = 4 NCCL

Exit status: 0 every section PASS or NOT COVERED (with a reason); 1 a section FAILed (or the run hung and
faulthandler ended it at --budget + 25 s, inside 6 minutes by default: the JSON keeps the finished sections,
the rest "NOT RUN").
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import faulthandler
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch

# TRITON_INTERPRET is read when moe_comm.kernels.triton_ops decorates its kernels, at import, and
# ``import moe_comm`` imports triton: so it is set here, before any moe_comm import (all are below, in
# functions). Spawned ranks re-run this module with the parent's argv.
DRY = "--dry-run-cpu" in sys.argv[1:]
INTERPRET_IGNORED = False
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"
elif os.environ.get("TRITON_INTERPRET", "0") == "1":
    os.environ["TRITON_INTERPRET"] = "0"  # the interpreter would stand in for the compiled kernels
    INTERPRET_IGNORED = True

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # this checkout's moe_comm, not an installed copy

PASS, FAIL, NOT_COVERED = "PASS", "FAIL", "NOT COVERED"
NOT_RUN = "NOT RUN"  # in the JSON until the section ran: a killed run shows where it stopped

# (rtol, atol) of unpermute outputs vs the reference, compared in float64: a GPU may fuse the multiply-add of
# the fp32 accumulation, and a half-precision result may then differ by 1 ulp.
UNPERMUTE_TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12),
                 torch.bfloat16: (2 ** -7, 1e-5), torch.float16: (2 ** -10, 1e-5)}
# max |got - want| / max |want| of layers and experts vs float64 on the same rounded weights and inputs.
# fp32: tests/modules/test_layer_multirank.py's bound. bf16 (and bf16 autocast): every GEMM output rounded to
# 8 bits of mantissa; the dry run's shapes measured at most 1.0e-2 (grad w3 of the loop, grad w1 under autocast).
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
SWEEP_BLOCK_BYTES = (1024, 2048, 4096, 8192, 16384)
# torch.cuda._sleep cycles that keep a stream busy ~0.2 s at the H200's ~2 GHz: long enough that a wait()
# that blocked the host shows.
SLEEP_CYCLES = 400_000_000


class NotCovered(Exception):
    """The whole section cannot run here; the message is the reason."""


class Record:
    """The checks and data of one section (or of a child process)."""

    def __init__(self, name: str):
        self.name, self.checks, self.data = name, [], {}

    def check(self, what: str, ok, detail: str = "") -> bool:
        ok = bool(ok)
        self.checks.append({"check": what, "status": PASS if ok else FAIL, "detail": str(detail)})
        if not ok:
            print(f"    FAIL {self.name}: {what}: {detail}", flush=True)
        return ok

    def not_covered(self, what: str, reason: str) -> None:
        self.checks.append({"check": what, "status": NOT_COVERED, "detail": reason})

    @contextlib.contextmanager
    def step(self, what: str):
        """A sub-check that may raise: the exception is a FAIL of ``what``, the section goes on."""
        try:
            yield
        except NotCovered as exc:
            self.not_covered(what, str(exc))
        except Exception as exc:  # noqa: BLE001 - any failure of the step is its verdict
            self.check(what, False, f"raised {type(exc).__name__}: {exc}")


@dataclasses.dataclass
class Ctx:
    args: argparse.Namespace
    dry: bool
    device: torch.device
    t_start: float
    tmpdir: str
    env: Dict = dataclasses.field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def backend(self) -> str:
        # Layers and dispatchers: "auto" is Triton on CUDA. The dry run takes the torch kernels: "auto" on
        # CPU would build the C++ ones on first use (~40 s); the kernels section runs Triton interpreted.
        return "torch" if self.dry else "auto"

    def left(self) -> float:
        return self.args.budget - (time.perf_counter() - self.t_start)

    def gen(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)


@dataclasses.dataclass(frozen=True)
class Section:
    name: str
    fn: Callable[[Ctx, Record], None]
    needs_s: float  # budget left needed to start it (rough, from its shapes; not measured on an H200)


SECTIONS: List[Section] = []


def section(name: str, needs_s: float = 5.0):
    def register(fn):
        SECTIONS.append(Section(name, fn, needs_s))
        return fn
    return register


# ======================================================================================= comparisons
def bits(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers: a bitwise comparison that sees NaN payloads and signed zeros."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def compare_bits(got: torch.Tensor, want: torch.Tensor, nan_equal: bool = False) -> Tuple[bool, str]:
    """Bit-identical (``nan_equal``: any NaN matches any NaN, for results of arithmetic on NaN)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False, f"got {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
    a, b = got.contiguous(), want.contiguous()
    differ = bits(a) != bits(b)
    if nan_equal and a.is_floating_point():
        differ &= ~(torch.isnan(a) & torch.isnan(b))
    n = int(differ.sum())
    return n == 0, "bitwise" if n == 0 else f"{n} of {a.numel()} elements differ"


def compare_close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> Tuple[bool, str]:
    """|got - want| <= atol + rtol |want| elementwise in float64, NaN where want is NaN, the same infinities.
    In chunks of 2^26 elements (float64 copies of 512 MiB at most: wide cases hold 2^31 elements)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False, f"got {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
    a_all, b_all = got.reshape(-1), want.reshape(-1)
    step, max_err, bad = 1 << 26, 0.0, 0
    for i in range(0, a_all.numel(), step):
        a, b = a_all[i:i + step].double(), b_all[i:i + step].double()
        finite = torch.isfinite(a) & torch.isfinite(b)
        diff = torch.where(finite, (a - b).abs(), torch.zeros_like(a))
        ok = torch.where(finite, diff <= atol + rtol * b.abs(), (torch.isnan(a) & torch.isnan(b)) | (a == b))
        bad += int((~ok).sum())
        max_err = max(max_err, float(diff.max()))
    return bad == 0, f"max abs err {max_err:.2e}, {bad} elements outside rtol={rtol:g} atol={atol:g}"


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| in float64 (the floor 1e-6 for a reference that is 0)."""
    if got.shape != want.shape:
        return float("inf")
    if want.numel() == 0:
        return 0.0
    a, b = got.detach().double(), want.detach().double().to(got.device)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def check_rel(rec: Record, what: str, got, want, tol: float) -> bool:
    err = rel_err(got, want)
    return rec.check(what, err <= tol, f"rel err {err:.2e} (tol {tol:g})")


@contextlib.contextmanager
def cuda_sync_warnings(out: List[str]):
    """Appends to ``out`` every synchronizing CUDA call of the block, as 'file:line' of the Python caller
    (torch.cuda.set_sync_debug_mode("warn") makes each one a warning)."""
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield out
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    for w in caught:
        if "synchroniz" in str(w.message):
            out.append(f"{os.path.relpath(w.filename, REPO_ROOT)}:{w.lineno}")


def host_syncs_class():
    """moe_comm.testing.syncs.HostSyncs, or None when this checkout does not have it."""
    try:
        from moe_comm.testing.syncs import HostSyncs
    except ImportError:
        return None
    return HostSyncs


# HostSyncs' kind for a non_blocking host -> device copy from pageable memory: CUDA stages it through a pinned
# buffer and "might be synchronous" (CUDA runtime, API synchronization behavior); set_sync_debug_mode does not
# flag it. Kept apart from the counted syncs and judged by pageable_copy_blocks, measured on the device.
PAGEABLE = "copy to device from pageable memory"


def count_syncs(fn: Callable[[], object], how: str, pageable: Optional[List[str]] = None) -> Tuple[object, List[str]]:
    """(fn(), the host syncs it made): how = "cuda" (sync debug mode) or "hostsyncs" (HostSyncs.events). With
    ``pageable`` (a list), HostSyncs' pageable host -> device copies go there instead of into the result."""
    if how == "cuda":
        events: List[str] = []
        with cuda_sync_warnings(events):
            out = fn()
        return out, events
    with host_syncs_class()() as s:
        out = fn()
    events = [str(e) for e in s.events]
    if pageable is None:
        return out, events
    pageable += [e for e in events if e.startswith(PAGEABLE)]
    return out, [e for e in events if not e.startswith(PAGEABLE)]


def pageable_copy_blocks(device: torch.device) -> Tuple[bool, str]:
    """Measured: does ``x.to(device, non_blocking=True)`` of a small pageable CPU tensor (a control row's size)
    wait on the host for ~0.2 s of GPU work queued before it? (blocks, detail)."""
    src = torch.arange(64, dtype=torch.int64)  # pageable: not pinned
    torch.cuda.synchronize(device)
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    src.to(device, non_blocking=True)
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize(device)
    blocks = host_ms > 50.0
    return blocks, f"a 512 B pageable non_blocking copy behind ~200 ms of queued GPU work took {host_ms:.2f} ms " \
                   f"on the host: {'blocks' if blocks else 'does not block'}"


def check_pageable(rec: Record, label: str, pageable: List[str], device: torch.device) -> None:
    """Pageable host -> device copies (HostSyncs on CUDA): a FAIL only where such a copy measurably blocks."""
    rec.data[f"{label}: pageable copies"] = pageable
    if not pageable:
        rec.check(f"{label}: no non_blocking copy from pageable memory", True, "none")
        return
    blocks, detail = pageable_copy_blocks(device)
    rec.data["pageable_copy_blocks"] = detail
    where = sorted({e.split(" at ", 1)[1].split(": ", 1)[0] for e in pageable})
    rec.check(f"{label}: {len(pageable)} non_blocking copies from pageable memory do not block", not blocks,
              f"{detail}; at {where} (fix: .pin_memory() before .to(device, non_blocking=True))")


# ======================================================================================= layer helpers
def layer_data(cfg, T: int, seed: int) -> Dict:
    """Float64 data of one layer case on CPU (x, router and expert weights, shared experts, output grad),
    the same in every process for a seed."""
    g = torch.Generator().manual_seed(seed)
    E, H, F = cfg.num_experts, cfg.hidden_size, cfg.ffn_hidden_size

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    d = {"x": randn(T, H), "rw": randn(E, H, scale=H ** -0.5), "w1": randn(E, F, H, scale=H ** -0.5),
         "w3": randn(E, F, H, scale=H ** -0.5), "w2": randn(E, H, F, scale=F ** -0.5), "shared": None}
    Fs = cfg.shared_ffn_size
    if Fs:
        d["shared"] = (randn(Fs, H, scale=H ** -0.5), randn(Fs, H, scale=H ** -0.5), randn(H, Fs, scale=Fs ** -0.5))
    d["gy"] = randn(T, H)
    return d


@torch.no_grad()
def load_layer(layer, d: Dict, rank: int = 0, world_size: int = 1) -> None:
    """The case's weights into a layer (this rank's experts g in [rank * e, (rank + 1) * e))."""
    e = layer.cfg.num_experts // world_size
    local = slice(rank * e, (rank + 1) * e)
    layer.router.weight.copy_(d["rw"])
    layer.experts.w1.copy_(d["w1"][local])
    layer.experts.w3.copy_(d["w3"][local])
    layer.experts.w2.copy_(d["w2"][local])
    if d["shared"] is not None:
        for p, v in zip((layer.shared_experts.w1, layer.shared_experts.w3, layer.shared_experts.w2), d["shared"]):
            p.copy_(v)


def run_layer(layer, x_TH: torch.Tensor, gy_TH: torch.Tensor, autocast: Optional[torch.dtype] = None) -> Dict:
    """One forward and backward of loss = sum(y * gy) + aux_loss: y, aux, the routing, every gradient."""
    layer.zero_grad(set_to_none=True)
    x = x_TH.detach().clone().requires_grad_(True)
    amp = torch.autocast(x.device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    with amp:
        y, routing = layer(x, return_routing=True)
    aux = layer.aux_loss
    ((y.double() * gy_TH).sum() + aux.double()).backward()
    # copies: a later backward accumulates into the same .grad tensors in place
    out = {"y": y.detach().clone(), "aux": float(aux.detach()), "topk": routing.topk_idx_TK.detach().clone(),
           "x": x.grad, "router": layer.router.weight.grad.clone()}
    for name in ("w1", "w3", "w2"):
        p = getattr(layer.experts, name)
        out[name] = torch.zeros_like(p) if p.grad is None else p.grad.clone()
    if layer.shared_experts is not None:
        out["shared"] = torch.cat([p.grad.reshape(-1) for p in layer.shared_experts.parameters()])
    return out


def dense_reference(d: Dict, cfg, tokens_per_rank: List[int], x_dtype: torch.dtype, w_dtype: torch.dtype,
                    device: torch.device) -> Dict:
    """The float64 oracle on the values the layer holds (x and weights rounded to their dtypes): routing,
    capacity and the aux loss per rank (its own tokens); gradients of sum(y * gy) + sum of aux."""
    from moe_comm.testing.reference import dense_moe

    def leaf(t, dtype):
        return t.to(dtype).double().to(device).requires_grad_(True)

    x = leaf(d["x"], x_dtype)
    rw, w1, w3, w2 = (leaf(d[k], w_dtype) for k in ("rw", "w1", "w3", "w2"))
    shared = None if d["shared"] is None else [leaf(t, w_dtype) for t in d["shared"]]
    ys, idxs, aux, start = [], [], 0.0, 0
    for T_r in tokens_per_rank:
        y_r, aux_r, idx_r = dense_moe(x[start:start + T_r], rw, w1, w3, w2, cfg, shared=shared)
        ys.append(y_r)
        idxs.append(idx_r)
        aux = aux + aux_r
        start += T_r
    y = torch.cat(ys)
    ((y * d["gy"].to(device)).sum() + aux).backward()
    out = {"y": y.detach(), "aux": float(torch.as_tensor(aux).detach()), "topk": torch.cat(idxs), "x": x.grad,
           "router": rw.grad,
           "w1": w1.grad, "w3": w3.grad, "w2": w2.grad}
    if shared is not None:
        out["shared"] = torch.cat([p.grad.reshape(-1) for p in shared])
    return out


def compare_layer(rec: Record, label: str, got: Dict, ref: Dict, tol: float) -> None:
    """Routing equal, then output, aux loss and every gradient within ``tol`` of the oracle."""
    differ = int((got["topk"].cpu() != ref["topk"].cpu()).any(1).sum())
    rec.check(f"{label}: routing equals the reference", differ == 0, f"{differ} tokens routed differently")
    check_rel(rec, f"{label}: output", got["y"], ref["y"], tol)
    aux_err = abs(got["aux"] - ref["aux"])
    rec.check(f"{label}: aux loss", aux_err <= tol * max(1.0, abs(ref["aux"])),
              f"{got['aux']:.6g} vs {ref['aux']:.6g}")
    for name in ("x", "router", "w1", "w3", "w2", "shared"):
        if name in ref:
            check_rel(rec, f"{label}: grad {name}", got[name], ref[name], tol)


def compare_ranks(rec: Record, results: List[Dict], ref: Dict, tol: float) -> None:
    """Every rank's layer step against the oracle of all ranks' tokens: routing, output, aux loss (summed over
    ranks), every gradient (the router weight is replicated: each rank holds its own tokens' gradient, and
    they sum to the dense one)."""
    differ = int((torch.cat([r["topk"] for r in results]) != ref["topk"]).any(1).sum())
    rec.check("routing equals the reference", differ == 0, f"{differ} tokens routed differently")
    check_rel(rec, "output", torch.cat([r["y"] for r in results]), ref["y"], tol)
    aux = sum(r["aux"] for r in results)
    rec.check("aux loss (sum over ranks)", abs(aux - ref["aux"]) <= tol * max(1.0, abs(ref["aux"])),
              f"{aux:.6g} vs {ref['aux']:.6g}")
    check_rel(rec, "grad x", torch.cat([r["x"] for r in results]), ref["x"], tol)
    check_rel(rec, "grad router (sum over ranks)", sum(r["router"].double() for r in results), ref["router"], tol)
    for name in ("w1", "w3", "w2"):
        check_rel(rec, f"grad {name}", torch.cat([r[name] for r in results]), ref[name], tol)


# ======================================================================================= sections
@section("env", needs_s=1)
def sec_env(ctx: Ctx, rec: Record) -> None:
    """Versions and capability; the Triton kernels compiled (CUDA) or interpreted (dry run)."""
    import torch.distributed as dist
    import triton

    import moe_comm
    from moe_comm.kernels import select_backend, triton_ops

    info = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "triton": triton.__version__, "moe_comm": moe_comm.__version__,
            "dry_run": ctx.dry, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
            "TRITON_INTERPRET_ignored": INTERPRET_IGNORED}
    try:
        git = ["git", "-C", REPO_ROOT]
        info["commit"] = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        timeout=10).stdout.strip()
        info["dirty"] = bool(subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                                            capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError) as exc:
        info["commit"] = f"unknown ({exc})"
    rec.data.update(info)
    ctx.env.update(info)
    rec.check("triton importable", triton_ops.available())
    if ctx.dry:
        rec.check("Triton kernels interpreted on CPU (TRITON_INTERPRET=1)", triton_ops._interpreting())
        rec.check("backend 'triton' on CPU tensors selects the Triton kernels",
                  select_backend("triton", "cpu") is triton_ops)
        rec.not_covered("CUDA device and capability", "dry run on CPU")
        return
    if not rec.check("CUDA device visible", torch.cuda.is_available(),
                     "torch.cuda.is_available() is False: run on the GPU machine, or use --dry-run-cpu"):
        return
    props = torch.cuda.get_device_properties(0)
    cap = torch.cuda.get_device_capability(0)
    nccl = torch.cuda.nccl.version() if dist.is_nccl_available() else None  # a tuple in torch 2.x
    dev = {"device": props.name, "capability": f"{cap[0]}.{cap[1]}", "sms": props.multi_processor_count,
           "memory_gib": round(props.total_memory / 2 ** 30, 1), "device_count": torch.cuda.device_count(),
           "cudnn": torch.backends.cudnn.version(),
           "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}
    try:
        dev["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        dev["driver"] = None
    rec.data.update(dev)
    ctx.env.update(dev)
    print(f"    {dev['device']} sm{cap[0]}{cap[1]} {dev['memory_gib']} GiB | torch {torch.__version__} "
          f"CUDA {torch.version.cuda} NCCL {dev['nccl']} | triton {triton.__version__} | moe_comm {info['commit']}")
    rec.check("Triton kernels compiled, not interpreted", not triton_ops._interpreting(),
              "TRITON_INTERPRET=1 was set before triton was imported")
    rec.check("backend 'auto' on CUDA selects the Triton kernels", select_backend("auto", "cuda") is triton_ops)
    rec.check("NCCL available", dist.is_nccl_available())
    if cap < (9, 0):
        rec.not_covered("sm90 (torch._grouped_mm)", f"capability {cap[0]}.{cap[1]}")


# ------------------------------------------------------------------------------- kernels
KERNEL_DTYPES = (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32),
                 ("fp64", torch.float64), ("uint8", torch.uint8))


def routing(ctx: Ctx, T: int, K: int, E: int, *, drop: float = 0.0, used_experts: Optional[int] = None,
            seed: int = 0):
    """(token_N, row_TK) of a random top-K routing from ``ops.make_layout``; experts >= used_experts get no
    rows, a fraction ``drop`` of the slots is dropped (-1)."""
    from moe_comm import ops

    g = ctx.gen(seed)
    scores_TE = torch.rand(T, E, generator=g, device=ctx.device)
    if used_experts is not None:
        scores_TE[:, used_experts:] = -1.0
    topk_idx_TK = scores_TE.topk(K, dim=1).indices
    if drop:
        topk_idx_TK[torch.rand(T, K, generator=g, device=ctx.device) < drop] = -1
        topk_idx_TK[0, -1] = -1  # at least one, whatever the draw
    layout = ops.make_layout(topk_idx_TK, num_experts=E, backend="torch")
    return layout.token_N, layout.dest_row_TK  # token_N reads N: a host sync, outside any timing


def payload(ctx: Ctx, shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = ctx.gen(seed)
    if dtype == torch.uint8:  # raw bytes, e.g. fp8 rows viewed as uint8
        return torch.randint(0, 256, shape, generator=g, device=ctx.device, dtype=torch.uint8)
    return torch.randn(shape, generator=g, device=ctx.device).to(dtype)


def slot_weights(ctx: Ctx, row_TK: torch.Tensor, seed: int) -> torch.Tensor:
    """Random fp32 weights, NaN on dropped slots: a kernel that reads a dropped slot's weight shows it."""
    w_TK = torch.rand(row_TK.shape, generator=ctx.gen(seed), device=ctx.device)
    return torch.where(row_TK >= 0, w_TK, torch.full_like(w_TK, float("nan")))


def kernel_ops(ctx: Ctx, rec: Record, label: str, x_TH, token_N, row_TK, seed: int, out_NH=None, out_TH=None):
    """Every kernel on one routing: permute (plain and scaled) bitwise; weighted and plain unpermute and the
    weight gradient close to the reference. Integer payloads: permute only."""
    from moe_comm.kernels import reference, triton_ops

    dense_TH = x_TH.contiguous()
    x_NH = triton_ops.permute_rows(x_TH, token_N, out=out_NH)
    rec.check(f"{label}: permute", *compare_bits(x_NH, reference.permute_rows(dense_TH, token_N)))
    if not x_TH.is_floating_point():
        return
    N, H = x_NH.shape
    scale_N = torch.rand(N, generator=ctx.gen(seed + 1), device=ctx.device) * 2
    rec.check(f"{label}: permute*scale", *compare_bits(triton_ops.permute_rows(x_TH, token_N, scale_N),
                                                        reference.permute_rows(dense_TH, token_N, scale_N),
                                                        nan_equal=True))
    rtol, atol = UNPERMUTE_TOL[x_TH.dtype]
    w_TK = slot_weights(ctx, row_TK, seed + 2)
    dense_NH = x_NH.contiguous()
    rec.check(f"{label}: unpermute*w", *compare_close(triton_ops.unpermute_rows(x_NH, row_TK, w_TK, out=out_TH),
                                                       reference.unpermute_rows(dense_NH, row_TK, w_TK), rtol, atol))
    rec.check(f"{label}: unpermute", *compare_close(triton_ops.unpermute_rows(x_NH, row_TK),
                                                     reference.unpermute_rows(dense_NH, row_TK), rtol, atol))
    grad_TH = payload(ctx, (row_TK.shape[0], H), x_TH.dtype, seed + 3)
    rtol_g, atol_g = (1e-10, 1e-10 * max(H, 1)) if x_TH.dtype == torch.float64 else (1e-4, 1e-6 * max(H, 1))
    rec.check(f"{label}: weight grad", *compare_close(triton_ops.unpermute_weight_grad(grad_TH, x_NH, row_TK),
                                                       reference.unpermute_weight_grad(grad_TH, dense_NH, row_TK),
                                                       rtol_g, atol_g))


@section("kernels", needs_s=30)
def sec_kernels(ctx: Ctx, rec: Record) -> None:
    """Triton kernels vs the torch reference over dtypes x H, then the edge cases at one wide H."""
    # The interpreter runs every program in Python (~0.1 s per launch at T = 16, K = 2): the dry run keeps H small
    # and adds one H of two bf16 column blocks (2048 columns each) for the masked tail.
    T, K, E = (2048, 8, 64) if ctx.cuda else (8, 2, 8)
    Hs = (1, 7, 5120, 7168) if ctx.cuda else (1, 7)
    token_N, row_TK = routing(ctx, T, K, E, drop=0.05, seed=1)
    seed = 10
    for name, dtype in KERNEL_DTYPES:
        for H in Hs:
            with rec.step(f"{name} H={H}"):
                kernel_ops(ctx, rec, f"{name} H={H}", payload(ctx, (T, H), dtype, seed), token_N, row_TK, seed)
            seed += 10
    if not ctx.cuda:
        with rec.step("bf16 H=2100"):
            kernel_ops(ctx, rec, "bf16 H=2100", payload(ctx, (T, 2100), torch.bfloat16, seed), token_N, row_TK, seed)
    # Edge cases (CUDA: H = 7168, 4 column blocks of bf16, 7 of fp32)
    Hm = 7168 if ctx.cuda else 40
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        with rec.step(f"{name} dropped + empty experts"):
            used = E // 4
            tok_N, r_TK = routing(ctx, T, K, E, drop=0.2, used_experts=used, seed=seed)
            kernel_ops(ctx, rec, f"{name} H={Hm} 20% dropped, {E - used} of {E} experts empty",
                       payload(ctx, (T, Hm), dtype, seed), tok_N, r_TK, seed)
        N = token_N.numel()
        with rec.step(f"{name} strided"):
            big = payload(ctx, (T, Hm + 24), dtype, seed + 1)
            x_rows = big[:, 8:8 + Hm]  # row stride H + 24, dense columns: the kernel reads it in place
            out_rows = torch.empty(N, Hm + 8, dtype=dtype, device=ctx.device)[:, :Hm]
            out_cols = torch.empty(T, 2 * Hm, dtype=dtype, device=ctx.device)[:, ::2]  # staged through a copy
            kernel_ops(ctx, rec, f"{name} H={Hm} row-strided x and out", x_rows, token_N, row_TK, seed + 2,
                       out_NH=out_rows, out_TH=out_cols)
            x_cols = payload(ctx, (T, 2 * Hm), dtype, seed + 3)[:, ::2]  # column stride 2: copied to dense
            kernel_ops(ctx, rec, f"{name} H={Hm} column-strided x", x_cols, token_N, row_TK, seed + 4)
        with rec.step(f"{name} NaN/Inf"):
            x = payload(ctx, (T, Hm), dtype, seed + 5)
            x[0, :3] = float("nan")
            x[1, 1] = float("inf")
            x[2, -1] = float("-inf")
            kernel_ops(ctx, rec, f"{name} H={Hm} NaN/Inf rows", x, token_N, row_TK, seed + 6)
        with rec.step(f"{name} N = 0, T = 0"):
            none_N = torch.empty(0, dtype=torch.int64, device=ctx.device)
            kernel_ops(ctx, rec, f"{name} every slot dropped", payload(ctx, (T, Hm), dtype, seed + 7), none_N,
                       torch.full((T, K), -1, dtype=torch.int64, device=ctx.device), seed + 7)
            kernel_ops(ctx, rec, f"{name} T=0", payload(ctx, (0, Hm), dtype, seed + 8), none_N,
                       torch.empty(0, K, dtype=torch.int64, device=ctx.device), seed + 8)
        seed += 20


@section("kernels_int64", needs_s=20)
def sec_kernels_int64(ctx: Ctx, rec: Record) -> None:
    """Row offsets beyond 2^31 elements: permute with N*H > 2^31, unpermute and weight grad with T*H > 2^31."""
    if not ctx.cuda:
        raise NotCovered("needs tensors of more than 2^31 elements (4 GiB each in bf16): CUDA only")
    from moe_comm.kernels import reference, triton_ops

    if torch.cuda.get_device_properties(0).total_memory < 60 * 2 ** 30:
        raise NotCovered("needs ~40 GiB of GPU memory")
    T, K, H = 8192, 4, 65600  # N*H = 2,149,580,800 > 2^31
    dev = ctx.device
    token_N = torch.arange(T * K, device=dev).flip(0) // K
    x_TH = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    x_NH = triton_ops.permute_rows(x_TH, token_N)
    rec.check(f"permute N*H = {T * K * H} > 2^31", torch.equal(bits(x_NH[-1]), bits(x_TH[0]))
              and torch.equal(bits(x_NH[0]), bits(x_TH[-1])), "first and last rows")
    rec.check("permute N*H > 2^31 vs reference", *compare_bits(x_NH, reference.permute_rows(x_TH, token_N)))
    ms = bench_ms(ctx, lambda: triton_ops.permute_rows(x_TH, token_N, out=x_NH))
    rec.data["permute_wide_gbps"] = (2 * x_NH.numel() * 2 + 8 * T * K) / (ms * 1e-3) / 1e9
    # unpermute of the same rows with K = 1: T2 = 32768 tokens, T2*H > 2^31, reversed rows, random weights
    T2 = T * K
    row_TK = torch.arange(T2, device=dev).flip(0).reshape(T2, 1)
    w_TK = torch.rand(T2, 1, device=dev)
    y_TH = triton_ops.unpermute_rows(x_NH, row_TK, w_TK)
    rec.check(f"unpermute*w T*H = {T2 * H} > 2^31",
              *compare_close(y_TH, reference.unpermute_rows(x_NH, row_TK, w_TK), 2 ** -7, 1e-5))
    rec.check("weight grad T*H > 2^31", *compare_close(triton_ops.unpermute_weight_grad(y_TH, x_NH, row_TK),
                                                        reference.unpermute_weight_grad(y_TH, x_NH, row_TK),
                                                        1e-4, 1e-6 * H))


# ------------------------------------------------------------------------------- bandwidth
def bench_ms(ctx: Ctx, fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn``: do_bench on CUDA (CUDA events, L2 flushed); on the dry run the wall
    time of one call after a warm-up one (interpreted launches: the number only shows the path runs)."""
    if ctx.cuda:
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=10, rep=50, quantiles=[0.5, 0.2, 0.8])[0])
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


class CopyBandwidth:
    """GB/s of ``dst.copy_(src)`` moving ``nbytes`` in all (half read, half written), measured once per size."""

    def __init__(self, ctx: Ctx):
        self.ctx, self.cache = ctx, {}

    def __call__(self, nbytes: int) -> float:
        half = max(nbytes // 2, 1)
        if half not in self.cache:
            src = torch.ones(half, dtype=torch.uint8, device=self.ctx.device)
            dst = torch.empty_like(src)
            self.cache[half] = 2 * half / (bench_ms(self.ctx, lambda: dst.copy_(src)) * 1e-3) / 1e9
        return self.cache[half]


def bandwidth_case(ctx: Ctx, rec: Record, copy_gbps: CopyBandwidth, shape, seed: int, sweep: bool):
    """(rows, sweep rows) of one shape: permute and weighted unpermute into reused buffers; with ``sweep``,
    every column block size, checked bitwise against the default one."""
    from moe_comm.kernels import triton_ops

    T, H, K, E, dtype = shape
    name = f"T={T} H={H} K={K} E={E} {str(dtype)[6:]}"
    token_N, row_TK = routing(ctx, T, K, E, seed=seed)
    N = token_N.numel()
    x_TH = payload(ctx, (T, H), dtype, seed + 1)
    w_TK = torch.rand(T, K, generator=ctx.gen(seed + 2), device=ctx.device)
    x_NH = triton_ops.permute_rows(x_TH, token_N)
    out_NH, out_TH = torch.empty_like(x_NH), torch.empty_like(x_TH)
    es = x_TH.element_size()
    nbytes = {"permute": 2 * N * H * es + 8 * N, "unpermute*w": N * H * es + T * H * es + 12 * T * K}
    launch = {"permute": lambda: triton_ops.permute_rows(x_TH, token_N, out=out_NH),
              "unpermute*w": lambda: triton_ops.unpermute_rows(x_NH, row_TK, w_TK, out=out_TH)}
    rows = []
    for op, fn in launch.items():
        ms = bench_ms(ctx, fn)
        gbps, cg = nbytes[op] / (ms * 1e-3) / 1e9, copy_gbps(nbytes[op])
        rows.append({"case": name, "op": op, "ms": ms, "bytes": nbytes[op], "gbps": gbps, "copy_gbps": cg,
                     "of_copy": gbps / cg})
        rec.check(f"{name} {op}: timed", 0 < gbps < float("inf"), f"{ms:.4f} ms")
        if ctx.cuda:
            rec.check(f"{name} {op}: >= {ctx.args.min_of_copy:g} of copy", gbps / cg >= ctx.args.min_of_copy,
                      f"{gbps:.0f} GB/s, copy {cg:.0f} GB/s ({gbps / cg:.2f})")
    sweep_rows = []
    if not sweep:
        return rows, sweep_rows
    p_ref, u_ref = triton_ops.permute_rows(x_TH, token_N), triton_ops.unpermute_rows(x_NH, row_TK, w_TK)
    seen = set()
    for block_bytes in SWEEP_BLOCK_BYTES:
        config = triton_ops._block_config(H, es, block_bytes)
        if config in seen:  # H below the block: the same launch as a smaller block_bytes
            continue
        seen.add(config)
        blocked = {"permute": lambda b=block_bytes: triton_ops._launch_permute(x_TH, token_N, None, out_NH, b),
                   "unpermute*w": lambda b=block_bytes: triton_ops._launch_unpermute(x_NH, row_TK, w_TK, out_TH, b)}
        for fn in blocked.values():
            fn()
        rec.check(f"{name} block {block_bytes} B: permute bitwise", *compare_bits(out_NH, p_ref))
        rec.check(f"{name} block {block_bytes} B: unpermute bitwise", *compare_bits(out_TH, u_ref))
        row = {"case": name, "block_bytes": block_bytes, "BLOCK_H": config[0], "num_warps": config[1]}
        for op, fn in blocked.items():
            gbps = nbytes[op] / (bench_ms(ctx, fn) * 1e-3) / 1e9
            row[f"{op}_gbps"], row[f"{op}_of_copy"] = gbps, gbps / copy_gbps(nbytes[op])
        sweep_rows.append(row)
    return rows, sweep_rows


@section("bandwidth", needs_s=25)
def sec_bandwidth(ctx: Ctx, rec: Record) -> None:
    """GB/s of permute and weighted unpermute into reused buffers, next to dst.copy_(src) of the same bytes.
    Bytes: permute reads and writes N*H elements (+ 8 B per row index); unpermute reads N*H and writes T*H
    elements (+ 12 B per slot for index and weight). The column-block sweep runs on the first two shapes."""
    from moe_comm.kernels import triton_ops

    shapes = [(16384, 7168, 8, 256, torch.bfloat16), (16384, 7168, 8, 256, torch.float32),
              (4096, 2048, 8, 256, torch.bfloat16), (8192, 5120, 8, 128, torch.bfloat16)] if ctx.cuda else \
        [(8, 40, 2, 4, torch.bfloat16), (8, 40, 2, 4, torch.float32)]
    copy_gbps, rows, sweep = CopyBandwidth(ctx), [], []
    for i, shape in enumerate(shapes):
        r, s = bandwidth_case(ctx, rec, copy_gbps, shape, seed=100 + 10 * i, sweep=i < 2)
        rows += r
        sweep += s
    rec.data.update(bandwidth=rows, sweep=sweep, block_bytes=triton_ops._BLOCK_BYTES)
    for r in rows:
        print(f"    {r['case']:<34} {r['op']:<12} {r['gbps']:8.1f} GB/s  copy {r['copy_gbps']:8.1f}  "
              f"{r['of_copy']:.2f}")
    best = {}
    for s in sweep:
        score = s["permute_gbps"] + s["unpermute*w_gbps"]
        if s["case"] not in best or score > best[s["case"]][0]:
            best[s["case"]] = (score, s["block_bytes"])
    rec.data["best_block_bytes"] = {k: v[1] for k, v in best.items()}
    print(f"    column-block sweep, fastest block_bytes (now {triton_ops._BLOCK_BYTES}): "
          + ", ".join(f"{k}: {v[1]}" for k, v in best.items()))
    if not ctx.cuda:
        rec.not_covered("bandwidth floor", "interpreter timings on CPU say nothing about the GPU")


# ------------------------------------------------------------------------------- experts
@section("experts", needs_s=5)
def sec_experts(ctx: Ctx, rec: Record) -> None:
    """The SwiGLU experts' paths vs float64 on the same rounded values, forward and the gradients of x, w1, w3,
    w2, with experts that receive no rows: torch._grouped_mm (where ``_use_grouped_mm`` holds: CUDA bf16
    sm90+, CPU), the per-expert loop, the grouped path against the loop, and GroupedExperts.forward plain
    and with NaN padding rows (the sync-free dispatch's input)."""
    from moe_comm.modules.experts import GroupedExperts, _blocks, _GroupedSwiGLU, _LoopSwiGLU, _use_grouped_mm, swiglu

    if ctx.cuda:
        e, H, F, counts = 8, 2048, 1408, [2048, 0, 1500, 1, 3000, 0, 643, 1000]
        dtypes = (torch.bfloat16, torch.float32)
    else:
        e, H, F, counts = 4, 16, 24, [7, 0, 1, 12]
        dtypes = (torch.float32, torch.bfloat16)
    R, pad = sum(counts), 5
    g = torch.Generator().manual_seed(7)
    x64 = torch.randn(R, H, generator=g, dtype=torch.float64)
    w64 = [torch.randn(e, F, H, generator=g, dtype=torch.float64) * H ** -0.5,
           torch.randn(e, F, H, generator=g, dtype=torch.float64) * H ** -0.5,
           torch.randn(e, H, F, generator=g, dtype=torch.float64) * F ** -0.5]
    gy64 = torch.randn(R, H, generator=g, dtype=torch.float64).to(ctx.device)
    names = ("x", "w1", "w3", "w2")
    tpe_e = torch.tensor(counts, dtype=torch.int64, device=ctx.device)

    for dtype in dtypes:
        dn, tol = str(dtype)[6:], REL_TOL[dtype]
        leaves = [t.to(dtype).double().to(ctx.device).requires_grad_(True) for t in [x64] + w64]
        y_ref, start = torch.zeros(R, H, dtype=torch.float64, device=ctx.device), 0
        for i, n in enumerate(counts):
            y_ref[start:start + n] = swiglu(leaves[0][start:start + n], leaves[1][i], leaves[2][i], leaves[3][i])
            start += n
        (y_ref * gy64).sum().backward()
        ref = {"y": y_ref.detach(), **{k: t.grad for k, t in zip(names, leaves)}}

        def run(fn, label, pad_rows=0, ref=ref, dtype=dtype, dn=dn, tol=tol):
            """fn(x, w1, w3, w2) on R rows (+ pad_rows NaN rows): forward and gradients vs ``ref``. fn returns
            y, or (y, the four tensors whose .grad are the gradients of x, w1, w3, w2)."""
            x = x64.to(dtype).to(ctx.device)
            if pad_rows:
                x = torch.cat([x, torch.full((pad_rows, H), float("nan"), dtype=dtype, device=ctx.device)])
            ins = [x.requires_grad_(True)] + [w.to(dtype).to(ctx.device).requires_grad_(True) for w in w64]
            y, leaves = (lambda r: r if isinstance(r, tuple) else (r, ins))(fn(*ins))
            gy = torch.cat([gy64, torch.ones(pad_rows, H, dtype=torch.float64, device=ctx.device)]) if pad_rows \
                else gy64
            y.backward(gy.to(dtype))
            got = {"y": y.detach()[:R], **{k: t.grad for k, t in zip(names, leaves)}}
            if pad_rows:
                rec.check(f"{label} {dn}: padding rows give 0 output and 0 input gradient",
                          bool((y.detach()[R:] == 0).all()) and bool((got["x"][R:] == 0).all()))
                got["x"] = got["x"][:R]
            for k in ("y",) + names:
                what = "output" if k == "y" else f"grad {k}"
                check_rel(rec, f"{label} {dn}: {what} vs float64", got[k], ref[k], tol)
            return got

        with rec.step(f"loop {dn}"):
            loop = run(lambda x, w1, w3, w2: _LoopSwiGLU.apply(x, w1, w3, w2, _blocks(counts)), "loop")
        probe = [t.to(dtype).to(ctx.device) for t in [x64] + w64]
        if _use_grouped_mm(*probe):
            with rec.step(f"grouped_mm {dn}"):
                got = run(lambda x, w1, w3, w2: _GroupedSwiGLU.apply(x, w1, w3, w2, tpe_e, False), "grouped_mm")
                for k in ("y",) + names:
                    check_rel(rec, f"grouped_mm vs loop {dn}: {k}", got[k], loop[k], tol)
        else:
            rec.not_covered(f"grouped_mm {dn}", "_use_grouped_mm is False here (CUDA: bf16 on sm90/sm100)")

        def module(x, w1, w3, w2, padded=False, dtype=dtype):
            mod = GroupedExperts(e, H, F, device=ctx.device, dtype=dtype)
            with torch.no_grad():
                for p, w in zip((mod.w1, mod.w3, mod.w2), (w1, w3, w2)):
                    p.copy_(w)
            return mod(x, tpe_e, padded=padded), [x, mod.w1, mod.w3, mod.w2]

        with rec.step(f"GroupedExperts.forward {dn}"):
            run(module, "GroupedExperts.forward")
        with rec.step(f"GroupedExperts.forward padded {dn}"):
            run(lambda *a: module(*a, padded=True), "GroupedExperts.forward padded (NaN rows)", pad_rows=pad)


# ------------------------------------------------------------------------------- regroup
def rank_major_case(ctx: Ctx, W: int, e: int, R: int, seed: int):
    """Rows as one chunk's all-to-all delivers them: W source blocks, each in local-expert order. Returns
    (counts [W][e] host ints, index_R: expert-major row r <- rank-major row index_R[r], inverse_R, segments
    [(expert, first row, rows)] of the rank-major rows). Some (source, expert) blocks are empty."""
    g = torch.Generator().manual_seed(seed)
    share = torch.rand(W * e, generator=g) * (torch.rand(W * e, generator=g) > 0.1)
    counts_We = torch.distributions.Multinomial(R, share / share.sum()).sample().to(torch.int64).view(W, e)
    start_We = (counts_We.reshape(-1).cumsum(0) - counts_We.reshape(-1)).view(W, e)
    index = [torch.arange(int(start_We[s, j]), int(start_We[s, j] + counts_We[s, j])) for j in range(e)
             for s in range(W)]
    index_R = torch.cat(index).to(ctx.device)
    inverse_R = torch.empty_like(index_R)
    inverse_R[index_R] = torch.arange(R, device=ctx.device)
    segments = [(j, int(start_We[s, j]), int(counts_We[s, j])) for s in range(W) for j in range(e)
                if counts_We[s, j] > 0]
    return counts_We.tolist(), index_R, inverse_R, segments


@section("regroup", needs_s=30)
def sec_regroup(ctx: Ctx, rec: Record) -> None:
    """Issue #26, item 11: the ways the experts can read one chunk's rows as the all-to-all delivers them (W
    source blocks, each in local-expert order), timed forward + backward with every weight gradient:
      regroup     today's CUDA path: a permute to expert-major rows, one grouped GEMM call (torch._grouped_mm),
                  a permute back; in backward the same two permutes (4 passes over R x H per step);
      per_source  one grouped GEMM call per source block on the rows as they arrived (no permute; the W weight
                  gradient parts are summed by autograd);
      segments    the per-(source, expert) block loop GroupedExperts runs with ``segments=`` (CPU's choice).
    The three must agree (checked); the times are data for choosing the CUDA path (no verdict: nothing here
    has run on a GPU before)."""
    from moe_comm.kernels import select_backend
    from moe_comm.modules.experts import _GroupedSwiGLU, _LoopSwiGLU, _grouped_mm_works

    if ctx.cuda:  # (W, e, H, F, R): a node, and DeepSeek-V3-like layers at EP 32 and 64
        cases, dtype = [(8, 8, 4096, 1536, 16384), (32, 8, 7168, 2048, 16384), (64, 4, 7168, 2048, 8192)], \
            torch.bfloat16
    else:
        cases, dtype = [(2, 2, 16, 24, 40), (4, 3, 16, 24, 60)], torch.bfloat16
    kernels = select_backend(ctx.backend, ctx.device)
    rows = []
    for i, (W, e, H, F, R) in enumerate(cases):
        name = f"W={W} e={e} H={H} F={F} R={R}"
        counts, index_R, inverse_R, segments = rank_major_case(ctx, W, e, R, seed=300 + i)
        gen = ctx.gen(310 + i)
        x = torch.randn(R, H, generator=gen, device=ctx.device).to(dtype)
        gy = torch.randn(R, H, generator=gen, device=ctx.device).to(dtype)
        ws = [(torch.randn(e, F, H, generator=gen, device=ctx.device) * H ** -0.5).to(dtype),
              (torch.randn(e, F, H, generator=gen, device=ctx.device) * H ** -0.5).to(dtype),
              (torch.randn(e, H, F, generator=gen, device=ctx.device) * F ** -0.5).to(dtype)]
        for w in ws:
            w.requires_grad_(True)
        per_expert_e = torch.tensor([sum(c[j] for c in counts) for j in range(e)], device=ctx.device)
        per_source = [torch.tensor(c, device=ctx.device) for c in counts]
        starts = [sum(sum(c) for c in counts[:s]) for s in range(W)]
        grouped = _grouped_mm_works(x, *ws)

        def regroup():
            xe = kernels.permute_rows(x, index_R).requires_grad_(True)
            ye = _GroupedSwiGLU.apply(xe, *ws, per_expert_e, False)
            y = kernels.permute_rows(ye.detach(), inverse_R)
            ye.backward(kernels.permute_rows(gy, index_R))
            return y, kernels.permute_rows(xe.grad, inverse_R)

        def per_source_calls():
            xr = x.detach().requires_grad_(True)
            y = torch.cat([_GroupedSwiGLU.apply(xr[a:a + sum(c)], *ws, n_e, False)
                           for a, c, n_e in zip(starts, counts, per_source)])
            y.backward(gy)
            return y.detach(), xr.grad

        def segment_loop():
            xr = x.detach().requires_grad_(True)
            y = _LoopSwiGLU.apply(xr, *ws, segments)
            y.backward(gy)
            return y.detach(), xr.grad

        variants = {"regroup": regroup, "per_source": per_source_calls, "segments": segment_loop}
        if not grouped:
            rec.not_covered(f"{name}: regroup, per_source", "torch._grouped_mm does not run these shapes here")
            variants = {"segments": segment_loop}
        got = {}
        for label, fn in variants.items():
            with rec.step(f"{name}: {label}"):
                for w in ws:
                    w.grad = None
                y, gx = fn()
                got[label] = (y, gx, [w.grad.clone() for w in ws])
        for label in got:
            if label == "segments":
                continue
            for what, a, b in zip(("output", "grad x", "grad w1", "grad w3", "grad w2"),
                                  [got[label][0], got[label][1]] + got[label][2],
                                  [got["segments"][0], got["segments"][1]] + got["segments"][2]):
                check_rel(rec, f"{name}: {label} vs segments, {what}", a.float(), b.float(), REL_TOL[dtype])

        def timed(fn):
            def step():
                for w in ws:
                    w.grad = None
                fn()
            return step
        row = {"case": name, "W": W, "e": e, "H": H, "F": F, "R": R, "dtype": str(dtype)[6:]}
        for label in got:
            row[f"{label}_ms"] = bench_ms(ctx, timed(variants[label]))
        passes = [lambda: kernels.permute_rows(x, index_R)] * 4
        row["four_permutes_ms"] = bench_ms(ctx, lambda: [f() for f in passes])
        rows.append(row)
        print(f"    {name:<36} " + "  ".join(f"{k[:-3]} {v:8.3f} ms" for k, v in row.items() if k.endswith("_ms")),
              flush=True)
    rec.data["regroup"] = rows
    if not ctx.cuda:
        rec.not_covered("regroup timings", "CPU timings say nothing about the GPU; the dry run checks the paths")


# ------------------------------------------------------------------------------- layer
LAYER_CONFIGS = [  # (label, parameter dtype, MoEConfig options, autocast dtype)
    ("bf16 C=1", torch.bfloat16, dict(num_chunks=1), None),
    ("bf16 C=4", torch.bfloat16, dict(num_chunks=4), None),
    ("fp32 C=1", torch.float32, dict(num_chunks=1), None),
    ("fp32 C=4", torch.float32, dict(num_chunks=4), None),
    ("fp32 shared experts C=2", torch.float32, dict(num_chunks=2, num_shared_experts=1), None),
    ("fp32 aux+z+capacity C=4", torch.float32,
     dict(num_chunks=4, aux_loss_coeff=1e-2, z_loss_coeff=1e-3, capacity_factor=1.0), None),
    ("autocast bf16 over fp32 C=4", torch.float32, dict(num_chunks=4), torch.bfloat16),
]


@section("layer", needs_s=15)
def sec_layer(ctx: Ctx, rec: Record) -> None:
    """MoELayer (W = 1) vs the dense float64 reference, then the same forward and backward again bit for bit."""
    import moe_comm

    T, H, F, E, K = (2048, 1024, 768, 8, 2) if ctx.cuda else (24, 16, 24, 4, 2)
    for i, (label, dtype, opts, amp) in enumerate(LAYER_CONFIGS):
        with rec.step(label):
            cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, **opts)
            d = layer_data(cfg, T, seed=500 + i)
            layer = moe_comm.MoELayer(cfg, seed=1, device=ctx.device, dtype=dtype, backend=ctx.backend,
                                      allow_single_process=True)
            load_layer(layer, d)
            x_TH, gy_TH = d["x"].to(dtype).to(ctx.device), d["gy"].to(ctx.device)
            got = run_layer(layer, x_TH, gy_TH, amp)
            ref = dense_reference(d, cfg, [T], dtype, dtype, ctx.device)
            compare_layer(rec, label, got, ref, REL_TOL[amp or dtype])
            again = run_layer(layer, x_TH, gy_TH, amp)
            differ = [k for k in ("y", "x", "router", "w1", "w3", "w2", "shared") if k in got
                      and not compare_bits(again[k], got[k])[0]]
            rec.check(f"{label}: rerun bit-identical", not differ, f"differ: {differ}" if differ else "bitwise")


# ------------------------------------------------------------------------------- host syncs
def sync_layer(ctx: Ctx, num_chunks: int = 2, **opts):
    """A layer and its input for sync counting (bf16 on CUDA, fp32 on CPU), end_check="deferred" (the CUDA
    default: the forward's end-of-phase exchange is read with the next one)."""
    import moe_comm

    T, H, F, E, K = (1024, 1024, 512, 8, 2) if ctx.cuda else (20, 16, 24, 4, 2)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, num_chunks=num_chunks, **opts)
    layer = moe_comm.MoELayer(cfg, seed=3, device=ctx.device, dtype=dtype, backend=ctx.backend,
                              end_check="deferred", allow_single_process=True)
    x = torch.randn(T, H, generator=ctx.gen(4), device=ctx.device).to(dtype).requires_grad_(True)
    return layer, x


def fwd_bwd_syncs(layer, x, how: str, pageable: Optional[List[str]] = None) -> Tuple[List[str], List[str]]:
    """Host syncs of one forward and of its backward (the loss between them is counted in neither); pageable
    host -> device copies into ``pageable`` when given (see count_syncs). ``layer``: a MoELayer or a
    Sequential of them."""
    y, fwd = count_syncs(lambda: layer(x), how, pageable)
    loss = y.float().square().mean() + sum(m.aux_loss for m in layer.modules() if hasattr(m, "aux_loss"))
    _, bwd = count_syncs(loss.backward, how, pageable)
    return fwd, bwd


# Expected host syncs of a layer at W = 1: the forward reads the counts exchange (one host read). The
# backward reads nothing: its check-in exchange is skipped at W = 1 (Dispatcher._exchange_status returns
# at once); two_ranks counts the W = 2 backward (one read: the check-in, with the deferred forward check).
W1_FORWARD_SYNCS, W1_BACKWARD_SYNCS = 1, 0


@section("host_syncs", needs_s=5)
def sec_host_syncs(ctx: Ctx, rec: Record) -> None:
    """Host syncs of a W = 1 layer's forward and backward after a warm-up step, plain and with an aux loss and
    capacity (the README's configuration: the router's counts must not be read on the host either)."""
    ways = []
    if ctx.cuda:
        ways.append(("cuda", "set_sync_debug_mode"))
    else:
        rec.not_covered("torch.cuda.set_sync_debug_mode", "no CUDA on the dry run")
    if host_syncs_class() is not None:
        ways.append(("hostsyncs", "HostSyncs"))
    else:
        rec.not_covered("HostSyncs", "moe_comm.testing.syncs missing")
    for label, opts in (("plain", {}), ("aux loss + capacity", dict(aux_loss_coeff=1e-2, capacity_factor=1.25))):
        layer, x = sync_layer(ctx, **opts)
        layer(x).float().square().mean().backward()  # warm-up: first-call work is not the steady state
        for how, counter in ways:
            pageable: List[str] = []
            fwd, bwd = fwd_bwd_syncs(layer, x, how, pageable)
            rec.data[f"{label}: {counter}"] = {"forward": fwd, "backward": bwd}
            if how == "hostsyncs" and ctx.cuda:
                check_pageable(rec, f"{label}, {counter}", pageable, ctx.device)
            rec.check(f"{label}, {counter}: forward {W1_FORWARD_SYNCS} sync", len(fwd) == W1_FORWARD_SYNCS,
                      f"{len(fwd)}: {fwd}")
            rec.check(f"{label}, {counter}: backward {W1_BACKWARD_SYNCS} syncs (W = 1)",
                      len(bwd) == W1_BACKWARD_SYNCS, f"{len(bwd)}: {bwd}")


@section("sync_free", needs_s=5)
def sec_sync_free(ctx: Ctx, rec: Record) -> None:
    """MoEConfig(max_tokens_per_rank=M): no host sync in forward or backward; the dropless layer's results."""
    import moe_comm

    if "max_tokens_per_rank" not in {f.name for f in dataclasses.fields(moe_comm.MoEConfig)}:
        raise NotCovered("MoEConfig has no field max_tokens_per_rank (the sync-free mode is not in this checkout)")
    dropless, x = sync_layer(ctx, num_chunks=1)  # the sync-free mode runs C = 1
    T = x.shape[0]
    free = moe_comm.MoELayer(dropless.cfg.replace(max_tokens_per_rank=T), seed=3, device=ctx.device,
                             dtype=x.dtype, backend=ctx.backend, end_check="deferred", allow_single_process=True)
    free.load_state_dict(dropless.state_dict())
    gy = torch.randn(x.shape, generator=ctx.gen(5), device=ctx.device, dtype=torch.float64)
    want, got = run_layer(dropless, x, gy), run_layer(free, x, gy)
    tol = 1e-5 if x.dtype == torch.float32 else REL_TOL[torch.bfloat16]
    for k in ("y", "x", "router", "w1", "w3", "w2"):
        err = rel_err(got[k], want[k])
        rec.check(f"{'output' if k == 'y' else 'grad ' + k} equals the dropless layer", err <= tol,
                  f"{'bitwise' if compare_bits(got[k], want[k])[0] else f'rel err {err:.2e}'} (tol {tol:g})")
    ways = ([("cuda", "set_sync_debug_mode")] if ctx.cuda else []) + \
        ([("hostsyncs", "HostSyncs")] if host_syncs_class() is not None else [])
    if not ctx.cuda:
        rec.not_covered("set_sync_debug_mode", "no CUDA on the dry run")
    if host_syncs_class() is None:
        rec.not_covered("HostSyncs", "moe_comm.testing.syncs missing")
    for how, label in ways:
        pageable: List[str] = []
        fwd, bwd = fwd_bwd_syncs(free, x, how, pageable)
        rec.data[f"{how}_forward"], rec.data[f"{how}_backward"] = fwd, bwd
        if how == "hostsyncs" and ctx.cuda:
            check_pageable(rec, label, pageable, ctx.device)
        rec.check(f"{label}: forward 0 syncs", not fwd, f"{len(fwd)}: {fwd}")
        rec.check(f"{label}: backward 0 syncs", not bwd, f"{len(bwd)}: {bwd}")
    if not ctx.cuda:
        rec.not_covered("CUDA graph capture of a sync-free step", "needs CUDA (on CPU: "
                        "tests/dispatch/test_sync_free_capture.py checks a step changes nothing on the host)")
        return
    check_graph_capture(ctx, rec, dropless, free, x, gy)


GRAPH_REPLAYS = 3


def check_graph_capture(ctx: Ctx, rec: Record, dropless, free, x: torch.Tensor, gy: torch.Tensor) -> None:
    """A sync-free layer step (forward and backward) captured in one CUDA graph, replayed on new tokens: each
    replay equals an eager step of the dropless layer on them, and the call number and the monitor's step
    advance on the device, one per replay."""
    static_x = x.detach().clone().requires_grad_(True)

    def step():
        y = free(static_x)
        ((y.double() * gy).sum() + free.aux_loss.double()).backward()
        return y

    side = torch.cuda.Stream(ctx.device)
    side.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(side):  # warm-up off the capture (kernels compiled, buffers cached)
        for _ in range(2):
            free.zero_grad(set_to_none=True)
            static_x.grad = None
            step()
    torch.cuda.current_stream(ctx.device).wait_stream(side)
    free.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            static_y = step()
    except Exception as err:  # noqa: BLE001 - the verdict names it
        rec.check("a sync-free step is captured in a CUDA graph", False, f"{type(err).__name__}: {err}"[:300])
        return
    rec.check("a sync-free step is captured in a CUDA graph", True)
    channel, monitor = free.dispatcher.channel, free.monitor
    call0 = int(channel.call_dev.item()) if channel.call_dev is not None else None
    steps0 = monitor.steps if monitor is not None else None
    worst = 0.0
    tol = 1e-5 if x.dtype == torch.float32 else REL_TOL[torch.bfloat16]
    for i in range(GRAPH_REPLAYS):
        x_new = torch.randn(x.shape, generator=ctx.gen(60 + i), device=ctx.device).to(x.dtype)
        static_x.data.copy_(x_new)
        graph.replay()
        want = run_layer(dropless, x_new, gy)
        got = {"y": static_y, "x": static_x.grad, "w1": free.experts.w1.grad, "w2": free.experts.w2.grad}
        worst = max([worst] + [rel_err(got[k], want[k]) for k in got])
    rec.check(f"{GRAPH_REPLAYS} replays on new tokens equal eager dropless steps", worst <= tol,
              f"worst rel err {worst:.2e} (tol {tol:g})")
    if call0 is not None:
        advanced = int(channel.call_dev.item()) - call0
        rec.check("the call number advances on the device, one per replay", advanced == GRAPH_REPLAYS,
                  f"+{advanced} after {GRAPH_REPLAYS} replays")
    if steps0 is not None:
        rec.check("the load monitor counts every replay", monitor.steps - steps0 == GRAPH_REPLAYS,
                  f"+{monitor.steps - steps0}")


# ------------------------------------------------------------------------------- child processes
# nccl_world1 and two_ranks run in processes of their own (a crash or a hung collective cannot take the
# script down), started in their turn. Started with the first section instead, to overlap their imports with
# the in-process sections, the dry run took longer on the shared 2-core machine (59.5 s vs 44.7 s, load ~4).
CHILD_TIMEOUT_S = 150.0


def child_deadline(ctx: Ctx, job: Dict) -> float:
    """time.monotonic() past which a section's processes are killed: CHILD_TIMEOUT_S after their start, and
    never past the budget (at least 10 s from now)."""
    return min(job["t0"] + CHILD_TIMEOUT_S, time.monotonic() + max(10.0, ctx.left()))


def kill_job(job: Dict) -> None:
    if "proc" in job and job["proc"].poll() is None:
        job["proc"].kill()
        job["proc"].communicate()
    for p in getattr(job.get("procs"), "processes", []):
        if p.is_alive():
            p.kill()
            p.join(5)


def child_world1(out_path: str, dry: bool) -> int:
    """Runs in its own process (a crash or hang must not take the script down): a 1-rank NCCL group (gloo
    on the dry run) from a file:// store; results to ``out_path`` as JSON after every step."""
    import torch.distributed as dist

    import moe_comm

    rec = Record("nccl_world1")
    dev = torch.device("cpu") if dry else torch.device("cuda", 0)
    backend, kernels = ("gloo", "torch") if dry else ("nccl", "auto")
    rec.data.update(backend=backend, TORCH_NCCL_BLOCKING_WAIT=os.environ.get("TORCH_NCCL_BLOCKING_WAIT"))

    def save():
        write_json(out_path, {"checks": rec.checks, "data": rec.data})

    with tempfile.TemporaryDirectory() as tmp:
        if not dry:
            torch.cuda.set_device(dev)
        dist.init_process_group(backend, init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        try:
            with rec.step("async all_to_all_single"):
                # warm-up: NCCL creates its communicator at the first collective, blocking the host meanwhile
                dist.all_to_all_single(torch.empty(8, device=dev), torch.ones(8, device=dev))
                if not dry:
                    torch.cuda.synchronize()
                send = torch.arange(1 << 20, dtype=torch.float32, device=dev)
                recv = torch.empty_like(send)
                if not dry:
                    torch.cuda.synchronize()
                    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    ev0.record()
                    torch.cuda._sleep(SLEEP_CYCLES)  # the collective queues behind ~0.2 s of GPU work
                t0 = time.perf_counter()
                work = dist.all_to_all_single(recv, send, async_op=True)
                t1 = time.perf_counter()
                work.wait()
                t2 = time.perf_counter()
                after = recv * 1  # on the current stream, which wait() ordered after the collective
                rec.check("async all_to_all_single returns a Work", hasattr(work, "wait"), type(work).__name__)
                if dry:
                    rec.not_covered("wait() does not block the host", "gloo's wait() blocks by design; NCCL only")
                else:
                    ev1.record()
                    torch.cuda.synchronize()
                    gpu_ms, host_ms = ev0.elapsed_time(ev1), (t2 - t0) * 1e3
                    rec.data.update(issue_ms=(t1 - t0) * 1e3, wait_ms=(t2 - t1) * 1e3, gpu_ms=gpu_ms)
                    rec.check("wait() does not block the host", gpu_ms > 20 and host_ms < 0.5 * gpu_ms,
                              f"issue + wait {host_ms:.2f} ms on the host, {gpu_ms:.1f} ms on the GPU")
                rec.check("result on the waiting stream equals the input", torch.equal(after, send))
            save()
            with rec.step("Dispatcher on the group"):
                T, H, K, E = 32, 16, 2, 4
                g = torch.Generator().manual_seed(5)
                x = torch.randn(T, H, generator=g).to(dev)
                idx = torch.rand(T, E, generator=g).topk(K, 1).indices
                idx[::5, 1] = -1  # dropped slots
                idx, w = idx.to(dev), torch.rand(T, K, generator=g).to(dev)
                want = 2 * (w * (idx >= 0)).sum(1, keepdim=True) * x  # every expert doubles its rows
                d = moe_comm.Dispatcher(num_experts=E, ep_group=dist.group.WORLD, backend=kernels)
                out = d.dispatch(x, idx)
                rec.check("Dispatcher dispatch: tokens_per_expert sums to the routed slots",
                          int(out.tokens_per_expert.sum()) == int((idx >= 0).sum()))
                rec.check("Dispatcher dispatch + combine", *compare_close(d.combine(out.tokens * 2, w, out.handle),
                                                                         want, 1e-5, 1e-6))
                rec.check("Dispatcher pipelined call, C = 2",
                          *compare_close(d(x, idx, w, lambda rows, counts: rows * 2, num_chunks=2), want, 1e-5, 1e-6))
            save()
            with rec.step("MoELayer on the group"):
                cfg = moe_comm.MoEConfig(hidden_size=16, ffn_hidden_size=24, num_experts=4, top_k=2, num_chunks=2)
                data = layer_data(cfg, 40, seed=6)
                layer = moe_comm.MoELayer(cfg, seed=1, device=dev, dtype=torch.float32, backend=kernels)
                load_layer(layer, data)
                x_TH, gy = data["x"].float().to(dev), data["gy"].to(dev)
                run_layer(layer, x_TH, gy)  # warm-up
                if dry:
                    got = run_layer(layer, x_TH, gy)
                else:
                    got, syncs = count_syncs(lambda: run_layer(layer, x_TH, gy), "cuda")
                    rec.data["layer_fwd_bwd_cuda_syncs"] = syncs
                ref = dense_reference(data, cfg, [40], torch.float32, torch.float32, dev)
                compare_layer(rec, "MoELayer fp32 on the group", got, ref, REL_TOL[torch.float32])
            save()
            if dry:
                rec.not_covered("a CPU tensor in an NCCL collective raises", "gloo takes CPU tensors")
            else:  # last: a rejected call must not leave anything in flight before the other steps
                try:
                    dist.all_to_all_single(torch.zeros(4), torch.ones(4))
                    raised = None
                except Exception as exc:  # noqa: BLE001 - any rejection will do; its text is recorded
                    raised = exc
                rec.check("a CPU tensor in an NCCL collective raises", raised is not None,
                          f"{type(raised).__name__}: {str(raised)[:300]}" if raised else "accepted")
        finally:
            save()
            dist.destroy_process_group()
    return 0


def start_world1(ctx: Ctx) -> Dict:
    out = os.path.join(ctx.tmpdir, "world1.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "world1", "--child-out", out]
    cmd += ["--dry-run-cpu"] if ctx.dry else []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    return {"proc": proc, "out": out, "t0": time.monotonic()}


@section("fp8_dispatch", needs_s=15)
def sec_fp8_dispatch(ctx: Ctx, rec: Record) -> None:
    """FP8 rows (``ops.quantize_rows`` / ``dequantize_rows``): Triton vs the torch reference bit for bit (packed
    bytes and dequantized rows, fp32 and ue8m0 scales, NaN/Inf blocks); a W = 1 layer with
    dispatch_dtype=float8_e4m3fn within 2^-4 of the plain layer (relative, in norm), and no host sync beyond
    the plain layer's one read."""
    import moe_comm
    from moe_comm import ops

    if not hasattr(ops, "quantize_rows"):
        raise NotCovered("moe_comm.ops has no quantize_rows (FP8 dispatch is not in this checkout)")
    fp8 = torch.float8_e4m3fn
    T, Hs = (4096, (7168, 130)) if ctx.cuda else (6, (130,))
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for H in Hs:
            for ue8m0 in (False, True):
                label = f"{name} H={H} {'ue8m0' if ue8m0 else 'fp32'} scales"
                with rec.step(label):
                    x = payload(ctx, (T, H), dtype, 40 + H)
                    x[0, :3] = float("nan")
                    x[1, 5] = float("inf")
                    q_tri = ops.quantize_rows(x, ue8m0=ue8m0, backend="triton")
                    q_ref = ops.quantize_rows(x, ue8m0=ue8m0, backend="torch")
                    rec.check(f"{label}: packed bytes, triton = torch", *compare_bits(q_tri, q_ref))
                    y_tri = ops.dequantize_rows(q_ref, H, dtype, ue8m0=ue8m0, backend="triton")
                    y_ref = ops.dequantize_rows(q_ref, H, dtype, ue8m0=ue8m0, backend="torch")
                    rec.check(f"{label}: dequantized rows, triton = torch", *compare_bits(y_tri, y_ref))
                    bound = ops.fp8_error_bound(x[2:], ue8m0=ue8m0)
                    err = (y_ref[2:].double() - x[2:].double()).abs()
                    ok = bool((err <= bound + (2 ** -8 if dtype == torch.bfloat16 else 0) * x[2:].double().abs()).all())
                    rec.check(f"{label}: finite rows within the e4m3 bound", ok)
    layer, x = sync_layer(ctx, num_chunks=1)
    quant = moe_comm.MoELayer(layer.cfg.replace(dispatch_dtype=fp8), seed=3, device=ctx.device, dtype=x.dtype,
                              backend=ctx.backend, end_check="deferred", allow_single_process=True)
    quant.load_state_dict(layer.state_dict())
    gy = torch.randn(x.shape, generator=ctx.gen(6), device=ctx.device, dtype=torch.float64)
    want, got = run_layer(layer, x, gy), run_layer(quant, x, gy)
    for k in ("y", "x", "w1", "w2"):  # the same routing (the router sees x): only the experts' inputs differ
        err = float((got[k].double() - want[k].double()).norm() / want[k].double().norm().clamp_min(1e-30))
        rec.check(f"{'output' if k == 'y' else 'grad ' + k}: FP8 layer within 2^-4 of the plain layer (norm)",
                  err <= 2 ** -4, f"rel err {err:.2e}")
    if host_syncs_class() is None:
        rec.not_covered("HostSyncs", "moe_comm.testing.syncs missing")
    else:
        pageable: List[str] = []
        fwd, bwd = fwd_bwd_syncs(quant, x, "hostsyncs", pageable)
        rec.data["hostsyncs_forward"], rec.data["hostsyncs_backward"] = fwd, bwd
        if ctx.cuda:
            check_pageable(rec, "HostSyncs", pageable, ctx.device)
        rec.check("HostSyncs: forward 1 sync (the control exchange read)", len(fwd) == 1, f"{len(fwd)}: {fwd}")
        rec.check("HostSyncs: backward 0 syncs (W = 1)", not bwd, f"{len(bwd)}: {bwd}")


@section("nccl_world1", needs_s=20)
def sec_nccl_world1(ctx: Ctx, rec: Record) -> None:
    job = start_world1(ctx)
    proc, timeout = job["proc"], child_deadline(ctx, job) - time.monotonic()
    try:
        _, stderr = proc.communicate(timeout=max(timeout, 0.1))
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        rec.check("child finished", False, f"killed after {time.monotonic() - job['t0']:.0f} s (a hung collective?)")
    child = json.load(open(job["out"])) if os.path.exists(job["out"]) else {"checks": [], "data": {}}
    rec.checks.extend(child["checks"])
    rec.data.update(child["data"])
    for c in child["checks"]:
        if c["status"] == FAIL:
            print(f"    FAIL {rec.name}: {c['check']}: {c['detail']}", flush=True)
    if proc.returncode not in (0, -9):
        rec.check("child finished", False, f"exit {proc.returncode}: {stderr.strip()[-1500:]}")


# ------------------------------------------------------------------------------- two ranks
TWO_RANKS_TOKENS = [13, 7]  # tokens of rank 0 and rank 1


def two_ranks_case(seed: int):
    import moe_comm

    cfg = moe_comm.MoEConfig(hidden_size=24, ffn_hidden_size=40, num_experts=4, top_k=2, num_chunks=2)
    return cfg, layer_data(cfg, sum(TWO_RANKS_TOKENS), seed)


def two_ranks_worker(rank: int, init_file: str, out_dir: str, dry: bool, seed: int) -> None:
    """One of 2 spawned ranks (pickled by reference: module level). Writes rank<r>.pt, whatever happens."""
    try:
        result = two_ranks_rank(rank, init_file, dry, seed)
    except Exception:  # noqa: BLE001 - the parent reports it
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def two_ranks_rank(rank: int, init_file: str, dry: bool, seed: int) -> Dict:
    t0 = time.perf_counter()
    import torch.distributed as dist

    import moe_comm
    t_import = time.perf_counter() - t0

    dev = torch.device("cpu") if dry else torch.device("cuda", 0)
    if not dry:
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        # Uneven splits as moe_comm sends them: rank r sends [1 + r, 2 - r] elements to ranks 0 and 1.
        in_splits = [1 + rank, 2 - rank]
        out_splits = [[1 + s, 2 - s][rank] for s in range(2)]
        send = torch.arange(3, dtype=torch.float32, device=dev) + 10 * rank
        recv = torch.empty(sum(out_splits), dtype=torch.float32, device=dev)
        try:
            dist.all_to_all_single(recv, send, out_splits, in_splits)
        except Exception as exc:  # noqa: BLE001 - unsupported by this gloo build: reported, not faked
            return {"unsupported": f"gloo all_to_all_single on {dev.type} tensors: {type(exc).__name__}: {exc}"}
        want = torch.cat([torch.arange(3, dtype=torch.float32)[sum([1 + s, 2 - s][:rank]):][:out_splits[s]] + 10 * s
                          for s in range(2)])
        out = {"a2a_ok": bool(torch.equal(recv.cpu(), want)), "import_s": t_import,
               "init_s": time.perf_counter() - t0 - t_import}
        cfg, d = two_ranks_case(seed)
        layer = moe_comm.MoELayer(cfg, seed=1, device=dev, dtype=torch.float32, backend="torch" if dry else "auto",
                                  end_check="deferred")
        load_layer(layer, d, rank, 2)
        start = sum(TWO_RANKS_TOKENS[:rank])
        rows = slice(start, start + TWO_RANKS_TOKENS[rank])
        x_TH, gy = d["x"][rows].float().to(dev), d["gy"][rows].to(dev)
        run_layer(layer, x_TH, gy)  # warm-up
        got = run_layer(layer, x_TH, gy)
        out.update({k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in got.items()})
        how = "cuda" if not dry else ("hostsyncs" if host_syncs_class() is not None else None)
        if how is not None:
            out["syncs_how"] = how
            out["syncs_fwd"], out["syncs_bwd"] = fwd_bwd_syncs(layer, x_TH.clone().requires_grad_(True), how)
        out["total_s"] = time.perf_counter() - t0
        return out
    finally:
        dist.destroy_process_group()


TWO_RANKS_SEED = 900


def start_two_ranks(ctx: Ctx) -> Dict:
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(dir=ctx.tmpdir)
    procs = mp.start_processes(two_ranks_worker, nprocs=2, join=False, start_method="spawn",
                               args=(os.path.join(out_dir, "store"), out_dir, ctx.dry, TWO_RANKS_SEED))
    return {"procs": procs, "out_dir": out_dir, "t0": time.monotonic()}


@section("two_ranks", needs_s=25)
def sec_two_ranks(ctx: Ctx, rec: Record) -> None:
    """2 gloo ranks in spawned processes (CUDA tensors on the one GPU; CPU on the dry run) vs the reference."""
    job = start_two_ranks(ctx)
    procs, out_dir, deadline = job["procs"], job["out_dir"], child_deadline(ctx, job)
    while not procs.join(timeout=0.5):
        if time.monotonic() > deadline:
            kill_job(job)
            raise RuntimeError(f"the 2 ranks did not finish in {time.monotonic() - job['t0']:.0f} s "
                               "(a hung collective?)")
    results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    for r, res in enumerate(results):
        if "error" in res:
            raise RuntimeError(f"rank {r}: {res['error'][-1500:]}")
    unsupported = [res["unsupported"] for res in results if "unsupported" in res]
    if unsupported:
        raise NotCovered(unsupported[0])
    rec.data["rank_seconds"] = [{k: round(r[k], 2) for k in ("import_s", "init_s", "total_s")} for r in results]
    rec.check("uneven all_to_all_single over gloo", all(res["a2a_ok"] for res in results),
              f"{'CPU' if ctx.dry else 'CUDA'} tensors")
    cfg, d = two_ranks_case(TWO_RANKS_SEED)
    ref = dense_reference(d, cfg, TWO_RANKS_TOKENS, torch.float32, torch.float32, torch.device("cpu"))
    compare_ranks(rec, results, ref, REL_TOL[torch.float32])
    syncs = [(r.get("syncs_how"), r.get("syncs_fwd"), r.get("syncs_bwd")) for r in results]
    rec.data["syncs"] = syncs
    if syncs[0][0] == "hostsyncs":
        # W = 2, end_check="deferred": forward reads the counts exchange; backward reads the check-in exchange
        # (with the deferred end-of-forward one): one each.
        for r, (_, fwd, bwd) in enumerate(syncs):
            rec.check(f"rank {r} HostSyncs: forward 1, backward 1", (len(fwd), len(bwd)) == (1, 1),
                      f"forward {fwd}, backward {bwd}")
    elif syncs[0][0] == "cuda":
        # gloo moves the control exchange through CPU tensors, so these CUDA syncs are data, not NCCL's count
        rec.not_covered("host syncs at W = 2", "gloo with CUDA tensors: recorded in data (not the NCCL path)")
    else:
        rec.not_covered("host syncs at W = 2", "moe_comm.testing.syncs missing")


# ------------------------------------------------------------------------------- nccl ranks
# NCCL takes one GPU per rank (two ranks on one device: "Duplicate GPU detected"), so on one GPU W >= 2 never runs
# over NCCL (two_ranks runs W = 2 over gloo with CUDA tensors). --nccl-ranks N runs W = N NCCL ranks on a machine
# with N GPUs; on the dry run (--dry-run-cpu --nccl-ranks N) the same section on N gloo ranks on CPU.
def nccl_ranks_tokens(world: int) -> List[int]:
    """Uneven tokens per rank: 7, 12, 8, 13, 9, ..."""
    return [7 + (5 * r) % 9 for r in range(world)]


def nccl_ranks_case(world: int, seed: int):
    import moe_comm

    cfg = moe_comm.MoEConfig(hidden_size=24, ffn_hidden_size=40, num_experts=2 * world, top_k=2, num_chunks=2)
    return cfg, layer_data(cfg, sum(nccl_ranks_tokens(world)), seed)


def nccl_ranks_worker(rank: int, world: int, init_file: str, out_dir: str, dry: bool, seed: int) -> None:
    """One of ``world`` spawned ranks (pickled by reference: module level). Writes rank<r>.pt, whatever happens."""
    try:
        result = nccl_ranks_rank(rank, world, init_file, dry, seed)
    except Exception:  # noqa: BLE001 - the parent reports it
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def outcome(fn: Callable[[], object]) -> str:
    """'value' when fn returned, else 'ExcType: message'."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the parent checks the type and text
        return f"{type(exc).__name__}: {exc}"
    return "value"


def nccl_ranks_failure(rank: int, world: int, dev: torch.device, kernels: str) -> Dict:
    """A mid-call failure: the last rank's expert_fn raises at chunk 1 of 2 (after chunk 0's rows moved), with
    end_check "eager" (every rank raises in the call) and "deferred" (every call returns placeholder rows, every
    rank raises at check()); then a good call on the same Dispatcher. {end_check: (call, check, good call ok)}."""
    import torch.distributed as dist

    import moe_comm

    E, T, K, bad = 2 * world, 9, 2, world - 1
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, 8, generator=g).to(dev)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K].to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    out = {}
    for end_check in ("eager", "deferred"):
        d = moe_comm.Dispatcher(num_experts=E, ep_group=dist.group.WORLD, backend=kernels, end_check=end_check)
        calls = []

        def failing(t, c):
            calls.append(1)
            if rank == bad and len(calls) == 2:
                raise ValueError("expert_fn failed on purpose at chunk 1")
            return t * 2.0

        first = outcome(lambda: d(x, idx, w, failing, num_chunks=2))
        second = outcome(d.check) if end_check == "deferred" else "not read"
        y = d(x, idx, w, lambda t, c: t * 2.0, num_chunks=2)
        good = bool(torch.allclose(y, 2 * w.sum(1, keepdim=True) * x, rtol=1e-5, atol=1e-6))
        out[end_check] = (first, second, good)
    return out


def nccl_ranks_rank(rank: int, world: int, init_file: str, dry: bool, seed: int) -> Dict:
    t0 = time.perf_counter()
    import torch.distributed as dist

    import moe_comm

    dev = torch.device("cpu") if dry else torch.device("cuda", rank)
    backend, kernels = ("gloo", "torch") if dry else ("nccl", "auto")
    kw = {} if dry else {"device_id": dev}
    if not dry:
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60), **kw)
    try:
        out = {"backend": str(dist.get_backend()), "init_s": time.perf_counter() - t0}
        # uneven all_to_all_single: rank r sends 1 + (r + w) % 3 elements to rank w, valued 100 r + w
        in_splits = [1 + (rank + w) % 3 for w in range(world)]
        out_splits = [1 + (s + rank) % 3 for s in range(world)]
        send = torch.cat([torch.full((n,), 100.0 * rank + w) for w, n in enumerate(in_splits)]).to(dev)
        recv = torch.empty(sum(out_splits), device=dev)
        dist.all_to_all_single(recv, send, out_splits, in_splits)
        want = torch.cat([torch.full((n,), 100.0 * s + rank) for s, n in enumerate(out_splits)])
        out["a2a_ok"] = bool(torch.equal(recv.cpu(), want))
        cfg, d = nccl_ranks_case(world, seed)
        tokens = nccl_ranks_tokens(world)
        layer = moe_comm.MoELayer(cfg, seed=1, device=dev, dtype=torch.float32, backend=kernels, end_check="deferred")
        load_layer(layer, d, rank, world)
        start = sum(tokens[:rank])
        x_TH = d["x"][start:start + tokens[rank]].float().to(dev)
        gy = d["gy"][start:start + tokens[rank]].to(dev)
        run_layer(layer, x_TH, gy)  # warm-up
        got = run_layer(layer, x_TH, gy)
        out.update({k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in got.items()})
        out["syncs"], out["stack_syncs"], pageable = {}, {}, []
        # a stack of STACK_DEPTH layers: one read per forward, one per backward pass (its first check-in)
        stack = torch.nn.Sequential(layer, *(moe_comm.MoELayer(cfg, seed=2 + i, device=dev, dtype=torch.float32,
                                                                backend=kernels, end_check="deferred")
                                             for i in range(STACK_DEPTH - 1)))
        stack(x_TH.clone().requires_grad_(True)).float().square().mean().backward()  # warm-up
        for how in ([] if dry else ["cuda"]) + (["hostsyncs"] if host_syncs_class() is not None else []):
            out["syncs"][how] = fwd_bwd_syncs(layer, x_TH.clone().requires_grad_(True), how,
                                              pageable if how == "hostsyncs" else None)
            out["stack_syncs"][how] = fwd_bwd_syncs(stack, x_TH.clone().requires_grad_(True), how)
        out["pageable"] = pageable
        if pageable and not dry:
            out["pageable_blocks"] = pageable_copy_blocks(dev)
        out["failure"] = nccl_ranks_failure(rank, world, dev, kernels)
        out["total_s"] = time.perf_counter() - t0
        return out
    finally:
        dist.destroy_process_group()


NCCL_RANKS_SEED = 950
STACK_DEPTH = 3  # layers of the stack whose backward pass reads once (end_check="deferred")


@section("nccl_ranks", needs_s=30)
def sec_nccl_ranks(ctx: Ctx, rec: Record) -> None:
    """W = N NCCL ranks, one GPU each (--nccl-ranks N, default 2): uneven all_to_all_single, MoELayer vs the dense
    reference (forward, aux loss, gradients), host syncs per rank (forward 1, backward 1; a stack of 3 layers:
    forward 3, backward 1), a mid-call failure
    raised on every rank (eager and deferred) with the group usable after it. The dry run: N gloo ranks on CPU,
    only when --nccl-ranks is given."""
    import torch.multiprocessing as mp

    world = ctx.args.nccl_ranks or 2
    gpus = torch.cuda.device_count() if ctx.cuda else 0
    rec.data.update(world=world, gpus=gpus)
    need = (f"NCCL with W = {world} needs {world} GPUs, one per rank (NCCL refuses two ranks on one device); "
            f"{gpus} GPU{'' if gpus == 1 else 's'} here")
    if ctx.dry and ctx.args.nccl_ranks is None:
        raise NotCovered(f"{need} (dry run); --dry-run-cpu --nccl-ranks N runs this section on N gloo ranks")
    if not ctx.dry and gpus < world:
        raise NotCovered(f"{need}: W >= 2 ran only over gloo (two_ranks); run --nccl-ranks N on N GPUs")
    out_dir = tempfile.mkdtemp(dir=ctx.tmpdir)
    job = {"procs": mp.start_processes(nccl_ranks_worker, nprocs=world, join=False, start_method="spawn",
                                       args=(world, os.path.join(out_dir, "store"), out_dir, ctx.dry, NCCL_RANKS_SEED)),
           "t0": time.monotonic()}
    deadline = child_deadline(ctx, job)
    while not job["procs"].join(timeout=0.5):
        if time.monotonic() > deadline:
            kill_job(job)
            raise RuntimeError(f"the {world} ranks did not finish in {time.monotonic() - job['t0']:.0f} s "
                               "(a hung collective?)")
    results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        if "error" in res:
            raise RuntimeError(f"rank {r}: {res['error'][-1500:]}")
    rec.data["backend"] = results[0]["backend"]
    rec.data["rank_seconds"] = [{k: round(r[k], 2) for k in ("init_s", "total_s")} for r in results]
    rec.check(f"{world} ranks over {results[0]['backend']}", all(r["backend"] == ("gloo" if ctx.dry else "nccl")
                                                                 for r in results), rec.data["backend"])
    rec.check("uneven all_to_all_single", all(r["a2a_ok"] for r in results))
    cfg, d = nccl_ranks_case(world, NCCL_RANKS_SEED)
    ref = dense_reference(d, cfg, nccl_ranks_tokens(world), torch.float32, torch.float32, torch.device("cpu"))
    compare_ranks(rec, results, ref, REL_TOL[torch.float32])
    # W >= 2, end_check="deferred": the forward reads the counts exchange; the backward its check-in: one each
    rec.data["syncs"] = [r["syncs"] for r in results]
    for how in results[0]["syncs"]:
        counter = "set_sync_debug_mode" if how == "cuda" else "HostSyncs"
        for r, res in enumerate(results):
            fwd, bwd = res["syncs"][how]
            rec.check(f"rank {r} {counter}: forward 1, backward 1", (len(fwd), len(bwd)) == (1, 1),
                      f"forward {fwd}, backward {bwd}")
            fwd, bwd = res["stack_syncs"][how]
            rec.check(f"rank {r} {counter}, {STACK_DEPTH} layers: forward {STACK_DEPTH}, backward 1",
                      (len(fwd), len(bwd)) == (STACK_DEPTH, 1), f"forward {fwd}, backward {bwd}")
    if host_syncs_class() is None:
        rec.not_covered("HostSyncs", "moe_comm.testing.syncs missing")
    if ctx.dry:
        rec.not_covered("set_sync_debug_mode", "no CUDA on the dry run")
    for r, res in enumerate(results):
        if res["pageable"]:
            blocks, detail = res["pageable_blocks"]
            where = sorted({e.split(" at ", 1)[1].split(": ", 1)[0] for e in res["pageable"]})
            rec.check(f"rank {r}: {len(res['pageable'])} non_blocking copies from pageable memory do not block",
                      not blocks, f"{detail}; at {where}")
    bad = world - 1
    rec.data["failure"] = [r["failure"] for r in results]
    for r, res in enumerate(results):
        own = "ValueError:" if r == bad else "PeerFailed:"
        first, _, good = res["failure"]["eager"]
        rec.check(f"rank {r}: mid-call failure on rank {bad}, eager: raises {own[:-1]} in the call",
                  first.startswith(own) and "on purpose" in first, first[:300])
        first, second, good_d = res["failure"]["deferred"]
        rec.check(f"rank {r}: mid-call failure on rank {bad}, deferred: the call returns, check() raises {own[:-1]}",
                  first == "value" and second.startswith(own) and "on purpose" in second,
                  f"{first[:150]} | {second[:150]}")
        rec.check(f"rank {r}: the next call after each failure is right", good and good_d)


# ------------------------------------------------------------------------------- timeline
@section("timeline", needs_s=5)
def sec_timeline(ctx: Ctx, rec: Record) -> None:
    """The layer's Timeline over one forward and backward at C = 4: CUDA-event spans on CUDA."""
    import moe_comm
    from moe_comm.profiling import format_report, overlap_report, to_chrome_trace

    C = 4
    T, H, F, E, K = (2048, 1024, 768, 8, 2) if ctx.cuda else (32, 16, 24, 4, 2)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, num_chunks=C)
    layer = moe_comm.MoELayer(cfg, seed=2, device=ctx.device, dtype=dtype, backend=ctx.backend,
                              allow_single_process=True)
    # The timeline follows the layer's parameters from construction: a timeline left on the control channel's
    # device (CPU for a layer without a process group) times CUDA work with host clocks, its launches rather than
    # its execution. Checked before the first forward (which must not be what moves it), again after it, and
    # never set here: the spans below come from the device the layer chose. On the dry run the layer is on the
    # CPU like the channel, so this passes either way (tests/tools/test_gpu_check.py checks a meta layer).
    def on_layer_device() -> Tuple[bool, str]:
        tl, p = layer.timeline.device, layer.router.weight.device
        same = tl.type == p.type and (tl.index is None or p.index is None or tl.index == p.index)
        return same, f"timeline on {tl}, parameters on {p}"

    rec.check("timeline on the layer's device at construction, before any forward", *on_layer_device())
    x = torch.randn(T, H, generator=ctx.gen(8), device=ctx.device).to(dtype).requires_grad_(True)
    layer(x).float().square().mean().backward()  # warm-up, timeline off
    rec.check("timeline on the layer's device after the first forward", *on_layer_device())
    layer.timeline.enabled = True
    try:
        layer(x).float().square().mean().backward()
        spans = layer.timeline.gather()  # no process group: this rank's spans, CUDA events resolved
    finally:
        layer.timeline.enabled = False
    rec.check("no span left pending", layer.timeline.synchronize(timeout=0.0) == 0)
    have = {(s.phase, s.kind, s.direction, s.chunk) for s in spans}
    want = {("router", "compute", "fwd", -1), ("layout", "compute", "fwd", -1), ("permute", "compute", "fwd", -1),
            ("unpermute", "compute", "fwd", -1), ("counts", "comm", "fwd", -1)}
    want |= {("experts", "compute", dr, c) for dr in ("fwd", "bwd") for c in range(C)}
    missing = sorted(want - have)
    rec.check("spans of every phase and chunk", not missing, f"missing {missing}" if missing else f"{len(spans)} spans")
    by = {(s.phase, s.direction, s.chunk): s for s in spans}
    experts_fwd = [by[("experts", "fwd", c)] for c in range(C) if ("experts", "fwd", c) in by]
    if experts_fwd and ("router", "fwd", -1) in by and ("unpermute", "fwd", -1) in by:
        slack = 1e-6
        ordered = by[("router", "fwd", -1)].end <= experts_fwd[0].start + slack and \
            all(a.end <= b.start + slack for a, b in zip(experts_fwd, experts_fwd[1:])) and \
            experts_fwd[-1].end <= by[("unpermute", "fwd", -1)].start + slack
        rec.check("forward spans in stream order: router, experts chunk 0..C-1, unpermute", ordered,
                  ", ".join(f"{s.phase}{s.chunk} {s.start:.6f}-{s.end:.6f}" for s in experts_fwd))
        rec.check("experts spans have a duration", all(s.duration > 0 for s in experts_fwd),
                  ", ".join(f"{s.duration * 1e3:.3f} ms" for s in experts_fwd))
    report = overlap_report(spans)
    overall = report["overall"]
    rec.data["overall"] = {k: overall[k] for k in ("T_compute", "T_comm", "hidden", "exposed", "T_step", "wall")}
    rec.check("overlap report covers every span", overall["num_spans"] == len(spans) and overall["T_compute"] > 0,
              f"{overall['num_spans']} spans, T_compute {overall['T_compute'] * 1e3:.3f} ms")
    rec.check("format_report renders", bool(format_report(report).strip()))
    path = os.path.join(ctx.tmpdir, "timeline_trace.json")
    to_chrome_trace(spans, path)
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    rec.check("Chrome trace: one complete event per span", len(events) == len(spans), f"{len(events)} events")


# ------------------------------------------------------------------------------- pytest -m gpu
@section("pytest_gpu", needs_s=60)
def sec_pytest_gpu(ctx: Ctx, rec: Record) -> None:
    if not ctx.cuda:
        raise NotCovered("needs CUDA: the gpu-marked tests skip without a device")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # conftest sets it only without CUDA
    timeout = ctx.left() - 5
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-2000:]
        rec.data["tail"] = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        rec.check("pytest -m gpu finished", False, f"timed out after {timeout:.0f} s")
        return
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", summary)}
    rec.data.update(returncode=proc.returncode, summary=summary, counts=counts, tail="\n".join(lines[-40:]))
    print(f"    {summary}")
    rec.check("pytest -m gpu exits 0", proc.returncode == 0, summary or proc.stderr.strip()[-500:])
    rec.check("gpu tests ran", counts.get("passed", 0) > 0, summary)


# ======================================================================================= runner
def write_json(path: str, payload: Dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)  # a reader (or a kill) never sees half a file


def verdict(rec: Record, error: Optional[BaseException]) -> Tuple[str, str]:
    """(status, reason) of a section from its checks and what it raised."""
    if isinstance(error, NotCovered):
        return NOT_COVERED, str(error)
    if error is not None:
        return FAIL, f"raised {type(error).__name__}: {str(error)[:300]}"
    failed = [c for c in rec.checks if c["status"] == FAIL]
    passed = [c for c in rec.checks if c["status"] == PASS]
    missed = [c for c in rec.checks if c["status"] == NOT_COVERED]
    if failed:
        first = failed[0]
        return FAIL, f"{len(failed)} of {len(rec.checks)} checks failed; first: {first['check']}: {first['detail']}"
    if not passed:
        return NOT_COVERED, "; ".join(f"{c['check']}: {c['detail']}" for c in missed) or "no checks ran"
    reason = f"{len(passed)} checks passed"
    if missed:
        reason += "; not covered: " + "; ".join(f"{c['check']} ({c['detail']})" for c in missed)
    return PASS, reason


def run_sections(ctx: Ctx, selected: List[str]) -> List[Dict]:
    results = [{"section": s.name, "status": NOT_RUN, "reason": "", "seconds": 0.0, "checks": [], "data": {}}
               for s in SECTIONS]

    def payload(done: bool) -> Dict:
        statuses = [r["status"] for r in results]
        return {"tool": "benchmarks/gpu_check.py", "argv": sys.argv[1:], "dry_run": ctx.dry,
                "device": str(ctx.device), "budget_s": ctx.args.budget, "complete": done,
                "elapsed_s": round(time.perf_counter() - ctx.t_start, 2), "env": ctx.env,
                "verdict": (FAIL if FAIL in statuses else PASS) if done else None,
                "counts": {s: statuses.count(s) for s in (PASS, FAIL, NOT_COVERED, NOT_RUN)}, "sections": results}

    def save(done: bool = False) -> None:
        if ctx.args.json:
            write_json(ctx.args.json, payload(done))

    save()
    no_cuda = not ctx.dry and not torch.cuda.is_available()
    for i, (sec, res) in enumerate(zip(SECTIONS, results)):
        rec, error, t0 = Record(sec.name), None, time.perf_counter()
        print(f"[{i + 1:2d}/{len(SECTIONS)}] {sec.name} ...", flush=True)
        if sec.name not in selected:
            error = NotCovered("not selected (--only)")
        elif no_cuda and sec.name != "env":
            error = NotCovered("no CUDA device")
        elif ctx.left() < sec.needs_s:
            error = NotCovered(f"budget: {time.perf_counter() - ctx.t_start:.0f} s of {ctx.args.budget:.0f} s spent, "
                               f"the section needs ~{sec.needs_s:.0f} s")
        else:
            try:
                if ctx.args.inject_failure == sec.name:
                    raise RuntimeError(f"injected failure (--inject-failure {sec.name})")
                sec.fn(ctx, rec)
            except Exception as exc:  # noqa: BLE001 - any failure of a section is its verdict, the rest run on
                error = exc
                if not isinstance(exc, NotCovered):
                    res["traceback"] = traceback.format_exc()
                    print(res["traceback"], file=sys.stderr, flush=True)
        status, reason = verdict(rec, error)
        error = None  # the traceback holds the section's frames (and its GPU tensors)
        if ctx.cuda:
            try:  # a kernel fault surfaces at the next sync: it belongs to this section
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001
                status, reason = FAIL, f"CUDA error after the section: {type(exc).__name__}: {exc}"
        res.update(status=status, reason=reason, seconds=round(time.perf_counter() - t0, 2), checks=rec.checks,
                   data=rec.data)
        print(f"        {status}  {res['seconds']:.1f} s  {reason[:200]}", flush=True)
        save()
    save(done=True)
    return results


def print_table(results: List[Dict], wall: float) -> None:
    rows = []
    for r in results:
        n = {s: sum(c["status"] == s for c in r["checks"]) for s in (PASS, FAIL, NOT_COVERED)}
        checks = f"{n[PASS]}/{n[PASS] + n[FAIL]}" + (f" +{n[NOT_COVERED]} n/c" if n[NOT_COVERED] else "")
        rows.append((r["section"], r["status"], checks, f"{r['seconds']:.1f}", r["reason"]))
    statuses = [r["status"] for r in results]
    total = f"{'FAIL' if FAIL in statuses else 'PASS'}: " + ", ".join(
        f"{statuses.count(s)} {s}" for s in (PASS, FAIL, NOT_COVERED)) + f" in {wall:.1f} s"
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"\n{'section':<14} {'status':<12} {'checks':<14} {'s':>6}  reason")
        for row in rows:
            print(f"{row[0]:<14} {row[1]:<12} {row[2]:<14} {row[3]:>6}  {row[4]}")
        print(total)
        return
    colour = {PASS: "green", FAIL: "bold red", NOT_COVERED: "yellow"}
    table = Table(title="gpu_check verdict", title_justify="left")
    for col, justify in (("section", "left"), ("status", "left"), ("checks", "right"), ("s", "right"),
                         ("reason", "left")):
        table.add_column(col, justify=justify, overflow="fold")
    for name, status, checks, secs, reason in rows:
        table.add_row(name, f"[{colour.get(status, 'white')}]{status}[/]", checks, secs, reason[:400])
    console = Console(width=160)
    console.print()
    console.print(table)
    console.print(total)


def parse_args(argv=None) -> argparse.Namespace:
    names = [s.name for s in SECTIONS]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write the results to PATH (rewritten after every section)")
    p.add_argument("--dry-run-cpu", action="store_true",
                   help="every section at tiny shapes on CPU (Triton interpreter, gloo): CI without a GPU")
    p.add_argument("--budget", type=float, default=330.0,
                   help="seconds; sections that would start past it are NOT COVERED ('budget'); default 330")
    p.add_argument("--min-of-copy", type=float, default=0.25,
                   help="bandwidth floor: kernel GB/s as a fraction of a device copy of the same bytes "
                        "(a sanity floor, not a measured target); default 0.25")
    p.add_argument("--only", metavar="NAMES", help=f"comma-separated sections to run (others NOT COVERED): {names}")
    p.add_argument("--inject-failure", metavar="SECTION", choices=names,
                   help="make SECTION raise (shows that the check can fail)")
    p.add_argument("--nccl-ranks", type=int, metavar="N",
                   help="nccl_ranks: W = N NCCL ranks, one GPU each (default 2; NOT COVERED with fewer GPUs); with "
                        "--dry-run-cpu the same section on N gloo ranks on CPU")
    p.add_argument("--child", choices=["world1"], help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.selected = names if not args.only else [s.strip() for s in args.only.split(",") if s.strip()]
    if args.nccl_ranks is not None and args.nccl_ranks < 2:
        p.error(f"--nccl-ranks: N >= 2 ranks (one rank: nccl_world1), got {args.nccl_ranks}")
    unknown = sorted(set(args.selected) - set(names))
    if unknown:
        p.error(f"--only: unknown sections {unknown}; known: {names}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child == "world1":
        return child_world1(args.child_out, args.dry_run_cpu)
    # A section that hangs (a stuck collective in this process) must not hang the call: every thread's stack
    # goes to stderr and the process exits 1 at 355 s by default; the JSON keeps what finished.
    faulthandler.dump_traceback_later(args.budget + 25, exit=True)
    if args.dry_run_cpu:  # tiny tensors: one intra-op thread per process, so 3 processes share 2 cores calmly
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"  # read by the child processes at their start
    device = torch.device("cpu") if args.dry_run_cpu or not torch.cuda.is_available() else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    print(f"gpu_check: {'dry run on CPU' if args.dry_run_cpu else device}, budget {args.budget:.0f} s"
          + (" (ignored TRITON_INTERPRET=1: the compiled kernels are the point)" if INTERPRET_IGNORED else ""))
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmpdir:
        ctx = Ctx(args=args, dry=args.dry_run_cpu, device=device, t_start=t_start, tmpdir=tmpdir)
        results = run_sections(ctx, args.selected)
    faulthandler.cancel_dump_traceback_later()
    print_table(results, time.perf_counter() - t_start)
    if args.json:
        print(f"wrote {args.json}")
    return 1 if any(r["status"] == FAIL for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
