"""Collectives on the EP process group: rows (all-to-all, point-to-point), the control channel and wire
protocol of every call, "every rank agrees or every rank raises", and poisoning after a failed collective."""
from moe_comm.comm.agree import RemoteError, agree
from moe_comm.comm.channel import Channel, PeerFailed
from moe_comm.comm.collectives import (CollectiveError, all_to_all_v, all_to_all_v_async, check_usable, exchange_counts,
                                       exchange_counts_async, group_device, group_rank, group_size, issue_segments,
                                       poison, resolve_group, wait_work)
from moe_comm.comm.wire import Phase, ProtocolError, Word

__all__ = ["CollectiveError", "ProtocolError", "PeerFailed", "RemoteError", "agree", "Channel", "Phase", "Word",
           "all_to_all_v", "all_to_all_v_async", "exchange_counts", "exchange_counts_async", "issue_segments",
           "group_device", "group_rank", "group_size", "resolve_group", "wait_work", "poison", "check_usable"]
