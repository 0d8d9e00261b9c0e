"""The timeline: spans of compute and communication, overlap analysis, Chrome trace export.
Importable from anywhere in the package (it imports nothing of moe_comm)."""
from moe_comm.profiling.timeline import Span, Timeline, format_report, overlap_report, to_chrome_trace

__all__ = ["Span", "Timeline", "overlap_report", "format_report", "to_chrome_trace"]
