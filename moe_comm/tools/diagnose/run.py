"""``profile_main``: profile a layer on W ranks, diagnose it, write the files; ``main``: its command line.

With ``opts["link"]`` the whole run is re-launched inside a fresh network namespace with a shaped
loopback, as ``python -m moe_comm.tools.diagnose OPTS_JSON OUT_DIR`` (see ``__main__.py``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional

import moe_comm
from moe_comm.profiling import Span, to_chrome_trace
from moe_comm.tools.diagnose.collect import profile_rank
from moe_comm.tools.diagnose.findings import diagnose
from moe_comm.tools.diagnose.options import DEFAULT_OPTS, normalize_opts
from moe_comm.tools.diagnose.render import format_diagnosis, plot_timeline

__all__ = ["profile_main", "main", "relaunch_command"]


def _error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)


def _jsonable(obj: Any) -> Any:
    """Strict JSON: non-finite floats (beta = inf on one rank) become None, keys become str."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def relaunch_command(opts: Dict[str, Any], out_dir: str):
    """(argv, env) that run this profile again in a child Python: ``python -m moe_comm.tools.diagnose
    OPTS_JSON OUT_DIR`` with the directory holding the ``moe_comm`` package first on PYTHONPATH, so the
    child imports this very checkout (e.g. inside a network namespace, under another working directory).
    opts: already normalised; out_dir: made absolute."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(moe_comm.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "moe_comm.tools.diagnose", json.dumps(opts), os.path.abspath(out_dir)]
    return cmd, env


def profile_main(opts: Dict[str, Any], out_dir: str) -> int:
    """Run the profile and write ``out_dir``/{trace.json, timeline.png, profile.json}; print the diagnosis.

    opts: see ``DEFAULT_OPTS``. With ``opts["link"]`` (e.g. "1gbit") the whole run happens in a fresh
    network namespace with a shaped loopback (``slow_link.run_on_slow_link``, needs root).
    Returns the exit code: 0 done (also on non-zero ranks under torchrun), 1 the run failed (a rank
    raised, the link could not be set up, timeout), 2 invalid options.
    """
    try:
        opts = normalize_opts(opts)
    except (TypeError, ValueError) as err:
        _error(str(err))
        return 2
    from moe_comm.tools.launch import launched_by_torchrun, run_ranks

    if opts["link"]:
        if launched_by_torchrun():
            _error("link emulation spawns its own ranks; do not combine it with torchrun")
            return 2
        from moe_comm.tools.slow_link import link_available, run_on_slow_link
        ok, why = link_available()
        if not ok:
            _error(why)
            return 1
        inner = {**opts, "link": None, "link_delay": None, "emulated_link": opts["link"]
                 + (f" + {opts['link_delay']} delay" if opts["link_delay"] else "")}
        cmd, env = relaunch_command(inner, out_dir)
        try:
            return run_on_slow_link(cmd, rate=opts["link"], delay=opts["link_delay"], env=env,
                                    timeout=opts["timeout_s"])
        except Exception as err:  # noqa: BLE001 -- setup failures and timeouts become exit code 1
            _error(f"profile on the emulated link failed: {err}")
            return 1
    try:
        result = run_ranks(profile_rank, opts["world_size"], opts)
    except Exception as err:  # noqa: BLE001 -- a rank's failure becomes exit code 1
        _error(f"profile run failed: {err}")
        return 1
    if result is None:  # a non-zero rank under torchrun: rank 0 reports
        return 0
    d = diagnose(result)
    print(format_diagnosis(d))
    os.makedirs(out_dir, exist_ok=True)
    spans = [Span(**s) for s in result["spans"]]
    paths = {name: os.path.join(out_dir, name) for name in ("trace.json", "timeline.png", "profile.json")}
    to_chrome_trace(spans, paths["trace.json"])
    plot_timeline(spans, paths["timeline.png"], title=d.header)
    with open(paths["profile.json"], "w") as f:
        json.dump(_jsonable({"result": result, "diagnosis": d.as_dict()}), f, indent=1)
    print("wrote " + ", ".join(paths.values()))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m moe_comm.tools.diagnose OPTS_JSON OUT_DIR``: what ``profile_main`` runs inside the namespace."""
    p = argparse.ArgumentParser(prog="python -m moe_comm.tools.diagnose", description=main.__doc__)
    p.add_argument("opts", help=f"JSON object of options; keys: {', '.join(DEFAULT_OPTS)}")
    p.add_argument("out_dir", help="where trace.json, timeline.png and profile.json go")
    ns = p.parse_args(argv)
    try:
        opts = json.loads(ns.opts)
    except json.JSONDecodeError as err:
        _error(f"opts must be a JSON object, got {ns.opts!r} ({err})")
        return 2
    return profile_main(opts, ns.out_dir)
