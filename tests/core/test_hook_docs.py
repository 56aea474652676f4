"""Every hook spec is documented in docs/plugin_hooks.md, and every documented hook exists."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from skyrl_core.plugins import hookspecs

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugin_hooks.md"


def _spec_names() -> set[str]:
    return {name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("skyrl_")}


def test_every_hook_has_a_section_and_no_section_is_stale():
    documented = set(re.findall(r"^### `(skyrl_\w+)", DOC.read_text(), flags=re.M))
    specs = _spec_names()
    assert specs, "no hook specs found"
    assert specs - documented == set(), f"undocumented hooks: {sorted(specs - documented)}"
    assert documented - specs == set(), f"documented hooks that do not exist: {sorted(documented - specs)}"


def test_every_hook_docstring_is_a_contract():
    for name in _spec_names():
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        assert len(doc) > 40, f"{name} has no real contract in its docstring"


def _sections(text: str) -> dict[str, tuple[str, str]]:
    """``{hook: (heading, body)}`` of the page's ``### `hook(...)` `` sections (body without the
    optional leading ``*firstresult*`` note)."""
    out = {}
    for match in re.finditer(r"^### `((skyrl_\w+)[^\n]*)`\n(.*?)(?=^### |^## |\Z)", text, flags=re.M | re.S):
        body = match.group(3).strip()
        if body.startswith("*firstresult*"):
            body = body.split("\n", 1)[1].strip()
        out[match.group(2)] = (match.group(1), body)
    return out


def test_each_section_mirrors_its_spec_signature_and_docstring():
    sections = _sections(DOC.read_text())
    for name in _spec_names():
        spec = getattr(hookspecs, name)
        heading, body = sections[name]
        assert heading == f"{name}{inspect.signature(spec)}".replace("'", ""), f"{name}: stale signature in the docs"
        assert body == inspect.getdoc(spec).strip(), f"{name}: docs/plugin_hooks.md differs from the docstring"


def test_the_mirror_check_sees_a_stale_signature():
    # Negative control: the page as it read before skyrl_worker_init took the engine's name.
    stale = "### `skyrl_worker_init(role: str) -> None`\n\nA runtime process started.\n"
    heading, body = _sections(stale)["skyrl_worker_init"]
    assert heading != f"skyrl_worker_init{inspect.signature(hookspecs.skyrl_worker_init)}"
    assert body == "A runtime process started."
