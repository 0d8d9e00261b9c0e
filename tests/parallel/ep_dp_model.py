"""Shared by the tests of tests/parallel: a tiny model holding one MoELayer, per-rank batches, the dense
one-process reference of a data-parallel step, and process-group helpers for the gloo rank pool.

Shapes legend: T tokens per rank, H hidden, O outputs, E experts, e = E / EP, N = EP x DP ranks.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn

import moe_comm

H, F, E, K = 16, 24, 8, 2
OUT = 4  # O


def make_cfg(**kwargs) -> moe_comm.MoEConfig:
    kwargs.setdefault("aux_loss_coeff", 1e-2)
    return moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, **kwargs)


class TinyMoENet(nn.Module):
    """in [H -> H] -> h + MoELayer(h) -> out [H -> O]; forward returns (y_TO, aux_loss). Every weight is
    drawn from ``seed`` (the same on every rank and in the one-process reference)."""

    def __init__(self, cfg: moe_comm.MoEConfig, seed: int = 0, **layer_kwargs):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(H, H)
        self.out = nn.Linear(H, OUT)
        with torch.no_grad():
            for p in list(self.inp.parameters()) + list(self.out.parameters()):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.moe = moe_comm.MoELayer(cfg, seed=seed + 1, **layer_kwargs)

    def forward(self, x_TH: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        h_TH = self.inp(x_TH)
        h_TH = h_TH + self.moe(h_TH)
        return self.out(h_TH), self.moe.aux_loss


def batch(rank: int, step: int = 0, tokens: int = 12) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens of step ``step``: x_TH [T, H], y_TO [T, O] (its own data, any process)."""
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + 5)
    return torch.randn(tokens, H, generator=g), torch.randn(tokens, OUT, generator=g)


def rank_loss(model: nn.Module, x_TH: torch.Tensor, y_TO: torch.Tensor) -> torch.Tensor:
    y, aux = model(x_TH)
    return torch.nn.functional.mse_loss(y, y_TO) + aux


def reference_grads(cfg: moe_comm.MoEConfig, seed: int, num_ranks: int, step: int = 0) -> Dict[str, torch.Tensor]:
    """One process, every expert: gradients of mean over the N ranks of each rank's loss on its batch."""
    model = TinyMoENet(cfg, seed=seed)
    total = sum(rank_loss(model, *batch(r, step)) for r in range(num_ranks)) / num_ranks
    total.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def grid(ep: int, dp: int):
    """The ('dp', 'ep') DeviceMesh over the pool's N = DP x EP ranks (rank = d * EP + i)."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))


def local_grads(model: nn.Module) -> Dict[str, torch.Tensor]:
    """name -> this rank's gradient (DTensor gradients as full tensors), names without wrapper prefixes."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name.removeprefix("module.")] = g.detach().clone()
    return out


def compare_to_reference(grads: List[Dict[str, torch.Tensor]], ref: Dict[str, torch.Tensor], ep: int,
                         rel: float = 1e-5) -> None:
    """Every rank's gradients against the one-process reference: replicated ones whole, expert ones the
    rows of the rank's EP position (rank = d * EP + i holds experts i * e .. (i + 1) * e - 1)."""
    e = E // ep
    for rank, got in enumerate(grads):
        i = rank % ep
        assert set(got) == set(ref), (sorted(got), sorted(ref))
        for name, g in got.items():
            want = ref[name][i * e:(i + 1) * e] if name.startswith("moe.experts.") else ref[name]
            err = float((g.double() - want.double()).abs().max() / want.abs().max().clamp_min(1e-12))
            assert err <= rel, f"rank {rank}: {name} differs from the reference by {err:.2e} (relative)"
