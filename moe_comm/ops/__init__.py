"""Autograd-aware permutation ops; the backend ("auto" | "triton" | "native" | "torch") is chosen per device."""
from moe_comm.ops.layout import Layout, make_layout, pad_layout
from moe_comm.ops.permute import gather_rows, permute, unpermute

__all__ = ["Layout", "make_layout", "pad_layout", "permute", "unpermute", "gather_rows"]
