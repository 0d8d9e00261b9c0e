"""A MoELayer's load statistics: the load monitor and the aux-loss-free bias (a mixin of ``MoELayer``).

Shapes legend: T tokens, K top-k, E logical experts, W EP world size.

Each training forward counts the tokens per logical expert, summed over EP x DP (the global batch): over EP
inside the forward's control exchange (``Dispatcher(summed_words=...)``: no collective of its own; above
``layer.SUMMED_IN_EXCHANGE_WORDS`` an async all_reduce of its own), then, with a DP group, one async all_reduce
over it. The monitor records it; the bias step it implies is applied at the
start of the next forward.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from moe_comm.comm.collectives import group_rank, group_size
from moe_comm.monitor.load import LoadMonitor, load_payload, reduce_counts
from moe_comm.routing import count_tokens

__all__ = ["LayerLoad", "make_monitor", "finish_bias_update_hook", "dropping_failed_loads"]


def make_monitor(monitor, num_experts: int, num_ranks: int) -> Optional[LoadMonitor]:
    if monitor is None or monitor is False:
        return None
    if monitor is True:
        return LoadMonitor(num_experts, num_ranks=num_ranks)
    if isinstance(monitor, dict):
        return LoadMonitor(num_experts, num_ranks=num_ranks, **monitor)
    if isinstance(monitor, LoadMonitor):
        if (monitor.num_experts, monitor.num_ranks) != (num_experts, num_ranks):
            raise ValueError(f"monitor must be built for num_experts={num_experts}, num_ranks={num_ranks} (the "
                             f"layer's E and EP size), got {monitor.num_experts}, {monitor.num_ranks}")
        return monitor
    raise TypeError(f"monitor must be True, False/None, a dict of LoadMonitor options or a LoadMonitor, "
                    f"got {type(monitor).__name__}")


def finish_bias_update_hook(module: "LayerLoad", *args, **kwargs) -> None:
    # Before state_dict: a saved bias includes the last training forward's step. Before load_state_dict:
    # the step is applied (its all_reduce consumed) before the loaded bias replaces it, not after.
    module.finish_bias_update()


@contextlib.contextmanager
def dropping_failed_loads(layers) -> None:
    """A read that raises drops the layers' pending aux-loss-free bias step on every rank: in the sync-free mode
    the load was summed inside an exchange that may have paired with a peer's other phase (a skipped backward),
    so it can differ between ranks; applied, the replicated bias would drift apart."""
    try:
        yield
    except Exception:
        for m in layers:
            m._pending_load = None
        raise


class LayerLoad:
    """The load half of ``MoELayer`` (its monitor, dispatcher, groups, config and router)."""

    def finish_bias_update(self) -> None:
        """Apply the pending aux-loss-free bias step (no-op when none is pending).

        Waits for the last training forward's global-load all_reduce (``work.wait``: the CPU waits for
        gloo's worker; on NCCL the stream waits, no host sync), then
        ``expert_bias += rate * sign(mean(load) - load)``. Runs at the start of every forward, before
        ``apply_placement`` and before ``state_dict()``.
        """
        pending, self._pending_load = self._pending_load, None
        if pending is None:
            return
        with torch.no_grad():
            load_E = pending.wait()  # float64 [E], identical on every rank
            step_E = torch.sign(load_E.mean() - load_E) * self.bias_update_rate
            self.router.expert_bias.add_(step_E.to(self.router.expert_bias.dtype))

    @torch.no_grad()
    def _record_load(self, routing) -> None:
        """Tokens per logical expert of this forward, summed over EP x DP (the global batch) -> the monitor
        and/or the pending bias update. Device ops, one async all_reduce over the EP group and, with a
        dp_group, one more over it (chained on the first: NCCL orders it on the stream, gloo waits for the
        small first one); no host sync."""
        update_bias = self.training and self.bias_update_rate > 0
        if self.monitor is None and not update_bias:
            return
        group = self.ep_group if self.world_size > 1 else None
        dp_group = self.dp_group if group_size(self.dp_group) > 1 else None
        timeout = self.dispatcher.timeout
        if self.dispatcher.summed_words:  # summed over EP in the forward's exchange (a failed rank sent zeros)
            sum_X = self.dispatcher.last_sum.clone()
            if self.monitor is not None:
                handle = self.monitor.record(sum_X, None, dp_group, timeout=timeout, rank=group_rank(self.ep_group))
            else:
                handle = reduce_counts(sum_X[:self.cfg.num_experts], None, dp_group=dp_group, timeout=timeout,
                                       phase="bias update (global expert load)")
            if update_bias:
                self._pending_load = handle
            return
        if routing is None:  # this rank failed alone: zero counts keep the collective paired with the peers'
            counts_E = torch.zeros(self.cfg.num_experts, dtype=torch.int64, device=self.experts.w1.device)
            dropped, scores = 0, None
        else:
            counts_E, dropped = count_tokens(routing.topk_idx_TK, self.cfg.num_experts, routing.token_mask_T)
            scores = routing.scores_TE
        if self.monitor is not None:
            handle = self.monitor.observe(counts_E, dropped, scores, group=group, dp_group=dp_group,
                                          timeout=timeout)
        else:
            handle = reduce_counts(counts_E, group, dp_group=dp_group, timeout=timeout,
                                   phase="bias update (global expert load)")
        if update_bias:
            self._pending_load = handle

    def _load_payload(self, routing) -> torch.Tensor:
        """This rank's load statistics of a forward as the [2E + 2] float64 words its exchange sums (counts, dropped
        slots, probability sums, tokens: ``LoadMonitor.payload``)."""
        counts_E, dropped = count_tokens(routing.topk_idx_TK, self.cfg.num_experts, routing.token_mask_T)
        return load_payload(counts_E, dropped, routing.scores_TE if self.monitor is not None else None)
