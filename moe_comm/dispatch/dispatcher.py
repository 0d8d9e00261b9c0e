"""Dispatcher: tokens -> their experts' ranks (dispatch) and back (combine), with autograd. The public API.

Shapes legend: T tokens, H hidden, K top-k, E experts (global), e = E / W local experts,
W EP world size, C chunks, N routed rows sent, R rows received.

One token's path (``__call__``): make_layout -> control exchange issued (header + per-chunk counts)
-> permute (rows grouped by chunk, dest rank, local expert) while it travels -> control exchange read
(the only host sync of the forward) -> per chunk, through one Transport: rows to the experts' ranks
-> experts -> rows back -> end-of-forward exchange (did every rank complete?) -> unpermute with the
routing weights. ``dispatch``/``combine`` are the same steps with C = 1 and user code between them.
"""
from __future__ import annotations

import zlib
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from moe_comm import ops
from moe_comm._checks import (check_bool, check_choice, check_float, check_int, check_tensor, graph_break,
                              graph_breaks_applied)
from moe_comm.comm.agree import agree
from moe_comm.comm.channel import Channel, next_index
from moe_comm.comm.collectives import group_device, group_rank, group_size, resolve_group
from moe_comm.comm.wire import Failure, Phase, dtype_code
from moe_comm.dispatch.autotune import AutoChunker, PipelinePlan, chunk_overhead, now
from moe_comm.dispatch.control import CallControl
from moe_comm.dispatch.hierarchy import NodeLevels, node_size
from moe_comm.dispatch import send_rows
from moe_comm.dispatch.plan import (ChunkPlan, DispatchHandle, DispatchOutput)
from moe_comm.dispatch.two_step import CombineRows, DispatchRows
from moe_comm.dispatch.workspace import shared_workspace
from moe_comm.kernels import BACKENDS
from moe_comm.profiling import Timeline

__all__ = ["Dispatcher", "DispatchOutput", "DispatchHandle", "ChunkPlan"]

# torch.compile: every public call is one opaque step (host-side protocol, collectives, host reads of counts);
# the graph breaks exactly here and the router and everything around the layer compile.
# (graph_break: torch.compiler.disable, applied when torch._dynamo is imported, so import moe_comm stays light)
_graph_break = graph_break

MAX_CHUNKS = 16  # default bound on C per call: sizes the control exchange (S = max_chunks x e words per rank)
DIRECT_MIN_BYTES_CPU = 1 << 20  # gloo, 4 ranks on 2 cores: point-to-point slower at 256 KiB, faster at 4 MiB
NEVER = 1 << 62
DISPATCH_DTYPES = (torch.float8_e4m3fn,)
# An eager call that moves at most this many bytes of rows over the whole group closes each phase inside its last
# transfer (its status rows ride after each destination's rows) instead of a closing exchange of its own: two
# collectives fewer per step, for a copy of the last chunk's rows each way (no rank's copy exceeds the bound).
# gloo, 2 cores: an exchange timed alone costs 0.4-0.5 ms at W = 2, 4-5 ms at W = 4 (less inside a step, where
# the ranks arrive together); a 1 MiB copy about 0.1 ms.
CARRY_MAX_BYTES = 1 << 20


class Dispatcher(CallControl):
    """Moves token rows to the ranks holding their experts and back.

    Args:
        num_experts: E, global experts; expert g lives on EP rank g // (E / W) as local expert g % (E / W).
        ep_group: process group of the EP ranks (any backend: NCCL, gloo, ...). None: WORLD when
            torch.distributed is initialised, else a single process (W = 1, no collectives).
        num_chunks: C, micro-chunks for ``__call__`` (tokens split into C contiguous ranges), or "auto".
        backend: permutation kernels, "auto" | "triton" | "native" | "torch".
        strict: also reject non-finite (NaN/Inf) rows of x: every rank raises, naming the rank that
            holds them (checked on the device and folded into the control exchange: no extra sync).
            Default False: a NaN token poisons only its own output rows.
        timeout: seconds to wait for any one exchange before raising CollectiveError naming the phase,
            the chunk and the peers that did not arrive (None: the process group's timeout). After a
            CollectiveError the group is marked unusable: every later call raises at once. On NCCL groups
            waits never block the host: the process group's own timeout (watchdog) applies there.
        direct_min_bytes: rows move point-to-point straight into expert-major order (no regroup pass)
            when the mean (rank pair, local expert, chunk) segment is at least this large; smaller ones
            go in one all-to-all plus a regroup, which costs fewer round trips (see ``transport.choose``).
            None: 1 MiB on CPU groups (measured on gloo); never on CUDA (W x e NCCL sends per call, not
            measured there: the collective path).
        max_chunks: the largest C a call may use (sizes the fixed control exchange; default
            max(16, num_chunks)).
        allow_single_process: with ep_group None and torch.distributed not initialised in a process a
            launcher started as one of several (torchrun's RANK / WORLD_SIZE), run alone anyway (default:
            raise, such a process would silently not be expert-parallel).
        end_check: when the end-of-forward and end-of-backward exchanges of ``__call__`` are read.
            "eager" (default on CPU, and with ``ranks_per_node``): at the end of the phase, so a failure
            mid-call on any rank raises on every rank before any returns (one more host read per phase: free on
            CPU, a sync on CUDA). A call that moves at most ``carry_max_bytes`` (1 MiB) of rows over the group
            reads it from status rows that ride in the phase's last transfer: no exchange of its own.
            "deferred" (default on CUDA): with the next read of this Dispatcher (the backward pass's first
            check-in, which reads every Dispatcher on the group at once, or the next call), keeping the
            forward at one host sync and a backward pass at one however deep; a failure mid-call then returns
            placeholder rows on every rank and raises on every rank at that next read (before any gradient
            is produced in training). ``check()`` reads it now.
        max_tokens_per_rank: M, turns on the sync-free mode of ``__call__`` (C = 1): every exchange has a
            fixed size (W x M x K rows of H per direction, padded with zeros), so a call reads nothing on
            the host after the first (which agrees on H, dtype and K: one read) - no host sync in forward or
            backward, the shape a CUDA graph can capture. The counts travel in the control exchange and stay
            on the device; ``expert_fn`` gets padded rows (see ``__call__``). Failures are deferred: a rank
            with more than M tokens, another H, dtype or K than its first call, or whose expert_fn raises,
            moves zero (placeholder) rows through the call like its peers and returns zeros of x's shape,
            so every rank issues the same collectives; every rank raises at ``check()`` (one host sync; in
            training call ``moe_comm.check(model)`` after the forward, before the backward). Costs: W x M x
            K x H x element size bytes per direction on the wire and as buffers, whatever the routing;
            ``dispatch``/``combine`` are not available. None (default): dropless, exact sizes (one host
            read per forward).
        dedup: one copy per (token, destination rank) in ``__call__`` (W > 1): a token whose top-k experts
            share a rank travels there once, with the local expert ids and weights of its slots ([K] ids and
            [K] weights, a second small all-to-all); that rank expands it to its experts and sends back one
            row, the weighted sum of their outputs (summed in slot order: deterministic). The backward
            mirrors it, and the weights' gradient comes back with the input gradient. Pays off when tokens
            often pick several experts of one rank (K > 1, e > 1, group-limited routing); costs the expansion
            pass and two small exchanges per chunk. Not with ``dispatch``/``combine`` (their weights are only
            known at combine) nor the sync-free mode. Default False. On CPU a C = 1 call after one that moved
            12 MiB from some rank sends its rows in 4 pieces, each permuted just before it goes
            (``moe_comm.dispatch.send_rows``); the experts then see each expert's rows in (piece, source
            rank) order.
        dispatch_dtype: None (default: rows travel in x's dtype) or torch.float8_e4m3fn: FP8 dispatch. Each
            token row is quantized once with one scale per 128 elements (``moe_comm.ops.quantize_rows``:
            ~1.03 bytes per element with fp32 scales), the packed rows travel, the experts' ranks dequantize
            them to x's dtype before the experts. Combine and every backward transfer stay in x's dtype; the
            gradient passes the quantization straight through. Also applies to ``dispatch()`` (it returns
            dequantized rows in x's dtype) and the sync-free mode.
        dispatch_scales: "fp32" (default) or "ue8m0" (power-of-two scales, one byte each) for FP8 dispatch.
        ranks_per_node: None (default): every rank sends straight to every rank. L (an int): EP ranks k*L ..
            k*L+L-1 are node k: a token crosses to each destination node once (one row per (token, node) over
            the rail group of ranks with its local index), is forwarded inside that node once per rank
            holding any of its experts, and combine sums inside the node before the one row goes back
            (``moe_comm.dispatch.hierarchy``). "auto": L from torchrun's LOCAL_WORLD_SIZE. One node or one rank
            per node stays flat. Every phase opens and closes with a control exchange over the whole group
            around the levels' own (read eagerly); with FP8 only the rail rows are FP8. Not with
            dispatch()/combine(), the sync-free mode, num_chunks="auto" or end_check="deferred" (it reads every
            exchange). ``last_bytes`` then also splits the
            wire bytes by link ("*_wire_inter", "*_wire_intra", this rank's rows to other ranks only).
        summed_words: float64 words a call may add to its control exchange (``__call__``'s ``summed_X``),
            summed over the EP group there into ``last_sum``: statistics that then need no collective of their
            own (MoELayer's load counts). Default 0.

    Construction is collective when W > 1: every rank must build its Dispatchers on a group in the same
    order with the same E, max_chunks, strict and direct_min_bytes (checked: every rank raises naming
    the field otherwise). Every rank must call the same methods in the same order, and backpropagate
    through their outputs (the backward is collective too); a rank that does not is named on every rank.
    """

    def __init__(self, num_experts: int, ep_group: Optional[dist.ProcessGroup] = None, num_chunks=1,
                 *, backend: str = "auto", strict: bool = False, timeout: Optional[float] = None,
                 direct_min_bytes: Optional[int] = None, max_chunks: Optional[int] = None,
                 end_check: Optional[str] = None, allow_single_process: bool = False,
                 max_tokens_per_rank: Optional[int] = None, dedup: bool = False,
                 dispatch_dtype: Optional[torch.dtype] = None, dispatch_scales: str = "fp32", summed_words: int = 0,
                 ranks_per_node=None):
        graph_breaks_applied()
        self.group = resolve_group(ep_group, name="Dispatcher: ep_group", allow_single_process=allow_single_process)
        self.world_size = group_size(self.group)
        self.rank = group_rank(self.group)
        local_error = None
        try:  # a rank whose arguments are rejected still joins the agreement below: every rank raises
            max_chunks = check_options(num_experts, self.world_size, num_chunks, backend=backend, timeout=timeout,
                                       direct_min_bytes=direct_min_bytes, max_chunks=max_chunks, end_check=end_check,
                                       max_tokens_per_rank=max_tokens_per_rank, dedup=dedup,
                                       dispatch_dtype=dispatch_dtype, dispatch_scales=dispatch_scales,
                                       summed_words=summed_words)
            nodes_L = node_size(ranks_per_node, self.group, self.world_size)
            if nodes_L is not None and (max_tokens_per_rank is not None or num_chunks == "auto"
                                        or end_check == "deferred"):
                raise ValueError("Dispatcher: ranks_per_node (two-level dispatch) is not available with "
                                 "max_tokens_per_rank (the sync-free mode), num_chunks='auto' nor "
                                 f"end_check='deferred' (it reads every exchange), got max_tokens_per_rank="
                                 f"{max_tokens_per_rank!r}, num_chunks={num_chunks!r}, end_check={end_check!r}")
        except Exception as err:  # noqa: BLE001 - any local failure travels to the agreement: every rank raises
            local_error = err
            max_chunks = max_chunks if isinstance(max_chunks, int) else MAX_CHUNKS
            nodes_L = None
        self.index = next_index(self.group)
        device_type = group_device(self.group).type
        if not isinstance(direct_min_bytes, int) or isinstance(direct_min_bytes, bool):
            # Measured on gloo only; on CUDA W x e NCCL sends per call are unmeasured: the collective path.
            direct_min_bytes = DIRECT_MIN_BYTES_CPU if device_type == "cpu" else NEVER
        if end_check not in ("eager", "deferred"):
            end_check = "eager" if device_type == "cpu" or nodes_L is not None else "deferred"
        if max_tokens_per_rank is not None and not isinstance(max_tokens_per_rank, int):
            max_tokens_per_rank = -1  # rejected above; a comparable value for the agreement
        settings = dict(index=self.index, num_experts=num_experts, max_chunks=max_chunks, strict=bool(strict),
                        direct_min_bytes=direct_min_bytes, end_check=end_check, max_tokens_per_rank=max_tokens_per_rank,
                        dedup=dedup is True, dispatch_dtype=str(dispatch_dtype), dispatch_scales=str(dispatch_scales),
                        summed_words=summed_words, ranks_per_node=nodes_L or 0)
        agree(self.group, settings, what="Dispatcher", local_error=local_error, timeout=timeout)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.world_size
        self.num_chunks, self.max_chunks = num_chunks, max_chunks
        self.backend, self.strict, self.timeout = backend, bool(strict), timeout
        self.direct_min_bytes, self.end_check = direct_min_bytes, end_check
        self._settings_hash = zlib.crc32(repr(sorted(settings.items())).encode())
        self.dedup = dedup is True
        self.dispatch_dtype, self.dispatch_scales = dispatch_dtype, dispatch_scales
        # counts area: slots per (chunk, local expert), then with dedup the rows per chunk
        self.summed_words = summed_words
        self.channel = Channel(self.group, self.index, max_chunks * (self.num_local_experts + self.dedup), timeout,
                               summed=summed_words)
        self.last_sum: Optional[torch.Tensor] = None  # the last call's summed words (see summed_words)
        self._transports = {}
        # Disabled: records nothing until enabled. On CUDA its spans are CUDA events on the working streams
        # (NCCL's Work completes at enqueue, so host clocks would read ~0 for comm).
        self.timeline = Timeline(rank=self.rank, device=self.channel.device)
        self.workspace = shared_workspace()  # scratch rows of the transfers, one set per process (CPU)
        self.auto = AutoChunker(self.group, self.channel.device)
        self.last_transport = ""  # name of the Transport the last call used ("all_to_all", "point_to_point", ...)
        self.max_tokens_per_rank = max_tokens_per_rank
        self._agreed = None  # sync-free mode: (H, dtype, K) every rank agreed on in its first call
        # bytes this rank sent in its last call, per direction: "dispatch_logical", "dispatch_wire",
        # "combine_logical", "combine_wire" (see _record_bytes); empty before the first call
        self.last_bytes = {}
        self.last_rows_W = []  # rows this rank sent to each rank in its last call (host ints)
        self._stream = False  # one copy per rank: the next C = 1 call moves its rows in pieces (send_rows.pieces)
        self.carry_max_bytes = CARRY_MAX_BYTES
        # the backward pass's first check-in reads every such Dispatcher of the group (pipeline backward)
        self.channel.reads_with_group = self.end_check == "deferred" and not self.sync_free and self.world_size > 1
        if self.sync_free:  # a read that finds this rank skipped a backward issues a placeholder one
            from moe_comm.dispatch.sync_free import placeholder_backward

            self.channel.resync = lambda: placeholder_backward(self)
        # two levels (rail, node) when the EP group spans nodes; None: every rank sends straight to every rank
        self.ranks_per_node = nodes_L
        self._nodes = None if nodes_L is None else NodeLevels(self, nodes_L)
        if self._nodes is not None:
            self.timeline = self._timeline

    # ---------------------------------------------------------------- properties
    @property
    def carry_max_bytes(self) -> int:
        """Calls that move at most this many bytes of rows over the whole group (every rank's sent rows, summed)
        close each phase inside its last transfer (no end-of-phase exchange); -1: never. Every rank must set the
        same value: it is part of the settings every exchange's header carries (``config_hash``), so a rank that
        differs makes every rank raise at the next call, before any row moves."""
        return self._carry_max_bytes

    @carry_max_bytes.setter
    def carry_max_bytes(self, value: int) -> None:
        check_int("Dispatcher.carry_max_bytes", value, -1)
        self._carry_max_bytes = value

    @property
    def config_hash(self) -> int:
        """The settings every rank agreed on at construction, and carry_max_bytes: in every exchange's header."""
        return zlib.crc32(f"{self._settings_hash} {self._carry_max_bytes}".encode())

    @property
    def sync_free(self) -> bool:
        """``max_tokens_per_rank`` is set: fixed-size exchanges, no host read after the first call."""
        return self.max_tokens_per_rank is not None

    @property
    def plan(self) -> Optional[PipelinePlan]:
        """The final num_chunks="auto" plan (None until the trials are done)."""
        return self.auto.plan

    @property
    def timeline(self) -> Timeline:
        return self._timeline

    @timeline.setter
    def timeline(self, tl: Timeline) -> None:
        self._timeline = tl
        if hasattr(self, "channel"):
            self.channel.timeline = tl
        for t in getattr(self, "_transports", {}).values():
            t.timeline = tl
        if getattr(self, "_nodes", None) is not None:
            self._nodes.set_timeline(tl)

    def transport(self, kind: type):
        """The Transport instance of class ``kind`` (Local, AllToAll, PointToPoint) of this Dispatcher."""
        if kind not in self._transports:
            self._transports[kind] = kind(self.group, self.world_size, self.rank, self.num_local_experts,
                                          self.workspace, self.backend, self.timeline, self.timeout)
        return self._transports[kind]

    def _record_bytes(self, handle: DispatchHandle, x_TH: torch.Tensor, meta_bytes: int = 0) -> None:
        """``last_bytes`` of this call (host ints, no sync): logical = routed slots x H x element size, as
        the field counts a dispatch; wire = what this rank hands the all-to-alls (rows, FP8 scales, the
        metadata of one copy per rank, ``meta_bytes`` per row; rows to itself included)."""
        H, es, N = x_TH.shape[1], x_TH.element_size(), handle.layout.num_rows
        row_wire = H * es if self.dispatch_dtype is None else self._wire_width(H)
        logical = handle.slots_sent * H * es if handle.slots_sent >= 0 else -1  # sync-free: not read on the host
        self.last_bytes = dict(dispatch_logical=logical, dispatch_wire=N * (row_wire + meta_bytes),
                               combine_logical=logical, combine_wire=N * H * es)
        self.last_rows_W = [sum(p.send_splits_W[w] for p in handle.chunks) for w in range(self.world_size)]

    def _row_width(self, x_TH: torch.Tensor) -> int:
        """Elements of one sent row: H, or the FP8 packed width in bytes."""
        return x_TH.shape[1] if self.dispatch_dtype is None else self._wire_width(x_TH.shape[1])

    def _wire_dtype(self, x_TH: torch.Tensor) -> torch.dtype:
        return x_TH.dtype if self.dispatch_dtype is None else torch.uint8

    def _wire_width(self, hidden: int) -> int:
        """Bytes of one FP8 packed row (payload and scales)."""
        return ops.packed_width(hidden, ue8m0=self.dispatch_scales == "ue8m0")

    def _quantize(self, x_TH: torch.Tensor) -> torch.Tensor:
        """FP8 dispatch: each token's packed row (no autograd)."""
        return ops.quantize_rows(x_TH.detach(), ue8m0=self.dispatch_scales == "ue8m0", backend=self.backend)

    def _dequantize(self, q_RB: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """FP8 dispatch: received packed rows back in the tokens' dtype."""
        return ops.dequantize_rows(q_RB, hidden, dtype, ue8m0=self.dispatch_scales == "ue8m0", backend=self.backend)

    @_graph_break
    def check(self) -> None:
        """Collective: read the deferred end-of-phase exchanges now (``end_check="deferred"``); raises on every
        rank if a rank failed in the last call (sync-free mode: in any call since the last read). A no-op when
        nothing is deferred (on every rank alike); in the sync-free mode after its first call, always one read."""
        if self.channel.deferred or self.channel.folded is not None or self.channel.sticky is not None:
            with self.workspace.dropped_on_error():
                self.channel.end(None)

    # ---------------------------------------------------------------- public API
    @_graph_break
    def dispatch(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor) -> DispatchOutput:
        """Send every routed row to its expert's rank.

        Args:
            x_TH: [T, H] float tokens of this rank (T may be 0 and may differ between ranks).
            topk_idx_TK: [T, K] int64 global expert ids, -1 = dropped (no row is sent).
        Returns: DispatchOutput with tokens [R, H] expert-major, tokens_per_expert [e] int64 and
            the handle for ``combine``. Differentiable w.r.t. x_TH. One host sync (the control exchange).
        """
        self._no_sync_free("dispatch()")
        self._no_nodes("dispatch()")
        pending, layout = self._open(Phase.DISPATCH, x_TH, topk_idx_TK, 1)
        send_SH, failed = None, None
        if layout is not None and (self.world_size > 1 or self.dispatch_dtype is not None):
            try:
                with self.timeline.compute("permute"):  # while the control exchange travels
                    send_SH, _ = send_rows.presend(self, x_TH, layout, fresh=False)
            except Exception as err:  # noqa: BLE001 - W > 1: placeholder rows below, raised at combine()
                failed = err
        if layout is None:
            self.channel.end(pending)  # raises on every rank
        handle, err = self._close(pending, layout, 1, x_TH.shape[1])
        failed = failed or err
        if failed is not None and self.world_size == 1:
            raise failed
        self._record_bytes(handle, x_TH)
        plan = handle.chunks[0]
        if failed is not None:  # the peers wait in the transfer: placeholder rows go, every rank raises at combine()
            self.channel.carry(failed, f"the dispatch() of call {handle.call}")
            send_SH = handle.transport.local(
                lambda: x_TH.new_empty(plan.num_rows, self._row_width(x_TH), dtype=self._wire_dtype(x_TH)),
                "placeholder rows")[0]
        if send_SH is None:  # one process: the permuted rows are the result
            tokens_RH = ops.permute(x_TH, handle.layout, backend=self.backend)
        else:
            tokens_RH = DispatchRows.apply(x_TH, send_SH.narrow(0, 0, plan.num_rows), self, handle)
        return DispatchOutput(tokens=tokens_RH, tokens_per_expert=plan.tokens_per_expert_e, handle=handle)

    def _check_combine(self, expert_out_RH, topk_weight_TK, handle: DispatchHandle) -> None:
        plan = handle.chunks[0]
        check_tensor("expert_out_RH", expert_out_RH, dim=2, floating=True)
        if tuple(expert_out_RH.shape) != (plan.num_recv, handle.hidden_size):
            raise ValueError(f"expert_out_RH must be [R, H] = [{plan.num_recv}, {handle.hidden_size}] (the rows "
                             f"this handle's dispatch returned), got {tuple(expert_out_RH.shape)}")
        dtype_code(expert_out_RH.dtype)
        lay = handle.layout
        check_weights(topk_weight_TK, (lay.num_tokens, lay.top_k), lay.dest_row_TK.device)

    @_graph_break
    def combine(self, expert_out_RH: torch.Tensor, topk_weight_TK: torch.Tensor,
                handle: DispatchHandle, *, failed: Optional[BaseException] = None) -> torch.Tensor:
        """Send expert outputs back and sum each token's K slots with their weights.

        Args:
            expert_out_RH: [R, H] rows in the order ``dispatch`` returned them.
            topk_weight_TK: [T, K] float32/float64 routing weights (ignored for dropped slots).
            handle: ``DispatchOutput.handle`` of the matching dispatch.
            failed: an exception this rank met between dispatch() and combine() (its experts raised); it goes
                out in combine's control exchange instead of rows, so every rank raises there (this one with
                it, the others ``PeerFailed`` naming it) instead of its peers waiting for rows that never come.
                expert_out_RH is then not read (any placeholder).
        Returns: y_TH [T, H] in expert_out's dtype. Differentiable w.r.t. both inputs. Every rank checks
        its arguments in a control exchange before rows move (a bad argument on one rank raises on all).
        """
        self._no_sync_free("combine()")
        self._no_nodes("combine()")
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be the DispatchHandle from dispatch(), got {type(handle).__name__}")
        if handle.owner != id(self):
            raise ValueError("handle comes from another Dispatcher's dispatch(); combine it with that Dispatcher")
        if len(handle.chunks) != 1:
            raise ValueError("handle comes from a pipelined call, not from dispatch()")
        if handle.combined:  # local misuse after a completed collective call: raised here, no exchange
            raise ValueError("handle was already combined: each dispatch() is combined exactly once")
        error = None
        topk_weight_TK = _exact_float32(topk_weight_TK)
        try:
            if failed is not None and not isinstance(failed, BaseException):
                raise TypeError(f"failed must be an exception or None, got {type(failed).__name__}")
            if failed is None:
                self._check_combine(expert_out_RH, topk_weight_TK, handle)
        except (TypeError, ValueError) as err:
            error = err
        ok = error is None and failed is None
        kind = Failure.NONE if ok else Failure.REJECTED if error is not None else Failure.RAISED
        self._exchange_status(Phase.COMBINE, handle, error or failed, kind,
                              row_bytes=handle.hidden_size * expert_out_RH.element_size() if ok else -1,
                              dtype=dtype_code(expert_out_RH.dtype) if ok else -1)
        handle.combined = True
        with self.alone(f"the combine() of call {handle.call}"):
            y_NH = expert_out_RH
            if self.world_size > 1:
                # y_NH is saved for backward only when the weights need grad: then fresh memory, else a workspace.
                keep = torch.is_grad_enabled() and topk_weight_TK.requires_grad
                y_NH = CombineRows.apply(expert_out_RH, self, handle, keep)
            with self.timeline.compute("unpermute"):
                return ops.unpermute(y_NH, handle.layout, topk_weight_TK, backend=self.backend)

    @_graph_break
    def __call__(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor,
                 expert_fn: Callable[..., torch.Tensor], *, num_chunks: Optional[int] = None,
                 side_fn: Optional[Callable[[], torch.Tensor]] = None, summed_X: Optional[torch.Tensor] = None):
        """dispatch -> expert_fn -> combine, pipelined over C chunks (see ``moe_comm.dispatch.pipeline``).

        Args:
            x_TH, topk_idx_TK, topk_weight_TK: as in ``dispatch`` and ``combine``.
            expert_fn: ``expert_fn(tokens_RH, tokens_per_expert_e) -> [R, H]`` on expert-major rows;
                any differentiable function. If it has ``wants_host_counts = True`` it is also given
                ``counts=`` (the host list of tokens_per_expert, already known: no extra sync). If it has a
                ``prefers_segments(block_rows, device)`` method returning True for this call's mean rows per
                (source rank, local expert) block, it gets the all-to-all's rows as they arrive, in such
                blocks, with ``segments=`` [(local expert, first row, rows), ...] instead (no regroup pass;
                only if its call takes ``segments``).
            num_chunks: overrides the Dispatcher's C for this call (every rank must pass the same: a
                mismatch raises on every rank).
            side_fn: optional work run while the first dispatch is in flight (shared experts); when
                given, the call returns ``(y_TH, side_fn())``.
            summed_X: with ``summed_words``: [summed_words] float64 on the rows' device, summed over the EP
                group inside the call's control exchange into ``last_sum`` (no collective of its own).
        Returns: y_TH [T, H], equal for every C (chunking only changes when rows move). An exception in
        expert_fn or side_fn on any rank raises on every rank (``PeerFailed`` on the others), after the
        call's remaining exchanges completed: with end_check="eager" no rank returns a value from a failed
        call; with "deferred" and in the sync-free mode every rank returns placeholder rows and raises at
        its next read (``check()`` in the sync-free mode).

        Sync-free mode (``max_tokens_per_rank``): tokens_RH holds W x M x K rows, expert-major with each
        expert's rows first and padding (zero rows) after the last; tokens_per_expert_e is on the device
        only. An expert_fn with ``supports_padded = True`` (GroupedExperts) is called with ``padded=True``;
        any other must treat rows past tokens_per_expert_e.sum() as padding without reading the counts on
        the host (a host read works, but is the sync this mode exists to avoid).
        """
        from moe_comm.dispatch.pipeline import run_pipeline

        topk_weight_TK = _exact_float32(topk_weight_TK)
        if self._nodes is not None:
            return self._nodes.call(x_TH, topk_idx_TK, topk_weight_TK, expert_fn, num_chunks, side_fn,
                                    summed_X if self.summed_words else None)
        if self.sync_free:
            if num_chunks not in (None, 1):
                raise ValueError(f"num_chunks must be 1 (or None) in sync-free mode (max_tokens_per_rank), "
                                 f"got {num_chunks!r}")
            return self._call_sync_free(x_TH, topk_idx_TK, topk_weight_TK, expert_fn, side_fn, summed_X=summed_X)
        C, measure, trial = self.num_chunks if num_chunks is None else num_chunks, False, False
        if C == "auto":
            C, measure, trial = self.auto.step()
        t_start = now(x_TH.device) if trial else 0.0
        rank_rows = self.dedup and self.world_size > 1
        pieces = send_rows.pieces(self, C, x_TH, rank_rows) if isinstance(x_TH, torch.Tensor) else 1
        pending, layout = self._open(Phase.FORWARD, x_TH, topk_idx_TK, C,
                                     extra_check=lambda: check_call_args(x_TH, topk_idx_TK, topk_weight_TK, expert_fn,
                                                                         side_fn),
                                     rank_rows=rank_rows, pieces=pieces,
                                     summed_X=summed_X if self.summed_words else None)
        if layout is None:
            self.channel.end(pending)  # raises on every rank
        # From here until the end-of-forward exchange no exception leaves this rank: its peers would wait in the
        # transfers. A local failure keeps the schedule with placeholder rows and travels in that exchange.
        failed = None
        try:
            with self.timeline.compute("permute"):  # while the control exchange travels
                send_NB, fill = send_rows.presend(self, x_TH, layout, pieces=pieces,
                                                  fresh=self.world_size == 1 and self.dispatch_dtype is None)
        except Exception as err:  # noqa: BLE001 - placeholder rows below, once N is read
            failed, send_NB, fill = err, None, None
        handle, err = self._close(pending, layout, C, x_TH.shape[1], pieces, expert_fn=expert_fn)
        failed = failed or err
        if self.summed_words:  # every rank's words, summed on the device (the read above checked the exchange)
            self.last_sum = self.channel.sum_of(pending)
        if send_NB is None:  # the permute failed: placeholder rows of the agreed size
            send_NB, err = handle.transport.local(
                lambda: x_TH.new_empty(handle.layout.num_rows, self._row_width(x_TH), dtype=self._wire_dtype(x_TH)),
                "placeholder rows")
        wire_NB = send_NB.narrow(0, 0, handle.layout.num_rows)
        # one copy per rank: the slot weights travel with the rows (the experts' ranks apply them), in float32
        # (float64 stays float64); else y_NH is saved for backward when the weights need grad at the unpermute
        meta_w_TK = None
        if handle.rank_rows is not None:
            meta_dtype = torch.float64 if topk_weight_TK.dtype == torch.float64 else torch.float32
            meta_w_TK, err = handle.transport.local(lambda: topk_weight_TK.to(meta_dtype), "slot weights")
            failed = failed or err
        self._record_bytes(handle, x_TH, 0 if meta_w_TK is None else 2 * meta_w_TK.shape[1] * meta_w_TK.element_size())
        keep = torch.is_grad_enabled() and topk_weight_TK.requires_grad and meta_w_TK is None
        y_NH, side_out, expert_s = run_pipeline(self, handle, x_TH, expert_fn, side_fn, measure=measure,
                                                keep_output=keep, meta_w_TK=meta_w_TK, wire_NB=wire_NB, fill=fill,
                                                failed=failed)
        if measure:
            nbytes = handle.layout.num_rows * x_TH.shape[1] * x_TH.element_size()
            self.auto.make_plan(expert_s, nbytes, chunk_overhead(expert_fn, x_TH, self.num_local_experts))
        with self.timeline.compute("unpermute"):
            y_TH = self.last_step(f"the unpermute of call {handle.call}", y_NH, x_TH.shape, lambda: ops.unpermute(
                y_NH, handle.layout, None if meta_w_TK is not None else topk_weight_TK, backend=self.backend))
        if trial:
            self.auto.record_trial(now(x_TH.device) - t_start)
        return y_TH if side_fn is None else (y_TH, side_out)

    @_graph_break
    def fail(self, error: Exception, num_chunks: Optional[int] = None, device=None):
        """Reject this rank's input collectively: join the forward's control exchange with ``error`` so every
        rank raises (naming this one) instead of waiting in the exchange. Raises, except in the sync-free
        mode after its first call: there this rank moves zero rows through the call like its peers and
        returns a 0-dim zero tensor attached to the call's graph (add it to the caller's placeholder output,
        so its backward runs the same exchanges); every rank raises at its next read (``check()``).
        ``device`` is accepted for compatibility and unused (exchanges use the group's device)."""
        if self.sync_free:  # after the first call: deferred like every failure of the mode
            return self._call_sync_free(None, None, None, None, None, local_error=error)
        if self._nodes is not None:
            self._nodes.fail(error, num_chunks)
        C = self.num_chunks if num_chunks is None else num_chunks
        if C == "auto":
            C = self.auto.step()[0]
        pending, _ = self._open(Phase.FORWARD, None, None, C, local_error=error)
        self.channel.end(pending)
        raise error  # not reached: the exchange raises on every rank


    def _no_nodes(self, what: str) -> None:
        if self._nodes is not None:  # agreed when built: the same on every rank
            raise ValueError(f"{what} is not available with ranks_per_node={self.ranks_per_node} (two-level "
                             "dispatch): use the pipelined call (Dispatcher.__call__ / MoELayer)")

    # ---------------------------------------------------------------- sync-free mode
    def _no_sync_free(self, what: str) -> None:
        if self.sync_free:  # the same on every rank (agreed when built): no exchange is left waiting
            raise ValueError(f"{what} is not available in sync-free mode (max_tokens_per_rank="
                             f"{self.max_tokens_per_rank}): it sizes its rows from counts read on the host; use "
                             "the pipelined call (Dispatcher.__call__ / MoELayer)")

    def _call_sync_free(self, x_TH, topk_idx_TK, topk_weight_TK, expert_fn, side_fn, local_error=None, summed_X=None):
        from moe_comm.dispatch.sync_free import call_sync_free

        return call_sync_free(self, x_TH, topk_idx_TK, topk_weight_TK, expert_fn, side_fn, local_error, summed_X)


def check_options(num_experts, world_size: int, num_chunks=1, *, backend: str = "auto",
                  timeout: Optional[float] = None, direct_min_bytes: Optional[int] = None,
                  max_chunks: Optional[int] = None, end_check: Optional[str] = None,
                  max_tokens_per_rank: Optional[int] = None, dedup: bool = False,
                  dispatch_dtype: Optional[torch.dtype] = None, dispatch_scales: str = "fp32",
                  summed_words: int = 0) -> int:
    """This rank's checks of a Dispatcher's arguments (a ValueError / TypeError naming the argument); returns
    max_chunks (its default resolved). ``Dispatcher`` runs them before its agreement; the framework plug-ins
    before theirs, so a bad value on one rank is named as that, not as a difference between ranks."""
    check_int("Dispatcher: num_experts", num_experts, 1)
    if num_experts % world_size:
        raise ValueError(f"Dispatcher: num_experts ({num_experts}) must be divisible by the EP world "
                         f"size, got world size {world_size}")
    if num_chunks != "auto":
        check_int("Dispatcher: num_chunks", num_chunks, 1)
    if max_chunks is None:
        max_chunks = max(MAX_CHUNKS, num_chunks if isinstance(num_chunks, int) else 1)
    check_int("Dispatcher: max_chunks", max_chunks, 1, high=1024)
    if num_chunks != "auto" and num_chunks > max_chunks:
        raise ValueError(f"Dispatcher: num_chunks ({num_chunks}) must be <= max_chunks ({max_chunks})")
    check_choice("Dispatcher: backend", backend, BACKENDS)
    if timeout is not None:
        check_float("Dispatcher: timeout", timeout, 0.0, low_open=True)
    if direct_min_bytes is not None:
        check_int("Dispatcher: direct_min_bytes", direct_min_bytes, 0)
    if end_check is not None:
        check_choice("Dispatcher: end_check", end_check, ("eager", "deferred"))
    if max_tokens_per_rank is not None:
        check_int("Dispatcher: max_tokens_per_rank", max_tokens_per_rank, 1)
        if num_chunks != 1:
            raise ValueError(f"Dispatcher: max_tokens_per_rank (the sync-free mode) needs num_chunks=1, got "
                             f"num_chunks={num_chunks!r}")
    check_bool("Dispatcher: dedup", dedup)
    if dedup and max_tokens_per_rank is not None:
        raise ValueError("Dispatcher: dedup=True is not available in the sync-free mode (max_tokens_per_rank)")
    if dispatch_dtype is not None and dispatch_dtype not in DISPATCH_DTYPES:
        raise ValueError(f"Dispatcher: dispatch_dtype must be None or one of {DISPATCH_DTYPES}, got "
                         f"{dispatch_dtype!r}")
    check_choice("Dispatcher: dispatch_scales", dispatch_scales, ("fp32", "ue8m0"))
    check_int("Dispatcher: summed_words", summed_words, 0, high=1 << 16)
    return max_chunks


def _exact_float32(topk_weight_TK):
    """fp16/bf16 routing weights as float32 (exact; the weighted sums run in float32 or float64), with autograd."""
    if isinstance(topk_weight_TK, torch.Tensor) and topk_weight_TK.dtype in (torch.float16, torch.bfloat16):
        return topk_weight_TK.float()
    return topk_weight_TK


def check_weights(topk_weight_TK, shape, device) -> None:
    """topk_weight_TK: [T, K] float on the tokens' device (the routing's shape)."""
    check_tensor("topk_weight_TK", topk_weight_TK, shape=list(shape),
                 dtypes=(torch.float32, torch.float64, torch.float16, torch.bfloat16), device=device)


def check_call_args(x_TH, topk_idx_TK, topk_weight_TK, expert_fn, side_fn) -> None:
    """Everything of a pipelined call that can be checked before rows move (folded into its exchange)."""
    check_weights(topk_weight_TK, topk_idx_TK.shape, x_TH.device)
    if not callable(expert_fn):
        raise TypeError(f"expert_fn must be callable, got {type(expert_fn).__name__}")
    if side_fn is not None and not callable(side_fn):
        raise TypeError(f"side_fn must be callable or None, got {type(side_fn).__name__}")
