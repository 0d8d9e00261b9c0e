"""Tier 1 (fresh interpreters): ``import moe_comm`` stays light, and the torch.compile graph breaks still apply.

``import moe_comm`` must not import ``torch._dynamo`` (about 1 s: sympy, triton, ...), ``triton`` or
``torch.utils.cpp_extension`` (setuptools): the Dispatcher's public calls are marked with
``moe_comm._checks.graph_break``, which applies ``torch.compiler.disable`` when ``torch._dynamo`` is imported.
That they are applied is checked here (dynamo imported after moe_comm, and before); that the graph breaks
are exactly where they were is tests/dispatch/test_compile.py.
A subprocess each: ``sys.modules`` of this test process has long held everything.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch._dynamo", "triton", "torch.utils.cpp_extension", "sympy")
BREAKS = ("check", "dispatch", "combine", "__call__", "fail")  # the Dispatcher's graph breaks


def _run(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _disabled(names=BREAKS) -> str:
    """Code: a dict name -> whether Dispatcher.<name> is torch.compiler.disable's wrapper of the original."""
    return ("{n: bool(getattr(vars(moe_comm.Dispatcher)[n], '_torchdynamo_disable', False)) and getattr(getattr("
            "vars(moe_comm.Dispatcher)[n], '__wrapped__', None), '__qualname__', None) == 'Dispatcher.' + n "
            f"for n in {names!r}}}")


def test_import_moe_comm_imports_no_dynamo_triton_or_cpp_extension():
    got = _run(f"import json, sys, moe_comm; print(json.dumps({{'loaded': [m for m in {HEAVY!r} if m in sys.modules], "
               f"'disabled': {_disabled()}}}))")
    assert got["loaded"] == [], f"import moe_comm imported {got['loaded']}"
    assert not any(got["disabled"].values()), got["disabled"]  # plain functions until dynamo is imported


def test_graph_breaks_applied_when_dynamo_is_imported_after_moe_comm():
    got = _run("import json, importlib, moe_comm; importlib.import_module('torch._dynamo'); "
               f"print(json.dumps({_disabled()}))")
    assert got == {n: True for n in BREAKS}, got


def test_graph_breaks_applied_when_dynamo_was_imported_first():
    got = _run(f"import json, torch._dynamo, moe_comm; print(json.dumps({_disabled()}))")
    assert got == {n: True for n in BREAKS}, got


def test_graph_breaks_applied_by_torch_compile():
    # torch.compile imports dynamo itself; the compiled function calls the Dispatcher (W = 1): the call runs
    # eagerly (one graph break) and gives the eager result.
    code = """
import json, torch, moe_comm
d = moe_comm.Dispatcher(num_experts=2)
x = torch.randn(4, 8)
idx, w = torch.tensor([[0], [1], [1], [0]]), torch.ones(4, 1)
def f(x):
    return d(x * 2, idx, w, lambda rows, counts: rows + 1) - 1
ref = f(x)
import torch._dynamo as dynamo
explained = dynamo.explain(f)(x)
out = torch.compile(f, backend="eager")(x)
print(json.dumps({"breaks": explained.graph_break_count, "equal": bool(torch.equal(out, ref)), "disabled": %s}))
""" % _disabled()
    got = _run(code)
    assert got["disabled"] == {n: True for n in BREAKS}, got
    assert got["equal"] and got["breaks"] == 1, got


def test_graph_breaks_applied_when_the_import_hook_was_passed_by():
    # torch._dynamo imported by a route the hook does not see (here: the hook removed first): building a
    # Dispatcher applies the pending breaks (moe_comm._checks.graph_breaks_applied)
    code = ("import json, sys, importlib, moe_comm, moe_comm._checks as c; "
            "sys.meta_path[:] = [f for f in sys.meta_path if f is not c._DynamoImportHook]; "
            "importlib.import_module('torch._dynamo'); before = " + _disabled() + "; "
            "moe_comm.Dispatcher(num_experts=2); print(json.dumps({'before': before, 'after': " + _disabled() + "}))")
    got = _run(code)
    assert not any(got["before"].values()) and got["after"] == {n: True for n in BREAKS}, got
