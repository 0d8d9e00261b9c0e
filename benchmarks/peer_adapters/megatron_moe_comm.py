"""Megatron-Core + moe_comm: the layer of ``megatron_moe`` (Megatron-Core 0.16.1's ``MoELayer``: its
``TopKRouter``, its ``SequentialMLP`` experts, the same config, weights and CPU stubs), with its token
dispatcher switched to moe_comm by ``moe_comm.integrations.megatron.use_moe_comm`` (dispatch / combine through
``moe_comm.Dispatcher`` on ``group``). The row next to "Megatron-Core" measures what swapping the dispatcher
alone changes; the router and the experts are Megatron's in both.

Of ``megatron_moe``'s stubs, this layer still needs ``torch.cuda.current_device`` -> cpu (the router) and,
while it is built, the alltoall dispatcher's placeholder stream (the layer builds the alltoall dispatcher
first; ``use_moe_comm`` then replaces it). moe_comm's dispatcher has no CUDA stream or device query.
"""
from __future__ import annotations

from torch import nn

from . import megatron_moe

NAME = "Megatron-Core + moe_comm"
INSTALL = megatron_moe.INSTALL + " (and moe_comm: pip install -e '.[megatron]')"
WITH_MOE_COMM = True  # a framework with moe_comm inside: shown next to the framework, not judged against moe_comm


def missing():
    why = megatron_moe.missing()
    if why is not None:
        return why
    try:
        from moe_comm.integrations import megatron  # noqa: F401
    except Exception as err:  # ImportError, or megatron-core failing at import
        return f"moe_comm.integrations.megatron not importable: {type(err).__name__}: {err}"
    return None


def build(ref, group) -> nn.Module:
    from moe_comm.integrations.megatron import use_moe_comm

    wrapped = megatron_moe.build(ref, group)  # MegatronMoE: forward(x_TH) -> y_TH around the MoELayer on group
    if use_moe_comm(wrapped.layer) != 1:
        raise RuntimeError("megatron_moe_comm adapter: use_moe_comm switched no MoE layer")
    return wrapped
