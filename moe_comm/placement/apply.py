"""Applying a rebalance plan to a layer: physical expert slots, weight and optimizer-state moves,
routing over replicas, replica gradient sums.

Shapes legend: T tokens, K top-k, E logical experts, R redundant replicas, P = E + R physical slots,
W EP world size, S = P / W slots per rank (physical slot p lives on rank p // S as local slot p % S),
C the most replicas any expert has, F FFN size, H hidden size, X bytes of one packed slot row.

A ``Placement`` (``moe_comm.placement``) says which logical expert every physical slot holds. This
module turns it into what a layer needs:

- (``moe_comm.modules.experts.PlacedExperts`` holds this rank's S slots, keyed by LOGICAL id.)
- ``transfer_plan`` / ``move_slots``: where each new slot's weights come from (a local slot when this
  rank already holds that expert, else one holder chosen round-robin) and one all-to-all of packed byte
  rows that moves every per-slot tensor (weights and optimizer state, any dtypes) at once.
- ``physical_topk``: logical top-K ids -> physical slots, device-only (no host sync). The slots a rank
  routes to a replicated expert g go round-robin over g's replicas in token order, starting at replica
  ``rank % C_g``: every replica gets the same share of every rank's tokens to within one row.
- ``relayout_slots``: what ``MoELayer.apply_placement`` runs: check the plan and the optimizer state on
  every rank (``agree``: all raise or none), then ``move_slots`` the weights and per-slot optimizer state.
- ``sync_replica_grads``: one all_reduce that sums the gradients of every replicated expert over the
  ranks holding its replicas (replicas then stay bit-identical under any optimizer).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from moe_comm._checks import check_int_list
from moe_comm.comm.agree import agree
from moe_comm.comm.collectives import all_to_all_v, group_rank, group_size, wait_work
from moe_comm.placement.planner import Placement

__all__ = ["check_placement", "transfer_plan", "move_slots", "replica_tables", "physical_topk",
           "sync_replica_grads", "optimizer_slot_state", "relayout_slots"]


def check_placement(placement, num_experts: int, num_ranks: int) -> List[int]:
    """Validate a Placement for a layer of E experts on W ranks; returns phys_to_logical as a host list.

    Raises TypeError (not a Placement, or a float / non-integer phys_to_logical: never truncated) or
    ValueError naming the field (got vs expected)."""
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a moe_comm.placement.Placement (from plan_placement), "
                        f"got {type(placement).__name__}")
    if placement.num_experts != num_experts:
        raise ValueError(f"placement.num_experts must equal the layer's num_experts ({num_experts}), "
                         f"got {placement.num_experts}")
    if placement.num_ranks != num_ranks:
        raise ValueError(f"placement.num_ranks must equal the EP world size ({num_ranks}), got {placement.num_ranks}")
    p2l = check_int_list("placement.phys_to_logical", placement.phys_to_logical, 0, high=num_experts - 1)
    P = len(p2l)
    if P % num_ranks:
        raise ValueError(f"placement.phys_to_logical length ({P}) must be divisible by the EP world size ({num_ranks})")
    if P < num_experts or sorted(set(p2l)) != list(range(num_experts)):
        raise ValueError(f"placement.phys_to_logical must hold every logical expert 0..{num_experts - 1} at "
                         f"least once, got {p2l}")
    return p2l


def transfer_plan(src_p2l: Sequence[int], dst_p2l: Sequence[int], num_ranks: int) -> List[Tuple[int, int, int, int]]:
    """Where each destination slot's data comes from: a list over destination slots q of
    ``(dst_rank, dst_local, src_rank, src_local)``. Pure logic, identical on every rank.

    A destination rank that already holds the logical expert copies it locally; otherwise the source is
    one of the expert's current holders, chosen round-robin by q (spreads the sending).
    Example: src [0, 1 | 2, 3], dst [0, 3 | 1, 2] (W=2): slot 1 (rank 0) <- rank 1 local 1;
        slot 2 (rank 1) <- rank 0 local 1; slots 0 and 3 are local copies.
    """
    S_src, S_dst = len(src_p2l) // num_ranks, len(dst_p2l) // num_ranks
    holders: Dict[int, List[Tuple[int, int]]] = {}
    for p, g in enumerate(src_p2l):
        holders.setdefault(int(g), []).append((p // S_src, p % S_src))
    out = []
    for q, g in enumerate(dst_p2l):
        d = q // S_dst
        mine = [h for h in holders[int(g)] if h[0] == d]
        src = mine[0] if mine else holders[int(g)][q % len(holders[int(g)])]
        out.append((d, q % S_dst, src[0], src[1]))
    return out


def _pack(tensors: Sequence[torch.Tensor], idx: List[int]) -> torch.Tensor:
    """Rows ``idx`` (dim 0) of every tensor as one uint8 [n, X] block (byte concatenation per row)."""
    n = len(idx)
    index = torch.tensor(idx, dtype=torch.int64, device=tensors[0].device)
    parts = [t.index_select(0, index).reshape(n, -1).contiguous().view(torch.uint8) for t in tensors]
    return torch.cat(parts, dim=1)


def _unpack(rows_NX: torch.Tensor, like: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Inverse of ``_pack``: [n, X] bytes -> one [n, *t.shape[1:]] tensor per template ``t``."""
    out, off, n = [], 0, rows_NX.shape[0]
    for t in like:
        width = t.shape[1:].numel() * t.element_size()
        seg = rows_NX[:, off:off + width].contiguous()  # offset 0: safe to view as a wider dtype
        out.append(seg.view(t.dtype).reshape((n,) + tuple(t.shape[1:])))
        off += width
    return out


@torch.no_grad()
def move_slots(tensors: Sequence[torch.Tensor], src_p2l: Sequence[int], dst_p2l: Sequence[int],
               group: Optional[dist.ProcessGroup]) -> List[torch.Tensor]:
    """Collective: re-lay per-slot tensors from one placement to another.

    Args:
        tensors: per-slot tensors of this rank, each [S_src, ...] (dim 0 = local slot of ``src_p2l``);
            any dtypes, all on one device; the same list (count, dtypes, trailing shapes) on every rank.
        src_p2l, dst_p2l: phys_to_logical of the current and the new placement (host lists, [P_src] and
            [P_dst], identical on every rank).
        group: EP process group (None: W = 1).
    Returns: the tensors re-laid as [S_dst, ...]: new slot i of this rank holds the data of logical
    expert dst_p2l[rank * S_dst + i] (replicas are copies). One all_to_all of uint8 rows moves everything.
    """
    W, me = group_size(group), group_rank(group)
    plan = transfer_plan(src_p2l, dst_p2l, W)
    S_dst = len(dst_p2l) // W
    send = [[] for _ in range(W)]   # local slots this rank sends to each destination, destination-slot order
    recv = [[] for _ in range(W)]   # destination local slots filled from each source, same order
    local = {}                      # destination local slot -> source local slot on this rank
    for d, i, s, j in plan:         # plan is in destination-slot order: both sides agree on the order
        if d == me and s == me:
            local[i] = j
        elif s == me:
            send[d].append(j)
        elif d == me:
            recv[s].append(i)
    rows = [None] * S_dst
    for i, j in local.items():
        rows[i] = ("local", j)
    received: List[torch.Tensor] = []
    n_send, n_recv = [len(x) for x in send], [len(x) for x in recv]
    if W > 1:
        # Every rank joins the all-to-all, even with nothing to send or receive (it is collective).
        flat_send = [j for x in send for j in x]
        width = sum(t.shape[1:].numel() * t.element_size() for t in tensors)
        send_NX = _pack(tensors, flat_send) if flat_send else \
            torch.empty(0, width, dtype=torch.uint8, device=tensors[0].device)
        recv_NX = all_to_all_v(send_NX, n_recv, n_send, group)
        received = _unpack(recv_NX, tensors)
        k = 0
        for s in range(W):
            for i in recv[s]:
                rows[i] = ("recv", k)
                k += 1
    if any(r is None for r in rows):  # the plan gives every slot a source; an error, not an assert (python -O)
        raise RuntimeError("moe_comm placement: a destination slot has no source (internal error; please report)")
    out = []
    for ti, t in enumerate(tensors):
        new = t.new_empty((S_dst,) + tuple(t.shape[1:]))
        for i, (kind, j) in enumerate(rows):
            new[i].copy_(t[j] if kind == "local" else received[ti][j])
        out.append(new)
    return out


def replica_tables(p2l: Sequence[int], num_experts: int, device=None) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Device tables for ``physical_topk``: (slots_EC [E, C] int64 physical slots of each expert, padded
    with its first slot; count_E [E] int64 replicas per expert; C). Example: p2l [0, 1, 0] ->
    slots [[0, 2], [1, 1]], count [2, 1], C 2."""
    slots: List[List[int]] = [[] for _ in range(num_experts)]
    for p, g in enumerate(p2l):
        slots[int(g)].append(p)
    C = max(len(s) for s in slots)
    table = [s + [s[0]] * (C - len(s)) for s in slots]
    return (torch.tensor(table, dtype=torch.int64, device=device),
            torch.tensor([len(s) for s in slots], dtype=torch.int64, device=device), C)


def physical_topk(topk_idx_TK: torch.Tensor, slots_EC: torch.Tensor, count_E: torch.Tensor, max_replicas: int,
                  rank: int = 0) -> torch.Tensor:
    """Logical expert ids -> physical slots, on the device, no host sync.

    Args:
        topk_idx_TK: [T, K] int64 logical ids, -1 = dropped (stays -1).
        slots_EC, count_E, max_replicas: from ``replica_tables``.
        rank: this rank's EP rank; the round-robin over an expert's replicas starts at ``rank``.
    Returns: [T, K] int64 physical slot ids. The n-th slot (in token-major order) routed to expert g goes
    to replica (n + rank) % count_E[g]: deterministic and balanced to within one row per replica.
    Example (expert 0 on slots [0, 2], expert 1 on [1]; rank 0): idx [[0, 1], [0, -1], [1, 0]]
        -> [[0, 1], [2, -1], [1, 0]].
    """
    E = count_E.shape[0]
    flat_N = topk_idx_TK.reshape(-1)
    valid_N = flat_N >= 0
    if max_replicas == 1:
        return torch.where(valid_N, slots_EC[:, 0][flat_N.clamp_min(0)], flat_N).reshape(topk_idx_TK.shape)
    g_N = torch.where(valid_N, flat_N, torch.full_like(flat_N, E))       # dropped slots -> bin E
    N = g_N.shape[0]
    order_N = torch.sort(g_N, stable=True).indices                        # by expert, token order within
    bins = torch.zeros(E + 1, dtype=torch.int64, device=g_N.device).scatter_add_(0, g_N, torch.ones_like(g_N))
    start = torch.cumsum(bins, 0) - bins
    occ_N = torch.empty_like(g_N)
    occ_N[order_N] = torch.arange(N, device=g_N.device) - start[g_N[order_N]]
    g_safe = g_N.clamp_max(E - 1)
    j_N = (occ_N + rank) % count_E[g_safe]
    phys_N = slots_EC[g_safe, j_N]
    return torch.where(valid_N, phys_N, flat_N).reshape(topk_idx_TK.shape)


@torch.no_grad()
def sync_replica_grads(params: Sequence[nn.Parameter], local_logical: Sequence[int], p2l: Sequence[int],
                       group: Optional[dist.ProcessGroup], *, timeout: Optional[float] = None) -> int:
    """Collective: sum the gradients of every replicated expert over all of its replicas.

    Args:
        params: per-slot parameters of this rank ([S, ...] each; a missing .grad counts as zeros and is
            created).
        local_logical: logical id of each local slot (a rank may hold several replicas of one expert: a
            hand-made placement; they are summed too). p2l: global phys_to_logical [P].
        group: EP process group (None: one process; replicas on this rank are still summed).
        timeout: seconds to wait for the all_reduce before raising CollectiveError (None: the group's).
    Returns: the number of replicated logical experts (0: nothing to do, and no collective on any rank,
    since p2l is the same everywhere). One all_reduce in float32 (float64 for float64 grads) over the
    whole group; ranks without a replica of an expert add zeros, so every replica ends up with the sum.
    Example: p2l [0, 1, 0 | 2, 3, 0] (W=2): rank 0 adds its two expert-0 gradients, the all_reduce adds
    rank 1's; all three expert-0 slots then hold the sum of the three.
    """
    counts: Dict[int, int] = {}
    for g in p2l:
        counts[int(g)] = counts.get(int(g), 0) + 1
    replicated = sorted(g for g, c in counts.items() if c > 1)
    if not replicated:
        return 0
    row_of = {g: j for j, g in enumerate(replicated)}
    local = [(i, row_of[int(g)]) for i, g in enumerate(local_logical) if int(g) in row_of]
    acc = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
    widths = [p[0].numel() for p in params]
    buf_NX = torch.zeros(len(replicated), sum(widths), dtype=acc, device=params[0].device)
    off = 0
    for p, w in zip(params, widths):
        if p.grad is not None:
            for i, j in local:  # add, not copy: two local replicas of one expert both count
                buf_NX[j, off:off + w] += p.grad[i].reshape(-1)
        off += w
    if group is not None and group_size(group) > 1:
        work = dist.all_reduce(buf_NX, group=group, async_op=True)
        wait_work(work, "replica gradient sum", timeout=timeout, rank=group_rank(group), direction="bwd",
                  what="all_reduce")
    off = 0
    for p, w in zip(params, widths):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        for i, j in local:
            p.grad[i].copy_(buf_NX[j, off:off + w].reshape(p.shape[1:]))
        off += w
    return len(replicated)


def optimizer_slot_state(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter],
                         num_slots: int) -> Tuple[List[Tuple[int, str]], List[torch.Tensor], list]:
    """The per-slot optimizer state of ``params`` (torch optimizers keyed by parameter).

    A state entry is per-slot when it is a tensor with at least one dimension whose dim 0 has
    ``num_slots`` entries (Adam's exp_avg / exp_avg_sq / max_exp_avg_sq, SGD's momentum_buffer, ...);
    0-dim tensors (Adam's shared ``step``) and non-tensors are shared by all slots and kept as they are.
    Returns (keys [(param index, state key)], tensors, signature); the signature (keys, dtypes, trailing
    shapes, shared keys) must be the same on every rank. Raises ValueError for any other tensor entry.
    """
    keys, tensors, sig = [], [], []
    for pi, p in enumerate(params):
        st = optimizer.state.get(p, {}) if hasattr(optimizer, "state") else {}
        for key in sorted(st, key=str):
            v = st[key]
            if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == num_slots:
                keys.append((pi, key))
                tensors.append(v)
                sig.append((pi, str(key), "slot", str(v.dtype), tuple(v.shape[1:])))
            elif torch.is_tensor(v) and v.dim() >= 1:
                raise ValueError(f"optimizer state {key!r} of expert parameter {pi} has shape {tuple(v.shape)}; "
                                 f"apply_placement moves only per-slot state (dim 0 = {num_slots} slots) and "
                                 "0-dim / non-tensor entries")
            else:
                sig.append((pi, str(key), "shared"))
    return keys, tensors, sig


def relayout_slots(params: Sequence[nn.Parameter], placement, current_p2l: Sequence[int], num_experts: int,
                   group: Optional[dist.ProcessGroup], optimizer: Optional[torch.optim.Optimizer] = None) -> List[int]:
    """Collective: move per-slot parameters (and their optimizer state) from ``current_p2l`` to ``placement``.

    Args:
        params: this rank's per-slot Parameters ([S_cur, ...] each, e.g. experts.w1/w3/w2); they stay the
            same Parameter objects (so the optimizer keeps them) and get [S_new, ...] data, ``.grad`` None.
        placement: a Placement for ``num_experts`` logical experts on the group's W ranks, the same on
            every rank.
        current_p2l: phys_to_logical of the present layout ([P_cur] host ints, identical on every rank).
        group: EP process group (None: one process).
        optimizer: None, or a torch optimizer keyed by parameter; the per-slot entries of ``params``' state
            (see ``optimizer_slot_state``) move with the weights, replicas get copies.
    Returns: the new phys_to_logical (host list).

    Every rank checks its own arguments (placement, optimizer type, optimizer state layout), then one
    ``agree`` compares the placement and the state layout across the group: on any rejection or
    difference every rank raises and nothing has moved. Then one all_to_all moves every tensor.
    """
    W = group_size(group)
    keys: List[Tuple[int, str]] = []
    states: List[torch.Tensor] = []
    signature: list = []
    new_p2l: Optional[List[int]] = None
    local_error: Optional[BaseException] = None
    try:  # a rank that rejects its arguments still joins the agreement: every rank raises
        new_p2l = check_placement(placement, num_experts, W)
        if optimizer is not None:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
            keys, states, signature = optimizer_slot_state(optimizer, params, params[0].shape[0])
    except (TypeError, ValueError) as err:
        local_error = err
    agree(group if W > 1 else None, {"placement": new_p2l, "optimizer state of the experts": signature},
          what="apply_placement", local_error=local_error)
    moved = move_slots([p.data for p in params] + states, current_p2l, new_p2l, group)
    for p, data in zip(params, moved[:len(params)]):
        p.data = data
        p.grad = None
    for (pi, key), data in zip(keys, moved[len(params):]):
        optimizer.state[params[pi]][key] = data
    return new_p2l
