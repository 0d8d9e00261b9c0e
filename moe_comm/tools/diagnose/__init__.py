"""`moe-comm profile`: run an MoE layer with the timeline on, then say where a step's time goes and what
to change.

One file per concern, each usable alone:
- ``options``: ``DEFAULT_OPTS`` and ``normalize_opts`` (the one place options are checked).
- ``collect``: ``profile_rank(rank, W, opts)`` (collective, run through ``launch.run_ranks``): builds
  the layer, times ``steps`` forward+backward steps with the timeline on, then measures what the
  diagnosis needs with the measurements ``num_chunks="auto"`` itself runs (``dispatch.autotune``: the
  alpha-beta fit, the overlap efficiency eta, the per-chunk overhead) plus the bare expert GEMMs on the
  rows this rank received, a plain GEMM, the expert load, and the distinct (token, rank) rows of the
  routing (what dedup would send).
- ``findings``: ``diagnose(result) -> Diagnosis``, a pure function of that result: six findings.
- ``wire``: the bytes per all-to-all the model sees with FP8 dispatch and / or dedup on or off.
- ``suggest``: the one suggestion, every gain predicted by ``autotune.predict_step`` with the measured eta.
- ``render``: ``format_diagnosis`` (text) and ``plot_timeline`` (PNG).
- ``run``: ``profile_main(opts, out_dir)`` runs it all (on an emulated slow link when ``opts["link"]``
  is set) and writes ``trace.json`` (Chrome trace), ``timeline.png`` and ``profile.json``; ``main`` is
  its command line: ``python -m moe_comm.tools.diagnose '{"world_size": 2, "link": "1gbit"}' out/``.
"""
from moe_comm.tools.diagnose.collect import profile_rank
from moe_comm.tools.diagnose.findings import Diagnosis, Finding, diagnose
from moe_comm.tools.diagnose.options import DEFAULT_OPTS, normalize_opts
from moe_comm.tools.diagnose.render import format_diagnosis, plot_timeline
from moe_comm.tools.diagnose.run import main, profile_main
from moe_comm.tools.diagnose.suggest import MIN_GAIN_SHARE, Suggestion

__all__ = ["DEFAULT_OPTS", "normalize_opts", "profile_rank", "Finding", "Suggestion", "Diagnosis", "diagnose",
           "format_diagnosis", "plot_timeline", "profile_main", "main", "MIN_GAIN_SHARE"]
