"""``skyrl_core.ops`` has no import cycles: each module imports alone in a fresh interpreter, and
the graph of every import between its modules (top-level and inside functions alike: a deferred
import hides a cycle, it does not remove it) is acyclic."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import skyrl_core.ops

OPS_DIR = pathlib.Path(skyrl_core.ops.__file__).parent
MODULES = sorted(f"skyrl_core.ops.{p.stem}" for p in OPS_DIR.glob("*.py") if p.stem != "__init__")


def _imports_within(package: str, path: pathlib.Path) -> set[str]:
    """Modules of ``package`` that the source at ``path`` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == package:  # ``from package import module``
                found.update(f"{package}.{alias.name}" for alias in node.names)
            elif node.module.startswith(package + "."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith(package + "."))
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [node, nxt] if nxt in stack else [node, nxt]
            if nxt not in state and (found := visit(nxt, stack + [node])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def test_cycle_finder_finds_the_former_dispatch_install_hf_cycle():
    # Negative control: the edges the package had before ``stock`` existed.
    before = {
        "skyrl_core.ops.dispatch": {"skyrl_core.ops.install"},
        "skyrl_core.ops.install": {"skyrl_core.ops.hf"},
        "skyrl_core.ops.hf": {"skyrl_core.ops.dispatch"},
    }
    assert _cycle(before) == ["skyrl_core.ops.dispatch", "skyrl_core.ops.install", "skyrl_core.ops.hf", "skyrl_core.ops.dispatch"]


def test_ops_modules_import_each_other_without_cycles():
    graph = {f"skyrl_core.ops.{p.stem}": _imports_within("skyrl_core.ops", p) - {"skyrl_core.ops"} for p in OPS_DIR.glob("*.py") if p.stem != "__init__"}
    assert graph["skyrl_core.ops.dispatch"] >= {"skyrl_core.ops.stock"}  # the parser sees real edges
    assert _cycle(graph) is None, f"import cycle in skyrl_core.ops: {' -> '.join(_cycle(graph))}"


def test_each_ops_module_imports_alone_in_a_fresh_interpreter():
    # One fresh interpreter per module, as many at once as there are CPUs: an import is mostly
    # torch's (~1.7 s each); the 14 one after another took ~14 s.
    def import_alone(module: str) -> tuple[str, subprocess.CompletedProcess]:
        return module, subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = dict(pool.map(import_alone, MODULES))
    assert sorted(results) == MODULES and len(MODULES) >= 10
    failed = {module: done.stderr[-2000:] for module, done in results.items() if done.returncode != 0}
    assert failed == {}, failed
