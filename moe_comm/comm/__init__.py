"""Collectives on the EP process group: all-to-all of rows, the counts exchange, point-to-point segments."""
from moe_comm.comm.collectives import (CollectiveError, all_to_all_v, all_to_all_v_async, exchange_counts,
                                       exchange_counts_async, exchange_segments, group_rank, group_size,
                                       resolve_group, wait_work)

__all__ = ["CollectiveError", "all_to_all_v", "all_to_all_v_async", "exchange_counts", "exchange_counts_async",
           "exchange_segments", "group_rank", "group_size", "resolve_group", "wait_work"]
