"""No import cycles anywhere in ``skyrl_core``: the graph of imports between its modules, top-level
and deferred alike (a deferred import hides a cycle, it does not remove it), is acyclic. Imports
under ``if TYPE_CHECKING:`` never run and do not count; nor does importing an enclosing package
(Python initialises it before the module). ``test_ops_imports.py`` checks ``skyrl_core.ops`` the
same way and imports each of its modules alone."""

from __future__ import annotations

import ast
import pathlib

import skyrl_core
from tests.core.test_ops_imports import _cycle

CORE = pathlib.Path(skyrl_core.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in CORE.rglob("*.py")}


def _runtime_nodes(tree: ast.AST):
    """Every node outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(module: str, source: str) -> set[str]:
    """The ``skyrl_core`` modules ``source`` (the text of ``module``) imports when it runs."""
    found = set()
    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in MODULES:
                found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
    ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    return found - ancestors - {module}


def test_the_scan_skips_type_checking_imports_and_enclosing_packages():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from skyrl_core import __version__\n"  # the enclosing package
        "if TYPE_CHECKING:\n    from skyrl_core.trainer.critic import Critic\n"
        "def f():\n    from skyrl_core.config.loader import structure_options\n"
    )
    assert imports_of("skyrl_core.trainer.checkpoint", source) == {"skyrl_core.config.loader"}


def test_the_cycle_finder_sees_the_former_loader_manager_cycle():
    # Negative control: the plugin manager built components itself, importing the config loader,
    # which asks the manager what is registered.
    before = {"skyrl_core.config.loader": {"skyrl_core.plugins.manager"},
              "skyrl_core.plugins.manager": {"skyrl_core.config.loader"}}
    assert _cycle(before) is not None


def test_core_modules_import_each_other_without_cycles():
    graph = {name: imports_of(name, path.read_text()) for name, path in MODULES.items()}
    assert "skyrl_core.plugins.manager" in graph["skyrl_core.config.loader"]  # the parser sees real edges
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle in skyrl_core: {' -> '.join(cycle)}"
