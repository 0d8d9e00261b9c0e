"""moe_comm: expert-parallel Mixture-of-Experts communication for PyTorch.

Public API: MoEConfig, MoELayer, Dispatcher, Router, GroupedExperts, ops (make_layout, permute,
unpermute), checkpoint helpers, and the dense reference.
"""
from . import checkpoint, ops
from .config import MoEConfig
from .dispatcher import DispatchHandle, Dispatcher, DispatchOutput
from .experts import GroupedExperts, SwiGLU
from .layer import MoELayer
from .monitor import LoadMonitor
from .rebalance import Placement, plan_placement
from .reference import dense_moe
from .router import Router, RouterOutput, route

__version__ = "0.1.0"

__all__ = [
    "MoEConfig", "MoELayer", "Dispatcher", "DispatchOutput", "DispatchHandle", "Router", "RouterOutput",
    "route", "GroupedExperts", "SwiGLU", "dense_moe", "ops", "checkpoint", "LoadMonitor", "Placement",
    "plan_placement", "__version__",
]
