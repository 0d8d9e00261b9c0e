"""A plain PyTorch expert-parallel layer with the fewest passes over the rows: the lowest overhead a
straightforward dropless layer reaches on this machine (always installed; no library of its own).

Forward, all by autograd: router GEMM, softmax, top-k, renormalise; one argsort of the T x K choices
(expert-major, hence destination-rank-major); one counts all-to-all and its host read; one gather of the
rows (``index_select``); one all-to-all; the experts on the rows as they arrive, one GEMM chain per
(source rank, local expert) block (moe_comm's ``GroupedExperts`` with ``segments=``, a copy); one
all-to-all back; one weighted ``index_add``. No input checks, no failure protocol, no timeline, no monitor,
no workspace reuse: what it leaves out is what moe_comm adds.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from moe_comm.comm.collectives import all_to_all_v  # a differentiable all_to_all_single, nothing more
from moe_comm.dispatch.plan import segments_of

NAME = "plain torch"
INSTALL = "(nothing: PyTorch only)"


def missing():
    return None


class _Layer(nn.Module):
    def __init__(self, ref, group):
        super().__init__()
        self.group, self.W = group, dist.get_world_size(group)
        self.E, self.K = ref.cfg.num_experts, ref.cfg.top_k
        self.router = nn.Parameter(ref.router.weight.detach().clone())
        self.experts = copy.deepcopy(ref.experts)

    def route(self, x_TH):
        """(renormalised top-K weights [T, K], expert ids [T, K], the slots in expert-major order [T*K],
        slots per expert [E])."""
        w_TK, idx_TK = torch.softmax(x_TH @ self.router.t(), dim=-1).topk(self.K, dim=-1)
        w_TK = w_TK / w_TK.sum(-1, keepdim=True)
        order_N = idx_TK.reshape(-1).argsort(stable=True)
        return w_TK, idx_TK, order_N, torch.bincount(idx_TK.reshape(-1), minlength=self.E)

    def forward(self, x_TH):
        T, H = x_TH.shape
        E, K, W = self.E, self.K, self.W
        e = E // W
        w_TK, idx_TK, order_N, counts_E = self.route(x_TH)
        recv_E = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_E, counts_E, group=self.group)
        send = counts_E.view(W, e).sum(1).tolist()  # host sync
        recv_We = recv_E.view(W, e).tolist()
        token_N = order_N // K
        recv = [sum(r) for r in recv_We]
        rows = all_to_all_v(x_TH.index_select(0, token_N), recv, send, self.group)
        segments = segments_of((i, n) for r in recv_We for i, n in enumerate(r))  # (source rank, expert) blocks
        out = self.experts(rows, torch.tensor([sum(c) for c in zip(*recv_We)]), segments=segments)
        back = all_to_all_v(out, send, recv, self.group)
        weighted = back * w_TK.reshape(-1).index_select(0, order_N)[:, None]
        return x_TH.new_zeros(T, H).index_add(0, token_N, weighted)


def build(ref, group):
    return _Layer(ref, group)
