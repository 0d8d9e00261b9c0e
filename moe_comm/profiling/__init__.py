"""The timeline: spans of compute and communication, overlap analysis, Chrome trace export.
Importable from anywhere in the package (it imports only ``moe_comm._checks``).

  timeline.py   Span, Timeline (recording: host clock, gloo future callbacks, CUDA events)
  analysis.py   overlap_report (hidden vs exposed comm) and its interval maths
  export.py     format_report (rich, imported lazily), to_chrome_trace
  model.py      model_timelines (every layer's Timeline, named by module path), gather_spans
How to get and read the overlap report: docs/profiling.md.
"""
from moe_comm.profiling.analysis import overlap_report
from moe_comm.profiling.export import format_report, to_chrome_trace
from moe_comm.profiling.model import gather_spans, model_timelines
from moe_comm.profiling.timeline import DIRECTIONS, KINDS, Span, Timeline

__all__ = ["Span", "Timeline", "overlap_report", "format_report", "to_chrome_trace", "model_timelines", "gather_spans",
           "KINDS", "DIRECTIONS"]
