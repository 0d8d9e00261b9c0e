"""Tier 2 (multi-rank gloo): a model with MoELayers compiles (aot_eager, inductor) and gives the eager results,
forward and backward; dynamo breaks the graph only at collectives (the Dispatcher's calls are opaque steps)."""
import pytest
import torch

import moe_comm

H = 32
# Files whose frames may end a graph: the Dispatcher's public calls and the collectives around a layer
# (the monitor's load all_reduce and its wait).
COLLECTIVE_FILES = ("moe_comm/dispatch/dispatcher.py", "moe_comm/comm/collectives.py", "moe_comm/monitor/load.py")


def _rank_compile(rank, world_size, backend):
    import torch._dynamo as dynamo
    torch.manual_seed(0)
    cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=H, num_experts=2 * world_size, top_k=2, num_chunks=2)

    def make():
        return torch.nn.Sequential(moe_comm.MoELayer(cfg, seed=0), torch.nn.Linear(H, H),
                                   moe_comm.MoELayer(cfg, seed=1))
    eager, compiled = make(), make()
    compiled.load_state_dict(eager.state_dict())
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(rank))
    y_ref = eager(x)
    y_ref.square().sum().backward()
    dynamo.reset()
    explained = dynamo.explain(compiled)(x)
    stacks = [b.user_stack[-1].filename.replace("\\", "/") for b in explained.break_reasons if b.user_stack]
    cm = torch.compile(compiled, backend=backend)
    y = cm(x)
    y.square().sum().backward()
    grads = [(a.grad - b.grad).abs().max().item() for a, b in zip(eager.parameters(), compiled.parameters())
             if a.grad is not None]
    return (y - y_ref).abs().max().item(), max(grads), explained.graph_break_count, stacks


@pytest.mark.multirank
# Each rank compiles its own process's graph: the world size changes only the row counts, which 2 ranks
# already vary (4 ranks compiling on 2 cores took 50 s of CI for no other coverage).
@pytest.mark.parametrize("world_size,backend", [(2, "aot_eager"), (2, "inductor")])
def test_compiled_model_matches_eager(ranks, world_size, backend):
    for y_diff, grad_diff, breaks, stacks in ranks(world_size).run(_rank_compile, backend, timeout=300):
        tol = 0.0 if backend == "aot_eager" else 1e-5
        assert y_diff <= tol and grad_diff <= max(tol, 1e-6), (y_diff, grad_diff)
        # the Dispatcher's call breaks the graph in each layer (opaque: a disabled frame has no user stack); any
        # break that names a frame is at a collective
        assert all(s.endswith(COLLECTIVE_FILES) for s in stacks), stacks
        assert 2 <= breaks <= 3 * 2, breaks  # per layer: its dispatcher call (and with DP a load all_reduce)
