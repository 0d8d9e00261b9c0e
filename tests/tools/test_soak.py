"""Tier 2 (multi-rank gloo): a short run of ``benchmarks/soak.py``, the long-run soak.

Two ranks, 60 steps (20 warm-up) of the same schedule as the full soak (drifting hot spots, empty ranks,
random K and chunk counts, dropped slots) through the session's rank pool, so its timeout fails a hang.
Every step's exact invariant must hold. The RSS bound here is 10%, not the full soak's 2%: over 40
post-warm-up steps the two 20-sample medians still see the allocator settling (glibc arenas, the mmap
threshold, first-touched code pages: up to ~1% on this machine's ~390 MiB ranks), so 2% would be flaky;
10% (~40 MiB) still fails a gross leak, e.g. a retained step of activations at 1 MiB/step or more. The
2% claim belongs to the 2,000-step run: ``python benchmarks/soak.py --steps 2000 --world-size 4``.
"""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


def _import_soak():
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    import soak
    return soak


def _soak_rank(rank, world_size, cfg_kwargs):
    """Runs in a pool worker: the pool pickles this function by reference (module test_soak)."""
    soak = _import_soak()
    return soak.rank_main(rank, world_size, soak.SoakConfig(**cfg_kwargs))


def test_rss_summary_compares_medians_after_warmup():
    soak = _import_soak()
    MiB = 2 ** 20
    # 10 warm-up samples at 50 MiB (ignored), then 100 MiB with one spike, then 101 MiB.
    samples = [50 * MiB] * 10 + [100 * MiB] * 20 + [900 * MiB] + [101 * MiB] * 19
    s = soak.rss_summary(samples, warmup_steps=10, window=50)
    assert s["window"] == 20  # clipped to half of the 40 post-warm-up samples
    assert s["start_mb"] == 100 and s["end_mb"] == 101  # the spike does not move a median
    assert s["growth_pct"] == pytest.approx(1.0)


@pytest.mark.multirank
def test_short_soak_is_exact_and_flat(ranks):
    cfg = dict(steps=60, warmup_steps=20, window=20, all_empty_every=40)  # step 20 has every rank empty
    results = ranks(2).run(_soak_rank, cfg, timeout=40.0)
    result = results[0]
    soak = _import_soak()
    for r in result["ranks"]:
        assert r["steps"] == 60, r
        assert r["errors"] == 0, r["messages"]
        assert r["rss"]["growth_pct"] < 10.0, r["rss"]
    assert soak.verdict(result, max_growth_pct=10.0) == []
