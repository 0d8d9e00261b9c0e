"""Tier 1 (W = 1) and tier 2 (W = 2, the ranks pool): the bytes one MoELayer forward keeps until its backward
(issue 26, "Memory that grows with depth": 26.3 the pipeline's per-chunk record, 26.4 autocast's weight copies).

Two counts, each over distinct storages (a view keeps its whole storage: counted once, at its full size), the
layer's Parameters left out (they are alive anyway):
- saved: every tensor autograd saves for backward during the forward (``saved_tensors_hooks``). The experts'
  own graph is not in the outer graph (the pipeline runs their backward nested, from its per-chunk record),
  but their forward runs inside the hooks' context, so their saved GEMM inputs and activations are counted
  (``test_the_count_sees_the_experts_saved_tensors`` checks it).
- held: saved plus what the pipeline's record (``ctx.run`` of its autograd node) keeps outside autograd's
  saved tensors: the per-chunk (input leaf, weights leaf, output) entries, the permuted rows, the plan. Storages
  of the process's shared Workspace are left out: one set of scratch buffers per process, reused by every layer
  (moe_comm.dispatch.workspace), so they do not grow with depth.
Each is compared with a bound written from the shapes (``_bound``), term by term: what backward needs.
"""
from __future__ import annotations

import pytest
import torch

import moe_comm

T, H, F, E, K = 256, 64, 128, 4, 2  # H, F multiples of 8: bf16 rows step in 16 bytes


def _storages(tensors, skip):
    """{storage data_ptr: bytes} of ``tensors`` (storages in ``skip`` left out; empty storages too)."""
    out = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in skip:
            out[st.data_ptr()] = st.nbytes()
    return out


def _record_tensors(obj, depth=0):
    """The tensors a pipeline record holds: direct attributes, tuples, lists and dicts, and the attributes of
    plain objects (the dispatch handle, its chunk plans) a few levels down; never into autograd nodes (the
    graph's saved tensors are counted by the hooks), modules or the dispatcher."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 4 or obj is None or isinstance(obj, (torch.nn.Module, torch.autograd.graph.Node)):
        return
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _record_tensors(o, depth + 1)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _record_tensors(o, depth + 1)
    elif hasattr(obj, "__dict__") and not callable(obj) and type(obj).__module__.startswith("moe_comm"):
        for name, o in vars(obj).items():
            if name != "dispatcher":
                yield from _record_tensors(o, depth + 1)


def _pipeline_record(y: torch.Tensor):
    """``ctx.run`` of the pipeline's autograd node in y's graph."""
    stack, seen = [y.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if hasattr(node, "run"):
            return node.run
        stack.extend(f for f, _ in node.next_functions)
    raise AssertionError("no pipeline node in the layer's graph")


def _kept(layer, x, amp: bool):
    """(saved bytes, held bytes, routing) of one forward of ``layer`` on x (bf16 autocast when ``amp``)."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        y, routing = layer(x, return_routing=True)
    run = _pipeline_record(y)
    shared = {b.untyped_storage().data_ptr() for b in layer.dispatcher.workspace._bufs.values()}
    saved_b = _storages(saved, params)
    assert not shared & set(saved_b), "a saved tensor lives in the shared Workspace (a later layer overwrites it)"
    held_b = dict(saved_b)
    held_b.update(_storages(_record_tensors(run), params | shared))
    return sum(saved_b.values()), sum(held_b.values()), y, routing


def _bound(*, R: int, C: int, W: int, amp: bool, x_bytes: int = 4):
    """What a forward must keep for backward, term by term: (saved terms, held-only terms), bytes.

    T tokens, K slots each, none dropped: N = T * K rows sent; R rows received on this rank (all chunks); e = E / W.
    The experts compute in bf16 under autocast (2 bytes), else in x's dtype; the router and the combine in fp32."""
    N, e = T * K, E // W
    c_bytes = 2 if amp else x_bytes
    saved = {
        "router: x [T, H] (input of the logits GEMM)": T * H * x_bytes,
        "router: scores [T, E] fp32 (softmax's output)": T * E * 4,
        "router: top-k ids [T, K] int64 (gather's index)": T * K * 8,
        "router: top-k scores [T, K] fp32 and their sum [T, 1] twice (norm_topk_prob's clamp and division)":
            T * K * 4 + 2 * T * 4,
        "experts: GEMM input rows [R, H], compute dtype": R * H * c_bytes,
        "experts: h1 = x w1^T and h3 = x w3^T [R, F], compute dtype (silu(h1) * h3 is recomputed)":
            2 * R * F * c_bytes,
        "experts: the weights: the Parameters themselves, no copy": 0,
        "combine: the rows it weighs [N, H], x's dtype (the routing weights' gradient)": N * H * x_bytes,
        "combine: routing weights [T, K] fp32": T * K * 4,
    }
    held = {
        "layout: destination row per slot [T, K] and the row maps 2 x [N], int64": T * K * 8 + 2 * N * 8,
        "plan: counts [C, W, e] and tokens per expert [e] per chunk, int64; the total rows (a scalar)":
            C * W * e * 8 + C * e * 8 + 8,
        # Under autocast the experts save the bf16 cast of the received rows; the rows themselves stay alive as
        # the record's gradient leaf (with W = 1 they are the permuted rows, which the record's wire holds too).
        # Backward never reads them: avoidable in the pipeline, tolerated here until it is (issue 26.3).
        "received rows [R, H], x's dtype: the record's gradient leaf (autocast only)": R * H * x_bytes if amp else 0,
    }
    if W > 1:
        held["plan: the regroup maps of the received rows (expert and source index) 2 x [R], int64"] = 2 * R * 8
    return saved, held


def _layer(C: int, ep_group=None):
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, num_chunks=C)
    return moe_comm.MoELayer(cfg, ep_group=ep_group, seed=5)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("C", [1, 4])
def test_a_forward_keeps_what_backward_needs_only(C, amp):
    """W = 1, T = 256, H = 64, F = 128, E = 4, K = 2: saved and held bytes within the bound of ``_bound``.
    Before 26.4 bf16 autocast saved one bf16 copy of w1, w3, w2 (e x 3 x F x H x 2 = 192 KiB) per chunk; before
    26.3 the record held every chunk's expert output [R, H] (N x H in all) until backward."""
    torch.manual_seed(0)
    layer = _layer(C)
    x = torch.randn(T, H, requires_grad=True)
    saved, held, y, routing = _kept(layer, x, amp)
    assert routing.topk_idx_TK.ge(0).all()  # dropless: N = T * K rows
    saved_terms, held_terms = _bound(R=T * K, C=C, W=1, amp=amp)
    bound_saved = sum(saved_terms.values())
    bound_held = bound_saved + sum(held_terms.values())
    weight_copy = 3 * E * F * H * 2
    assert saved <= bound_saved, (f"saved {saved} B > bound {bound_saved} B by {saved - bound_saved} B "
                                  f"({(saved - bound_saved) / weight_copy:.2f} bf16 weight copies)")
    assert held <= bound_held, (f"held {held} B > bound {bound_held} B by {held - bound_held} B "
                                f"({(held - bound_held) / (T * K * H):.2f} x [N, H] elements)")
    y.float().sum().backward()  # the forward was a real one: its backward runs
    assert layer.experts.w1.grad is not None and layer.experts.w1.grad.abs().sum() > 0


def test_the_count_sees_the_experts_saved_tensors():
    """The experts' graph lives in the pipeline's record, not under y.grad_fn: the hooks must still see its saved
    GEMM inputs and h1, h3, i.e. the count exceeds everything else in the bound."""
    layer = _layer(4)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    saved, _, _, _ = _kept(layer, x, amp=False)
    terms, _ = _bound(R=T * K, C=4, W=1, amp=False)
    experts = sum(v for k, v in terms.items() if k.startswith("experts:"))
    assert saved > sum(terms.values()) - experts  # without the experts' tensors it could not be
    assert saved >= experts


def _rank_kept(rank, world_size, C, amp):
    import torch.distributed as dist

    torch.manual_seed(0)
    layer = _layer(C, ep_group=dist.group.WORLD)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(10 + rank), requires_grad=True)
    saved, held, y, routing = _kept(layer, x, amp)
    counts_E = torch.bincount(routing.topk_idx_TK.reshape(-1), minlength=E)
    dist.all_reduce(counts_E)
    e = E // world_size
    R = int(counts_E[rank * e:(rank + 1) * e].sum())
    y.float().sum().backward()
    return saved, held, R, bool(routing.topk_idx_TK.ge(0).all())


@pytest.mark.multirank
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16_autocast"])
def test_a_forward_keeps_what_backward_needs_only_on_2_ranks(ranks, amp):
    """W = 2, C = 4, each rank T = 256 tokens: the bound of ``_bound`` with this rank's R received rows."""
    for saved, held, R, dropless in ranks(2).run(_rank_kept, 4, amp):
        assert dropless
        saved_terms, held_terms = _bound(R=R, C=4, W=2, amp=amp)
        bound_saved = sum(saved_terms.values())
        assert saved <= bound_saved, (saved, bound_saved, saved - bound_saved)
        assert held <= bound_saved + sum(held_terms.values()), (held, bound_saved + sum(held_terms.values()))
