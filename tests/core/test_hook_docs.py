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
