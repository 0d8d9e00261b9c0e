"""Adapters that build another library's expert-parallel MoE layer with the weights of a moe_comm layer, for
``benchmarks/peers.py``. One module per peer; each exposes

    NAME: str                      # shown in the table
    INSTALL: str                   # the pip line a user runs to get it (peers.py installs nothing)
    def missing() -> str | None    # why it cannot run here (import error, ...), None when it can
    def build(ref, group) -> torch.nn.Module

``build`` takes ``ref``, a ``moe_comm.MoELayer`` on the EP group ``group`` (every rank of the group calls
it), built with ``score_func="softmax"``, ``norm_topk_prob=True``, no capacity, no shared experts, float32:
router weight ``ref.router.weight`` [E, H] (logits = x @ W.T, no bias), local experts
``ref.experts.w1`` / ``w3`` [e, F, H] and ``w2`` [e, H, F] for global experts
[rank * e, (rank + 1) * e), y_e(x) = (silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T.
It returns a module whose ``forward(x_TH) -> y_TH`` computes the same function with the peer's own router,
token dispatcher and expert parallelism over ``group``, dropless; copies of the weights (not shared
storage), so both layers' backward passes can run in one process. Whatever the peer needs that has no CPU
path (CUDA streams, device queries) is replaced in the adapter, narrowly, and said so in its docstring.

A "framework + moe_comm" adapter (the framework's MoE module with its dispatch through ``moe_comm.integrations``)
also sets ``WITH_MOE_COMM = True``: ``peers.py`` then shows its row next to the framework's, cross-checked and
timed, without a verdict against moe_comm. Register an adapter in ``peers.ADAPTERS`` (one line each).
"""
