"""Random single-rank fault loop (issue #27, "Reliability II"): W gloo ranks run ``--iters`` iterations; each
draws (seeded, the same on every rank) a fault kind, a failing rank, a phase, a chunk and a Dispatcher mode, makes
that one rank fail there, and checks what every rank saw.

Shapes legend: T tokens of one rank (1..T_MAX), H hidden, K top-k, E experts (global, 2W), e = 2 local experts,
C chunks, R received rows, W EP world size.

Kinds: the ``moe_comm.testing.faults`` kinds (permute, quantize, piece, send_regroup, recv_buffer, plan,
unpermute, sf_permute, sf_regroup), plus ``expert_fn`` (the expert function raises at chunk c in the forward, or
its backward raises at chunk c), ``side_fn`` (the side function raises) and ``none`` (a good call).
Modes, one Dispatcher each, kept for the whole loop (the call after a failure runs on the same objects):
eager, deferred (end_check="deferred"), sync_free (max_tokens_per_rank), dedup (dedup=True with
``d._stream = True`` before every call: C = 1 calls stream in pieces), p2p (direct_min_bytes=0, E = 2W),
fp8 (dispatch_dtype=float8_e4m3fn). C is drawn in 1..3 (sync-free: 1). ``_applies`` says which (kind, mode,
phase) combinations are drawn: every one where the fault can fire, none left out (the findings of the first runs,
a failed deferred/sync-free call retained on the failing rank and the sync-free final unpermute fault never
carried to its peers, are fixed: ``moe_comm.comm.channel.kept``, ``Dispatcher.last_step``).

One iteration, on every rank:
1. the drawn call, forward + backward (+ ``check()`` in the deferred and sync-free modes), the fault injected on
   the failing rank. ``unpermute`` (a fault after the call's last exchange; dedup: mid-call) in two phases:
   "train", that training step with grad on, and "fwd", the call under no_grad followed by a probe call, the
   "next exchange" that must raise on every rank;
2. a good call on the same Dispatcher (fresh routing, the iteration's C), which must be exact;
3. one RSS read (/proc/self/statm, ``soak.read_rss``).
Each rank appends one JSON line per iteration to its own file (no collective: the verdict is made by the
launcher after every rank exited, so a poisoned group cannot hide the record). Payloads are exact (as in
``benchmarks/soak.py``): x small integers in float64 (column 0 the rank, column 1 the token id), weights on a
1/16 grid, expert g multiplies its rows by g + 1, so ``y_t = x_t * sum_k w_tk (g_tk + 1)`` and
``dL/dx``, ``dL/dw`` are compared with ``torch.equal`` (FP8: y and dL/dw within e4m3's relative rounding 2^-4
of each term; dL/dx exact, the backward stays in x's dtype).

The four properties (``verdict``):
1. alive: the launcher saw every rank exit 0, and every rank wrote every iteration;
2. raised: a fault that fired made every rank raise in that call (healthy ranks a PeerFailed naming ``[bad]``;
   the failing rank its own "injected" error; deferred backward faults leave NaN gradients on every rank).
   ``unpermute`` after the last exchange, "train": the failing rank's forward returned NaN rows (its healthy
   peers' forward the exact value), and every rank raised later in that same step, not in the forward (its
   backward's check-in, or check(): measured, the sync-free mode at check(), the others in the backward), the
   healthy ranks a PeerFailed naming ``[bad]`` and the fault; "fwd" (no_grad): the failing rank raised at once,
   its peers returned the exact value, and the probe raised on every rank naming ``[bad]``;
3. exact: every successful call (the ``none`` calls and every good call after a fault) equals the reference,
   forward, dL/dx and dL/dw, on every rank; a drawn fault that did not fire counts as a failure of the table;
4. flat: per rank, the median RSS of the last quarter of iterations minus the median of the second quarter
   (the first quarter is warm-up: allocator arenas, first-touched code) is < ``--max-growth-mb`` MiB (default 2;
   measured at 200 iterations, seed 0: +0.27 and +0.36 MiB at W = 2, +0.40 to +0.50 MiB at W = 4; +0.12 MiB at
   1,000, W = 2; a loop of only eager permute faults settles by ~0.7 MiB over its first 300 iterations, then
   grows 0.2 KiB per iteration over 2,000), and the live tensors after gc.collect() grow by at most
   MAX_TENSOR_GROWTH from the end of warm-up to the end (exact where RSS is not: a failed call retained on the
   failing rank, the leak the first runs found in the deferred and sync-free modes, was ~40 tensors but only
   ~60 KiB each here; measured now: +4 at 200 iterations, W = 2 and 4).

    python benchmarks/fault_loop.py --iters 200 --world-size 2 --seed 0 --json /tmp/fault_loop_w2.json
    python benchmarks/fault_loop.py --iters 200 --world-size 4 --seed 0 --json /tmp/fault_loop_w4.json
Exit status: 0 when all four properties held, else 1.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import json
import os
import random
import sys
import tempfile
import time
import warnings
from typing import Dict, List, Optional, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
for _p in (ROOT, BENCHMARKS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import moe_comm  # noqa: E402
from moe_comm.testing import faults  # noqa: E402
from moe_comm.tools.launch import run_ranks  # noqa: E402
from soak import read_rss, rss_summary  # noqa: E402

H = 16  # hidden size (the sync-free Dispatcher agrees on it in its first call)
T_MAX = 12  # tokens per rank are drawn in 1..T_MAX; also the sync-free M
K_SYNC_FREE = 2  # the sync-free Dispatcher's K (agreed in its first call)
TIMEOUT_S = 20.0  # each Dispatcher's exchange timeout: a hang becomes a CollectiveError, not a stuck loop

# Live tensors (after gc.collect()) may grow this much from the end of warm-up to the end: workspace buffers
# keyed by (kind, direction, chunk) of a C or shape first seen late. A retained failed call would hold ~36
# (T <= 12), more than this bound.
MAX_TENSOR_GROWTH = 16

MODES = ("eager", "deferred", "sync_free", "dedup", "p2p", "fp8")
KINDS = ("none",) + faults.KINDS + ("expert_fn", "side_fn")
# the all-to-all transport with its regroup pass (e = 2 > 1); dedup's rows arrive rank-major and are expanded by
# the experts' rank (no regroup scratch): send_regroup and recv_buffer never fire there (checked: 0 of 6 draws)
REGROUP_MODES = ("eager", "deferred", "fp8")
PIPELINED_MODES = ("eager", "deferred", "dedup", "p2p", "fp8")  # Dispatcher.__call__ without max_tokens_per_rank


@dataclasses.dataclass(frozen=True)
class Case:
    """One iteration's draw (the same on every rank)."""

    kind: str
    mode: str
    phase: str  # "fwd" | "bwd"; unpermute: "fwd" (no_grad + probe) | "train" (grad on)
    chunk: int  # expert_fn: the chunk whose expert call (or its backward) raises; else -1
    C: int
    bad: int  # the failing rank
    K: int


def _applies(kind: str) -> Dict[str, Tuple[str, ...]]:
    """mode -> the phases ``kind`` can be injected in, for the modes where it applies."""
    both = ("fwd", "bwd")
    table = {
        "none": {m: ("fwd",) for m in MODES},
        "permute": {m: ("fwd",) for m in PIPELINED_MODES},  # send_rows.presend; sync-free: sf_permute
        "quantize": {"fp8": ("fwd",)},
        "piece": {"dedup": ("fwd",)},  # streamed pieces: C = 1 only (see draw)
        # the regroup before rows go back: the all-to-all transport with e > 1, an expert_fn without segments
        "send_regroup": {m: both for m in REGROUP_MODES},
        "recv_buffer": {m: both for m in REGROUP_MODES},  # AllToAll's receive scratch
        "plan": {m: ("fwd",) for m in PIPELINED_MODES},
        # "fwd": under no_grad, then a probe call; "train": with grad on, forward + backward (+ check()).
        # dedup: the experts' rank's expansion (the same moe_comm.ops.unpermute) fails first, mid-call
        "unpermute": {m: ("fwd", "train") for m in MODES},
        "sf_permute": {"sync_free": ("fwd",)},
        "sf_regroup": {"sync_free": ("fwd",)},
        "expert_fn": {m: both for m in MODES},
        "side_fn": {m: ("fwd",) for m in MODES},
    }
    return table[kind]


def after_last_exchange(kind: str, mode: str) -> bool:
    """The fault hits the call's final unpermute, after its last exchange (dedup: the experts' expansion unpermute
    fails first, mid-call, like any other fault). Phase "fwd" (no_grad): the failing rank raises at once, every
    rank at its next exchange, the probe. Phase "train" (a backward to come): the failing rank returns NaN rows,
    its error is carried by its next exchange, the call's own backward check-in (deferred, sync-free: read at
    check()), and every rank raises in that step, the ranks in step for the next one."""
    return kind == "unpermute" and mode != "dedup"


def draw(seed: int, it: int, world_size: int) -> Case:
    """The iteration's case, from a generator seeded by (seed, it): the same on every rank."""
    rng = random.Random(f"fault_loop:{seed}:{it}")  # str seeds hash with sha512: the same in every process
    kind = rng.choice(KINDS)
    mode, phase = rng.choice([(m, p) for m, phases in _applies(kind).items() for p in phases])
    C = 1 if mode == "sync_free" or kind == "piece" else rng.randint(1, 3)
    chunk = rng.randrange(C) if kind == "expert_fn" else -1
    K = K_SYNC_FREE if mode == "sync_free" else rng.randint(1, 3)
    return Case(kind=kind, mode=mode, phase=phase, chunk=chunk, C=C, bad=rng.randrange(world_size), K=K)


# --------------------------------------------------------------------------------------------------------
# Experts and inputs

class ScaleByExpertId:
    """expert_fn: each expert-major row times (its global expert id + 1). Rows past the counts (the sync-free
    mode's padding, zero rows) get expert e - 1's factor: they stay zero. Linear: the combine is exact."""

    def __init__(self, first_expert: int, num_local_experts: int):
        self.factor_e = torch.arange(first_expert + 1, first_expert + num_local_experts + 1, dtype=torch.float64)

    def __call__(self, tokens_RH: torch.Tensor, tokens_per_expert_e: torch.Tensor) -> torch.Tensor:
        ends_e = torch.cumsum(tokens_per_expert_e, 0)
        rows_R = torch.arange(tokens_RH.shape[0], device=tokens_RH.device)
        local_R = torch.searchsorted(ends_e, rows_R, right=True).clamp_(max=len(self.factor_e) - 1)
        return tokens_RH * self.factor_e.to(tokens_RH.dtype)[local_R][:, None]


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, chunk):
        ctx.chunk = chunk
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError(f"injected expert backward fault at chunk {ctx.chunk}")


class FailingExpert:
    """ScaleByExpertId whose call number ``chunk`` (one call per chunk) raises (phase "fwd") or whose backward
    raises there (phase "bwd")."""

    def __init__(self, inner: ScaleByExpertId, chunk: int, phase: str):
        self.inner, self.chunk, self.phase, self.calls = inner, chunk, phase, 0

    def __call__(self, tokens_RH, tokens_per_expert_e):
        c, self.calls = self.calls, self.calls + 1
        if c == self.chunk and self.phase == "fwd":
            raise ValueError(f"injected expert_fn fault at chunk {c}")
        out = self.inner(tokens_RH, tokens_per_expert_e)
        return _RaiseInBackward.apply(out, c) if c == self.chunk else out


def _generator(seed: int, it: int, rank: int, what: str) -> torch.Generator:
    return torch.Generator().manual_seed(random.Random(f"fault_loop:{seed}:{it}:{rank}:{what}").getrandbits(63))


def make_inputs(seed: int, it: int, rank: int, case: Case, E: int, what: str):
    """(x_TH, topk_idx_TK, w_TK, grad_TH): exact payload, distinct experts per token, ~10% dropped slots."""
    g = _generator(seed, it, rank, what)
    T = int(torch.randint(1, T_MAX + 1, (), generator=g))
    idx_TK = torch.rand(T, E, generator=g).argsort(1)[:, :case.K]
    idx_TK = idx_TK.masked_fill(torch.rand(T, case.K, generator=g) < 0.1, -1)
    x_TH = torch.randint(-8, 9, (T, H), generator=g).to(torch.float64)
    x_TH[:, 0] = rank
    x_TH[:, 1] = torch.arange(T, dtype=torch.float64)
    w_TK = torch.randint(1, 17, (T, case.K), generator=g).to(torch.float64) / 16
    grad_TH = torch.randint(-3, 4, (T, H), generator=g).to(torch.float64)
    return x_TH, idx_TK, w_TK, grad_TH


def compare(y_TH, gx_TH, gw_TK, x_TH, idx_TK, w_TK, grad_TH, fp8: bool, backward: bool = True) -> Optional[str]:
    """None if y (and dL/dx, dL/dw when ``backward``) equal the reference; else what differed."""
    kept_TK = idx_TK >= 0
    factor_TK = torch.where(kept_TK, (idx_TK + 1).to(torch.float64), torch.zeros((), dtype=torch.float64))
    factor_T = (w_TK * factor_TK).sum(1)
    want_y = x_TH * factor_T[:, None]
    want_gx = grad_TH * factor_T[:, None]
    want_gw = factor_TK * (x_TH * grad_TH).sum(1, keepdim=True)

    def differs(name, got, want, bound=None):
        if got is None:
            return f"{name} is None"
        if tuple(got.shape) != tuple(want.shape):
            return f"{name} has shape {tuple(got.shape)}, want {tuple(want.shape)}"
        got = got.detach()
        if bound is None:
            if torch.equal(got, want):
                return None
        elif bool(((got - want).abs() <= bound).all()):
            return None
        err = (got - want).abs()
        row = int(err.reshape(len(err), -1).max(1).values.argmax()) if err.numel() else -1
        return f"{name} wrong (max err {float(err.max()) if err.numel() else 0.0:g}, token {row})"

    # FP8: each dequantized element within 2^-4 of x (e4m3, 3 mantissa bits, round to nearest)
    y_bound = 2 ** -4 * x_TH.abs() * (w_TK * factor_TK).abs().sum(1, keepdim=True) + 1e-12 if fp8 else None
    gw_bound = 2 ** -4 * factor_TK * (x_TH * grad_TH).abs().sum(1, keepdim=True) + 1e-12 if fp8 else None
    checks = [differs("y", y_TH, want_y, y_bound)]
    if backward:
        checks += [differs("dL/dx", gx_TH, want_gx), differs("dL/dw", gw_TK, want_gw, gw_bound)]
    return next((c for c in checks if c), None)


# --------------------------------------------------------------------------------------------------------
# The rank function

def make_dispatchers(world_size: int) -> Dict[str, moe_comm.Dispatcher]:
    """One Dispatcher per mode, built in MODES order on every rank (construction is collective)."""
    E = 2 * world_size
    a2a = 1 << 40  # never point-to-point
    kw = {"eager": dict(end_check="eager", direct_min_bytes=a2a),
          "deferred": dict(end_check="deferred", direct_min_bytes=a2a),
          "sync_free": dict(max_tokens_per_rank=T_MAX),
          "dedup": dict(dedup=True, direct_min_bytes=a2a),
          "p2p": dict(direct_min_bytes=0),
          "fp8": dict(dispatch_dtype=torch.float8_e4m3fn, direct_min_bytes=a2a)}
    return {m: moe_comm.Dispatcher(num_experts=E, timeout=TIMEOUT_S, **kw[m]) for m in MODES}


def _error(err: BaseException) -> Dict[str, str]:
    text = " ".join([str(err)] + list(getattr(err, "__notes__", [])))
    return {"type": type(err).__name__, "message": text[:2000]}


def run_call(d, mode: str, case: Case, inputs, expert_fn, *, fault: Optional[str] = None, direction: str = "fwd",
             side_raises: bool = False, grad: bool = True) -> dict:
    """One call (forward, backward, check()) on this rank; its outcome: {"raised": {type, message} | None,
    "at": where it raised, "nan_y": the forward returned all-NaN rows, "y_mismatch": what the forward's value
    differed in from the reference | None (recorded even when a later phase raised), "nan_grad": dL/dx all NaN
    (tokens with a kept slot), "mismatch": what differed from the reference | None}."""
    x_TH, idx_TK, w_TK, grad_TH = (t.clone() for t in inputs)
    x_TH.requires_grad_(grad)
    w_TK.requires_grad_(grad)
    side_fn = None
    if case.kind == "side_fn":
        def side_fn():
            if side_raises:
                raise RuntimeError("injected side_fn fault")
            return x_TH.detach().sum()
    out = {"raised": None, "at": None, "nan_y": False, "y_mismatch": None, "nan_grad": False, "mismatch": None}
    y_TH, at = None, "forward"
    try:
        with faults.inject(fault, direction) if fault else contextlib.nullcontext():
            if mode == "dedup":
                d._stream = True  # as after a call that moved 12 MiB from some rank: a C = 1 call streams
            with torch.set_grad_enabled(grad):
                kw = {} if mode == "sync_free" else {"num_chunks": case.C}
                y_TH = d(x_TH, idx_TK, w_TK, expert_fn, side_fn=side_fn, **kw)
                if side_fn is not None:
                    y_TH = y_TH[0]
                out["nan_y"] = bool(torch.isnan(y_TH).all())
                out["y_mismatch"] = compare(y_TH, None, None, x_TH.detach(), idx_TK, w_TK.detach(), grad_TH,
                                            fp8=mode == "fp8", backward=False)
                if grad:
                    at = "backward"
                    y_TH.backward(grad_TH)
            if mode in ("deferred", "sync_free"):
                at = "check"
                d.check()
    except Exception as err:  # noqa: BLE001 - the loop records every outcome
        out["raised"], out["at"] = _error(err), at
    if grad and x_TH.grad is not None:  # tokens with every slot dropped get no row, hence a zero gradient
        out["nan_grad"] = bool(torch.isnan(x_TH.grad[(idx_TK >= 0).any(1)]).all())
    if out["raised"] is None:
        out["mismatch"] = compare(y_TH, x_TH.grad, w_TK.grad, x_TH.detach(), idx_TK, w_TK.detach(), grad_TH,
                                  fp8=mode == "fp8", backward=grad)
    return out


def live_objects() -> Dict[str, int]:
    """Tensors and Python objects alive after a full collection: exact, unlike RSS (a retained failed call shows
    as its tensors, its autograd context and its exception's frames)."""
    gc.collect()
    objs = gc.get_objects()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op object warns
        warnings.simplefilter("ignore", FutureWarning)
        return {"tensors": sum(isinstance(o, torch.Tensor) for o in objs), "objects": len(objs)}


def rank_main(rank: int, world_size: int, iters: int, seed: int, out_dir: str,
              cases: Optional[List[Case]] = None) -> None:
    """Run the loop on this rank, one JSON line per iteration into ``out_dir/rank<r>.jsonl``. ``cases``: replay
    these cases in turn instead of drawing (to reproduce one iteration)."""
    torch.manual_seed(seed)
    E = 2 * world_size
    dispatchers = make_dispatchers(world_size)
    good_fn = ScaleByExpertId(rank * 2, 2)
    path = os.path.join(out_dir, f"rank{rank}.jsonl")
    t0 = time.perf_counter()
    with open(path, "w") as f:
        for it in range(iters):
            case = draw(seed, it, world_size) if not cases else cases[it % len(cases)]
            d, me = dispatchers[case.mode], rank == case.bad
            rec = {"it": it, "rank": rank, "case": dataclasses.asdict(case)}
            t_it = time.perf_counter()
            inputs = make_inputs(seed, it, rank, case, E, "call")
            kind = case.kind
            if kind == "expert_fn":
                fn = FailingExpert(good_fn, case.chunk, case.phase) if me else good_fn
                rec["call"] = run_call(d, case.mode, case, inputs, fn)
            elif kind == "side_fn":
                rec["call"] = run_call(d, case.mode, case, inputs, good_fn, side_raises=me)
            elif kind == "unpermute" and case.phase == "train":  # a training step: forward + backward (+ check())
                rec["call"] = run_call(d, case.mode, case, inputs, good_fn, fault=kind if me else None)
            elif kind == "unpermute":  # forward only (no_grad), then the next exchange: the probe
                rec["call"] = run_call(d, case.mode, case, inputs, good_fn, fault=kind if me else None, grad=False)
                probe = make_inputs(seed, it, rank, case, E, "probe")
                rec["probe"] = run_call(d, case.mode, case, probe, good_fn, grad=False)
            else:
                fault = kind if me and kind != "none" else None
                rec["call"] = run_call(d, case.mode, case, inputs, good_fn, fault=fault, direction=case.phase)
            after = make_inputs(seed, it, rank, case, E, "after")
            rec["after"] = run_call(d, case.mode, case, after, good_fn)
            rec["iter_s"] = time.perf_counter() - t_it
            if it + 1 in (iters // 4, iters):  # end of warm-up and end: what the process still holds
                rec["live"] = live_objects()
            rec["rss"], rec["anon_rss"] = read_rss()
            f.write(json.dumps(rec) + "\n")
            f.flush()
            if rank == 0 and (it + 1) % max(1, iters // 10) == 0:
                print(f"iter {it + 1:4d}/{iters}  {(it + 1) / (time.perf_counter() - t0):5.1f} it/s  "
                      f"rank-0 RSS {rec['rss'] / 2 ** 20:7.1f} MiB", flush=True)


# --------------------------------------------------------------------------------------------------------
# Verdict (in the launcher, from every rank's records)

def judge(case: dict, recs: List[dict]) -> Tuple[bool, List[str]]:
    """(whether the fault fired, the problems of this iteration across ranks)."""
    bad, kind, problems = case["bad"], case["kind"], []
    where = (f"iter {recs[0]['it']} {kind} mode={case['mode']} phase={case['phase']} chunk={case['chunk']} "
             f"C={case['C']} K={case['K']} bad={bad}")

    def note(rank, what):
        problems.append(f"{where}: rank {rank} {what}")

    calls = [r["call"] for r in recs]
    fired = kind != "none" and calls[bad]["raised"] is not None and "injected" in calls[bad]["raised"]["message"]
    if kind == "none":
        for rank, c in enumerate(calls):
            if c["raised"] is not None:
                note(rank, f"raised in a good call: {c['raised']}")
            elif c["mismatch"]:
                note(rank, f"good call: {c['mismatch']}")
    elif after_last_exchange(kind, case["mode"]) and case["phase"] == "train":
        # the failing rank returns NaN rows; every rank raises in this step (its backward's check-in; deferred,
        # sync-free: at check()): the failing rank its own error, the others a PeerFailed naming it
        for rank, c in enumerate(calls):
            e = c["raised"]
            if e is None:
                note(rank, f"returned from the training step whose unpermute failed on rank {bad} without raising "
                           f"(mismatch: {c['mismatch']})")
                continue
            if c["at"] == "forward":
                note(rank, f"raised in the forward of the training step whose unpermute failed on rank {bad} "
                           f"(want: in its backward or check()): {e['type']}: {e['message'][:300]}")
            if rank == bad:
                if not fired or e["type"] == "PeerFailed":
                    note(rank, f"mis-raised: want its own injected unpermute error, got {e['type']}: "
                               f"{e['message'][:300]}")
                if c["at"] != "forward" and not c["nan_y"]:
                    note(rank, "did not return NaN rows from the forward whose unpermute failed")
            else:
                if e["type"] != "PeerFailed" or f"[{bad}]" not in e["message"] or "injected" not in e["message"]:
                    note(rank, f"mis-raised: want a PeerFailed naming [{bad}] and the fault, got {e['type']}: "
                               f"{e['message'][:300]}")
                if c["y_mismatch"]:  # its own forward ran whole: its value must be right
                    note(rank, f"returned a wrong forward value from the step whose unpermute failed on rank {bad}: "
                               f"good call {c['y_mismatch']}")
    elif after_last_exchange(kind, case["mode"]):
        for rank, c in enumerate(calls):
            if rank == bad:
                if not fired:
                    note(rank, f"did not raise the injected unpermute fault at once: {c['raised']}")
            elif c["raised"] is not None:
                note(rank, f"raised in the call whose unpermute failed on rank {bad}: {c['raised']}")
            elif c["mismatch"]:  # its own unpermute ran: its value must be right
                note(rank, f"returned a wrong value from the call whose unpermute failed on rank {bad}: good call "
                           f"{c['mismatch']}")
        for rank, r in enumerate(recs):
            p = r["probe"]["raised"]
            if p is None:
                note(rank, "the next exchange after the unpermute fault returned a value")
            elif f"[{bad}]" not in p["message"] or "injected" not in p["message"]:
                note(rank, f"the next exchange's error does not name rank [{bad}] and the fault: {p}")
    elif not fired:
        c = calls[bad]
        note(bad, f"the drawn fault did not fire (raised: {c['raised']}, mismatch: {c['mismatch']})")
    else:
        for rank, c in enumerate(calls):
            e = c["raised"]
            if e is None:
                note(rank, f"returned a value from the failed call (mismatch: {c['mismatch']})")
            elif rank != bad and (e["type"] != "PeerFailed" or f"[{bad}]" not in e["message"]):
                note(rank, f"mis-raised: want a PeerFailed naming [{bad}], got {e['type']}: {e['message'][:300]}")
            if case["mode"] == "deferred" and case["phase"] == "bwd" and not c["nan_grad"]:
                note(rank, "deferred failed backward left non-NaN gradients")
        for rank, r in enumerate(recs if "probe" in recs[0] else []):  # dedup no_grad: the probe is a good call
            p = r["probe"]
            if p["raised"] is not None or p["mismatch"]:
                note(rank, f"the good call after: {p['raised'] or p['mismatch']}")
    for rank, r in enumerate(recs):
        a = r["after"]
        if a["raised"] is not None:
            note(rank, f"the good call after raised: {a['raised']['type']}: {a['raised']['message'][:300]}")
        elif a["mismatch"]:
            note(rank, f"the good call after: {a['mismatch']}")
    return fired, problems


def summarize(per_rank: List[List[dict]], iters: int, world_size: int, alive: dict, max_growth_mb: float) -> dict:
    """The JSON result: counts, the four properties, RSS per rank."""
    counts = {k: collections.Counter() for k in ("kind", "mode", "kind_mode", "kind_phase", "phase", "C")}
    failed = {k: collections.Counter() for k in ("kind", "mode")}
    raised_types = collections.Counter()
    problems, not_fired, good_calls, exact_calls = [], 0, 0, 0
    complete = min((len(r) for r in per_rank), default=0)
    for it in range(complete):
        recs = [r[it] for r in per_rank]
        case = recs[0]["case"]
        if any(r["case"] != case for r in recs):
            problems.append(f"iter {it}: ranks drew different cases")
            continue
        for k, v in (("kind", case["kind"]), ("mode", case["mode"]), ("kind_mode", f"{case['kind']}/{case['mode']}"),
                     ("kind_phase", f"{case['kind']}/{case['phase']}"), ("phase", case["phase"]),
                     ("C", str(case["C"]))):
            counts[k][v] += 1
        fired, found = judge(case, recs)
        problems += found
        if case["kind"] != "none" and not fired:
            not_fired += 1
        if fired:
            failed["kind"][case["kind"]] += 1
            failed["mode"][case["mode"]] += 1
            for rank, r in enumerate(recs):
                c = r["probe"] if "probe" in r and after_last_exchange(case["kind"], case["mode"]) else r["call"]
                if c["raised"] is not None:
                    who = "bad" if rank == case["bad"] else "healthy"
                    raised_types[f"{who}:{c['raised']['type']}@{c['at']}"] += 1
        for r in recs:  # successful calls: the good call after every iteration, and the "none" calls
            mid_call_unpermute = case["kind"] == "unpermute" and not after_last_exchange(case["kind"], case["mode"])
            probe = [r["probe"]] if mid_call_unpermute and "probe" in r else []
            for c in [r["after"]] + ([r["call"]] if case["kind"] == "none" else []) + probe:
                good_calls += 1
                exact_calls += c["raised"] is None and c["mismatch"] is None
    rss = []
    for rank, recs in enumerate(per_rank):
        if len(recs) < 8:
            rss.append({"rank": rank, "judged": False})
            continue
        q = len(recs) // 4
        total = rss_summary([r["rss"] for r in recs], warmup_steps=q, window=q)
        anon = rss_summary([r["anon_rss"] for r in recs], warmup_steps=q, window=q)
        live = [r["live"] for r in recs if "live" in r]
        rss.append({"rank": rank, "judged": True, "rss": total, "anon_rss": anon,
                    "growth_mb": total["end_mb"] - total["start_mb"],
                    "live_tensors": [x["tensors"] for x in live], "live_objects": [x["objects"] for x in live],
                    "tensor_growth": live[-1]["tensors"] - live[0]["tensors"] if len(live) == 2 else None,
                    "iter_s_median": sorted(r["iter_s"] for r in recs)[len(recs) // 2]})
    props = {
        "alive": alive["ok"] and all(len(r) == iters for r in per_rank),
        "raised_everywhere": not any("mis-raised" in p or "returned a value from the failed" in p
                                     or "next exchange" in p or "did not raise" in p or "non-NaN" in p
                                     or "raised in the call whose" in p or "training step" in p
                                     or "NaN rows" in p for p in problems),
        "exact": not any("good call" in p or "did not fire" in p or "ranks drew" in p for p in problems),
        "rss_flat": all(r["judged"] and r["growth_mb"] < max_growth_mb and r["tensor_growth"] is not None
                        and r["tensor_growth"] <= MAX_TENSOR_GROWTH for r in rss),
    }
    return {"world_size": world_size, "iters": iters, "iters_done": complete, "max_growth_mb": max_growth_mb,
            "properties": props, "ok": all(props.values()), "alive": alive,
            "counts": {k: dict(v) for k, v in counts.items()},
            "failed_calls": {k: dict(v) for k, v in failed.items()}, "faults_not_fired": not_fired,
            "raised_types": dict(raised_types), "good_calls": good_calls, "exact_calls": exact_calls,
            "problems": problems[:200], "num_problems": len(problems), "rss": rss}


def run(iters: int, world_size: int, seed: int, max_growth_mb: float, cases: Optional[List[Case]] = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="moe_comm_fault_loop_") as out_dir:
        alive = {"ok": True, "error": None}
        t0 = time.perf_counter()
        try:
            run_ranks(rank_main, world_size, iters, seed, out_dir, cases, timeout=120.0)
        except Exception as err:  # noqa: BLE001 - a rank that died or exited non-zero: property 1 fails
            alive = {"ok": False, "error": f"{type(err).__name__}: {err}"[:4000]}
        wall = time.perf_counter() - t0
        per_rank = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.jsonl")
            with open(path) if os.path.exists(path) else contextlib.nullcontext([]) as f:
                per_rank.append([json.loads(line) for line in f if line.strip()])
    result = summarize(per_rank, iters, world_size, alive, max_growth_mb)
    result.update(seed=seed, wall_s=wall, replayed=[dataclasses.asdict(c) for c in cases or []])
    return result


# --------------------------------------------------------------------------------------------------------
# Report

def _table(title: str, columns: List[str], rows: List[List[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print("  ".join(f"{c:>14}" for c in columns))
        for r in rows:
            print("  ".join(f"{v:>14}" for v in r))
        return
    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(*r)
    Console(width=160).print(t)


def print_report(res: dict) -> None:
    c, f = res["counts"], res["failed_calls"]
    _table(f"Fault loop: W={res['world_size']}, {res['iters_done']}/{res['iters']} iterations, seed {res['seed']}, "
           f"{res['wall_s']:.1f} s", ["kind", "drawn", "by phase", "failed calls"],
           [[k, str(c["kind"].get(k, 0)),
             " ".join(f"{p} {c['kind_phase'][f'{k}/{p}']}" for p in ("fwd", "bwd", "train")
                      if f"{k}/{p}" in c["kind_phase"]), str(f["kind"].get(k, 0))] for k in KINDS])
    _table("by mode", ["mode", "drawn", "failed calls"],
           [[m, str(c["mode"].get(m, 0)), str(f["mode"].get(m, 0))] for m in MODES])
    _table("RSS per rank (MiB; medians of the 2nd and last quarter)",
           ["rank", "start", "end", "growth", "anon start", "anon end", "slope KiB/it", "live tensors", "s/iter"],
           [[str(r["rank"]), f"{r['rss']['start_mb']:.1f}", f"{r['rss']['end_mb']:.1f}", f"{r['growth_mb']:+.2f}",
             f"{r['anon_rss']['start_mb']:.1f}", f"{r['anon_rss']['end_mb']:.1f}",
             f"{r['rss']['slope_kb_per_step']:+.1f}", " -> ".join(map(str, r["live_tensors"])),
             f"{r['iter_s_median']:.3f}"]
            for r in res["rss"] if r["judged"]])
    print(f"good calls exact: {res['exact_calls']}/{res['good_calls']}; faults not fired: {res['faults_not_fired']}")
    print("properties: " + ", ".join(f"{k}={v}" for k, v in res["properties"].items()))
    if not res["properties"]["rss_flat"]:
        print(f"  memory limits: RSS growth < {res['max_growth_mb']} MiB, live tensors +{MAX_TENSOR_GROWTH} at most")
    if res["alive"]["error"]:
        print("ranks: " + res["alive"]["error"])
    for p in res["problems"][:20]:
        print("  " + p)
    print("PASS" if res["ok"] else f"FAIL ({res['num_problems']} problems)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-growth-mb", type=float, default=2.0,
                   help="RSS limit: median of the last quarter minus the second quarter's, per rank (default 2)")
    p.add_argument("--json", default=None, help="write the result to this path")
    p.add_argument("--case", action="append", default=[], metavar="KIND,MODE,PHASE,CHUNK,C,BAD,K",
                   help="replay this case (repeatable; cycled over --iters) instead of drawing: reproduces one "
                        "iteration of a run")
    a = p.parse_args(argv)
    if a.iters < 8:
        p.error(f"--iters must be >= 8 (RSS is judged on quarters), got {a.iters}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    cases = []
    for text in a.case:
        kind, mode, phase, chunk, C, bad, K = text.split(",")
        cases.append(Case(kind=kind, mode=mode, phase=phase, chunk=int(chunk), C=int(C), bad=int(bad), K=int(K)))
    res = run(a.iters, a.world_size, a.seed, a.max_growth_mb, cases)
    print_report(res)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
