"""Tier 1: GroupedExperts' explicit backward against autograd of the plain per-expert SwiGLU."""
import pytest
import torch

from moe_comm.modules.experts import GroupedExperts, _LoopSwiGLU, swiglu


@pytest.mark.parametrize("counts", [[3, 0, 5], [0, 0, 4], [0, 0, 0], [7, 1, 2]])
def test_grouped_experts_match_plain_swiglu(counts):
    torch.manual_seed(0)
    ex = GroupedExperts(3, 6, 5, seed=2).double()
    R = sum(counts)
    x = torch.randn(R, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(R, 6, dtype=torch.float64)
    y = ex(x, torch.tensor(counts), counts=counts)
    (y * g).sum().backward()
    params = [p.detach().clone().requires_grad_(True) for p in (ex.w1, ex.w3, ex.w2)]
    x2 = x.detach().clone().requires_grad_(True)
    outs, start = [], 0
    for i, n in enumerate(counts):
        outs.append(swiglu(x2[start:start + n], params[0][i], params[1][i], params[2][i]))
        start += n
    ref = torch.cat(outs)
    (ref * g).sum().backward()
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(x.grad, x2.grad)
    for p, r in zip((ex.w1, ex.w3, ex.w2), params):
        torch.testing.assert_close(p.grad, r.grad if r.grad is not None else torch.zeros_like(p))


def test_grouped_experts_gradcheck():
    torch.manual_seed(1)
    ex = GroupedExperts(2, 4, 3, seed=0).double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    def fn(x, w1, w3, w2):
        return _LoopSwiGLU.apply(x, w1, w3, w2, [2, 3])
    assert torch.autograd.gradcheck(fn, (x, ex.w1, ex.w3, ex.w2))


def test_counts_must_cover_the_rows():
    ex = GroupedExperts(2, 4, 3)
    with pytest.raises(ValueError, match="counts must hold e = 2 row counts summing to R = 5"):
        ex(torch.randn(5, 4), torch.tensor([2, 2]), counts=[2, 2])


@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16])
def test_grouped_experts_under_autocast(amp_dtype):
    """fp32 experts under torch.autocast(cpu): the GEMMs run in the autocast dtype (the output equals the
    same experts cast to it), the weight gradients come back to the fp32 parameters."""
    ex = GroupedExperts(3, 8, 6, seed=4)
    counts = [2, 0, 5]
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with torch.autocast("cpu", dtype=amp_dtype):
        y = ex(x, torch.tensor(counts), counts=counts)
    assert y.dtype == amp_dtype
    low = GroupedExperts(3, 8, 6, seed=4).to(amp_dtype)
    assert torch.equal(y, low(x.detach().to(amp_dtype), torch.tensor(counts), counts=counts))
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in (ex.w1, ex.w3, ex.w2))
    assert ex.w1.grad[1].eq(0).all() and ex.w1.grad[0].abs().sum() > 0  # expert 1 got no rows
    with torch.autocast("cpu", dtype=amp_dtype):  # float64 rows: autocast leaves them alone
        y64 = ex.double()(x.detach().double(), torch.tensor(counts), counts=counts)
    assert y64.dtype == torch.float64
