"""Tier 2 (2 gloo ranks): the layer's load counts reach the monitor the same way whether they travel in the
forward's control exchange (small W x E) or in the monitor's own all_reduce (above
``layer.SUMMED_IN_EXCHANGE_WORDS``): equal monitor state after a few steps, and the bias update agrees."""
from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm.modules import layer as layer_mod


def _rank_paths(rank, world_size):
    cfg = moe_comm.MoEConfig(hidden_size=8, ffn_hidden_size=16, num_experts=8, top_k=2, num_chunks=2)
    in_exchange = moe_comm.MoELayer(cfg, seed=3, bias_update_rate=0.01)
    saved = layer_mod.SUMMED_IN_EXCHANGE_WORDS
    layer_mod.SUMMED_IN_EXCHANGE_WORDS = 0  # the same layer with its own all_reduce
    try:
        own = moe_comm.MoELayer(cfg, seed=3, bias_update_rate=0.01)
    finally:
        layer_mod.SUMMED_IN_EXCHANGE_WORDS = saved
    words = (in_exchange.dispatcher.summed_words, own.dispatcher.summed_words)
    for step in range(3):
        x = torch.randn(10, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        for lay in (in_exchange, own):
            lay(x).sum().backward()
    states = [{k: v.tolist() for k, v in lay.monitor.read_state().items()} for lay in (in_exchange, own)]
    biases = [lay.router.expert_bias.tolist() if getattr(lay.router, "expert_bias", None) is not None else None
              for lay in (in_exchange, own)]
    return words, states, biases


@pytest.mark.multirank
def test_load_counts_in_the_exchange_equal_the_all_reduce(ranks):
    for words, (a, b), (bias_a, bias_b) in ranks(2).run(_rank_paths):
        assert words == (2 * 8 + 2, 0)
        assert a == b
        assert bias_a == bias_b and any(v != 0 for v in bias_a)  # the bias moved, equally
