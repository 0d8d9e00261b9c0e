"""DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``, checked with 0.19.8), used directly (no engine), on CPU.

Configured: ``k=2``, ``top2_2nd_expert_sampling=False`` (2nd expert = argmax of the logits, no Gumbel
noise), ``noisy_gate_policy=None``, ``use_rts=False``, ``drop_tokens=False`` (capacity = the largest
per-expert count over the EP group, so nothing is dropped; ``capacity_factor`` / ``min_capacity`` are then
unused), ``ep_size`` = size of ``group``. DeepSpeed's top-2 gate is softmax over all E, top 2, the two gates
renormalized to sum 1: moe_comm's softmax + ``norm_topk_prob=True``. The gate linear ``wg`` is fp32, as is
``ref.router.weight``. The all-to-alls split the [E, C, H] buffer along E in group-rank order, so local
expert i on group rank r is global expert r * e + i, the same numbering as ``ref.experts``.

Set up outside DeepSpeed's own code path, and why:

* ``DS_ACCELERATOR=cpu`` is put in ``os.environ`` before the first ``import deepspeed`` when it is unset
  (DeepSpeed picks its accelerator once per process; without oneCCL its CPU accelerator uses gloo).
* The EP group: ``MOELayer._set_ep_group(group)`` with the driver's ``group``, instead of
  ``MoE.set_deepspeed_parallelism()``, which would build new expert / expert-data groups over the world.
* ``deepspeed.comm.init_distributed`` wraps the already initialized torch.distributed; while it does,
  ``deepspeed.comm.torch.build_shm_op`` is stubbed to return None. Otherwise it JIT-compiles a C++
  shared-memory all-reduce kernel (about 100 s cold on a 2-core machine) that only
  ``inference_all_reduce`` uses; the MoE layer's collectives (all_to_all_single, an all_reduce MAX of the
  capacity) go to torch.distributed either way.

Nothing CUDA-only is on this path, so nothing else is stubbed.
"""
import os

import torch
import torch.nn.functional as F
from torch import nn

NAME = "DeepSpeed MoE"
INSTALL = "DS_BUILD_OPS=0 pip install deepspeed==0.19.8"


def _deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.moe.layer  # noqa: F401
    return deepspeed


def missing():
    try:
        _deepspeed()
    except Exception as err:  # noqa: BLE001 -- any import failure means "cannot run here"
        return f"{type(err).__name__}: {err}"
    return None


class _SwiGLU(nn.Module):
    """One expert; DeepSpeed deep-copies it once per local expert."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(hidden, ffn))

    def forward(self, x):  # x: [..., H] (DeepSpeed passes [W, 1, C, H])
        return F.linear(F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3), self.w2)


class _Peer(nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x_TH):
        return self.moe(x_TH)[0]  # (output, l_aux, exp_counts); output has x's shape


def build(ref, group):
    deepspeed = _deepspeed()
    import torch.distributed as dist
    from unittest import mock
    from deepspeed.moe.layer import MoE

    cfg, W = ref.cfg, dist.get_world_size(group)
    E, H, F_ = cfg.num_experts, cfg.hidden_size, cfg.ffn_hidden_size
    if (cfg.top_k, cfg.score_func, cfg.norm_topk_prob) != (2, "softmax", True):
        raise ValueError("DeepSpeed's top-2 gate matches only top_k=2, softmax, norm_topk_prob=True")
    e = E // W
    if ref.experts.w1.shape[0] != e:
        raise ValueError(f"ref has {ref.experts.w1.shape[0]} local experts, DeepSpeed would have {e}")

    if not deepspeed.comm.is_initialized():
        with mock.patch("deepspeed.comm.torch.build_shm_op", return_value=None):
            deepspeed.comm.init_distributed(dist_backend=dist.get_backend(group), dist_init_required=False,
                                            verbose=False)

    moe = MoE(H, _SwiGLU(H, F_), num_experts=E, ep_size=W, k=2, noisy_gate_policy=None,
              drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
    moe.deepspeed_moe._set_ep_group(group)

    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.copy_(ref.router.weight)
        for i, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            expert.w1.copy_(ref.experts.w1[i])
            expert.w3.copy_(ref.experts.w3[i])
            expert.w2.copy_(ref.experts.w2[i])
    return _Peer(moe)
