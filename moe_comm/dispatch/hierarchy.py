"""Dispatch across nodes in two levels: a token crosses the slow link once per destination node, then goes
once to each rank of that node holding any of its experts; combine sums inside the node first.

Shapes legend: T tokens, H hidden, K top-k, R rows received, W EP world size, L ranks per node, N = W / L
nodes, e local experts.

Node k holds EP ranks k*L .. k*L+L-1 (``Dispatcher(ranks_per_node=L)``, or "auto": torchrun's
LOCAL_WORLD_SIZE). A call of such a Dispatcher runs two Dispatchers with one copy per destination:
- the rail: the N ranks with this rank's local index, one per node; on it a node is one "rank" whose local
  experts are its L*e experts. Each token goes once to each node holding any of its experts (to the rank
  of its own local index there) with its slots' node-local expert ids and weights (the [2K] metadata of
  one copy per rank), in chunks, pipelined, FP8 if asked;
- the node: the L ranks of this node. Each row that came over the rail is dispatched again, as the
  rail's expert function (``takes_slot_rows``), once to each rank of the node holding any of its slots;
  the experts' weighted outputs are summed there, sent back, summed per row at the forwarding rank, and
  one row per (token, node) goes back over the rail, where the token's rank sums its nodes' rows.
The backward mirrors both. Each slot's weight is applied once, at its expert's rank; every sum has a fixed
order (deterministic); results equal flat dispatch to float rounding.

Failure rule across levels: a call opens and closes each phase with a control exchange over the whole EP
group (input checks, call and phase agreement), around the rail's and node's own exchanges. A failure at
either level is caught on the rank where it surfaces and carried to the closing exchange, so every rank
raises (the failing one its own error, the others ``PeerFailed`` naming it) and no level is left with a
rank in it: a rail or a node never raises alone. A failed transfer (``CollectiveError``) raises at once and
poisons the whole group and both levels on that rank; the peers in the other levels time out in their next
exchange, naming the phase. Weight gradients that the experts defer (GroupedExperts, ``moe_comm._wgrad``)
reach ``.grad`` only after the whole-group closing exchange of the backward; a plain expert_fn's reach it
during its node's backward.

Not here: ``dispatch()``/``combine()``, the sync-free mode, num_chunks="auto" (each would need its own
whole-group agreement per level); exchanges are read eagerly (one host read per exchange, also on CUDA), so
end_check="deferred" is refused.
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from moe_comm import _wgrad
from moe_comm._checks import check_int
from moe_comm.comm.agree import RemoteError
from moe_comm.comm.channel import IN_LEVEL, PeerFailed, as_collective_error, kept
from moe_comm.comm.collectives import poison
from moe_comm.comm.wire import Failure, Phase, Word, dtype_code
from moe_comm.dispatch.workspace import Workspace

__all__ = ["node_size", "ranks_on_node", "NodeLevels", "node_groups", "OnTrack", "INTER_TRACK", "INTRA_TRACK"]


def node_size(ranks_per_node, group, world: int) -> Optional[int]:
    """L from ``ranks_per_node`` (None, an int, or "auto": LOCAL_WORLD_SIZE and the EP group's global ranks),
    or None when the call stays flat (one node, or one rank per node: nothing to gather per node)."""
    if ranks_per_node is None:
        return None
    L = ranks_on_node(ranks_per_node, group, world)
    return L if 1 < L < world else None


def ranks_on_node(ranks_per_node, group, world: int) -> int:
    """EP ranks per node from ``ranks_per_node`` (an int or "auto"), checked: raises ValueError naming it."""
    if ranks_per_node == "auto":
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is None or not local.isdigit() or int(local) < 1:
            raise ValueError(f"Dispatcher: ranks_per_node='auto' reads LOCAL_WORLD_SIZE (torchrun sets it), got "
                             f"{local!r}: pass ranks_per_node=<EP ranks per node> instead")
        ranks = dist.get_process_group_ranks(group) if world > 1 else [0]
        nodes = [r // int(local) for r in ranks]  # torchrun numbers each node's ranks consecutively
        sizes = [nodes.count(n) for n in dict.fromkeys(nodes)]
        if len(set(sizes)) > 1 or nodes != sorted(nodes):
            raise ValueError(f"Dispatcher: ranks_per_node='auto': the EP group's ranks {ranks} lie on nodes {nodes} "
                             f"(LOCAL_WORLD_SIZE={local}): each node must hold one consecutive block of the EP "
                             "group, all of one size; pass ranks_per_node= for another layout")
        L = sizes[0]
    else:
        check_int("Dispatcher: ranks_per_node", ranks_per_node, 1)
        L = ranks_per_node
        if world % L:
            raise ValueError(f"Dispatcher: ranks_per_node ({L}) must divide the EP world size ({world})")
    return L


_NODE_WORKSPACE = Workspace()  # every node-level call's scratch rows (those calls run one after another)
_GROUPS: Dict[Tuple, Tuple] = {}  # (EP group id, L) -> (EP group, node group, rail group): one pair per topology


def node_groups(group, L: int) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's node group, its rail group) of the EP group with L ranks per node. Made once per (group, L)
    and shared by every Dispatcher on it (a group of the same ranks made twice would share a store prefix).
    Collective over the EP group's ranks only (``use_local_synchronization``)."""
    key = (id(group), L)
    hit = _GROUPS.get(key)
    if hit is not None and hit[0] is group:
        return hit[1], hit[2]
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    backend = dist.get_backend(group)
    W = len(ranks)
    node = dist.new_group([ranks[(me // L) * L + j] for j in range(L)], backend=backend,
                          use_local_synchronization=True)
    rail = dist.new_group([ranks[k * L + me % L] for k in range(W // L)], backend=backend,
                          use_local_synchronization=True)
    _GROUPS[key] = (group, node, rail)
    return node, rail


INTER_TRACK, INTRA_TRACK = "comm inter-node", "comm intra-node"


class OnTrack:
    """A Timeline as one level sees it: every comm span it records goes on ``track``; all else is the Timeline's."""

    def __init__(self, timeline, track: str):
        object.__setattr__(self, "_timeline", timeline)
        object.__setattr__(self, "_track", track)

    def comm(self, phase, work, chunk=-1, direction="fwd", *, start=None, layer=None, track=None):
        return self._timeline.comm(phase, work, chunk, direction, start=start, layer=layer,
                                   track=self._track if track is None else track)

    def __getattr__(self, name):
        return getattr(self._timeline, name)

    def __setattr__(self, name, value):
        setattr(self._timeline, name, value)


def _relayed(err: BaseException) -> bool:
    """A peer's failure reported by a level's exchange: its origin reports it itself in the closing exchange."""
    return isinstance(err, (PeerFailed, RemoteError))


class NodeLevels:
    """The two levels of Dispatcher ``d`` with ``L`` ranks per node (built collectively after its agreement)."""

    def __init__(self, d, L: int):
        from moe_comm.dispatch.dispatcher import Dispatcher

        self.d, self.L = d, L
        self.nodes = d.world_size // L
        self.node, self.local = d.rank // L, d.rank % L
        node_group, rail_group = node_groups(d.group, L)
        common = dict(backend=d.backend, strict=d.strict, timeout=d.timeout, end_check="eager", dedup=True)
        self.rail = Dispatcher(d.num_experts, rail_group, d.num_chunks, max_chunks=d.max_chunks,
                               direct_min_bytes=d.direct_min_bytes, dispatch_dtype=d.dispatch_dtype,
                               dispatch_scales=d.dispatch_scales, **common)
        self.inner = Dispatcher(L * d.num_local_experts, node_group, 1, **common)
        for level in self.levels:  # each level closes with its own exchange, read before the whole group's
            level.carry_max_bytes = -1
        # the node's calls run while the rail's transfers are in flight: scratch rows of their own
        self.inner.workspace = _NODE_WORKSPACE
        self._intra = [0, 0]  # this call's rows to the node's other ranks, (dispatch, combine) bytes

    @property
    def levels(self):
        return self.rail, self.inner

    def set_timeline(self, timeline) -> None:
        """The owner's Timeline for both levels, each level's comm spans (transfers, exchanges) on a track of its
        own: "comm inter-node" (the rail; its rows to this rank's own node are a local copy) and "comm
        intra-node"; the whole group's exchanges stay on "comm"."""
        self.rail.timeline = OnTrack(timeline, INTER_TRACK)
        self.inner.timeline = OnTrack(timeline, INTRA_TRACK)

    # ------------------------------------------------------------------ whole-group exchanges
    def _status(self, phase: Phase, call: int, C: int, error: Optional[BaseException] = None, *,
                row_bytes: int = -1, dtype: int = -1, dynamic=None, summed_X=None) -> None:
        """A control exchange over the whole EP group: raises on every rank if any rank failed or is elsewhere.
        A relayed failure (a peer's, reported by a level) is not sent: its origin sends its own."""
        d = self.d
        own = None if error is None or _relayed(error) else error
        hdr = d._header(phase, call, C, row_bytes, dtype)
        hdr[Word.CHUNK] = -1 if phase in (Phase.FORWARD, Phase.BACKWARD) else IN_LEVEL  # the opening: before rows
        failed = Failure.NONE if own is None else (
            Failure.REJECTED if phase == Phase.FORWARD and isinstance(own, (TypeError, ValueError)) else Failure.RAISED)
        with d.workspace.dropped_on_error():
            pending = d.channel.begin(phase, hdr, local_error=own, failed=failed, dynamic=dynamic, summed_X=summed_X)
            d.channel.end(pending)
        if summed_X is not None or (phase == Phase.FORWARD and d.summed_words):
            d.last_sum = d.channel.sum_of(pending)  # the layer's load counts, summed over the EP group
        if error is not None:  # every rank raised above unless only relays were sent: raise the relay here
            raise error

    def _late(self) -> Optional[BaseException]:
        """A failure a level keeps for its next exchange (after its call's last one): taken here, it goes out
        with the whole group's closing exchange instead (a level's next exchange would raise in that level alone)."""
        found = None
        for level in self.levels:
            late, level.channel.late = level.channel.late, None
            if late is not None and found is None:
                found = late[0]
        return found

    def named(self, err: BaseException) -> BaseException:
        """A level's transport or protocol error, saying which ranks its "EP rank" numbers are. Every group of the
        call is poisoned: a level's peers may still be in its transfers, the whole group's in its exchanges."""
        for group in (self.d.group, self.rail.group, self.inner.group):
            poison(group, f"a two-level call on EP rank {self.d.rank}: {err}")
        return type(err)(f"moe_comm: EP rank {self.d.rank} (node {self.node}, local rank {self.local}) in a two-level "
                         f"call; its node's group numbers it {self.local}, its rail's group {self.node} (the rail of "
                         f"local rank {self.local}: EP ranks {self.local}, {self.local + self.L}, ...): {err}")

    # ------------------------------------------------------------------ the call
    def call(self, x_TH, topk_idx_TK, topk_weight_TK, expert_fn, num_chunks, side_fn, summed_X=None):
        from moe_comm.dispatch.dispatcher import check_call_args

        d = self.d
        C = d.num_chunks if num_chunks is None else num_chunks
        self._intra = [0, 0]
        if isinstance(x_TH, torch.Tensor) and d.channel.device.type == x_TH.device.type == "cuda":
            d.channel.device = x_TH.device  # NCCL: this rank's own device (built before set_device: cuda:0's)
        d.channel.call += 1
        call = d.channel.call
        error, dynamic, row_bytes, dtype = None, None, -1, -1
        try:
            d._check_inputs(x_TH, topk_idx_TK, C)
            check_call_args(x_TH, topk_idx_TK, topk_weight_TK, expert_fn, side_fn)
            row_bytes, dtype = x_TH.shape[1] * x_TH.element_size(), dtype_code(x_TH.dtype)
            bad = ((topk_idx_TK < -1) | (topk_idx_TK >= d.num_experts)).sum()
            nonfinite = (~torch.isfinite(x_TH)).any(1).sum() if d.strict else torch.zeros_like(bad)
            dynamic = torch.stack([bad, nonfinite, torch.zeros_like(bad)])
        except (TypeError, ValueError) as err:
            error = err
        C_agreed = self._agreed(C)
        # whole-group opening exchange: a rejected input raises on every rank before any level moves a row
        self._status(Phase.FORWARD, call, C_agreed, error, row_bytes=row_bytes, dtype=dtype, dynamic=dynamic,
                     summed_X=None if error is not None else summed_X)
        run = _Run(self, topk_idx_TK, expert_fn, C, side_fn, torch.is_grad_enabled(), call)
        anchor = torch.empty(0, device=x_TH.device, requires_grad=True) if run.grad else None
        error, y_TH = None, None
        try:
            y_TH = _NodeCall.apply(x_TH, topk_weight_TK, anchor, run)
        except Exception as err:  # noqa: BLE001 - goes to every rank in the closing exchange below
            if as_collective_error(err):
                raise self.named(err) from err
            error = kept(err)
        error = error or self._late()
        self._status(Phase.FORWARD_END, call, C_agreed, error)
        self._record_bytes(x_TH)
        return y_TH if side_fn is None else (y_TH, run.side_out)

    def fail(self, error: Exception, num_chunks=None):
        """``Dispatcher.fail``: join the whole group's opening exchange with ``error`` (every rank raises)."""
        d = self.d
        d.channel.call += 1
        self._status(Phase.FORWARD, d.channel.call, self._agreed(d.num_chunks if num_chunks is None else num_chunks),
                     error)

    def _agreed(self, C) -> int:
        """The chunk count a header carries: C, or 1 for a C this rank rejects (its error says why)."""
        return C if isinstance(C, int) and not isinstance(C, bool) and 1 <= C <= self.d.max_chunks else 1

    def node_fn(self, expert_fn):
        """The rail's expert function: a node's rows with their slots' node-local expert ids and weights ->
        the weighted sum of their experts' outputs per row, through the node's Dispatcher."""
        inner = self.inner

        def experts_of_node(rows_RH, ids_RK, w_RK):
            y_RH = inner(rows_RH, ids_RK, w_RK, expert_fn)
            late, inner.channel.late = inner.channel.late, None
            if late is not None:  # raised into the rail's schedule: it goes to every rank in the closing exchange
                raise late[0]
            sent = _to_others(inner, self.local)
            self._intra = [a + b for a, b in zip(self._intra, sent[:2])]
            return y_RH

        experts_of_node.takes_slot_rows = True
        experts_of_node.fail = inner.fail  # this rank failed before its node's call: joins it with the error
        return experts_of_node

    # ------------------------------------------------------------------ bytes by link
    def _record_bytes(self, x_TH) -> None:
        b = self.rail.last_bytes
        if not b:
            return
        inter_dispatch, inter_combine, rows_inter = _to_others(self.rail, self.node)
        self.d.last_bytes = dict(
            dispatch_logical=b["dispatch_logical"], combine_logical=b["combine_logical"],
            dispatch_wire=b["dispatch_wire"] + self._intra[0], combine_wire=b["combine_wire"] + self._intra[1],
            dispatch_wire_inter=inter_dispatch, combine_wire_inter=inter_combine,
            dispatch_wire_intra=self._intra[0], combine_wire_intra=self._intra[1],
            rows_inter=rows_inter, tokens=x_TH.shape[0])


def _to_others(level, me: int) -> Tuple[int, int, int]:
    """(dispatch wire bytes, combine wire bytes, rows) of a level Dispatcher's last call that went to ranks other
    than ``me`` (its rows to itself are a local copy); every row of a call has the same wire width."""
    b, rows = level.last_bytes, level.last_rows_W
    others = sum(n for w, n in enumerate(rows) if w != me)
    total = max(sum(rows), 1)
    return b["dispatch_wire"] * others // total, b["combine_wire"] * others // total, others


class _Run:
    def __init__(self, levels: NodeLevels, topk_idx_TK, expert_fn, C, side_fn, grad: bool, call: int):
        self.levels, self.idx, self.expert_fn, self.C, self.side_fn = levels, topk_idx_TK, expert_fn, C, side_fn
        self.grad, self.call = grad, call
        self.side_out = None
        self.y = self.x = self.w = None
        self.backward_done = False


class _NodeCall(torch.autograd.Function):
    """The rail's call on detached inputs; the backward runs its backward nested (as the pipeline runs the
    experts'), between the whole group's check-in and closing exchanges."""

    @staticmethod
    def forward(ctx, x_TH, w_TK, anchor, run: _Run):
        levels = run.levels
        x = x_TH.detach().requires_grad_(run.grad)
        w = w_TK.detach().requires_grad_(run.grad and w_TK.requires_grad)
        with torch.set_grad_enabled(run.grad):
            out = levels.rail(x, run.idx, w, levels.node_fn(run.expert_fn), num_chunks=run.C, side_fn=run.side_fn)
        y = out if run.side_fn is None else out[0]
        if run.side_fn is not None:
            run.side_out = out[1]
        run.y, run.x, run.w = (y, x, w) if run.grad else (None, None, None)
        ctx.run = run
        return y.detach()

    @staticmethod
    def backward(ctx, grad_y_TH):
        run: _Run = ctx.run
        levels = run.levels
        error = None
        if run.backward_done or run.y is None:
            error = RuntimeError("moe_comm: backward ran twice through the same forward (retain_graph), or the "
                                 "forward ran without grad; neither is supported: run the forward again")
        levels._status(Phase.BACKWARD, run.call, run.C if isinstance(run.C, int) else 1, error)
        run.backward_done = True
        error = None
        with _wgrad.holding() as held:
            try:
                if run.y.requires_grad:
                    torch.autograd.backward([run.y], [grad_y_TH])
            except Exception as err:  # noqa: BLE001 - every rank raises at the closing exchange below
                if as_collective_error(err):
                    raise levels.named(err) from err
                error = kept(err)
            error = error or levels._late()
            levels._status(Phase.BACKWARD_END, run.call, run.C if isinstance(run.C, int) else 1, error)
        held.flush()  # every rank completed its backward: the experts' weight gradients into .grad
        x, w = run.x, run.w
        run.y = run.x = run.w = None
        grad_x = x.grad if x.grad is not None else torch.zeros_like(x)
        grad_w = w.grad if w.requires_grad and w.grad is not None else None
        return grad_x, grad_w, None, None
