"""The NCCL-rules mode (``moe_comm.testing.nccl_rules``) catches each rule broken on purpose, on every rank
of the call, before the real call is issued, and the group works afterwards (tier 2, gloo).

Each rank function runs its calls under ``nccl_rules()`` itself (nested in the pool's own install when
that is on) and returns ``(rule, message)`` of the NcclRuleError it caught, then proves the group and the
side group still work with a correct call.
"""
import pytest
import torch
import torch.distributed as dist

from moe_comm.comm import collectives
from moe_comm.testing import nccl_rules
from moe_comm.testing.nccl_rules import NcclRuleError


def _caught(fn):
    try:
        fn()
    except NcclRuleError as e:
        return e.rule, str(e)
    return None, "no error"


def _still_works(world_size: int) -> bool:
    t = torch.ones(3)
    dist.all_reduce(t)
    return t.tolist() == [float(world_size)] * 3


def _rank_rule(rank, world_size, case):
    with nccl_rules.nccl_rules():
        got = _caught(lambda: _CASES[case](rank, world_size))
        return got, _still_works(world_size)


def _wrong_device(rank, world_size):
    # Declare the group a CUDA group on rank 1 only: its CPU tensor breaks the rule there, and rank 0,
    # whose call is fine, raises with it.
    patched, real = (lambda group: torch.device("cuda", 0)), collectives.group_device
    collectives.group_device = patched if rank == 1 else real
    try:
        dist.all_reduce(torch.ones(4))
    finally:
        collectives.group_device = real


def _not_contiguous(rank, world_size):
    t = torch.zeros(2, 4)
    dist.all_reduce(t.t() if rank == 0 else t.reshape(4, 2))


def _different_collectives(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(4))
    else:
        dist.broadcast(torch.ones(4), src=0)


def _different_sizes(rank, world_size):
    dist.all_reduce(torch.ones(4 + rank))


def _splits_disagree(rank, world_size):
    # Rank 0 sends 2 rows to rank 1; rank 1 expects 1 row from rank 0.
    inp = torch.zeros(3, 2) if rank == 0 else torch.zeros(2, 2)
    out = torch.zeros(2, 2)
    dist.all_to_all_single(out, inp, output_split_sizes=[1, 1], input_split_sizes=[1, 2] if rank == 0 else [1, 1])


def _splits_bad_sum(rank, world_size):
    dist.all_to_all_single(torch.zeros(2), torch.zeros(2), [1, 1], [1, 2] if rank == 1 else [1, 1])


def _p2p_sizes(rank, world_size):
    peer = 1 - rank
    n = 4 if rank == 0 else 5  # rank 0 sends 4 elements, rank 1 receives 5
    send, recv = torch.zeros(4), torch.zeros(n)
    ops = [dist.P2POp(dist.isend, send, peer)] if rank == 0 else []
    ops += [dist.P2POp(dist.irecv, recv, peer)] if rank == 1 else []
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def _p2p_count(rank, world_size):
    # Rank 0 posts two sends to rank 1, which posts one receive: NCCL hangs on the second.
    ops = ([dist.P2POp(dist.isend, torch.zeros(3), 1), dist.P2POp(dist.isend, torch.zeros(3), 1, tag=1)]
           if rank == 0 else [dist.P2POp(dist.irecv, torch.zeros(3), 0)])
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def _p2p_unbatched(rank, world_size):
    t = torch.zeros(2)
    work = dist.isend(t, 1) if rank == 0 else dist.irecv(t, 0)
    work.wait()


def _monitored_barrier(rank, world_size):
    dist.monitored_barrier()


_CASES = {"group-device": _wrong_device, "contiguous": _not_contiguous, "different-kind": _different_collectives,
          "different-size": _different_sizes, "splits-disagree": _splits_disagree, "splits-sum": _splits_bad_sum,
          "p2p-sizes": _p2p_sizes, "p2p-count": _p2p_count, "p2p-batched": _p2p_unbatched,
          "monitored-barrier": _monitored_barrier}

# case -> (rule every rank raises, text each rank's message holds (rank -> text))
EXPECTED = {
    "group-device": ("group-device", {0: "broken on rank 1: [group-device]",
                                      1: "tensor is on cpu, the group's device is cuda:0"}),
    "contiguous": ("contiguous", {0: "tensor (4, 2) strides (1, 4) is not contiguous",
                                  1: "broken on rank 0: [contiguous]"}),
    "different-kind": ("same-collective", {r: "rank 0: #" for r in (0, 1)}),
    "different-size": ("same-collective", {r: "4 elements" for r in (0, 1)}),
    "splits-disagree": ("split-sizes", {r: "rank 0 sends 4 elements to rank 1, which expects 2" for r in (0, 1)}),
    "splits-sum": ("split-sizes", {0: "broken on rank 1: [split-sizes]",
                                   1: "input split sizes [1, 2] sum to 3, but input has 2 rows"}),
    "p2p-sizes": ("p2p-sizes", {0: "sends 1 op(s) of [4] elements to rank 1, which receives 1 op(s) of [5]",
                                1: "receives 1 op(s) of [5] elements from rank 0, which sends 1 op(s) of [4]"}),
    "p2p-count": ("p2p-sizes", {0: "sends 2 op(s) of [3, 3] elements to rank 1, which receives 1 op(s) of [3]",
                                1: "receives 1 op(s) of [3] elements from rank 0, which sends 2 op(s)"}),
    "p2p-batched": ("p2p-batched", {0: "dist.isend with rank 1 outside batch_isend_irecv",
                                    1: "dist.irecv with rank 0 outside batch_isend_irecv"}),
    "monitored-barrier": ("nccl-unsupported", {r: "monitored_barrier" for r in (0, 1)}),
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(EXPECTED))
def test_each_rule_raises_on_every_rank_and_the_group_still_works(ranks, case):
    rule, texts = EXPECTED[case]
    for rank, ((got_rule, message), works) in enumerate(ranks(2).run(_rank_rule, case, timeout=60)):
        assert got_rule == rule, (rank, message)
        assert f"NCCL rule [{rule}] broken" in message and texts[rank] in message, (rank, message)
        assert works, rank


def _rank_correct_calls(rank, world_size):
    """Uneven all-to-all splits, a batch with several segments per pair, object collectives and a subgroup:
    all pass under the mode and move the right data."""
    W = world_size
    with nccl_rules.nccl_rules():
        in_splits = [rank + w + 1 for w in range(W)]          # to w: rank + w + 1 rows
        out_splits = [r + rank + 1 for r in range(W)]         # from r: r + rank + 1 rows
        inp = torch.cat([torch.full((n, 2), float(rank)) for n in in_splits])
        out = torch.empty(sum(out_splits), 2)
        dist.all_to_all_single(out, inp, out_splits, in_splits)
        a2a_ok = out[:, 0].tolist() == [float(r) for r in range(W) for _ in range(out_splits[r])]
        ops, recvs = [], []
        for p in range(W):
            if p != rank:
                for k in range(2):
                    ops.append(dist.P2POp(dist.isend, torch.full((k + 1,), float(rank)), p, tag=k))
                    recvs.append((p, torch.empty(k + 1)))
                    ops.append(dist.P2POp(dist.irecv, recvs[-1][1], p, tag=k))
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        p2p_ok = all(t.eq(float(p)).all().item() for p, t in recvs)
        every = [None] * W
        dist.all_gather_object(every, rank)
        sub = dist.new_group([0, 1])
        t = torch.ones(1)
        if rank < 2:
            dist.all_reduce(t, group=sub)
        dist.barrier()
        return a2a_ok, p2p_ok, every == list(range(W)), t.item() == (2.0 if rank < 2 else 1.0)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_correct_calls_pass_and_move_the_right_data(ranks, world_size):
    for rank, flags in enumerate(ranks(world_size).run(_rank_correct_calls)):
        assert all(flags), (rank, flags)


def _rank_missing_peer(rank, world_size):
    # Rank 1 skips the collective: rank 0's side check gives up after its timeout instead of hanging.
    with nccl_rules.nccl_rules():
        _still_works(world_size)  # the side group is built (with the default timeout, as in the pool)
    if rank == 1:
        return None, None
    with nccl_rules.nccl_rules(timeout=3.0):
        got = _caught(lambda: dist.all_reduce(torch.ones(2)))
    return got, nccl_rules.broken()


@pytest.mark.multirank
def test_a_rank_that_never_arrives_is_a_timeout_not_a_hang(ranks):
    (rule, message), why = ranks(2).run(_rank_missing_peer, timeout=60)[0]
    assert rule == "same-collective" and "did not issue this call" in message, message
    assert why and "all_reduce #" in why, why  # rank 0 leaves the pool after this (tests/rank_pool.py)


def _rank_installed(rank, world_size):
    return nccl_rules.installed()


@pytest.mark.multirank
def test_pool_ranks_run_under_the_mode(ranks, request):
    on = request.config.getoption("--nccl-rules") == "on"
    assert ranks(2).run(_rank_installed) == [on, on]


@pytest.mark.multirank
@pytest.mark.nccl_rules_exempt("checks the marker itself")
def test_exempt_marker_turns_the_mode_off(ranks):
    assert ranks(2).run(_rank_installed) == [False, False]


def test_install_nests_and_uninstall_restores_torch_distributed():
    import conftest
    before = dist.all_reduce
    with nccl_rules.nccl_rules():
        assert dist.all_reduce is not before and dist.isend == dist.distributed_c10d.isend
        with nccl_rules.nccl_rules():
            pass
        assert nccl_rules.installed()
    assert dist.all_reduce is before and not nccl_rules.installed()
    assert conftest.NCCL_RULES_ENV == nccl_rules.ENV
