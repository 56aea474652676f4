"""The package boundaries of docs/architecture.md ("Sharing code"): the core imports no plugin, and
no plugin imports another plugin's package. Code two plugins need lives in a core support module.

Every import counts, top-level or inside a function (a deferred import is still a dependency), and
so does a ``"package.module:attr"`` string outside docstrings (a factory the core would import)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = ROOT / "skyrl_core"
# {import package: its source directory} of every plugin in plugins/skyrl-*/src
PLUGIN_PACKAGES = {
    pkg.name: pkg
    for pkg in sorted(ROOT.glob("plugins/skyrl-*/src/*"))
    if pkg.is_dir() and (pkg / "__init__.py").is_file()
}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def references(source: str) -> set[tuple[str, int]]:
    """``(top-level package, line)`` of every absolute import in ``source``, and of every string
    constant (docstrings aside) that names a module path (``"pkg.mod"`` or ``"pkg.mod:attr"``)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add((node.module.split(".")[0], node.lineno))
        elif isinstance(node, ast.Import):
            found.update((alias.name.split(".")[0], node.lineno) for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            head = node.value.split(":")[0]
            if head.replace(".", "").replace("_", "").isalnum() and " " not in node.value:
                found.add((head.split(".")[0], node.lineno))
    return found


def _violations(files: list[pathlib.Path], forbidden: set[str]) -> list[str]:
    out = []
    for path in files:
        for package, line in sorted(references(path.read_text())):
            if package in forbidden:
                out.append(f"{path.relative_to(ROOT)}:{line} uses {package}")
    return out


def test_the_plugin_packages_are_found():
    assert {"skyrl_fsdp", "skyrl_isoexec", "skyrl_megatron", "skyrl_sglang", "skyrl_torch", "skyrl_vllm"} <= set(
        PLUGIN_PACKAGES)


def test_the_core_imports_no_plugin():
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 50
    assert _violations(files, set(PLUGIN_PACKAGES)) == []


def test_no_plugin_imports_another_plugins_package():
    problems = []
    for package, src in PLUGIN_PACKAGES.items():
        problems += _violations(sorted(src.rglob("*.py")), set(PLUGIN_PACKAGES) - {package})
    assert problems == [], "plugins importing each other (move the shared code to a skyrl_core module):\n" + "\n".join(
        problems)


def test_the_scan_sees_deferred_imports_and_factory_strings_but_not_docstrings():
    # Negative control: what skyrl-sglang's engine had before the engine helpers moved to the core.
    source = '''
"""Mentions skyrl_vllm.lifecycle in prose only."""
from skyrl_vllm.lifecycle import environ

def start():
    """skyrl_vllm.model_dir:materialize_model, in a docstring."""
    from skyrl_vllm.model_dir import materialize_model
    import skyrl_torch.engine
    return "skyrl_fsdp.backend:FSDPBackend", "a sentence about skyrl_megatron"
'''
    assert references(source) >= {("skyrl_vllm", 3), ("skyrl_vllm", 7), ("skyrl_torch", 8), ("skyrl_fsdp", 9)}
    assert not any(package == "skyrl_megatron" for package, _ in references(source))
    assert {line for _, line in references(source)}.isdisjoint({2, 6})  # the docstrings
