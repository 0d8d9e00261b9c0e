"""Tier 1 (pure logic): the package's import structure, as stated in moe_comm/__init__.py's docstring.

(a) ``import moe_comm`` loads neither rich nor matplotlib, nor tools/ or testing/ (fresh interpreter).
(b) Nothing outside moe_comm/tools and moe_comm/testing imports moe_comm.tools or moe_comm.testing, at any
    depth (inside functions too, and ``importlib.import_module`` of a constant name); the one exception is
    the lazy ``dense_moe`` in ``moe_comm.__getattr__``.
(c) One-way layers, lowest first: kernels -> ops -> comm -> dispatch -> {monitor, placement} -> modules.
    A module never imports a higher layer, and the two siblings monitor and placement never import each
    other. config, routing, _checks, _wgrad, _recompute and profiling may be imported from anywhere; routing may
    import ops and kernels; config, _checks and profiling import only each other; _wgrad and _recompute import
    nothing of moe_comm.
(d) No module calls ``matplotlib.use`` (or ``pyplot.switch_backend``): that switches the backend of the
    user's whole process; draw on ``matplotlib.figure.Figure`` with an Agg canvas instead.
(b)-(d) read the source with ``ast`` and import nothing.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "moe_comm"

LAYERS = {"kernels": 0, "ops": 1, "comm": 2, "dispatch": 3, "monitor": 4, "placement": 4, "modules": 5,
          "parallel": 6, "hf": 6, "integrations": 6}
FREE_IMPORTS = {  # importable from anywhere; what each may import itself
    "_wgrad": set(),
    "_recompute": set(),
    "config": {"config", "_checks", "profiling"},
    "_checks": {"config", "_checks", "profiling"},
    "profiling": {"config", "_checks", "profiling"},
    "routing": {"config", "_checks", "profiling", "routing", "ops", "kernels"},
}
ON_TOP = {"tools", "testing"}
ROOT = "<moe_comm/__init__.py>"  # ``import moe_comm`` / ``from moe_comm import MoELayer``: the whole package


@dataclass(frozen=True)
class Import:
    path: str         # relative to the repository, e.g. "moe_comm/ops/layout.py"
    line: int
    target: str       # absolute module name, e.g. "moe_comm.kernels"
    function: Optional[str]  # innermost enclosing def, None at module level

    def __str__(self) -> str:
        where = f" (in {self.function})" if self.function else ""
        return f"{self.path}:{self.line}: imports {self.target}{where}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class _Collector(ast.NodeVisitor):
    def __init__(self, path: Path):
        self.rel = path.relative_to(REPO).as_posix()
        self.module = _module_name(path)
        self.is_package = path.name == "__init__.py"
        self.stack: List[str] = []
        self.found: List[Import] = []

    def _add(self, node: ast.AST, target: str) -> None:
        imp = Import(self.rel, node.lineno, target, self.stack[-1] if self.stack else None)
        if imp not in self.found:  # ``from m import a, b`` names m once
            self.found.append(imp)

    def _function(self, node) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve(node, self.module, self.is_package)
        for alias in node.names:
            # ``from moe_comm import ops`` depends on the submodule moe_comm.ops; ``from moe_comm import
            # MoELayer`` on moe_comm itself.
            sub = f"{base}.{alias.name}"
            self._add(node, sub if alias.name != "*" and _is_module(sub) else base)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            self._add(node, node.args[0].value)
        self.generic_visit(node)


def _imports() -> List[Import]:
    found: List[Import] = []
    for path in sorted(PKG.rglob("*.py")):
        collector = _Collector(path)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        found.extend(collector.found)
    return found


def _unit(module_or_path: str) -> Optional[str]:
    """Top-level unit of a moe_comm module ("ops", "config", ... or ROOT); None for other packages."""
    parts = module_or_path.replace("/", ".").removesuffix(".py").split(".")
    if parts[0] != "moe_comm":
        return None
    if len(parts) == 1 or parts[1] == "__init__":
        return ROOT
    return parts[1] if (PKG / parts[1]).is_dir() or (PKG / f"{parts[1]}.py").is_file() else ROOT


def _layer_violation(imp: Import) -> Optional[str]:
    src, dst = _unit(imp.path), _unit(imp.target)
    if dst is None or src == dst or src in ON_TOP or src == ROOT:
        return None
    if dst in ON_TOP:
        return None  # test (b)'s business
    if src in FREE_IMPORTS:
        return None if dst in FREE_IMPORTS[src] else f"{src} may import only {sorted(FREE_IMPORTS[src])}"
    if dst in FREE_IMPORTS:
        return None
    if dst == ROOT:
        return "the package root imports every layer"
    for unit in (src, dst):
        if unit not in LAYERS:
            return f"moe_comm.{unit} has no place in the dependency rule (add it to LAYERS or FREE_IMPORTS)"
    if LAYERS[dst] > LAYERS[src]:
        return f"{src} (layer {LAYERS[src]}) imports the higher layer {dst} ({LAYERS[dst]})"
    if LAYERS[dst] == LAYERS[src]:
        return f"{src} and {dst} are siblings and independent"
    return None


# ------------------------------------------------------------------------------------------------- (a)
def test_import_moe_comm_loads_no_rich_matplotlib_tools_or_testing():
    code = ("import json, sys, moe_comm; print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('rich', 'matplotlib') or m.startswith(('moe_comm.tools', 'moe_comm.testing')))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == [], f"import moe_comm loaded {loaded}"


# ------------------------------------------------------------------------------------------------- (b)
def test_core_never_imports_tools_or_testing():
    offending = [imp for imp in _imports()
                 if _unit(imp.path) not in ON_TOP and _unit(imp.target) in ON_TOP]
    # The one exception: ``from moe_comm.testing.reference import dense_moe`` inside moe_comm.__getattr__.
    lazy = [imp for imp in offending if imp.path == "moe_comm/__init__.py" and imp.function == "__getattr__"
            and imp.target == "moe_comm.testing.reference"]
    assert len({imp.line for imp in lazy}) == 1, (
        "expected exactly one lazy import of dense_moe from moe_comm.testing.reference in moe_comm.__getattr__, "
        f"got {[str(imp) for imp in lazy]}")
    rest = [imp for imp in offending if imp not in lazy]
    assert not rest, "the core imports tools/ or testing/:\n" + "\n".join(map(str, rest))


def test_collector_sees_imports_inside_functions_and_relative_ones(tmp_path):
    # The walker itself: a nested, a relative and an import_module() import are all found.
    src = ("import importlib\n"
           "def f():\n    from moe_comm.tools import cli\n"
           "from ..testing import workloads\n"
           "x = importlib.import_module('moe_comm.testing.payloads')\n")
    collector = _Collector(PKG / "ops" / "layout.py")
    collector.visit(ast.parse(src))
    got = {(imp.target, imp.function) for imp in collector.found}
    assert ("moe_comm.tools.cli", "f") in got
    assert ("moe_comm.testing.workloads", None) in got
    assert ("moe_comm.testing.payloads", None) in got


# ------------------------------------------------------------------------------------------------- (c)
def test_layers_import_one_way():
    violations = [f"{imp}: {why}" for imp in _imports() if (why := _layer_violation(imp))]
    assert not violations, "dependency rule broken:\n" + "\n".join(violations)


def test_layer_rule_flags_upward_and_sibling_imports():
    def why(path, target):
        return _layer_violation(Import(path, 1, target, None))

    assert why("moe_comm/kernels/native.py", "moe_comm.ops.layout") is not None
    assert why("moe_comm/ops/permute.py", "moe_comm.dispatch") is not None
    assert why("moe_comm/comm/collectives.py", "moe_comm") is not None
    assert why("moe_comm/monitor/load.py", "moe_comm.placement.planner") is not None
    assert why("moe_comm/profiling/timeline.py", "moe_comm.kernels") is not None
    assert why("moe_comm/modules/layer.py", "moe_comm.dispatch.dispatcher") is None
    assert why("moe_comm/routing.py", "moe_comm.ops") is None
    assert why("moe_comm/kernels/native.py", "moe_comm._checks") is None
    assert why("moe_comm/dispatch/dispatcher.py", "moe_comm.profiling.timeline") is None


# ------------------------------------------------------------------------------------------------- (d)
def _backend_switches(tree: ast.AST) -> List[int]:
    """Lines calling matplotlib.use / pyplot.switch_backend under any alias."""
    mpl, plt, use = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "matplotlib" or (a.name.startswith("matplotlib.") and not a.asname):
                    mpl.add(a.asname or "matplotlib")  # ``import matplotlib.pyplot`` binds matplotlib
                elif a.name == "matplotlib.pyplot":
                    plt.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module in ("matplotlib", "matplotlib.pyplot"):
            for a in node.names:
                if node.module == "matplotlib" and a.name == "use":
                    use.add(a.asname or "use")
                elif node.module == "matplotlib" and a.name == "pyplot":
                    plt.add(a.asname or "pyplot")
                elif node.module == "matplotlib.pyplot" and a.name == "switch_backend":
                    use.add(a.asname or "switch_backend")
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in use:
            lines.append(node.lineno)
        elif isinstance(f, ast.Attribute):
            owner = ast.unparse(f.value)
            if (f.attr == "use" and owner in mpl) or (f.attr == "switch_backend" and (
                    owner in plt or owner in {f"{m}.pyplot" for m in mpl})):
                lines.append(node.lineno)
    return lines


def test_no_module_switches_the_matplotlib_backend():
    calls = [f"{path.relative_to(REPO).as_posix()}:{line}"
             for path in sorted(PKG.rglob("*.py"))
             for line in _backend_switches(ast.parse(path.read_text(), filename=str(path)))]
    assert not calls, ("matplotlib.use switches the backend of the user's whole process; draw on "
                       "matplotlib.figure.Figure with FigureCanvasAgg instead:\n" + "\n".join(calls))


def test_backend_switch_finder_sees_aliases():
    src = ("import matplotlib as mpl\nmpl.use('Agg')\n"
           "from matplotlib import use as u\nu('Agg')\n"
           "import matplotlib.pyplot as plt\nplt.switch_backend('Agg')\n"
           "from matplotlib.figure import Figure\nFigure().use('x')\n")
    assert _backend_switches(ast.parse(src)) == [2, 4, 6]
