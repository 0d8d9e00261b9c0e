"""num_chunks="auto": pick the pipeline depth C from measurements, not guesses.

Model (one forward; backward is the same with twice the compute). Per chunk, an all-to-all of S/C
bytes takes c = alpha + S / (C * beta) (alpha: latency, beta: bandwidth, fitted on this group), and the
experts take x = X / C + kappa (X: measured expert time of the whole step, kappa: fixed cost of one
more chunk: a kernel launch / Python round). Dispatch and combine share the link, so
    T(C) = max(C * x + 2c,  2C * c + x)
which is x + 2c (serial) at C = 1, compute-bound C * x + 2c or link-bound 2C * c + x beyond.
Only a fraction eta of that overlap is real: where the transport copies bytes on the same cores as
the GEMMs (gloo on loopback), communication in flight slows the compute down. eta is measured by
running an all-to-all under a GEMM of the same duration: eta = (t_gemm + t_a2a - t_both) / min(...),
so  T_eff(C) = serial(C) - eta * (serial(C) - T(C)),  serial(C) = C * x + 2C * c.
Measured here: eta ~0.2-0.4 on loopback with 2-4 ranks on 2 cores, ~0.9 on a 1 Gbit/s shaped link.
C = 1 wins when communication is negligible (every extra chunk only adds alpha and kappa).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["PipelinePlan", "fit_alpha_beta", "measure_alpha_beta", "measure_overlap", "predict_step",
           "choose_num_chunks", "chunk_overhead", "call_expert_fn", "now", "AutoChunker"]

CANDIDATES = (1, 2, 4, 8, 16)
KAPPA_S = 2e-4  # default per-chunk fixed cost when none is measured (~0.2 ms: Python + launches)


@dataclass
class PipelinePlan:
    """What ``num_chunks="auto"`` chose and why (``layer.pipeline_plan``)."""

    num_chunks: int
    alpha_s: float                 # all-to-all latency
    beta_bytes_per_s: float        # all-to-all bandwidth (bytes leaving a rank per second)
    expert_s: float                # measured expert compute of one forward (slowest rank)
    kappa_s: float                 # measured fixed cost of one more chunk (experts on an empty chunk)
    overlap_efficiency: float      # eta: share of the ideal overlap this machine delivers (measured)
    bytes_per_a2a: int             # bytes one rank sends in the dispatch (largest over ranks)
    predicted_s: Dict[int, float] = field(default_factory=dict)  # C -> predicted fwd+bwd time
    measured_s: Dict[int, float] = field(default_factory=dict)   # C -> measured forward (shortlist trials)
    reason: str = ""

    def as_dict(self) -> Dict:
        return asdict(self)


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]):
    """Least-squares fit t = alpha + size / beta. Returns (alpha >= 0, beta > 0)."""
    n = len(sizes)
    if n < 2:
        raise ValueError(f"sizes needs at least 2 points, got {n}")
    mx, my = sum(sizes) / n, sum(times) / n
    sxx = sum((s - mx) ** 2 for s in sizes)
    slope = sum((s - mx) * (t - my) for s, t in zip(sizes, times)) / sxx if sxx > 0 else 0.0
    slope = max(slope, 1e-15)  # a flat fit means a very fast link
    alpha = max(my - slope * mx, 0.0)
    return alpha, 1.0 / slope


def measure_alpha_beta(group: Optional[dist.ProcessGroup], device: torch.device,
                       sizes: Sequence[int] = (4 << 10, 64 << 10, 512 << 10, 2 << 20), repeats: int = 3):
    """Time all_to_all_single of even splits at several per-rank sizes (bytes) on ``group``; fit alpha, beta.

    Collective: every rank of the group must call it with the same arguments. Returns (alpha, beta),
    the slowest rank's view (all-reduced MAX of each median time).
    """
    if group is None or dist.get_world_size(group) == 1:
        return 0.0, float("inf")
    W = dist.get_world_size(group)
    medians = []
    for size in sizes:
        per = max(size // W, 1)
        send = torch.zeros(per * W, dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)
        samples = []
        for _ in range(repeats + 1):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_to_all_single(recv, send, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # host sync: one-time measurement
            samples.append(time.perf_counter() - t0)
        medians.append(statistics.median(samples[1:]))
    t = torch.tensor(medians, dtype=torch.float64).to(device)  # collectives take the group's device
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return fit_alpha_beta([float(s) for s in sizes], t.tolist())  # host sync: one-time measurement


def measure_overlap(group: Optional[dist.ProcessGroup], device: torch.device, nbytes: int,
                    repeats: int = 3) -> float:
    """eta in [0, 1]: how much of an all-to-all of ``nbytes`` per rank hides under a GEMM of equal length.

    Collective (same arguments on every rank); returns the smallest eta over the ranks.
    """
    if group is None or dist.get_world_size(group) == 1:
        return 1.0
    W = dist.get_world_size(group)
    per = max(int(nbytes) // W, 1)
    send = torch.zeros(per * W, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # host sync: one-time measurement
        return time.perf_counter() - t0

    def a2a():
        dist.all_to_all_single(recv, send, group=group)

    t_a2a = []
    for _ in range(repeats + 1):
        dist.barrier(group=group)
        t_a2a.append(timed(a2a))
    t_a2a = statistics.median(t_a2a[1:])
    n = 128  # grow a square GEMM until it lasts as long as the all-to-all (local, no collectives)
    a = torch.randn(n, n, device=device)
    t_mm = timed(lambda: a @ a)
    while t_mm < t_a2a and n < 4096:
        n *= 2
        a = torch.randn(n, n, device=device)
        t_mm = min(timed(lambda: a @ a) for _ in range(2))
    both = []
    for _ in range(repeats):
        dist.barrier(group=group)

        def together():
            work = dist.all_to_all_single(recv, send, group=group, async_op=True)
            a @ a
            work.wait()
        both.append(timed(together))
    t_both = statistics.median(both)
    eta = (t_mm + t_a2a - t_both) / max(min(t_mm, t_a2a), 1e-9)
    out = torch.tensor([min(max(eta, 0.0), 1.0)], dtype=torch.float64).to(device)
    dist.all_reduce(out, op=dist.ReduceOp.MIN, group=group)
    return float(out)  # host sync: one-time measurement (num_chunks='auto', profile)


def predict_step(C: int, expert_s: float, nbytes: float, alpha: float, beta: float,
                 kappa: float = KAPPA_S, overlap: float = 1.0) -> float:
    """Predicted forward + backward time of the pipelined experts with C chunks (see module doc)."""
    c = alpha + nbytes / (C * beta) if beta != float("inf") else alpha
    total = 0.0
    for X in (expert_s, 2.0 * expert_s):  # forward, backward
        x = X / C + kappa * (X / expert_s if expert_s > 0 else 1.0)  # backward costs twice per chunk too
        serial = C * x + 2 * C * c
        total += serial - overlap * (serial - max(C * x + 2 * c, 2 * C * c + x))
    return total


def choose_num_chunks(expert_s: float, nbytes: float, alpha: float, beta: float, kappa: float = KAPPA_S,
                      candidates: Sequence[int] = CANDIDATES, overlap: float = 1.0) -> PipelinePlan:
    """The C in ``candidates`` with the smallest predicted step (ties: the smaller C).

    A deeper pipeline must beat the next shallower one by 3% to be chosen: the model ignores the
    GEMM efficiency lost on smaller chunks."""
    pred = {C: predict_step(C, expert_s, nbytes, alpha, beta, kappa, overlap) for C in candidates}
    best = candidates[0]
    for C in candidates[1:]:
        if pred[C] < 0.97 * pred[best]:
            best = C
    comm = 2 * (alpha + (nbytes / beta if beta != float("inf") else 0.0))
    serial = pred[1]
    reason = (f"C={best}: overlap efficiency {overlap:.2f}, per-chunk overhead {kappa * 1e3:.2f} ms, "
              f"comm {comm * 1e3:.2f} ms/fwd (alpha {alpha * 1e6:.0f} us, beta {beta / 1e9:.2f} GB/s, "
              f"{nbytes / 1e6:.2f} MB per a2a), experts {expert_s * 1e3:.2f} ms/fwd; predicted fwd+bwd "
              f"{pred[best] * 1e3:.2f} ms vs {serial * 1e3:.2f} ms unchunked")
    return PipelinePlan(num_chunks=best, alpha_s=alpha, beta_bytes_per_s=beta, expert_s=expert_s, kappa_s=kappa,
                        overlap_efficiency=overlap,
                        bytes_per_a2a=int(nbytes), predicted_s=pred, reason=reason)


def call_expert_fn(expert_fn, tokens_RH: torch.Tensor, tokens_per_expert_e: torch.Tensor, counts_e,
                   segments=None) -> torch.Tensor:
    """``expert_fn(tokens_RH, tokens_per_expert_e)`` (plus ``counts=`` the host list when the function
    has ``wants_host_counts = True``); its result must be [R, H] like tokens_RH. counts_e None (sync-free
    mode): rows past tokens_per_expert_e.sum() are padding; a function with ``supports_padded = True`` is
    told so with ``padded=True`` (and must not read the counts on the host). ``segments``: the rows are in
    (source rank, local expert) blocks, not expert-major; given only to a function whose
    ``prefers_segments(block_rows, device)`` chose them, as ``segments=`` [(local expert, first row, rows),
    ...] instead of counts."""
    if segments is not None:
        out_RH = expert_fn(tokens_RH, tokens_per_expert_e, segments=segments)
    elif counts_e is None:
        padded = {"padded": True} if getattr(expert_fn, "supports_padded", False) else {}
        out_RH = expert_fn(tokens_RH, tokens_per_expert_e, **padded)
    elif getattr(expert_fn, "wants_host_counts", False):
        out_RH = expert_fn(tokens_RH, tokens_per_expert_e, counts=list(counts_e))
    else:
        out_RH = expert_fn(tokens_RH, tokens_per_expert_e)
    if not isinstance(out_RH, torch.Tensor) or tuple(out_RH.shape) != tuple(tokens_RH.shape):
        got = tuple(out_RH.shape) if isinstance(out_RH, torch.Tensor) else type(out_RH).__name__
        raise ValueError(f"expert_fn must return [R, H] = {list(tokens_RH.shape)}, got {got}")
    return out_RH


def now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: only while measuring for num_chunks="auto" / profiling
    return time.perf_counter()


def chunk_overhead(expert_fn, like_TH: torch.Tensor, num_local_experts: int, repeats: int = 5) -> float:
    """Seconds one more pipeline chunk costs beyond its rows: ``expert_fn`` on one row per local expert,
    forward and input-gradient backward, median of ``repeats``, forward share (one third). Local."""
    e = num_local_experts
    rows = like_TH.new_zeros(e, like_TH.shape[1])
    tokens_per_expert_e = torch.ones(e, dtype=torch.int64, device=like_TH.device)
    samples = []
    for _ in range(repeats):
        t0 = now(like_TH.device)
        with torch.enable_grad():
            t_in = rows.detach().requires_grad_(True)
            out = call_expert_fn(expert_fn, t_in, tokens_per_expert_e, [1] * e)
            if out.requires_grad:  # input gradient only: nothing accumulates into .grad
                torch.autograd.grad(out.sum(), [t_in], allow_unused=True)
        samples.append(now(like_TH.device) - t0)
    return statistics.median(samples) / 3.0  # forward share of forward + backward


class AutoChunker:
    """The ``num_chunks="auto"`` state machine of one Dispatcher.

    Call 1 runs unchunked as a warm-up (lazy inits, kernel builds); call 2 unchunked with the experts
    timed, after which the model shortlists C = 1, its choice with the measured overlap efficiency and
    its choice with perfect overlap; the next calls try each shortlisted C twice, interleaved, and the
    fastest (slowest rank, best of two) is kept for good. Every rank takes the same steps (the times are
    all-reduced), so all agree on C. Collectives use tensors on ``device`` (the group's).
    """

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device):
        self.group, self.device = group, device
        self.world = 1 if group is None else dist.get_world_size(group)
        self.plan: Optional[PipelinePlan] = None
        self.calls, self.order, self.times, self.model = 0, None, [], None
        self.last_C = 1

    def step(self):
        """(C, measure_experts, timed_trial) for this call."""
        if self.plan is not None:
            return self.plan.num_chunks, False, False
        if torch._C._current_graph_task_id() != -1:
            # Inside backward (activation checkpointing recomputes the forward): repeat the C of the
            # forward being recomputed and leave the tuning state alone, identically on every rank.
            return self.last_C, False, False
        self.calls += 1
        if self.order is None:
            self.last_C = 1
            return 1, self.calls >= 2, False
        self.last_C = self.order[len(self.times)]
        return self.last_C, False, True

    def _all_max(self, values) -> list:
        t = torch.tensor(values, dtype=torch.float64).to(self.device)
        if self.group is not None and self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()  # host sync: only while tuning num_chunks="auto" (a few calls)

    def record_trial(self, seconds: float) -> None:
        self.times.append(seconds)
        if len(self.times) < len(self.order):
            return
        best_of: Dict[int, float] = {}
        for C, sec in zip(self.order, self._all_max(self.times)):
            best_of[C] = min(best_of.get(C, float("inf")), sec)
        chosen = min(best_of, key=lambda C: (best_of[C], C))
        tried = ", ".join(f"C={C} {sec * 1e3:.1f} ms" for C, sec in sorted(best_of.items()))
        self.plan = PipelinePlan(**{**self.model.as_dict(), "num_chunks": chosen, "measured_s": best_of,
                                    "reason": f"C={chosen}: fastest forward of the shortlist ({tried}); "
                                              f"model: {self.model.reason}"})

    def make_plan(self, expert_s: float, nbytes: float, kappa: float) -> None:
        """After the timed unchunked call: fit the link, model C, and set up the shortlist trials.
        Collective: all ranks agree on the slowest rank's expert time, largest message and overhead."""
        alpha, beta = measure_alpha_beta(self.group, self.device)
        expert_max, bytes_max, kappa_max = self._all_max([expert_s, float(nbytes), kappa])
        # eta: probed with a message of one chunk of a 4-deep pipeline (what overlap would move).
        eta = measure_overlap(self.group, self.device, int(bytes_max // 4))
        model = choose_num_chunks(expert_max, bytes_max, alpha, beta, kappa_max, overlap=eta)
        ideal = choose_num_chunks(expert_max, bytes_max, alpha, beta, kappa_max, overlap=1.0)
        shortlist = sorted({1, model.num_chunks, ideal.num_chunks})
        if len(shortlist) == 1:  # nothing to try: the model says C = 1 either way
            self.plan = model
            return
        self.order, self.model = shortlist * 2, model
