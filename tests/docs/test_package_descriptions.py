"""Each package's long description (its pyproject ``readme``) has no relative links: on a package
index they would resolve against the index, not the source tree."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYPROJECTS = [REPO / "pyproject.toml", *sorted((REPO / "plugins").glob("*/pyproject.toml"))]
# Markdown links and images, inline ([text](target)) or reference-style ([label]: target).
LINK_TARGETS = re.compile(r"\]\(\s*<?([^)\s>]+)|^\s*\[[^\]]+\]:\s*(\S+)", re.M)
HTML_TARGETS = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)""")


def relative_targets(markdown: str) -> list[str]:
    targets = [a or b for a, b in LINK_TARGETS.findall(markdown)] + HTML_TARGETS.findall(markdown)
    return [t for t in targets if not re.match(r"(https?:|mailto:|#)", t)]


def test_relative_targets_are_found() -> None:
    text = "[a](docs/x.md) [b](https://x.org/y) ![c](img.png) [d](#top)\n[e]: ../z.md\n<a href='w.md'>"
    assert relative_targets(text) == ["docs/x.md", "img.png", "../z.md", "w.md"]


@pytest.mark.parametrize("pyproject", PYPROJECTS, ids=lambda p: str(p.parent.relative_to(REPO)) or "core")
def test_long_description_has_no_relative_links(pyproject: Path) -> None:
    readme = tomllib.loads(pyproject.read_text())["project"]["readme"]
    path = pyproject.parent / (readme if isinstance(readme, str) else readme["file"])
    assert relative_targets(path.read_text()) == []
