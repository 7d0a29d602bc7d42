"""The package's import graph, read from the source with ``ast`` (CPU, nothing imported).

Every ``import`` and ``from ... import`` of every module counts, wherever it sits: at the top,
inside a function (a lazy import is still a dependency), under ``if TYPE_CHECKING``. Relative
imports are resolved against the importing module. ``from pkg import name`` is an edge to the
submodule ``pkg.name`` when that is a module of the package, else to ``pkg`` itself. Importing
a submodule also runs its parent packages' ``__init__``; those implicit edges are left out, as
every checker of import cycles does (else each module re-exported by its package's
``__init__`` would close a cycle through it).

Two rules (issue 29, DESIGN §4):
- no cycle inside ``mok_cute/``;
- the runtime library never imports the benchmark subpackage ``mok_cute.bench``: only the
  bench itself and the command line (``mok_cute/cli.py``, lazily) may.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = "mok_cute"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
BENCH = f"{PACKAGE}.bench"
# modules outside the bench that may import it: the command line hands `bench`, `timeline`
# and the like to it
MAY_IMPORT_BENCH = {f"{PACKAGE}.cli"}


def module_names() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package by its ``__init__``)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target> import ...`` written in ``module``."""
    base = module.split(".")
    if not is_package:
        base = base[:-1]  # a plain module's relative imports start from its package
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(module: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def add(name: str) -> None:
        # the longest prefix that is a module of the package: `import mok_cute.sim.tune`
        # depends on mok_cute.sim.tune, `from mok_cute.timeline import decode` on mok_cute.timeline
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            candidate = ".".join(parts[:n])
            if candidate in modules:
                found.add(candidate)
                return

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            source = (_resolve_relative(module, is_package, node.level, node.module)
                      if node.level else node.module or "")
            if not (source == PACKAGE or source.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in modules:
                    found.add(sub)  # `from mok_cute import jit`: the module jit
                else:
                    add(source)  # `from mok_cute.config import MoKConfig`: the module config
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    names = set(modules)
    return {name: imports_of(name, path, names) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (or a module
    importing itself), as the path a -> b -> ... -> a (Tarjan, then a walk inside the SCC)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursive: the package has ~70 modules, far below the limit
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)

    cycles = []
    for component in components:
        members = set(component)
        if len(component) == 1 and component[0] not in graph.get(component[0], ()):
            continue
        # a shortest way back to the start, inside the component (breadth first)
        start = component[0]
        previous: dict[str, str] = {}
        frontier = [start]
        closing = None
        while frontier and closing is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w == start:
                        closing = v
                        break
                    if w not in previous:
                        previous[w] = v
                        nxt.append(w)
                if closing is not None:
                    break
            frontier = nxt
        path = [closing]
        while path[-1] != start:
            path.append(previous[path[-1]])
        cycles.append(path[::-1] + [start])
    return cycles


def test_the_graph_sees_lazy_and_relative_imports():
    """The reader itself: the edges it must find, or the two tests below prove nothing."""
    graph = import_graph()
    assert f"{PACKAGE}.api" in graph[PACKAGE]  # `from .api import ...` in __init__
    assert f"{PACKAGE}.reference" in graph[f"{PACKAGE}.api"]  # `from . import reference`
    assert f"{PACKAGE}.jit" in graph[f"{PACKAGE}.cli"]  # imported inside functions only
    assert f"{PACKAGE}.sim.model" in graph[f"{PACKAGE}.sim.tune"]  # `from .model import`


def test_find_cycles_reports_a_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(map(tuple, find_cycles(graph))) == [("a", "b", "c", "a"), ("e", "e")]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    cycles = find_cycles(import_graph())
    text = "\n".join("  " + " -> ".join(c) for c in cycles)
    assert not cycles, f"import cycles in {PACKAGE}/ (each import anywhere in a module counts):\n{text}"


def test_the_runtime_library_never_imports_the_bench():
    graph = import_graph()
    offenders = sorted(
        f"{module} -> {', '.join(sorted(t for t in targets if t == BENCH or t.startswith(BENCH + '.')))}"
        for module, targets in graph.items()
        if not (module == BENCH or module.startswith(BENCH + ".")) and module not in MAY_IMPORT_BENCH
        and any(t == BENCH or t.startswith(BENCH + ".") for t in targets))
    assert not offenders, ("runtime modules import the benchmark subpackage (move the code, or "
                           "import it from mok_cute.bench instead):\n  " + "\n  ".join(offenders))


def test_importing_the_library_loads_no_bench_and_no_matplotlib():
    """The same rule at run time, in a fresh interpreter: the public API, the timeline's decoder
    and the tuner load neither the bench nor matplotlib (the ``bench`` extra)."""
    code = ("import sys, mok_cute, mok_cute.api, mok_cute.timeline, mok_cute.sim.tune, mok_cute.cli; "
            "print(sorted(m for m in sys.modules if m.startswith(('mok_cute.bench', 'matplotlib'))))")
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_the_shape_catalogue_imports_nothing_from_the_package():
    assert import_graph()[f"{PACKAGE}.shapes"] == set()
