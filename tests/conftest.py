"""Test setup shared by all tiers.

Tier 1 (pure logic) needs nothing. Tier 2 (multi-rank CPU) uses the ``ranks`` fixture: one pool of
gloo ranks per world size, reused for the whole session. Tier 3 is ``@pytest.mark.gpu``.
Triton kernels run on CPU under TRITON_INTERPRET=1, which must be set before triton is imported.
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402

from rank_pool import RankPool  # noqa: E402


@pytest.fixture(scope="session")
def ranks():
    """``ranks(W)`` -> a RankPool of W gloo ranks (created on first use, rebuilt if torn down)."""
    pools = {}

    def get(world_size: int) -> RankPool:
        pool = pools.get(world_size)
        if pool is None or not pool.alive:
            pool = pools[world_size] = RankPool(world_size)
        return pool

    yield get
    for pool in pools.values():
        pool.close()
