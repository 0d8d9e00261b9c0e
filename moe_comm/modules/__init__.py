"""nn.Modules: the experts, MoELayer, and expert-keyed checkpoints."""
from moe_comm.modules import checkpoint
from moe_comm.modules.experts import GroupedExperts, PlacedExperts, SwiGLU
from moe_comm.modules.layer import MoELayer, check

__all__ = ["GroupedExperts", "PlacedExperts", "SwiGLU", "MoELayer", "check", "checkpoint"]
