"""Mistakes get the fix in the message (issue #29.7), and each message is stated once.

Tier 1 (one process): bf16 input into an fp32 layer names ``.to()`` for the input and the layer and
``torch.autocast`` (each fix then runs); a float64 input gets no autocast hint; the error text appears once in
the printed traceback. Tier 2 (2 gloo ranks): the rank whose input is fine gets the fix too (it travels in the
control exchange); a layer called on one rank alone (eval mode, no_grad) times out with "every rank of its EP
group must call it"; a plain DDP wrapper over the experts and a construction every rank rejects print their text
once (no repeat per rank, no chained cause repeating it).
"""
from __future__ import annotations

import time
import traceback

import pytest
import torch
import torch.distributed as dist

import moe_comm

H = 16


def _cfg(**kw) -> moe_comm.MoEConfig:
    return moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=24, num_experts=4, top_k=2, **kw)


def _printed(fn) -> str:
    """What Python prints for the exception ``fn()`` raises (the whole chain, notes included), without the
    indented frame and source lines (a source line may quote the message)."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test reads the text
        text = "".join(traceback.format_exception(err))
        return "\n".join(line for line in text.splitlines() if not line.startswith(" "))
    raise AssertionError("did not raise")


# ------------------------------------------------------------------------------------------- tier 1
def test_bf16_input_into_an_fp32_layer_names_the_fixes():
    layer = moe_comm.MoELayer(_cfg(), seed=0)
    x = torch.randn(5, H)
    with pytest.raises(TypeError) as info:
        layer(x.bfloat16())
    text = str(info.value)
    head = text.split(" [")[0]
    assert head == ("x has dtype torch.bfloat16, not the experts' dtype torch.float32: cast the input, "
                    "x.to(torch.float32), or the layer, layer.to(torch.bfloat16); or pass torch.float32 x under "
                    "torch.autocast(device_type, dtype=torch.bfloat16)"), text
    assert len(f"TypeError: {head}".encode()) <= 256  # reaches the peers whole (wire.MESSAGE_WORDS)
    assert text.count("x has dtype") == 1 and "EP rank 0 (before any rows moved): this same error" in text, text
    assert _printed(lambda: layer(x.bfloat16())).count("x has dtype") == 1
    # each fix runs
    assert layer(x.bfloat16().to(torch.float32)).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(layer(x)).all()
    low = moe_comm.MoELayer(_cfg(), seed=0).to(torch.bfloat16)
    assert low(x.bfloat16()).dtype == torch.bfloat16


def test_float64_input_gets_no_autocast_hint():
    layer = moe_comm.MoELayer(_cfg(), seed=0)
    want = (r"x has dtype torch.float64, not the experts' dtype torch.float32: cast the input, x.to\(torch.float32\), "
            r"or the layer, layer.to\(torch.float64\) \[")
    with pytest.raises(TypeError, match=want) as info:
        layer(torch.randn(5, H, dtype=torch.float64))
    assert "autocast" not in str(info.value)


# ------------------------------------------------------------------------------------------- tier 2
def _rank_dtype(rank, world_size):
    layer = moe_comm.MoELayer(_cfg(), seed=0)
    x = torch.randn(5, H)
    bad = world_size - 1
    got = _printed(lambda: layer(x.bfloat16() if rank == bad else x))
    y = layer(x)  # the group still works
    return got, bool(torch.isfinite(y).all())


@pytest.mark.multirank
def test_the_peer_of_a_bf16_rank_gets_the_fix_too(ranks):
    res = ranks(2).run(_rank_dtype)
    for rank, (got, ok) in enumerate(res):
        last = got.strip().splitlines()[-1]
        want = "RemoteError: moe_comm: EP rank(s) [1] rejected their input" if rank == 0 else "TypeError: x has dtype"
        assert last.startswith(want, last.index(":") - len(want.split(":")[0])) and ok, (rank, last)
        assert "x.to(torch.float32)" in last and "layer.to(torch.bfloat16)" in last, (rank, last)
        assert "torch.autocast(device_type, dtype=torch.bfloat16)" in last, (rank, last)
        assert got.count("x has dtype") == 1, (rank, got)


def _rank_alone(rank, world_size):
    group = dist.new_group(list(range(world_size)))  # poisoned below: not the pool's WORLD
    layer = moe_comm.MoELayer(_cfg(), group, seed=0, timeout=1.0).eval()
    if rank != 0:
        return "skipped", 0.0  # evaluates nothing: rank 0 evaluates alone
    t0 = time.perf_counter()
    with torch.no_grad():
        got = _printed(lambda: layer(torch.randn(5, H)))
    return got.strip().splitlines()[-1], time.perf_counter() - t0


@pytest.mark.multirank
@pytest.mark.nccl_rules_exempt("a rank skips the layer on purpose; the rules' side check would wait for it")
def test_a_layer_called_on_one_rank_says_every_rank_must_call_it(ranks):
    got, elapsed = ranks(2).run(_rank_alone)[0]
    assert got.startswith("moe_comm.comm.collectives.CollectiveError: moe_comm: EP rank 0: the forward"), got
    assert "Peers not at this exchange: EP rank 1 last at Dispatcher agreement" in got, got
    assert ("every rank of its EP group must call it (forward, and backward when training), also in eval mode and "
            "under torch.no_grad(); a layer called on some ranks only waits here") in got, got
    assert elapsed < 1.0 + 4.0, elapsed


def _rank_ddp(rank, world_size):
    model = torch.nn.Sequential(torch.nn.Linear(H, H), moe_comm.MoELayer(_cfg(), seed=0))
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    ddp_text = _printed(lambda: wrapped(torch.randn(5, H)))
    agree_text = _printed(lambda: moe_comm.MoELayer(_cfg(), seed=0, bias_update_rate=-1.0))
    t = torch.tensor([1.0])
    dist.all_reduce(t)  # the group still pairs collectives
    return ddp_text, agree_text, float(t)


@pytest.mark.multirank
def test_ddp_misuse_and_rejected_construction_print_their_text_once(ranks):
    for rank, (ddp_text, agree_text, total) in enumerate(ranks(2).run(_rank_ddp)):
        last = ddp_text.strip().splitlines()[-1]
        assert last.startswith("RuntimeError: MoELayer: DistributedDataParallel over ranks [0, 1]"), (rank, last)
        assert "moe_comm.parallel.wrap_ddp(model)" in last, last
        assert "EP ranks [0, 1] (before any rows moved): this same error" in last, last
        assert ddp_text.count("hold DIFFERENT experts") == 1, (rank, ddp_text)
        assert "direct cause" not in ddp_text, ddp_text
        assert agree_text.count("bias_update_rate") == 1 and "direct cause" not in agree_text, (rank, agree_text)
        assert "rank(s) [0, 1] rejected their arguments, every rank raised" in agree_text, agree_text
        assert total == 2.0
