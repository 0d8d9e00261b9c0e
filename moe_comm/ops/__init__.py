"""Autograd-aware permutation ops and FP8 row quantization (not differentiable); the backend
("auto" | "triton" | "native" | "torch") is chosen per device."""
from moe_comm.ops.layout import Layout, RankRows, make_layout, make_rank_rows, pad_layout
from moe_comm.ops.permute import gather_rows, permute, unpermute
from moe_comm.ops.quant import dequantize_rows, fp8_error_bound, packed_width, quantize_rows

__all__ = ["Layout", "RankRows", "make_layout", "make_rank_rows", "pad_layout", "permute", "unpermute", "gather_rows",
           "quantize_rows", "dequantize_rows", "packed_width", "fp8_error_bound"]
