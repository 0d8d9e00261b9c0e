"""Expert load statistics: tokens per expert and rank, hot experts, summaries and plots."""
from moe_comm.monitor.load import GlobalCounts, HotExpert, LoadMonitor, reduce_counts

__all__ = ["LoadMonitor", "HotExpert", "GlobalCounts", "reduce_counts"]
