"""Two-level dispatch across nodes (``Dispatcher(ranks_per_node=L)``, ``moe_comm.dispatch.hierarchy``).

Tier 2 (gloo ranks, nodes emulated by rank blocks): outputs, input, weight and expert gradients against the
dense float64 reference at 2 x 2 and 2 x 4 ranks, C = 1 and 3, dropped slots and a rank without tokens; one
row per (token, destination node) crosses nodes; FP8 within its bound; a failure on one rank of one node
raises on every rank (the failing one its own error, the others ``PeerFailed`` naming it), in the forward
and in the backward, and the next call works; bad arguments raise naming the argument.
"""
from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm.dispatch.hierarchy import node_size

from tanh_oracle import H, data as _data, dense as _dense, experts as _experts  # tests/tanh_oracle.py


def _expert_fn(W_local, fail_on=None):
    def expert_fn(tokens_RH, tokens_per_expert_e):
        if fail_on is not None and fail_on():
            raise RuntimeError("expert kernel failed on purpose")
        outs, start = [], 0
        for j, n in enumerate(tokens_per_expert_e.tolist()):
            outs.append(torch.tanh(tokens_RH[start:start + n] @ W_local[j]))
            start += n
        return torch.cat(outs) if outs else tokens_RH * 1.0
    return expert_fn


def _rel(a, b):
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _node_limited(idx, E, nodes, seed):
    """The same number of slots per token, every token's experts on one node (its first slot's, or a random one)."""
    g = torch.Generator().manual_seed(seed)
    per_node = E // nodes
    node_T = torch.randint(0, nodes, (idx.shape[0],), generator=g)
    pick = torch.rand(idx.shape[0], per_node, generator=g).argsort(1)[:, :idx.shape[1]]
    return torch.where(idx >= 0, node_T[:, None] * per_node + pick, idx)


def _routing(rank, world_size, L, E, K, T, node_limited):
    x, idx, w = _data(rank, E, K, T, drop=True)
    if node_limited:
        idx = _node_limited(idx, E, world_size // L, seed=99 + rank)
    return x, idx, w


def _rank_exact(rank, world_size, L, E, K, tokens, chunk_counts, node_limited=False):
    T, e = tokens[rank], E // world_size
    x, idx, w = _routing(rank, world_size, L, E, K, T, node_limited)
    W_full = _experts(E)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    W_ref = W_full.clone().requires_grad_(True)
    yr = _dense(xr, idx, wr, W_ref)
    scale = torch.arange(1, H + 1, dtype=torch.float64)
    (yr * scale).sum().backward()
    out = {"ref": (yr.detach(), xr.grad, wr.grad, W_ref.grad[rank * e:(rank + 1) * e])}
    for C in chunk_counts:
        d = moe_comm.Dispatcher(E, num_chunks=C, ranks_per_node=L)
        assert d.ranks_per_node == L
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        W_local = W_full[rank * e:(rank + 1) * e].clone().requires_grad_(True)
        y = d(xi, idx, wi, _expert_fn(W_local))
        (y * scale).sum().backward()
        out[C] = (y.detach(), xi.grad, wi.grad, W_local.grad, dict(d.last_bytes))
    # the tokens' distinct destination nodes other than their own: what should cross
    node_of = (idx.clamp(min=0) // (e * L))
    remote = [len({int(n) for n, i in zip(node_of[t], idx[t]) if i >= 0} - {rank // L}) for t in range(T)]
    out["remote_nodes"] = sum(remote)
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,L,E,K,tokens,node_limited", [
    (4, 2, 8, 4, [11, 6, 0, 13], False),
    (8, 4, 16, 4, [7, 3, 5, 0, 9, 4, 6, 2], False),
    (8, 4, 16, 4, [7, 3, 5, 0, 9, 4, 6, 2], True),  # every token's experts on one node
])
def test_two_levels_match_dense_reference(ranks, world_size, L, E, K, tokens, node_limited):
    chunk_counts = [1, 4]
    per_rank = ranks(world_size).run(_rank_exact, L, E, K, tokens, chunk_counts, node_limited)
    for rank, res in enumerate(per_rank):
        y_ref, x_ref, w_ref, _ = res["ref"]
        for C in chunk_counts:
            y, xg, wg, Wg, b = res[C]
            assert _rel(y, y_ref) <= 1e-12, (rank, C)
            assert _rel(xg, x_ref) <= 1e-12, (rank, C)
            assert _rel(wg, w_ref) <= 1e-12, (rank, C)
            assert Wg is not None
            # one row per (token, destination node) crosses nodes, with its [2K] metadata
            assert b["rows_inter"] == res["remote_nodes"], (rank, C, b)
            assert b["dispatch_wire_inter"] == res["remote_nodes"] * (H * 8 + 2 * K * 8)
            assert b["combine_wire_inter"] == res["remote_nodes"] * H * 8
    # each rank's expert gradients equal the reference's (summed over all ranks' tokens)
    if node_limited:  # at most one row per token crosses
        assert all(res[C][4]["rows_inter"] <= tokens[r] for r, res in enumerate(per_rank) for C in chunk_counts)
    ref_sum = _reference_expert_grads(world_size, L, E, K, tokens, node_limited)
    for rank, res in enumerate(per_rank):
        for C in chunk_counts:
            assert _rel(res[C][3], ref_sum[rank]) <= 1e-12, (rank, C)


def _reference_expert_grads(world_size, L, E, K, tokens, node_limited):
    """Every rank's tokens through the dense reference: the gradient of each rank's expert block."""
    W_full = _experts(E).requires_grad_(True)
    scale = torch.arange(1, H + 1, dtype=torch.float64)
    for rank in range(world_size):
        x, idx, w = _routing(rank, world_size, L, E, K, tokens[rank], node_limited)
        (_dense(x, idx, w, W_full) * scale).sum().backward()
    e = E // world_size
    return [W_full.grad[r * e:(r + 1) * e] for r in range(world_size)]


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("expert backward failed on purpose")


def _rank_failure(rank, world_size, where):
    E, K, T, L = 8, 2, 6, 2
    e = E // world_size
    x, idx, w = _data(rank, E, K, T, drop=False)
    W_local = _experts(E)[rank * e:(rank + 1) * e].clone().requires_grad_(True)
    d = moe_comm.Dispatcher(E, num_chunks=2, ranks_per_node=L, timeout=30)
    experts = _expert_fn(W_local, fail_on=lambda: rank == 3 and where == "forward")

    def expert_fn(tokens_RH, tokens_per_expert_e):
        out = experts(tokens_RH, tokens_per_expert_e)
        return _FailBackward.apply(out) if rank == 3 and where == "backward" else out
    outcome = None
    try:
        y = d(x.clone().requires_grad_(True), idx, w, expert_fn)
        y.sum().backward()
        outcome = "returned"
    except Exception as err:  # noqa: BLE001 - the outcome is what the test checks
        outcome = f"{type(err).__name__}: {err}"
    # the next call works on every rank
    y2 = d(x, idx, w, _expert_fn(_experts(E)[rank * e:(rank + 1) * e]))
    return outcome, float(y2.abs().sum())


@pytest.mark.multirank
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_failure_on_one_rank_raises_on_every_rank(ranks, where):
    per_rank = ranks(4).run(_rank_failure, where)
    for rank, (outcome, y2) in enumerate(per_rank):
        if rank == 3:
            assert outcome.startswith("RuntimeError") and "on purpose" in outcome, outcome
        else:
            assert outcome.startswith("PeerFailed") and "EP rank(s) [3]" in outcome, (rank, outcome)
        assert y2 > 0


def _rank_bad_input(rank, world_size):
    E, K, T = 8, 2, 5
    x, idx, w = _data(rank, E, K, T, drop=False)
    if rank == 2:
        idx = idx.clone()
        idx[0, 0] = E + 1  # out of range on one rank only
    d = moe_comm.Dispatcher(E, ranks_per_node=2)
    try:
        d(x, idx, w, lambda t, n: t * 2.0)
        return "returned"
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"


@pytest.mark.multirank
def test_bad_input_on_one_rank_raises_on_every_rank(ranks):
    for rank, outcome in enumerate(ranks(4).run(_rank_bad_input)):
        assert outcome.startswith("ValueError") and "expert ids outside" in outcome and "[2]" in outcome, outcome


def _rank_args(rank, world_size):
    errors = []
    for kwargs in (dict(ranks_per_node=3), dict(ranks_per_node=0), dict(ranks_per_node=2, max_tokens_per_rank=4),
                   dict(ranks_per_node=2, num_chunks="auto")):
        try:
            moe_comm.Dispatcher(8, **kwargs)
            errors.append("built")
        except (TypeError, ValueError) as err:
            errors.append(str(err))
    d = moe_comm.Dispatcher(8, ranks_per_node=2)
    try:
        d.dispatch(torch.zeros(2, H), torch.zeros(2, 1, dtype=torch.int64))
        errors.append("dispatched")
    except ValueError as err:
        errors.append(str(err))
    flat = moe_comm.Dispatcher(8, ranks_per_node=4)  # one node: flat
    errors.append(repr(flat.ranks_per_node))
    return errors


@pytest.mark.multirank
def test_argument_errors_name_the_argument(ranks):
    for errors in ranks(4).run(_rank_args):
        assert "ranks_per_node (3) must divide the EP world size (4)" in errors[0]
        assert "ranks_per_node" in errors[1]
        assert "max_tokens_per_rank" in errors[2] and "ranks_per_node" in errors[2]
        assert "num_chunks='auto'" in errors[3]
        assert "dispatch() is not available with ranks_per_node=2" in errors[4]
        assert errors[5] == "None"


def test_node_size_auto_reads_the_launcher(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        node_size("auto", None, 1)
    assert node_size(None, None, 4) is None
    assert node_size(2, None, 4) == 2
    assert node_size(1, None, 4) is None and node_size(4, None, 4) is None


def _rank_forwarder_fault(rank, world_size, kind):
    """A fault on rank 1 in the node level (its forwarding permute) or the rail level: every rank raises."""
    from moe_comm.dispatch import send_rows
    from moe_comm.testing import faults

    E, K, T = 8, 3, 7
    x, idx, w = _data(rank, E, K, T, drop=False)
    d = moe_comm.Dispatcher(E, num_chunks=2, ranks_per_node=2, timeout=30)
    original = send_rows.presend

    def presend(disp, *args, **kwargs):
        if disp is d._nodes.inner:
            raise RuntimeError("injected forwarding fault")
        return original(disp, *args, **kwargs)

    fn = lambda t, n: t * 2.0  # noqa: E731
    outcome = None
    try:
        if kind == "forward":
            send_rows.presend = presend if rank == 1 else original
            d(x, idx, w, fn)
        else:
            with (faults.inject(kind) if rank == 1 else _nothing()):
                d(x.requires_grad_(True), idx, w, fn).sum().backward()
        outcome = "returned"
    except Exception as err:  # noqa: BLE001
        outcome = f"{type(err).__name__}: {err}"
    finally:
        send_rows.presend = original
    try:
        y = d(x.detach(), idx, w, fn)  # the next call works
        return outcome, bool(torch.isfinite(y).all())
    except Exception as err:  # noqa: BLE001
        return outcome, f"next call: {type(err).__name__}: {err}"


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _rank_dequantize_fault(rank, world_size):
    """FP8: rank 1's dequantize of the rows that came over the rail fails, before its node's call: it joins that
    call with the error, so every rank raises naming it (its node peers are in the call) - no timeout."""
    E, K, T = 8, 3, 7
    x, idx, w = _data(rank, E, K, T, drop=False)
    x = x.float()
    d = moe_comm.Dispatcher(E, num_chunks=2, ranks_per_node=2, timeout=30, dispatch_dtype=torch.float8_e4m3fn)
    rail = d._nodes.rail
    original = rail._dequantize

    def dequantize(*args, **kwargs):
        raise RuntimeError("injected dequantize fault")

    rail._dequantize = dequantize if rank == 1 else original
    try:
        d(x, idx, w.float(), lambda t, n: t * 2.0)
        outcome = "returned"
    except Exception as err:  # noqa: BLE001
        outcome = f"{type(err).__name__}: {err}"
    rail._dequantize = original
    y = d(x, idx, w.float(), lambda t, n: t * 2.0)  # the next call works
    return outcome, bool(torch.isfinite(y).all())


@pytest.mark.multirank
def test_fault_before_the_node_call_raises_on_every_rank(ranks):
    for rank, (outcome, next_ok) in enumerate(ranks(4).run(_rank_dequantize_fault)):
        if rank == 1:
            assert outcome.startswith("RuntimeError: injected dequantize fault"), outcome
        else:
            assert outcome.startswith("PeerFailed") and "EP rank(s) [1]" in outcome, (rank, outcome)
        assert next_ok, rank


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["forward", "permute", "unpermute"])
def test_fault_on_a_forwarding_rank_raises_on_every_rank(ranks, kind):
    for rank, (outcome, next_ok) in enumerate(ranks(4).run(_rank_forwarder_fault, kind)):
        if rank == 1:
            assert outcome.startswith("RuntimeError: inject"), outcome
        else:
            assert outcome.startswith("PeerFailed") and "EP rank(s) [1]" in outcome, (rank, outcome)
        assert next_ok is True, (rank, next_ok)


def _killed_rank(rank, world_size, init_file, q):
    import datetime
    import os
    import time

    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    E = 8
    x, idx, w = _data(rank, E, 3, 6, drop=False)
    d = moe_comm.Dispatcher(E, num_chunks=2, ranks_per_node=2, timeout=3.0)

    def expert_fn(tokens, counts):
        if rank == 3:
            os._exit(1)  # killed on node 1, inside the node level of the call
        return tokens * 2

    t0 = time.perf_counter()
    try:
        d(x, idx, w, expert_fn)
        q.put((rank, "no error", time.perf_counter() - t0, ""))
    except Exception as err:  # noqa: BLE001
        msg = f"{type(err).__name__}: {err}"
        t1 = time.perf_counter()
        try:  # every group of the call is poisoned: the next call raises at once
            d(x, idx, w, expert_fn)
            again = "no error"
        except Exception as err2:  # noqa: BLE001
            again = f"{type(err2).__name__} after {time.perf_counter() - t1:.2f} s: {err2}"
        q.put((rank, msg, t1 - t0, again))
    q.close()
    q.join_thread()
    os._exit(0)


@pytest.mark.multirank
def test_killed_rank_on_the_other_node_raises_within_the_timeout(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_killed_rank, args=(r, 4, str(tmp_path / "store"), q)) for r in range(4)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < 3:
            rank, msg, elapsed, again = q.get(timeout=90)
            got[rank] = (msg, elapsed, again)
    finally:
        for p in procs:
            p.kill()
            p.join()
    assert sorted(got) == [0, 1, 2]
    for rank, (msg, elapsed, again) in got.items():
        assert again.startswith("CollectiveError after 0.") and "earlier collective" in again, (rank, again)
        named = f"EP rank {rank} (node {rank // 2}, local rank {rank % 2})"
        assert msg.startswith("CollectiveError") and msg.count(named) == 1, (rank, msg)
        assert elapsed < 2 * 3.0 + 6.0, (rank, elapsed)  # two levels' timeouts at most, plus scheduling
