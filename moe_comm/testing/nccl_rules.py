"""NCCL's rules on any process group: a test mode that wraps ``torch.distributed`` and raises
``NcclRuleError``, naming the rule, where a call would fail, hang or corrupt data on NCCL, even on a
gloo run, which tolerates most of these mistakes.

    with nccl_rules():      # or install() / uninstall(); every rank of every group runs under it
        ...

The tests run every pool rank under it (``MOE_COMM_NCCL_RULES``, see tests/conftest.py).

Rules (``RULES``) and how each is checked:

- group-device: every tensor handed to a collective or a point-to-point op is on the group's device,
  ``moe_comm.comm.collectives.group_device(group)`` (an NCCL group takes CUDA tensors of the current
  device, never a CPU tensor). Checked locally before the call.
- contiguous: those tensors are dense and contiguous (NCCL raises "Tensors must be contiguous"). Local.
- same-collective: every rank of a group issues the same collectives in the same order, with the same
  kind, root, reduce op, dtype and element counts; collectives of two groups over the same ranks
  interleave alike on every rank (NCCL communicators sharing a device can deadlock otherwise).
- split-sizes: in an all-to-all, the elements rank r sends to rank w are the elements w receives from r.
  The last two, and any local violation, are checked collectively: before the real call the ranks
  all-gather one fixed row (sequence number, kind, group, dtype, counts, per-peer elements, the rule a
  rank broke locally) on a private gloo group over the same ranks. Every rank reads the same rows and
  reaches the same verdict, so all raise together and the real collective is never issued.
- p2p-sizes: between two ranks, the k-th send meets the k-th receive with the same count and dtype
  (NCCL matches by order and ignores tags). Checked at each ``batch_isend_irecv``: every rank swaps a
  summary of the pair's ops (counts, dtypes, the first sizes) with each peer it has ops with, over the
  private group; both ranks of a pair reach the same verdict.
- p2p-batched: point-to-point goes through ``batch_isend_irecv`` (one NCCL group call). A lone
  send/recv/isend/irecv raises: loops of them deadlock on NCCL once messages outgrow its buffers.
- nccl-unsupported: ``monitored_barrier`` (gloo only).

Limits:
- On a CPU-only gloo run the group's device is the CPU, so group-device cannot tell a tensor made on
  the group's device from one made on the CPU by accident. The rule bites on CUDA machines (NCCL
  groups, or CUDA tensors handed to a gloo group) and where a test declares another device for a group
  (patching ``group_device``, as tests/test_nccl_rules.py does).
- Only calls through the ``torch.distributed`` namespace are seen (``dist.all_reduce(...)``), not torch's
  own inner calls (``all_gather_object``'s ``all_gather``), functional collectives or C++ callers.
- A rank that never reaches a check is found by the side exchange's timeout, not at once; the private
  group cannot be trusted after that: ``broken()`` says why and every later check raises at once.
- Ranks meet at every collective's issue (the side exchange waits for all), so timing-sensitive code
  sees a rendezvous there that NCCL would not add.
"""
from __future__ import annotations

import contextlib
import datetime
import inspect
import math
import threading
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["NcclRuleError", "RULES", "ENV", "install", "uninstall", "installed", "nccl_rules", "broken"]

ENV = "MOE_COMM_NCCL_RULES"  # "1": the test rank pool installs the mode in every rank (tests/conftest.py)

RULES: Dict[str, str] = {
    "group-device": "every tensor handed to a collective or point-to-point op is on the group's device "
                    "(moe_comm.comm.collectives.group_device): NCCL takes CUDA tensors of its device, no CPU tensor",
    "contiguous": "tensors handed to NCCL are dense and contiguous",
    "same-collective": "every rank of a group issues the same collectives in the same order (kind, group, root, "
                       "reduce op, dtype, element counts); NCCL hangs or corrupts data otherwise",
    "split-sizes": "in an all-to-all, the elements rank r sends to rank w are the elements w receives from r",
    "p2p-sizes": "between two ranks the k-th send meets the k-th receive with the same count and dtype "
                 "(NCCL matches by order and ignores tags)",
    "p2p-batched": "point-to-point goes through batch_isend_irecv (one NCCL group call); lone send/recv/isend/irecv "
                   "can deadlock on NCCL",
    "nccl-unsupported": "only what NCCL implements (monitored_barrier is gloo only)",
}
_RULE_CODES = {name: i + 1 for i, name in enumerate(RULES)}  # 0: no violation
_RULE_NAMES = {code: name for name, code in _RULE_CODES.items()}

_MAGIC = 0x4E43434C  # "NCCL"
_HEAD = 10           # words of a collective's side row before the 2 x W per-peer element counts
_SIZES = 8           # sizes of the first sends / receives a pair's summary carries (for the message)
_TAG = 0x4E43        # tag of the pairwise side messages on the private group


class NcclRuleError(AssertionError):
    """A call broke one of NCCL's rules (``RULES``); ``.rule`` names it. Raised before the call is issued."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"NCCL rule [{rule}] broken: {message}. Rule: {RULES[rule]}")
        self.rule = rule


def _h(text: str) -> int:
    return zlib.crc32(text.encode())  # stable across processes (hash() is salted per process)


_DTYPES = {_h(str(d)): str(d).replace("torch.", "") for d in vars(torch).values() if isinstance(d, torch.dtype)}
_GROUPS: Dict[int, str] = {}  # hash -> name of the groups this process has seen (names agree across ranks)


def _dtype(code: int) -> str:
    return _DTYPES.get(code, "-") if code else "-"


# ---- state -----------------------------------------------------------------------------------------------

_lock = threading.RLock()
_originals: Dict[str, Callable] = {}
_depth = 0
_timeout_s = 60.0
_shadows: Dict[Tuple, "_Shadow"] = {}
_broken: Optional[str] = None


def broken() -> Optional[str]:
    """Why the private side group can no longer be trusted (a side exchange timed out or failed), else None."""
    return _broken


def installed() -> bool:
    return _depth > 0


class _Shadow:
    """A private gloo group over the ranks of checked groups: the side exchanges never touch the checked
    group itself, whose collectives pair exactly as they would without the mode. Built from the default
    store, outside torch's group registry (no group name or counter changes)."""

    def __init__(self, ranks: Tuple[int, ...], rank: int):
        store = dist.distributed_c10d._get_default_store()
        key = "moe_comm/nccl_rules/" + "-".join(map(str, ranks))
        # Every member adds 1: the n-th build of this rank set reads values in [nW + 1, (n + 1)W] on all of them.
        generation = (store.add(key + "/builds", 1) - 1) // len(ranks)
        prefixed = dist.PrefixStore(f"{key}/{generation}/", store)
        self.pg = dist.ProcessGroupGloo(prefixed, rank, len(ranks), datetime.timedelta(seconds=_timeout_s))
        self.size, self.rank = len(ranks), rank
        self.seq = 0                      # collectives checked on this rank set
        self.pair_seq = [0] * len(ranks)  # batches checked with each peer
        self.lock = threading.Lock()


def _shadow(group) -> _Shadow:
    ranks = tuple(dist.get_process_group_ranks(group))
    key = (id(dist.distributed_c10d._get_default_group()), ranks)
    with _lock:
        sh = _shadows.get(key)
        if sh is None:
            try:
                sh = _shadows[key] = _Shadow(ranks, dist.get_rank(group))
            except RuntimeError as e:
                _fail(f"building the side group over ranks {list(ranks)}: {e}")
        return sh


def _fail(reason: str):
    global _broken
    _broken = _broken or reason
    raise NcclRuleError("same-collective", f"a side check could not complete ({reason}): a rank of the group did "
                                           f"not issue this call (it skipped it, issued another one first, or is "
                                           f"stuck). The side group is broken: restart the ranks")


def _wait(works, what: str) -> None:
    try:
        for w in works:
            w.wait(datetime.timedelta(seconds=_timeout_s))
    except RuntimeError as e:
        _fail(f"{what}, {_timeout_s:.0f} s: {e}")


# ---- what a call hands over ----------------------------------------------------------------------------

class _Call:
    """What one collective hands over: tensors to check, the fields every rank must agree on, the
    elements sent to / received from each peer (all-to-all), and the first local violation."""

    def __init__(self, kind: str, group, W: int, me: int):
        self.kind, self.group, self.W, self.me = kind, group, W, me
        self.tensors: List[Tuple[str, torch.Tensor]] = []
        self.dtype, self.count, self.root, self.op = 0, -1, -1, -1
        self.send_W: Optional[List[int]] = None
        self.recv_W: Optional[List[int]] = None
        self.problem: Optional[Tuple[str, str]] = None

    def bad(self, rule: str, text: str) -> None:
        if self.problem is None:
            self.problem = (rule, text)

    def tensor(self, name: str, t) -> Optional[torch.Tensor]:
        if isinstance(t, torch.Tensor):
            self.tensors.append((name, t))
            return t
        return None

    def check_tensors(self) -> None:
        from moe_comm.comm import collectives  # looked up per call: a test may patch group_device
        dev = collectives.group_device(self.group)
        for name, t in self.tensors:
            if t.device != dev:
                self.bad("group-device", f"{name} is on {t.device}, the group's device is {dev}")
            elif t.layout != torch.strided or not t.is_contiguous():
                self.bad("contiguous", f"{name} {tuple(t.shape)} strides {t.stride()} is not contiguous")


def _row_elems(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) if t.dim() else 1


def _peer_elems(c: _Call, name: str, t: torch.Tensor, splits) -> List[int]:
    """Elements to or from each peer of an all_to_all_single side (even split when ``splits`` is empty)."""
    W = c.W
    if not splits:
        if t.dim() == 0 or t.shape[0] % W:
            c.bad("split-sizes", f"{name} has {t.shape[0] if t.dim() else 'no'} rows, not a multiple of the "
                                 f"group size {W}, and no split sizes")
            return [0] * W
        return [t.numel() // W] * W
    splits = [int(s) for s in splits]
    if len(splits) != W:
        c.bad("split-sizes", f"{name} split sizes {splits} have {len(splits)} entries for a group of {W}")
        return [0] * W
    if sum(splits) != t.shape[0]:
        c.bad("split-sizes", f"{name} split sizes {splits} sum to {sum(splits)}, but {name} has {t.shape[0]} rows")
    return [s * _row_elems(t) for s in splits]


def _group_rank_of(group, a: Dict[str, Any], glob: str, local: str) -> int:
    if a.get(local) is not None:
        return int(a[local])
    if a.get(glob) is not None:
        return dist.get_group_rank(group, int(a[glob]))
    return -1


def _op_code(op) -> int:
    try:
        return int(op)
    except (TypeError, ValueError):
        return _h(repr(op)) & 0xFFFF


def _same_dtype(c: _Call, *named) -> None:
    ts = [(n, t) for n, t in named if isinstance(t, torch.Tensor)]
    if ts:
        c.dtype = _h(str(ts[0][1].dtype))
        for n, t in ts[1:]:
            if t.dtype != ts[0][1].dtype:
                c.bad("same-collective", f"{n} is {t.dtype} but {ts[0][0]} is {ts[0][1].dtype}")


def _list_of(c: _Call, name: str, ts, each: int) -> None:
    """A list argument holds one tensor per rank with ``each`` elements."""
    ts = list(ts or [])
    if len(ts) != c.W:
        c.bad("same-collective", f"{name} holds {len(ts)} tensors for a group of {c.W}")
    for i, t in enumerate(ts):
        c.tensor(f"{name}[{i}]", t)
        if isinstance(t, torch.Tensor) and t.numel() != each:
            c.bad("same-collective", f"{name}[{i}] has {t.numel()} elements, the input has {each}")


def _d_all_to_all_single(c: _Call, a) -> None:
    out, inp = c.tensor("output", a["output"]), c.tensor("input", a["input"])
    _same_dtype(c, ("input", inp), ("output", out))
    c.send_W = _peer_elems(c, "input", inp, a.get("input_split_sizes"))
    c.recv_W = _peer_elems(c, "output", out, a.get("output_split_sizes"))


def _d_all_to_all(c: _Call, a) -> None:
    outs, ins = list(a["output_tensor_list"]), list(a["input_tensor_list"])
    for name, ts in (("output_tensor_list", outs), ("input_tensor_list", ins)):
        if len(ts) != c.W:
            c.bad("split-sizes", f"{name} holds {len(ts)} tensors for a group of {c.W}")
        for i, t in enumerate(ts):
            c.tensor(f"{name}[{i}]", t)
    _same_dtype(c, *[(f"input_tensor_list[{i}]", t) for i, t in enumerate(ins)],
                *[(f"output_tensor_list[{i}]", t) for i, t in enumerate(outs)])
    c.send_W = ([t.numel() for t in ins] + [0] * c.W)[:c.W]
    c.recv_W = ([t.numel() for t in outs] + [0] * c.W)[:c.W]


def _d_all_reduce(c: _Call, a) -> None:
    t = c.tensor("tensor", a["tensor"])
    _same_dtype(c, ("tensor", t))
    c.count, c.op = t.numel(), _op_code(a.get("op"))


def _d_broadcast(c: _Call, a) -> None:
    t = c.tensor("tensor", a["tensor"])
    _same_dtype(c, ("tensor", t))
    c.count, c.root = t.numel(), _group_rank_of(c.group, a, "src", "group_src")


def _d_reduce(c: _Call, a) -> None:
    t = c.tensor("tensor", a["tensor"])
    _same_dtype(c, ("tensor", t))
    c.count, c.op, c.root = t.numel(), _op_code(a.get("op")), _group_rank_of(c.group, a, "dst", "group_dst")


def _d_all_gather_into_tensor(c: _Call, a) -> None:
    out, inp = c.tensor("output_tensor", a["output_tensor"]), c.tensor("input_tensor", a["input_tensor"])
    _same_dtype(c, ("input_tensor", inp), ("output_tensor", out))
    c.count = inp.numel()
    if out.numel() != c.W * inp.numel():
        c.bad("same-collective", f"output_tensor has {out.numel()} elements, not {c.W} x {inp.numel()}")


def _d_all_gather(c: _Call, a) -> None:
    t = c.tensor("tensor", a["tensor"])
    _same_dtype(c, ("tensor", t), *[(f"tensor_list[{i}]", x) for i, x in enumerate(a["tensor_list"] or [])])
    c.count = t.numel()
    _list_of(c, "tensor_list", a["tensor_list"], t.numel())


def _d_reduce_scatter_tensor(c: _Call, a) -> None:
    out, inp = c.tensor("output", a["output"]), c.tensor("input", a["input"])
    _same_dtype(c, ("input", inp), ("output", out))
    c.count, c.op = out.numel(), _op_code(a.get("op"))
    if inp.numel() != c.W * out.numel():
        c.bad("same-collective", f"input has {inp.numel()} elements, not {c.W} x {out.numel()}")


def _d_reduce_scatter(c: _Call, a) -> None:
    out = c.tensor("output", a["output"])
    _same_dtype(c, ("output", out), *[(f"input_list[{i}]", x) for i, x in enumerate(a["input_list"] or [])])
    c.count, c.op = out.numel(), _op_code(a.get("op"))
    _list_of(c, "input_list", a["input_list"], out.numel())


def _d_gather(c: _Call, a) -> None:
    t = c.tensor("tensor", a["tensor"])
    _same_dtype(c, ("tensor", t))
    c.count, c.root = t.numel(), _group_rank_of(c.group, a, "dst", "group_dst")
    c.root = 0 if c.root < 0 else c.root  # torch's default dst
    if c.me == c.root:
        _list_of(c, "gather_list", a.get("gather_list"), t.numel())


def _d_scatter(c: _Call, a) -> None:
    t = c.tensor("tensor", a["tensor"])
    _same_dtype(c, ("tensor", t))
    c.count, c.root = t.numel(), _group_rank_of(c.group, a, "src", "group_src")
    c.root = 0 if c.root < 0 else c.root
    if c.me == c.root:
        _list_of(c, "scatter_list", a.get("scatter_list"), t.numel())


def _d_kind_only(c: _Call, a) -> None:
    pass


def _d_object_root(glob: str, local: str):
    def describe(c: _Call, a) -> None:
        root = _group_rank_of(c.group, a, glob, local)
        c.root = 0 if root < 0 else root
        if "object_list" in a and glob == "src":  # broadcast_object_list: the lists must be as long everywhere
            c.count = len(a["object_list"])
    return describe


# name -> how to read its arguments. Object collectives pickle into tensors torch places itself.
_COLLECTIVES: Dict[str, Callable[[_Call, Dict[str, Any]], None]] = {
    "all_to_all_single": _d_all_to_all_single,
    "all_to_all": _d_all_to_all,
    "all_reduce": _d_all_reduce,
    "broadcast": _d_broadcast,
    "reduce": _d_reduce,
    "all_gather_into_tensor": _d_all_gather_into_tensor,
    "all_gather": _d_all_gather,
    "reduce_scatter_tensor": _d_reduce_scatter_tensor,
    "reduce_scatter": _d_reduce_scatter,
    "gather": _d_gather,
    "scatter": _d_scatter,
    "barrier": _d_kind_only,
    "all_gather_object": _d_kind_only,
    "broadcast_object_list": _d_object_root("src", "group_src"),
    "gather_object": _d_object_root("dst", "group_dst"),
    "scatter_object_list": _d_object_root("src", "group_src"),
}
_KINDS = {name: i + 1 for i, name in enumerate(_COLLECTIVES)}
_KIND_NAMES = {i: name for name, i in _KINDS.items()}
_UNBATCHED = ("send", "recv", "isend", "irecv")


def _group_of(a: Dict[str, Any]):
    g = a.get("group")
    return dist.distributed_c10d._get_default_group() if g is None else g


def _group_name(group) -> str:
    name = "WORLD" if group is dist.distributed_c10d._get_default_group() else group.group_name
    _GROUPS[_h(name)] = name
    return name


# ---- the collective check ------------------------------------------------------------------------------

def _describe_row(rows: List[List[int]], r: int) -> str:
    row = rows[r]
    text = f"#{row[1]} {_KIND_NAMES.get(row[2], '?')} on group {_GROUPS.get(row[3], hex(row[3]))}"
    if row[4]:
        text += f", {_dtype(row[4])}"
    if row[5] >= 0:
        text += f", {row[5]} elements"
    if row[6] >= 0:
        text += f", root {row[6]}"
    if row[7] >= 0:
        text += f", op {row[7]}"
    return text


def _verdict(rows: List[List[int]], me: int) -> Optional[Tuple[str, str]]:
    """(rule, message) when the side rows of one collective (one per rank) show a violation, else None.
    The same on every rank except for the wording "this rank"."""
    W = len(rows)
    bad = [r for r in range(W) if rows[r][0] != _MAGIC]
    if bad:
        return "same-collective", f"rank(s) {bad} sent a side row that is not one (the side group is out of step)"
    local = [r for r in range(W) if rows[r][8]]
    if local:
        others = ", ".join(f"rank {r}: [{_RULE_NAMES.get(rows[r][8], '?')}]" for r in local)
        return _RULE_NAMES.get(rows[local[0]][8], "same-collective"), \
            f"broken on {others} (each raises with the details); every rank of the group raised"
    fields = [tuple(row[1:8]) for row in rows]
    if len(set(fields)) > 1:
        return "same-collective", "the ranks issued different calls: " + "; ".join(
            f"rank {r}: {_describe_row(rows, r)}" for r in range(W))
    if rows[0][9]:  # per-peer elements: what r sends to w is what w receives from r
        send = [row[_HEAD:_HEAD + W] for row in rows]
        recv = [row[_HEAD + W:_HEAD + 2 * W] for row in rows]
        wrong = [(r, w) for r in range(W) for w in range(W) if send[r][w] != recv[w][r]]
        if wrong:
            return "split-sizes", f"{_describe_row(rows, me)}: " + "; ".join(
                f"rank {r} sends {send[r][w]} elements to rank {w}, which expects {recv[w][r]}"
                for r, w in wrong[:6]) + ("; ..." if len(wrong) > 6 else "")
    return None


def _check_collective(kind: str, a: Dict[str, Any]) -> None:
    if _broken:
        _fail("earlier: " + _broken)
    group = _group_of(a)
    if not isinstance(group, dist.ProcessGroup) or dist.get_rank(group) < 0:
        return  # not a member: torch returns without communicating
    W, me = dist.get_world_size(group), dist.get_rank(group)
    c = _Call(kind, group, W, me)
    _COLLECTIVES[kind](c, a)
    c.check_tensors()
    where = f"rank {me} of group {_group_name(group)}, {kind}"
    if W == 1:
        if c.problem:
            raise NcclRuleError(c.problem[0], f"{where}: {c.problem[1]}")
        return
    sh = _shadow(group)
    per_peer = c.send_W is not None
    with sh.lock:
        sh.seq += 1
        row = [_MAGIC, sh.seq, _KINDS[kind], _h(_group_name(group)), c.dtype, c.count, c.root, c.op,
               _RULE_CODES[c.problem[0]] if c.problem else 0, int(per_peer)]
        row += (c.send_W + c.recv_W) if per_peer else [0] * (2 * W)
        mine = torch.tensor(row, dtype=torch.int64, device="cpu")  # the side group is gloo on the host
        got = [torch.empty_like(mine) for _ in range(W)]
        _wait([sh.pg.allgather([got], [mine])], f"the side check of {kind} #{sh.seq} on group {_group_name(group)}")
        rows = torch.stack(got).tolist()  # host sync: none, side rows on the host
        found = _verdict(rows, me)
        if found is not None:
            sh.seq = max(r[1] for r in rows)  # every rank read the same rows: all continue in step
    if c.problem:
        raise NcclRuleError(c.problem[0], f"{where}: {c.problem[1]}")
    if found is not None:
        raise NcclRuleError(found[0], f"{where}: {found[1]}")


# ---- point-to-point ------------------------------------------------------------------------------------

def _summary(ops: List[Tuple[int, int]]) -> List[int]:
    sizes = [n for n, _ in ops[:_SIZES]]
    return [len(ops), _h(repr(ops))] + sizes + [-1] * (_SIZES - len(sizes))


def _sizes_text(ops: List[Tuple[int, int]]) -> str:
    return "[" + ", ".join(f"{n} {_dtype(d)}" for n, d in ops[:_SIZES]) + (", ..." if len(ops) > _SIZES else "") + "]"


def _pair_text(summary: List[int]) -> str:
    n, sizes = summary[0], [s for s in summary[2:] if s >= 0]
    return f"{n} op(s) of {sizes}{' ...' if n > len(sizes) else ''} elements"


def _check_batch(ops: List) -> None:
    if _broken:
        _fail("earlier: " + _broken)
    group = ops[0].group
    if dist.get_rank(group) < 0:
        return
    W, me = dist.get_world_size(group), dist.get_rank(group)
    c = _Call("batch_isend_irecv", group, W, me)
    send: Dict[int, List[Tuple[int, int]]] = {}
    recv: Dict[int, List[Tuple[int, int]]] = {}
    for i, op in enumerate(ops):
        is_send = op.op is _originals["isend"]
        c.tensor(f"op {i} ({'isend to' if is_send else 'irecv from'} rank {op.group_peer})", op.tensor)
        (send if is_send else recv).setdefault(op.group_peer, []).append((op.tensor.numel(), _h(str(op.tensor.dtype))))
    c.check_tensors()
    where = f"rank {me} of group {_group_name(group)}, batch_isend_irecv"
    peers = sorted((set(send) | set(recv)) - {me})
    if me in send or me in recv:
        if send.get(me, []) != recv.get(me, []):
            c.bad("p2p-sizes", f"sends to itself {_sizes_text(send.get(me, []))} but receives "
                               f"{_sizes_text(recv.get(me, []))} from itself")
    if not peers:
        if c.problem:
            raise NcclRuleError(c.problem[0], f"{where}: {c.problem[1]}")
        return
    sh = _shadow(group)
    with sh.lock:
        mine, theirs, works = {}, {}, []
        for p in peers:
            row = [_MAGIC, sh.pair_seq[p], _h(_group_name(group)), _RULE_CODES[c.problem[0]] if c.problem else 0]
            row += _summary(send.get(p, [])) + _summary(recv.get(p, []))
            mine[p] = torch.tensor(row, dtype=torch.int64, device="cpu")
            theirs[p] = torch.empty_like(mine[p])
            sh.pair_seq[p] += 1
            works.append(sh.pg.send([mine[p]], p, _TAG))
            works.append(sh.pg.recv([theirs[p]], p, _TAG))
        _wait(works, f"the side check of batch_isend_irecv with ranks {peers} on group {_group_name(group)}")
    if c.problem:
        raise NcclRuleError(c.problem[0], f"{where}: {c.problem[1]}")
    n = 2 + _SIZES
    for p in peers:
        ours, row = mine[p].tolist(), theirs[p].tolist()  # host sync: none, side rows on the host
        if row[0] != _MAGIC or row[2] != ours[2] or row[1] != ours[1]:
            raise NcclRuleError("same-collective", f"{where}: this rank's batch #{ours[1]} with rank {p} met rank "
                                                   f"{p}'s batch #{row[1]} on group {_GROUPS.get(row[2], hex(row[2]))}")
        if row[3]:
            raise NcclRuleError(_RULE_NAMES.get(row[3], "p2p-sizes"),
                                f"{where}: rank {p} broke this rule in its part of the batch (it raised with the "
                                f"details)")
        their_send, their_recv = row[4:4 + n], row[4 + n:4 + 2 * n]
        our_send, our_recv = ours[4:4 + n], ours[4 + n:4 + 2 * n]
        if our_send[:2] != their_recv[:2]:
            raise NcclRuleError("p2p-sizes", f"{where}: this rank sends {_pair_text(our_send)} to rank {p}, "
                                             f"which receives {_pair_text(their_recv)} from it")
        if our_recv[:2] != their_send[:2]:
            raise NcclRuleError("p2p-sizes", f"{where}: this rank receives {_pair_text(our_recv)} from rank {p}, "
                                             f"which sends {_pair_text(their_send)} to it")


# ---- the wrappers ---------------------------------------------------------------------------------------

class _Wrapped:
    """A checked stand-in for ``torch.distributed.<name>``; equal to the original, so that torch's own
    ``op in [isend, irecv]`` test (``P2POp``) accepts it."""

    def __init__(self, name: str, original: Callable, check: Callable):
        self.__name__ = self.__qualname__ = name
        self.__doc__, self.__wrapped__ = original.__doc__, original
        self._check, self._sig = check, inspect.signature(original)

    @torch.compiler.disable  # dynamo calls it as it would call the collective: one graph break at the caller
    def __call__(self, *args, **kwargs):
        bound = self._sig.bind(*args, **kwargs)
        bound.apply_defaults()  # op=SUM given or left out reads the same
        self._check(self.__name__, bound.arguments)
        return self.__wrapped__(*args, **kwargs)

    def __eq__(self, other) -> bool:
        return other is self or other is self.__wrapped__ or (isinstance(other, _Wrapped)
                                                               and other.__wrapped__ is self.__wrapped__)

    def __hash__(self) -> int:
        return hash(self.__wrapped__)

    def __repr__(self) -> str:
        return f"<torch.distributed.{self.__name__} under nccl_rules>"


def _unbatched_check(name, a) -> None:
    peer = next((a[k] for k in ("dst", "src", "group_dst", "group_src") if a.get(k) is not None), "?")
    raise NcclRuleError("p2p-batched", f"dist.{name} with rank {peer} outside batch_isend_irecv")


def _unsupported_check(name, a) -> None:
    raise NcclRuleError("nccl-unsupported", f"dist.{name}: NCCL has no {name}")


class _Batch(_Wrapped):
    @torch.compiler.disable
    def __call__(self, p2p_op_list):
        if not isinstance(p2p_op_list, list) or not p2p_op_list or not all(
                isinstance(op, dist.P2POp) for op in p2p_op_list):
            return self.__wrapped__(p2p_op_list)  # torch raises its own error
        ops = []
        for op in p2p_op_list:  # torch tells sends from receives by identity (op.op is isend)
            copy = object.__new__(type(op))
            copy.__dict__.update(op.__dict__)
            copy.op = _originals["isend"] if op.op == _originals["isend"] else _originals["irecv"]
            ops.append(copy)
        self._check(ops)
        return self.__wrapped__(ops)


def install(timeout: Optional[float] = None) -> None:
    """Wrap the ``torch.distributed`` calls (nested calls count; ``uninstall`` undoes the outermost).

    timeout: seconds a side exchange waits for the other ranks (default 60; keep it at least the group's
    own timeout, so that a slow but correct rank is never taken for a missing one). None keeps the
    current value."""
    global _depth, _timeout_s
    with _lock:
        if timeout is not None:
            _timeout_s = float(timeout)
        _depth += 1
        if _depth > 1:
            return
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                _originals[name] = getattr(dist, name)
                setattr(dist, name, _Wrapped(name, _originals[name], _check_collective))
        for name in _UNBATCHED:
            _originals[name] = getattr(dist, name)
            setattr(dist, name, _Wrapped(name, _originals[name], _unbatched_check))
        if hasattr(dist, "monitored_barrier"):
            _originals["monitored_barrier"] = dist.monitored_barrier
            setattr(dist, "monitored_barrier", _Wrapped("monitored_barrier", dist.monitored_barrier,
                                                         _unsupported_check))
        _originals["batch_isend_irecv"] = dist.batch_isend_irecv
        dist.batch_isend_irecv = _Batch("batch_isend_irecv", dist.batch_isend_irecv, _check_batch)


def uninstall() -> None:
    """Undo ``install`` (the side groups stay built for the next install)."""
    global _depth
    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if _depth:
            return
        for name, fn in _originals.items():
            setattr(dist, name, fn)
        _originals.clear()


@contextlib.contextmanager
def nccl_rules(timeout: Optional[float] = None):
    """``install(timeout)`` for the block; after it ``uninstall()`` and the timeout as it was."""
    global _timeout_s
    before = _timeout_s
    install(timeout)
    try:
        yield
    finally:
        uninstall()
        _timeout_s = before
