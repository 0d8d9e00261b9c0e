"""The options of `moe-comm profile`: their defaults and the one place they are checked.

Shapes legend: T tokens per rank, H hidden, F expert FFN size, E experts (global), K top-k, W EP world
size, C chunks.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch

__all__ = ["DEFAULT_OPTS", "DTYPES", "FP8", "normalize_opts"]

DEFAULT_OPTS: Dict[str, Any] = {
    "world_size": 2,        # W: gloo ranks to spawn (ignored under torchrun)
    "tokens": 1024,         # T per rank
    "hidden": 256,          # H
    "ffn": 512,             # F
    "experts": 8,           # E (global)
    "top_k": 2,             # K
    "num_chunks": 1,        # C, pipeline depth of the profiled layer
    "steps": 3,             # timed forward+backward steps
    "warmup": 1,            # untimed steps first (lazy inits, kernel builds)
    "workload": "uniform",  # a moe_comm.testing.workloads name, or "router" (the layer's own random router)
    "workload_params": {},  # e.g. {"p": 0.6} for hot_rank / hot_experts
    "dtype": "float32",
    "seed": 0,
    "dispatch_dtype": None,  # None (rows travel in dtype) or "float8_e4m3fn" (FP8 dispatch; "fp8" is accepted)
    "dispatch_scales": "fp32",  # FP8 block scales, "fp32" or "ue8m0" (also what an FP8 suggestion models)
    "dedup": False,         # one copy per (token, destination rank) in the layer's pipelined call
    "ranks_per_node": None,  # the layer's two-level dispatch (MoEConfig.ranks_per_node): None, "auto" or L
    "link": None,           # e.g. "1gbit": re-run inside a namespace with a shaped loopback
    "link_delay": None,     # e.g. "1ms": netem delay on that link
    "timeout_s": 900,       # the whole run on the emulated link
    "emulated_link": None,  # informational: set by profile_main for the run inside the namespace
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
FP8 = "float8_e4m3fn"  # the one dispatch_dtype besides None (Dispatcher(dispatch_dtype=torch.float8_e4m3fn))
_INT_OPTS = ("world_size", "tokens", "hidden", "ffn", "experts", "top_k", "num_chunks", "steps")


def normalize_opts(opts: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Defaults filled in and every field checked; returns a new dict (JSON-serialisable).

    opts: a dict with keys of ``DEFAULT_OPTS`` (missing ones take the default) or None (all defaults).
    Raises TypeError when opts is not a dict; ValueError naming the field (unknown key, K > E, E not
    divisible by W, unknown workload, dtype, dispatch_dtype or dispatch_scales, a non-bool dedup, a
    skewed workload with H < E, too many ranks for this machine, a malformed link rate or delay).
    dispatch_dtype None / "none" becomes None, "fp8" / "float8_e4m3fn" becomes "float8_e4m3fn".
    """
    from moe_comm.testing.workloads import WORKLOADS, make_workload
    from moe_comm.tools.launch import launched_by_torchrun

    if opts is None:
        opts = {}
    if not isinstance(opts, dict):
        raise TypeError(f"opts must be a dict, got {type(opts).__name__}")
    unknown = sorted(set(opts) - set(DEFAULT_OPTS))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(DEFAULT_OPTS)}")
    o = {**DEFAULT_OPTS, **opts}
    o["workload_params"] = dict(o["workload_params"] or {})
    for name in _INT_OPTS:
        v = o[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if isinstance(o["warmup"], bool) or not isinstance(o["warmup"], int) or o["warmup"] < 0:
        raise ValueError(f"warmup must be an int >= 0, got {o['warmup']!r}")
    if o["top_k"] > o["experts"]:
        raise ValueError(f"top_k must be <= experts ({o['experts']}), got {o['top_k']}")
    W = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else o["world_size"]
    if o["experts"] % W:
        raise ValueError(f"experts ({o['experts']}) must be divisible by the world size, got {W}")
    max_ranks = max(8, 4 * (os.cpu_count() or 1))
    if not launched_by_torchrun() and o["world_size"] > max_ranks:
        raise ValueError(f"world_size must be <= {max_ranks} on this machine ({os.cpu_count()} cores; "
                         f"use torchrun for more), got {o['world_size']}")
    if o["dtype"] not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {o['dtype']!r}")
    if o["dispatch_dtype"] in (None, "none"):
        o["dispatch_dtype"] = None
    elif o["dispatch_dtype"] in ("fp8", FP8):
        o["dispatch_dtype"] = FP8
    else:
        raise ValueError(f"dispatch_dtype must be None, 'none', 'fp8' or {FP8!r}, got {o['dispatch_dtype']!r}")
    if o["dispatch_scales"] not in ("fp32", "ue8m0"):
        raise ValueError(f"dispatch_scales must be 'fp32' or 'ue8m0', got {o['dispatch_scales']!r}")
    if not isinstance(o["dedup"], bool):
        raise ValueError(f"dedup must be a bool, got {o['dedup']!r}")
    rpn = o["ranks_per_node"]
    if rpn is not None and rpn != "auto" and (isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1):
        raise ValueError(f"ranks_per_node must be None, 'auto' or an int >= 1, got {rpn!r}")
    if o["workload"] != "router":
        if o["workload"] not in WORKLOADS:
            raise ValueError(f"workload must be 'router' or one of {', '.join(WORKLOADS)}, got {o['workload']!r}")
        if o["workload"] == "hot_rank":
            o["workload_params"].setdefault("num_ranks", W)
        make_workload(o["workload"], **o["workload_params"])  # raises on bad parameters
        if o["hidden"] < o["experts"]:
            raise ValueError(f"hidden ({o['hidden']}) must be >= experts ({o['experts']}) to impose the "
                             f"{o['workload']!r} routing through the router; use workload='router'")
    elif o["workload_params"]:
        raise ValueError(f"workload_params must be empty for workload='router', got {o['workload_params']!r}")
    for name in ("link", "link_delay"):
        if o[name] is not None and not isinstance(o[name], str):
            raise ValueError(f"{name} must be a tc string like '1gbit' / '1ms' or None, got {o[name]!r}")
    if o["link"] is not None:
        from moe_comm.tools.slow_link import parse_rate
        parse_rate(o["link"])
    if o["link_delay"] is not None:
        from moe_comm.tools.slow_link import parse_delay
        parse_delay(o["link_delay"])
    if not isinstance(o["timeout_s"], (int, float)) or not o["timeout_s"] > 0:
        raise ValueError(f"timeout_s must be seconds > 0, got {o['timeout_s']!r}")
    return o
