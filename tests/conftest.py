"""Test setup shared by all tiers.

Tier 1 (pure logic) needs nothing. Tier 2 (multi-rank CPU) uses the ``ranks`` fixture: one pool of
gloo ranks per world size, reused for the whole session. Tier 3 is ``@pytest.mark.gpu``.

NCCL semantics on gloo: pool ranks run every call under ``moe_comm.testing.nccl_rules`` (tensors on the
group's device, contiguous, the same collectives in the same order, agreed all-to-all splits, matching
and batched point-to-point). ``--nccl-rules=off`` (or ``MOE_COMM_NCCL_RULES=0``) turns it off; a test
marked ``nccl_rules_exempt(reason)`` or listed in ``NCCL_RULES_EXEMPT`` runs its ranks without it.
Multi-rank tests that start their own processes (CLI runs, dead or stalled peers) run without it.

Triton: kernels run on CPU tensors under TRITON_INTERPRET=1, which must be set before triton is imported
(kernels are decorated in interpreter mode or not, once per process). Pool ranks always interpret
(tests/rank_pool.py). This process interprets unless CUDA is present and the session selects only
``gpu`` tests (``pytest -m gpu``): there the compiled kernels are what is tested. So the default session
(``-m 'not gpu'``) runs the same on a CPU and a CUDA machine; a session mixing both tiers on CUDA
interprets, and the compiled-kernel tests skip themselves (run ``pytest -m gpu`` for those).
``TRITON_INTERPRET=0`` set by hand wins (then tier-1 Triton tests need CUDA tensors).
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rank_pool import RankPool  # noqa: E402

# moe_comm.testing.nccl_rules.ENV, not imported: importing moe_comm imports triton, which must wait until
# pytest_configure has set TRITON_INTERPRET.
NCCL_RULES_ENV = "MOE_COMM_NCCL_RULES"

# Tests whose pool ranks run without the NCCL-rules mode, and why (besides any marked nccl_rules_exempt).
NCCL_RULES_EXEMPT = {
    "tests/profiling/test_profiling.py::test_gloo_comm_span_ends_at_completion":
        "times an async all-to-all issued 0.5 s before the peer joins; the mode's side check makes every "
        "issue wait for all ranks",
    "tests/profiling/test_profiling.py::test_gloo_hidden_and_exposed_comm":
        "measures comm hidden under compute while a peer joins late; the side check waits for that peer "
        "before the all-to-all is issued, so the compute runs after the transfer and hides nothing",
}


def _only_gpu_tests(markexpr: str) -> bool:
    """Whether ``-m markexpr`` selects gpu tests and no other test (markers a test may carry: gpu, multirank)."""
    if not markexpr:
        return False
    try:
        from _pytest.mark.expression import Expression  # pytest's own -m parser
        expr = Expression.compile(markexpr)

        def selects(*marks) -> bool:
            return expr.evaluate(lambda name, **kwargs: name in marks)
    except Exception:  # another pytest: assume other tests are selected (interpreter on, as without CUDA)
        return False
    return (selects("gpu") or selects("gpu", "multirank")) and not (selects() or selects("multirank"))


def pytest_addoption(parser):
    parser.addoption("--nccl-rules", choices=("on", "off"),
                     default="off" if os.environ.get(NCCL_RULES_ENV, "1") == "0" else "on",
                     help="run the multi-rank pool under moe_comm.testing.nccl_rules "
                          f"(default on; {NCCL_RULES_ENV}=0 turns it off)")


def pytest_configure(config):
    config.addinivalue_line("markers", "nccl_rules_exempt(reason): the pool ranks run this test without the "
                                       "NCCL-rules mode (it breaks a rule on purpose, e.g. a stray collective)")
    if not torch.cuda.is_available() or not _only_gpu_tests(config.option.markexpr):
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def _rank_pools():
    """W -> the session's RankPool of W gloo ranks (created on first use, rebuilt if torn down)."""
    pools = {}

    def get(world_size: int) -> RankPool:
        pool = pools.get(world_size)
        if pool is None or not pool.alive:
            if pool is not None:
                pool.close(kill=True)  # a rank died; no-op when the pool closed itself (timeout, broken rules)
            pool = pools[world_size] = RankPool(world_size)
        return pool

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture
def ranks(_rank_pools, request):
    """``ranks(W)`` -> a RankPool of W gloo ranks, its calls under the NCCL rules unless turned off or exempt."""
    rules = (request.config.getoption("--nccl-rules") == "on"
             and request.node.get_closest_marker("nccl_rules_exempt") is None
             and request.node.nodeid.split("[")[0] not in NCCL_RULES_EXEMPT)

    def get(world_size: int) -> RankPool:
        pool = _rank_pools(world_size)
        pool.nccl_rules = rules
        return pool

    return get
