"""Expert load statistics (``load``: counting on the device, summaries, hot experts) and their reports
(``report``: strict JSON, plots)."""
from moe_comm.monitor.load import GlobalCounts, HotExpert, LoadMonitor, reduce_counts

__all__ = ["LoadMonitor", "HotExpert", "GlobalCounts", "reduce_counts"]
