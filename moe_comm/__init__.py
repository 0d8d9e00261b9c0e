"""moe_comm: expert-parallel Mixture-of-Experts communication for PyTorch.

Public API: MoEConfig, MoELayer, Dispatcher, Router, GroupedExperts, ops (make_layout, permute,
unpermute), check (read deferred failures), set_step (every rank checks that all are at the same step),
checkpoint helpers, LoadMonitor, plan_placement, and the dense reference (``dense_moe``).

Dependency rule (one way, lowest first; tested in tests/test_dependencies.py):

    kernels -> ops -> comm -> dispatch -> {monitor, placement} -> modules -> {parallel, hf}

``config``, ``routing``, ``_checks``, ``_wgrad``, ``_recompute`` and ``profiling`` may be imported from anywhere in
the core.
Nothing in the core imports ``tools`` (cli, bench, diagnose, launch, slow_link) or ``testing`` (dense
reference, self-checking payloads, routing workloads); those two sit on top. ``import moe_comm`` loads
neither rich nor matplotlib, nor torch._dynamo, triton or torch.utils.cpp_extension (tests/test_import.py:
the Dispatcher's graph breaks are applied when torch._dynamo is imported, ``_checks.graph_break``).
"""
from moe_comm import ops
from moe_comm.comm.wire import set_step
from moe_comm.config import MoEConfig
from moe_comm.dispatch import DispatchHandle, Dispatcher, DispatchOutput
from moe_comm.modules import GroupedExperts, MoELayer, SwiGLU, check, checkpoint
from moe_comm.monitor import LoadMonitor
from moe_comm.placement import Placement, plan_placement
from moe_comm.routing import Router, RouterOutput, route

__version__ = "0.1.0"

__all__ = [
    "MoEConfig", "MoELayer", "Dispatcher", "DispatchOutput", "DispatchHandle", "Router", "RouterOutput",
    "route", "GroupedExperts", "SwiGLU", "dense_moe", "ops", "checkpoint", "LoadMonitor", "Placement",
    "plan_placement", "check", "set_step", "__version__",
]


def __getattr__(name: str):
    # The dense reference lives in testing/ (the core never imports it); moe_comm.dense_moe stays public.
    if name == "dense_moe":
        from moe_comm.testing.reference import dense_moe
        return dense_moe
    raise AttributeError(f"module 'moe_comm' has no attribute {name!r}")
