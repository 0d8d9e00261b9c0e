"""Workloads and the LoadMonitor.

Tier 1 (pure logic, one process): workloads are reproducible and plant the distribution they promise;
monitor counts and metrics equal a brute-force recount for every workload; planted hot experts are found
with their rank and nothing is flagged on uniform load; the hot-change callback and log record fire at
the right steps; summary / to_json schema; plot writes a PNG (skipped without matplotlib) whose title
names the layer (model_monitors: its module path) and whose foot defines balancedness; observe makes
no host sync (host-reading Tensor methods raise while it runs); a window too large for memory raises at
construction; to_json writes strict JSON (null for NaN / Infinity).
Tier 2 (multi-rank gloo, ``ranks`` fixture, 2 and 4 ranks): observe(group=...) sums over the EP group
and equals the brute-force recount of every rank's routing; with dp_group=... it (and reduce_counts) sums
over EP x DP, the global batch.
"""
from __future__ import annotations

import json
import logging
import math
import sys

import pytest
import torch

from moe_comm.testing import workloads as wl
from moe_comm.monitor.load import HotExpert, LoadMonitor

# Workload name -> parameters used throughout (valid for E = 16, K = 2, W = 4).
CASES = {
    "uniform": {},
    "zipf": {"s": 1.2},
    "hot_experts": {"k": 2, "p": 0.4},
    "hot_rank": {"rank": 1, "num_ranks": 4, "p": 0.6},
    "drifting": {"hot": 2, "period": 3, "p": 0.4},
}
E, K, W = 16, 2, 4


def _routing(name, step, seed=0, T=256, drop_every=0):
    """topk_idx_TK of a workload, with every ``drop_every``-th slot set to -1 (dropped) when > 0."""
    idx = wl.make_workload(name, **CASES[name])(T, E, K, seed=seed, step=step)
    if drop_every:
        idx = idx.clone()
        idx.view(-1)[::drop_every] = -1
    return idx


# ----------------------------------------------------------------------------------------- workloads

def test_workloads_listed():
    assert set(wl.WORKLOADS) == set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_workload_reproducible_and_well_formed(name):
    f = wl.make_workload(name, **CASES[name])
    a = f(300, E, K, seed=3, step=5)
    assert a.shape == (300, K) and a.dtype == torch.int64
    assert torch.equal(a, f(300, E, K, seed=3, step=5)), "same arguments, same routing"
    assert torch.equal(a, getattr(wl, name)(300, E, K, 3, 5, **CASES[name])), "function and factory agree"
    assert not torch.equal(a, f(300, E, K, seed=4, step=5))
    assert not torch.equal(a, f(300, E, K, seed=3, step=6))
    assert int(a.min()) >= 0 and int(a.max()) < E
    s = a.sort(dim=1).values
    assert bool((s[:, 1:] != s[:, :-1]).all()), "experts of a token are distinct"
    assert f(0, E, K).shape == (0, K)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_workload_matches_expected_shares(name, top_k):
    """Every expert's slot count is within 5 sigma of T * K * expected share (binomial per token)."""
    T = 20000
    f = wl.make_workload(name, **CASES[name])
    counts = torch.bincount(f(T, E, top_k, seed=1).view(-1), minlength=E).double()
    pi = f.expected_shares(E, top_k) * top_k  # inclusion probability per token
    assert pi.sum().item() == pytest.approx(top_k) and float(pi.max()) <= 1.0 + 1e-12
    sigma = (T * pi * (1 - pi)).sqrt().clamp_min(1.0)
    z = (counts - T * pi).abs() / sigma
    assert float(z.max()) < 5.0, f"{name}: worst expert is {float(z.max()):.1f} sigma off"


def test_planted_distributions():
    T = 20000
    # k hot experts really take p of the slots (here p / k = 0.2 <= 1 / K, so no cap applies).
    idx = wl.hot_experts(T, E, 2, seed=0, k=2, p=0.4)
    share_hot = float((idx < 2).double().mean())
    assert share_hot == pytest.approx(0.4, abs=0.01)
    # One rank's experts take p of the slots.
    idx = wl.hot_rank(T, E, 2, seed=0, rank=1, num_ranks=4, p=0.6)
    assert float(((idx >= 4) & (idx < 8)).double().mean()) == pytest.approx(0.6, abs=0.01)
    # Zipf: monotone in expectation, and the sampled counts of blocks of experts decrease too.
    q = wl.expected_shares("zipf", 64, 1, s=1.2)
    assert bool((q[1:] <= q[:-1]).all())
    assert float(q[0] / q[1]) == pytest.approx(2 ** 1.2)
    counts = torch.bincount(wl.zipf(T, 64, 1, seed=0, s=1.2).view(-1), minlength=64).double()
    blocks = counts.reshape(8, 8).sum(1)
    assert bool((blocks[1:] < blocks[:-1]).all())
    # The 1/K cap: with K = 8 experts 0 and 1 are in every token, the rest share what is left.
    q8 = wl.expected_shares("zipf", 64, 8, s=1.2)
    assert q8[:2].tolist() == pytest.approx([1 / 8, 1 / 8]) and float(q8[2]) < 1 / 8
    assert bool((wl.zipf(1000, 64, 8, seed=0)[:, :] < 2).sum(1).eq(2).all())
    # Drifting: the hot set at each step is where the load is.
    for step in (0, 7, 30):
        hot = wl.drifting_hot_set(E, step, hot=2, period=3)
        idx = wl.drifting(4000, E, 2, seed=0, step=step, hot=2, period=3, p=0.4)
        c = torch.bincount(idx.view(-1), minlength=E)
        assert set(c.topk(2).indices.tolist()) == set(hot.tolist())
    assert wl.drifting_hot_set(8, 0, 2, 10).tolist() == [0, 4]
    assert wl.drifting_hot_set(8, 15, 2, 10).tolist() == [1, 5]


def test_workload_errors():
    with pytest.raises(ValueError, match="unknown workload 'zipff'.*uniform, zipf"):
        wl.make_workload("zipff")
    with pytest.raises(ValueError, match="unknown parameter.*k.*s=1.2"):
        wl.make_workload("zipf", k=3)
    with pytest.raises(ValueError, match="p must be a fraction"):
        wl.hot_experts(10, 8, 2, p=1.5)
    with pytest.raises(ValueError, match="top_k must be <= num_experts"):
        wl.uniform(10, 4, 5)
    with pytest.raises(ValueError, match="fewer than top_k"):
        wl.hot_experts(10, 8, 4, k=2, p=1.0)
    with pytest.raises(ValueError, match="divisible by num_ranks"):
        wl.hot_rank(10, 10, 2, num_ranks=4)
    with pytest.raises(ValueError, match="period"):
        wl.drifting(10, 8, 2, period=0)


def test_routing_logits_and_count_tokens():
    idx = wl.zipf(500, E, 3, seed=2)
    logits = wl.routing_logits(idx, E, seed=1)
    assert logits.shape == (500, E) and logits.dtype == torch.float32
    assert torch.equal(logits.softmax(-1).topk(3, dim=-1).indices, idx), "top-K of the logits is the routing"
    counts, dropped = wl.count_tokens(torch.tensor([[0, 2], [2, -1]]), 3)
    assert counts.tolist() == [1, 0, 2] and int(dropped) == 1


# ------------------------------------------------------------------------------------------- monitor

def _recount(idx):
    valid = idx[idx >= 0]
    return torch.bincount(valid, minlength=E), int((idx < 0).sum())


def _ratio(a, b):
    return a / b if b > 0 else None


@pytest.mark.parametrize("name", list(CASES))
def test_monitor_counts_equal_recount(name):
    """History, totals, EMA, every metric and the router entropy against brute force (17 steps, window 6)."""
    steps, window, decay = 17, 6, 0.8
    mon = LoadMonitor(E, num_ranks=W, window=window, ema_decay=decay)
    per_step, drops, ents, ema = [], [], [], None
    for step in range(steps):
        idx = _routing(name, step, drop_every=7)
        counts_E, dropped = wl.count_tokens(idx, E)
        scores = wl.routing_logits(idx.clamp_min(0), E, seed=step).double().softmax(-1)
        mon.observe(counts_E, dropped, scores)
        c, d = _recount(idx)
        per_step.append(c)
        drops.append(d)
        p = scores.mean(0)
        ents.append(float(-(p * p.log()).sum()))
        ema = c.double() if ema is None else decay * ema + (1 - decay) * c.double()
    hist = mon.history()
    assert hist["steps"] == list(range(steps - window, steps))
    assert hist["tokens_per_expert"] == [c.tolist() for c in per_step[-window:]]
    assert hist["dropped"] == drops[-window:]
    assert hist["router_entropy"] == pytest.approx(ents[-window:])

    s = mon.summary()
    assert s["steps"] == steps and s["window_steps"] == window
    total = torch.stack(per_step).sum(0)
    assert s["total"]["tokens_per_expert"] == total.tolist()
    assert s["total"]["dropped"] == sum(drops) and s["total"]["routed"] == int(total.sum())
    assert s["total"]["drop_fraction"] == pytest.approx(sum(drops) / (sum(drops) + int(total.sum())))

    def check_view(view, load, dropped=None):
        load = load.double()
        rank = load.reshape(W, -1).sum(1)
        assert view["tokens_per_expert"] == pytest.approx(load.tolist())
        assert view["tokens_per_rank"] == pytest.approx(rank.tolist())
        assert view["balancedness"] == pytest.approx(float(load.mean() / load.max()))
        assert view["expert_max_over_mean"] == pytest.approx(float(load.max() / load.mean()))
        assert view["rank_max_over_mean"] == pytest.approx(float(rank.max() / rank.mean()))
        assert view["cv"] == pytest.approx(float(load.std(unbiased=False) / load.mean()))
        if dropped is not None:
            assert view["drop_fraction"] == pytest.approx(dropped / (dropped + float(load.sum())))

    check_view(s["window"], torch.stack(per_step[-window:]).sum(0), sum(drops[-window:]))
    check_view(s["last"], per_step[-1], drops[-1])
    check_view(s["ema"], ema)
    steps_bal = [float(c.double().mean() / c.max()) for c in per_step[-window:]]
    assert s["window"]["step_balancedness"] == pytest.approx(sum(steps_bal) / window)
    assert s["router_entropy"]["last"] == pytest.approx(ents[-1])
    assert s["router_entropy"]["window_mean"] == pytest.approx(sum(ents[-window:]) / window)
    assert s["router_entropy"]["max"] == pytest.approx(math.log(E))


def test_planted_hot_experts_found_with_rank():
    mon = LoadMonitor(E, num_ranks=W, hot_persistence=5)
    for step in range(5):
        mon.observe(wl.count_tokens(_routing("hot_experts", step), E)[0])
        hot = mon.hot_experts()
        assert [h.expert for h in hot] == ([0, 1] if step == 4 else []), "persistence: not hot before step 4"
    assert all(isinstance(h, HotExpert) and h.rank == 0 and h.since_step == 4 for h in hot)
    assert all(h.load_over_mean == pytest.approx(0.2 / (1 / E), rel=0.25) for h in hot)  # 20% of slots each

    mon = LoadMonitor(E, num_ranks=W)
    for step in range(10):
        mon.observe(wl.count_tokens(_routing("hot_rank", step), E)[0])
    # Rank 1's four experts take 60% of the slots: 2.4x the mean each.
    assert [(h.expert, h.rank) for h in mon.hot_experts()] == [(4, 1), (5, 1), (6, 1), (7, 1)]


def test_nothing_flagged_on_uniform_load():
    events = []
    mon = LoadMonitor(64, num_ranks=8, window=50, hot_persistence=3,
                      on_hot_change=lambda a, r, s: events.append((a, r, s)))
    for step in range(300):
        mon.observe(wl.count_tokens(wl.uniform(512, 64, 8, seed=0, step=step), 64)[0])
    assert mon.hot_experts() == [] and events == []
    assert mon.summary()["hot_experts"] == []


def test_hot_change_callback_and_log_record(caplog):
    """One hot expert moving every 20 steps: hot 5 steps (persistence) after it arrives, cold 5 steps after
    it leaves; one callback and one INFO record per change, in order, with the step of the change —
    even though the monitor is only read at the end."""
    events = []
    mon = LoadMonitor(E, num_ranks=W, window=100, hot_persistence=5,
                      on_hot_change=lambda added, removed, step: events.append((added, removed, step)))
    f = wl.make_workload("drifting", hot=1, period=20, p=0.5)
    with caplog.at_level(logging.INFO, logger="moe_comm.monitor.load"):
        for step in range(50):
            mon.observe(wl.count_tokens(f(256, E, K, seed=0, step=step), E)[0])
        assert events == []  # observe alone never syncs, so nothing is delivered yet
        mon.summary()
    assert events == [([0], [], 4), ([1], [0], 24), ([2], [1], 44)]
    records = [r for r in caplog.records if r.name == "moe_comm.monitor.load"]
    assert len(records) == 3 and all(r.levelno == logging.INFO for r in records)
    assert "step 24" in records[1].getMessage() and "1 (rank 0)" in records[1].getMessage()
    mon.summary()
    assert len(events) == 3, "changes are delivered once"


def test_sync_every_delivers_without_a_read():
    events = []
    mon = LoadMonitor(E, num_ranks=W, hot_persistence=2, sync_every=1,
                      on_hot_change=lambda a, r, s: events.append((a, r, s)))
    for step in range(2):
        mon.observe(wl.count_tokens(_routing("hot_experts", step), E)[0])
    assert events == [([0, 1], [], 1)]


def test_observe_makes_no_host_sync(monkeypatch):
    mon = LoadMonitor(E, num_ranks=W, window=4, hot_persistence=2)
    inputs = []
    for step in range(6):
        idx = _routing("drifting", step, drop_every=5)
        counts_E, dropped = wl.count_tokens(idx, E)
        inputs.append((counts_E, dropped, wl.routing_logits(idx.clamp_min(0), E).softmax(-1)))

    def forbidden(*args, **kwargs):
        raise AssertionError("host sync inside observe")

    with monkeypatch.context() as m:
        for meth in ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"):
            m.setattr(torch.Tensor, meth, forbidden)
        for counts_E, dropped, scores in inputs:
            mon.observe(counts_E, dropped, scores)
            mon.observe(counts_E, 3)  # python-int dropped, no scores
        with pytest.raises(AssertionError, match="host sync"):
            mon.summary()  # the patch does catch a read
    s = mon.summary()  # reading is where the sync happens: works once the patch is gone
    assert s["steps"] == 12 and s["total"]["routed"] == 2 * sum(int(c.sum()) for c, _, _ in inputs)


def test_observe_validates_input():
    mon = LoadMonitor(E, num_ranks=W)
    with pytest.raises(ValueError, match=r"shape \[16\]"):
        mon.observe(torch.zeros(8, dtype=torch.int64))
    with pytest.raises(TypeError, match="integer tensor"):
        mon.observe(torch.zeros(E))
    with pytest.raises(ValueError, match=r"scores_TE must have shape \[T, 16\]"):
        mon.observe(torch.zeros(E, dtype=torch.int64), 0, torch.zeros(3, 5))
    with pytest.raises(ValueError, match="dropped"):
        mon.observe(torch.zeros(E, dtype=torch.int64), -1)
    with pytest.raises(ValueError, match="divisible by num_ranks"):
        LoadMonitor(10, num_ranks=4)
    with pytest.raises(ValueError, match="hot_threshold"):
        LoadMonitor(E, hot_threshold=0.5)


def test_summary_schema_and_json(tmp_path):
    mon = LoadMonitor(E, num_ranks=W, window=8)
    empty = mon.summary()
    assert empty["steps"] == 0 and empty["window"] is None and empty["hot_experts"] == []
    for step in range(12):
        idx = _routing("hot_experts", step, drop_every=9)
        mon.observe(*wl.count_tokens(idx, E))
    s = mon.summary()
    assert set(s) == {"num_experts", "num_ranks", "steps", "window_steps", "config", "window", "ema", "last",
                      "total", "router_entropy", "hot_experts"}
    view_keys = {"tokens_per_expert", "tokens_per_rank", "balancedness", "expert_max_over_mean",
                 "rank_max_over_mean", "rank_balancedness", "cv"}
    assert set(s["ema"]) == view_keys
    assert set(s["last"]) == view_keys | {"routed", "dropped", "drop_fraction"}
    assert set(s["window"]) == view_keys | {"routed", "dropped", "drop_fraction", "step_balancedness",
                                            "step_rank_max_over_mean"}
    assert s["router_entropy"]["last"] is None and s["router_entropy"]["window_mean"] is None  # no scores given
    assert [(h["expert"], h["rank"], h["since_step"]) for h in s["hot_experts"]] == [(0, 0, 4), (1, 0, 4)]
    assert all(set(h) == {"expert", "rank", "load_over_mean", "since_step"} for h in s["hot_experts"])
    path = tmp_path / "monitor.json"
    assert mon.to_json(path) == str(path)
    data = json.loads(path.read_text())
    assert {k: v for k, v in data.items() if k != "history"} == json.loads(json.dumps(s))
    assert data["history"]["steps"] == list(range(4, 12)) and len(data["history"]["hot"]) == 8
    mon.reset()
    assert mon.steps == 0 and mon.summary()["total"]["routed"] == 0


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    mon = LoadMonitor(32, num_ranks=4, window=60)
    f = wl.make_workload("drifting", hot=2, period=10, p=0.4)
    for step in range(80):
        mon.observe(*wl.count_tokens(f(512, 32, 4, seed=0, step=step), 32))
    path = mon.plot(tmp_path / "load.png")
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(RuntimeError, match="nothing observed"):
        LoadMonitor(4).plot(tmp_path / "empty.png")


def test_plot_names_the_layer_and_defines_balancedness(tmp_path):
    """The figure's title names the layer by its module path (model_monitors over a two-layer model) and
    gives the balancedness it computed; the foot of the figure says what balancedness is."""
    pytest.importorskip("matplotlib")
    import moe_comm
    from moe_comm.monitor import report

    cfg = moe_comm.MoEConfig(hidden_size=16, ffn_hidden_size=16, num_experts=4, top_k=2)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
    for i, block in enumerate(model.layers):
        block.moe = moe_comm.MoELayer(cfg, seed=i)
    mons = report.model_monitors(model)
    assert list(mons) == ["layers.0.moe", "layers.1.moe"] and mons["layers.1.moe"] is model.layers[1].moe.monitor
    counts = torch.tensor([[6, 2, 2, 2], [6, 2, 2, 2]])          # balancedness = mean 3 / max 6 = 0.50
    mon = mons["layers.1.moe"]
    for c in counts:
        mon.observe(c)
    fig = report.load_figure(mon)
    head, stats = fig.get_suptitle().split("\n")
    assert head == "Layer layers.1.moe" and "balancedness 0.50" in stats and "4 experts on 1 ranks" in stats
    assert fig.get_supxlabel() == report.BALANCEDNESS
    assert report.BALANCEDNESS.startswith("balancedness = mean / max tokens per expert")
    assert report.load_figure(mon, "step 7", layer="blocks.9").get_suptitle().startswith("step 7\n")
    assert report.load_figure(mon, layer="blocks.9").get_suptitle().startswith("Layer blocks.9\n")
    anon = LoadMonitor(4)
    anon.observe(counts[0])
    assert report.load_figure(anon).get_suptitle().startswith("Unnamed layer (name it: model_monitors(model))")
    path = mon.plot(tmp_path / "load.png")                         # LoadMonitor.plot goes through plot_load
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"

    model.layers[1].moe.monitor = model.layers[0].moe.monitor
    with pytest.raises(ValueError, match="'layers.0.moe' and 'layers.1.moe' share one LoadMonitor"):
        report.model_monitors(model)
    with pytest.raises(ValueError, match="holds no module with a LoadMonitor"):
        report.model_monitors(torch.nn.Linear(2, 2))


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    mon = LoadMonitor(4)
    mon.observe(torch.ones(4, dtype=torch.int64))
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` raise ImportError
    with pytest.raises(ImportError, match=r"pip install moe_comm\[plot\]"):
        mon.plot(tmp_path / "x.png")


# ------------------------------------------------------------------------------------- tier 2: ranks

def _rank_observe(rank, world_size, name, params, steps, T):
    """Each rank routes its own tokens (seed = 100 + rank) and observes with the group reduction."""
    import torch.distributed as dist

    f = wl.make_workload(name, **params)
    mon = LoadMonitor(E, num_ranks=world_size, window=steps)
    for step in range(steps):
        idx = f(T, E, K, seed=100 + rank, step=step)
        idx.view(-1)[rank::5] = -1  # some dropped slots, different per rank
        counts_E, dropped = wl.count_tokens(idx, E)
        scores = wl.routing_logits(idx.clamp_min(0), E, seed=rank * 1000 + step).double().softmax(-1)
        mon.observe(counts_E, dropped, scores, group=dist.group.WORLD)
    return mon.history(), mon.summary()


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_monitor_group_reduce_equals_recount(ranks, world_size):
    steps, T = 6, 64
    for name, params in CASES.items():
        if name == "hot_rank":
            params = {**params, "num_ranks": world_size, "rank": world_size - 1}
        results = ranks(world_size).run(_rank_observe, name, params, steps, T)
        f = wl.make_workload(name, **params)
        exp_counts, exp_drops, exp_ent = [], [], []
        for step in range(steps):
            c_sum, d_sum, p_sum = torch.zeros(E, dtype=torch.int64), 0, torch.zeros(E, dtype=torch.float64)
            for rank in range(world_size):
                idx = f(T, E, K, seed=100 + rank, step=step)
                idx.view(-1)[rank::5] = -1
                c, d = _recount(idx)
                c_sum, d_sum = c_sum + c, d_sum + d
                p_sum += wl.routing_logits(idx.clamp_min(0), E, seed=rank * 1000 + step).double().softmax(-1).sum(0)
            exp_counts.append(c_sum.tolist())
            exp_drops.append(d_sum)
            p = p_sum / p_sum.sum()
            exp_ent.append(float(-(p * p.log()).sum()))
        for rank, (hist, summ) in enumerate(results):
            assert hist["tokens_per_expert"] == exp_counts, f"{name}: rank {rank} counts differ from the recount"
            assert hist["dropped"] == exp_drops
            assert hist["router_entropy"] == pytest.approx(exp_ent)
            assert summ == results[0][1], "every rank sees the same global statistics"


def _rank_observe_ep_dp(rank, world_size, steps, T):
    """EP 2 x DP (world / 2): observe over the EP group and the DP group; also ``reduce_counts``."""
    from torch.distributed.device_mesh import init_device_mesh

    from moe_comm.monitor.load import reduce_counts
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "ep"))
    ep, dp = mesh["ep"].get_group(), mesh["dp"].get_group()
    f = wl.make_workload("zipf", s=1.2)
    mon, alone = LoadMonitor(E, num_ranks=2, window=steps), []
    for step in range(steps):
        idx = f(T, E, K, seed=100 + rank, step=step)
        counts_E, dropped = wl.count_tokens(idx, E)
        mon.observe(counts_E, dropped, group=ep, dp_group=dp)
        alone.append(reduce_counts(counts_E, ep, dp_group=dp).wait().tolist())
    return mon.history()["tokens_per_expert"], alone


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_monitor_counts_over_ep_and_dp_are_the_global_batch(ranks, world_size):
    """With dp_group the monitor (and reduce_counts) sum over EP x DP: every rank holds the counts of all
    world_size ranks' tokens (with the EP group alone, it would hold its own EP group's)."""
    steps, T = 3, 32
    f = wl.make_workload("zipf", s=1.2)
    want = [sum((wl.count_tokens(f(T, E, K, seed=100 + r, step=s), E)[0] for r in range(world_size)),
                torch.zeros(E, dtype=torch.int64)).tolist() for s in range(steps)]
    for monitored, alone in ranks(world_size).run(_rank_observe_ep_dp, steps, T):
        assert monitored == want
        assert alone == [[float(c) for c in row] for row in want]


def test_huge_window_is_rejected_before_allocating():
    """A window whose device state would not fit raises at construction, naming window and the bytes."""
    expected = r"window=10000000000 would need 23,200,000,014,344 bytes .* 256 experts \(2320 bytes per step\)"
    with pytest.raises(ValueError, match=expected):
        LoadMonitor(256, window=10 ** 10)
    mon = LoadMonitor(256, window=400_000)  # 0.93 GB of state: allowed, allocated at the first observe
    assert mon.window == 400_000
    with pytest.raises(ValueError, match=r"the limit is 1,073,741,824 bytes, i.e. window <= 462,813"):
        LoadMonitor(256, window=500_000)
    with pytest.raises(TypeError, match="LoadMonitor: window must be an int"):
        LoadMonitor(E, window=10.0)


def _strict_json(text):
    def reject(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=reject)


def test_to_json_writes_null_for_undefined_figures(tmp_path):
    """An expert still hot after a step with no tokens at all has load_over_mean = 0/0 (the EMA is all
    zeros with ema_decay=0): written as null, so the file is valid JSON for any reader."""
    mon = LoadMonitor(4, window=4, ema_decay=0.0, hot_persistence=2)
    hot = torch.tensor([10, 0, 0, 0])
    for counts in (hot, hot, torch.zeros(4, dtype=torch.int64)):
        mon.observe(counts, 0, torch.full((3, 4), 0.25) if counts.sum() else torch.zeros(0, 4))
    assert math.isnan(mon.summary()["hot_experts"][0]["load_over_mean"]), "the case this test is about"
    path = mon.to_json(tmp_path / "mon.json")
    data = _strict_json(open(path).read())
    assert data["hot_experts"] == [{"expert": 0, "rank": 0, "load_over_mean": None, "since_step": 1}]
    assert data["history"]["router_entropy"][-1] is None and data["steps"] == 3


def test_report_module_writes_json_and_plots():
    """The JSON and plot writers live in monitor/report.py; LoadMonitor stays exported where it was."""
    import moe_comm
    from moe_comm.monitor import report

    assert moe_comm.LoadMonitor is LoadMonitor and moe_comm.monitor.LoadMonitor is LoadMonitor
    assert report.json_safe({"a": [1.0, float("nan")], "b": float("-inf"), "c": (2, "x")}) == \
        {"a": [1.0, None], "b": None, "c": [2, "x"]}
