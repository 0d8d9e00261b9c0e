"""Tier 2: multi-rank on CPU. ``benchmarks/overlap.py``: its limit pipeline (the same rows and expert GEMMs in C
chunks with nothing else) moves every row to the right rank and gives the experts the weight gradients of
every chunk; the script end to end on loopback writes the limit next to moe_comm's steps.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import moe_comm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")


def _rank_limit(rank, W, C):
    import torch.distributed as dist

    sys.path.insert(0, BENCH)
    import overlap

    torch.manual_seed(rank)
    cfg = moe_comm.MoEConfig(hidden_size=16, ffn_hidden_size=24, num_experts=2 * W, top_k=2)
    layer = moe_comm.MoELayer(cfg, seed=3)
    x = torch.randn(40 + 11 * rank, 16)
    with torch.no_grad():
        plan = layer.dispatcher.dispatch(x, layer.router(x).topk_idx_TK).handle.chunks[0]
    step = overlap._limit_pipeline(layer.experts, plan, 16, C, layer.dispatcher.group)
    lane = step()
    b = {k: [t.detach().clone() for t in v] for k, v in step.bufs.items()}
    every = [None] * W
    dist.all_gather_object(every, {k: b[k] for k in "xg"})
    send = [[overlap._parts(int(n), C)[c] for n in plan.send_splits_W] for c in range(C)]
    every_send = [None] * W
    dist.all_gather_object(every_send, send)
    # rows received in chunk c: every rank's chunk-c rows addressed to this rank, in source-rank order
    sent_here = {}
    for k, into in (("x", "r"), ("g", "h")):
        sent_here[into] = []
        for c in range(C):
            rows = []
            for j in range(W):
                start = sum(every_send[j][c][:rank])
                rows.append(every[j][k][c][start:start + every_send[j][c][rank]])
            sent_here[into].append(torch.cat(rows))
    # the reference weight gradients: each chunk's experts on its received rows, backward with its gradients
    ref = [torch.zeros_like(p) for p in (layer.experts.w1, layer.experts.w3, layer.experts.w2)]
    e = layer.experts.num_local_experts
    for c in range(C):
        r = b["r"][c].detach()
        counts = overlap._parts(r.shape[0], e)
        weights = [p.detach().clone().requires_grad_(True) for p in (layer.experts.w1, layer.experts.w3,
                                                                      layer.experts.w2)]
        y = moe_comm.modules.experts.GroupedExperts._compute(r, *weights, torch.tensor(counts), counts, False)
        for acc, g in zip(ref, torch.autograd.grad(y, weights, b["h"][c])):
            acc += g
    return {"lane": lane, "rows": [(sent_here[k][c], b[k][c]) for k in "rh" for c in range(C)],
            "wgrad": [(p.grad, r) for p, r in zip((layer.experts.w1, layer.experts.w3, layer.experts.w2), ref)]}


@pytest.mark.multirank
@pytest.mark.nccl_rules_exempt("a CPU benchmark: gloo only")
@pytest.mark.parametrize("C", [1, 3])
def test_limit_pipeline_moves_every_row_and_keeps_every_chunks_weight_gradients(ranks, C):
    for r in ranks(2).run(_rank_limit, C):
        assert r["lane"] > 0
        for want, got in r["rows"]:
            assert want.shape[0] > 0 and torch.equal(want, got)
        for got, want in r["wgrad"]:
            assert got is not None and want.abs().max() > 0
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.multirank
def test_overlap_bench_writes_the_limit_beside_each_step(tmp_path):
    path = tmp_path / "overlap.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "overlap.py"), "--links", "loopback", "--world-sizes",
                           "2", "--tokens", "48", "--hidden", "16", "--ffn", "24", "--experts", "4", "--chunks",
                           "1,3,auto", "--warmup", "1", "--repeats", "1", "--json", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "The limit on this machine" in proc.stdout
    (s,) = json.loads(path.read_text())["results"]
    fixed = [p for p in s["points"] if p["C"] != "auto"]
    assert [p["C"] for p in fixed] == [1, 3] and all(p["limit_step_s"] > 0 for p in fixed)
    lim = s["limit"]
    best = min(fixed, key=lambda p: p["limit_step_s"])
    assert lim["limit_best_C"] == best["C"] and lim["limit_best_s"] == best["limit_step_s"]
    assert lim["limit_best_over_max"] == pytest.approx(best["limit_step_s"] / s["ideal_s"])
    assert lim["best_over_limit_best"] == pytest.approx(s["best_step_s"] / best["limit_step_s"])
