"""Tier 1 (and one tier-3 ``gpu`` test): the router GEMMs never hold a whole float32 copy of a bf16 / fp16 x
(#26.13).

Logits are computed in float32 (DESIGN.md's contract). CPU torch 2.13 has no bf16 x bf16 -> float32 GEMM
(``aten::mm.dtype`` has no CPU kernel; addmm / linear / mm(out=) refuse mixed dtypes), so ``_RouterLogits``
casts x in row blocks of ``routing._CAST_BYTES``; on CUDA, with x and the weight in one half dtype,
``torch.mm(..., out_dtype=torch.float32)`` reads x as it is. Checked: no op of forward or backward outputs a
float32 tensor of x's size (a ``TorchDispatchMode`` sees every aten op), autograd saves none, and logits and
gradients stay float32 / x's dtype and equal the float32 formulation ``F.linear(x.float(), w.float())`` up
to summation order.

Shapes legend: T tokens, H hidden, E experts (global).
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from moe_comm import routing
from moe_comm.config import MoEConfig
from moe_comm.routing import Router

T, H, E = 96, 64, 8


class _Outputs(TorchDispatchMode):
    """Records (op, dtype, numel) of every tensor every aten op returns while active."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.seen.append((str(func), t.dtype, t.numel()))
        return out


def _router(w_dtype):
    """A Router whose weight is ``w_dtype`` and whose logits are float32 (router_dtype None)."""
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=32, num_experts=E, top_k=2)
    return Router(cfg, dtype=w_dtype)


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                              (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
@pytest.mark.parametrize("block_rows", [16, 1, 1000])
def test_no_float32_copy_of_x_forward_or_backward(monkeypatch, x_dtype, w_dtype, block_rows):
    """block_rows 16: six row blocks; 1: a block per row; 1000: x fits one block (the bit-exact path), where
    a copy of x is the block: checked with T * H above the bytes allowed."""
    monkeypatch.setattr(routing, "_CAST_BYTES", block_rows * H * 4, raising=False)
    r = _router(w_dtype)
    with torch.no_grad():
        r.weight.copy_(r.weight.to(x_dtype))  # x's precision in every case: each product is exact in float32
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(0)).to(x_dtype).requires_grad_(True)
    g_TE = torch.randn(T, E, generator=torch.Generator().manual_seed(1))
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t
    with _Outputs() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = r(x).logits_TE
        (logits * g_TE).sum().backward()
    big32 = [s for s in mode.seen if s[1] == torch.float32 and s[2] >= T * H]
    if block_rows < T:
        assert not big32, big32  # before: aten._to_copy of x to float32 in forward, and again in backward
        assert max(n for _, d, n in mode.seen if d == torch.float32) <= max(block_rows * H, E * H, T * E)
    assert not [s for s in saved if s[0] == torch.float32 and s[1] >= T * H], saved
    # float32 logits and gradients in the parameters' dtypes, equal to the float32 formulation
    x_old = x.detach().clone().requires_grad_(True)
    w_old = r.weight.detach().clone().requires_grad_(True)
    old = F.linear(x_old.float(), w_old.float())
    (old * g_TE).sum().backward()
    assert logits.dtype == torch.float32 and x.grad.dtype == x_dtype and r.weight.grad.dtype == r.weight.dtype
    torch.testing.assert_close(logits, old, rtol=1e-6, atol=1e-6)
    # the float32 products may differ in the last bit between a row block's GEMM and the whole one: at most one
    # rounding of x's dtype apart
    torch.testing.assert_close(x.grad, x_old.grad, rtol=torch.finfo(x_dtype).eps, atol=1e-5)
    torch.testing.assert_close(r.weight.grad.float(), w_old.grad.float(), rtol=1e-5, atol=1e-4)  # summed by blocks


def test_zero_tokens_and_three_dim_x(monkeypatch):
    monkeypatch.setattr(routing, "_CAST_BYTES", 4 * H * 4)
    r = _router(torch.float32)
    for shape in ((0, H), (3, 10, H)):
        x = torch.randn(*shape).bfloat16().requires_grad_(True)
        logits = routing._RouterLogits.apply(x, r.weight, torch.float32)
        assert logits.shape == (*shape[:-1], E) and logits.dtype == torch.float32
        logits.sum().backward()
        ref = F.linear(x.detach().float(), r.weight.detach())
        torch.testing.assert_close(logits, ref, rtol=1e-6, atol=1e-6)
        assert x.grad.shape == x.shape and r.weight.grad.shape == r.weight.shape
        r.weight.grad = None


@pytest.mark.gpu
def test_cuda_half_router_reads_x_as_it_is():
    """CUDA, bf16 x and bf16 weight: one mm with out_dtype=float32, no cast of x at all."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    r = _router(torch.bfloat16).cuda()
    x = torch.randn(4096, H, device="cuda").bfloat16()
    assert routing._mm_out_dtype(x, r.weight, torch.float32)
    with _Outputs() as mode:
        logits = routing._RouterLogits.apply(x, r.weight, torch.float32)
    assert logits.dtype == torch.float32
    assert not [s for s in mode.seen if s[1] == torch.float32 and s[2] >= x.numel()], mode.seen
    torch.testing.assert_close(logits, x.float() @ r.weight.float().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fwd_autocast", [False, True])
def test_router_gradients_ignore_autocast_around_backward(fwd_autocast):
    """An fp32 router on fp32 x (nothing cast): its gradients are the same bits whether ``backward()`` runs inside
    ``torch.autocast`` or not (autograd's own linear would compute them in bf16 there: ~3e-3 relative error)."""
    cfg = MoEConfig(hidden_size=96, ffn_hidden_size=96, num_experts=8, top_k=2, aux_loss_coeff=1e-2)
    x0 = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    grads = []
    for bwd_autocast in (False, True):
        torch.manual_seed(0)
        router, x = Router(cfg), x0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bwd_autocast):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=fwd_autocast):
                out = router(x)
                loss = out.topk_weight_TK.square().sum() + out.aux_loss + out.scores_TE.square().sum()
            loss.backward()
        grads.append((x.grad, router.weight.grad))
    (gx0, gw0), (gx1, gw1) = grads
    assert torch.equal(gx0, gx1) and torch.equal(gw0, gw1)
