"""Every fenced code block of the docs runs, so the docs cannot drift from the code.

The files: README.md, docs/*.md and every plugin's README.md. By the block's language:

- ``python``: run in a fresh interpreter (cwd: a temporary directory), must exit 0;
- ``bash``: run with ``bash -eo pipefail`` in a directory that looks like the repository root (its
  files, linked; no ``runs/``), ``.venv/bin`` first on PATH;
- ``yaml``: a config or a part of one; validated by the config loader (a ``model`` is added
  when the block has none), without looking at the disk;
- ``toml``: parsed; a ``[project]`` needs a ``[build-system]`` (pip cannot build it otherwise);
- no language, ``text``: shown, not run (command output, trees, pseudo-code, synopses).

A block that cannot run here quickly (it trains for minutes, installs packages, needs a GPU or a
server) has ``<!-- doc-test: skip REASON -->`` on the line right before its opening fence; the
reason says what runs it instead, if anything. The convention is documented in
docs/architecture.md ("Documentation is tested").
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import attrs
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "plugins").glob("*/README.md"))]
RUN_LANGUAGES = ("python", "bash", "yaml", "toml")
SHOWN_LANGUAGES = ("", "text")
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
SKIP = re.compile(r"<!-- doc-test: skip (.+?) -->\s*\Z", re.S)


@attrs.frozen
class Block:
    path: Path
    line: int
    language: str
    code: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def doc_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()]
        last_line = before.rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(last_line + "\n")
        blocks.append(Block(path, before.count("\n") + 1, match.group(1), match.group(2),
                            skip.group(1).strip() if skip else None))
    return blocks


ALL_BLOCKS = [b for path in DOCS for b in doc_blocks(path)]
RUN_BLOCKS = [b for b in ALL_BLOCKS if b.language in RUN_LANGUAGES]


def test_every_block_has_a_known_language_and_skips_say_why() -> None:
    unknown = [(b.id, b.language) for b in ALL_BLOCKS if b.language not in RUN_LANGUAGES + SHOWN_LANGUAGES]
    assert unknown == []
    assert all(len(b.skip.split()) >= 3 for b in ALL_BLOCKS if b.skip), "a skip needs a reason"
    # the markers are few: most blocks run
    assert sum(b.skip is not None for b in RUN_BLOCKS) <= len(RUN_BLOCKS) // 2


def test_the_block_extractor_finds_languages_and_markers(tmp_path) -> None:
    doc = tmp_path / "d.md"
    doc.write_text("x\n```python\nprint(1)\n```\n<!-- doc-test: skip it trains for minutes -->\n```bash\nmake demo\n```\n")
    first, second = doc_blocks(doc)
    assert (first.language, first.code, first.skip, first.line) == ("python", "print(1)\n", None, 2)
    assert (second.language, second.skip) == ("bash", "it trains for minutes")


def _env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_AUTH_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}  # belt and braces: no block can download a package
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run_python(block: Block, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", block.code], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, f"{block.id}:\n{done.stderr[-3000:]}"


# A docs block runs in the developer's own checkout and venv: one that installs or removes packages or
# rebuilds the venv would change the machine the rest of the suite runs on (a `pip install` of the
# GPU extras once replaced the venv's CPU torch with a CUDA build). Such blocks must carry a skip marker.
MUTATES_THE_MACHINE = re.compile(r"\b(pip3?|uv|apt(-get)?|conda)\s+(install|uninstall|remove|sync)\b|\bmake\s+(venv|clean-venv|test|demo)\b|\brm\s+-")


def _run_bash(block: Block, tmp_path: Path) -> None:
    assert not MUTATES_THE_MACHINE.search(block.code), (
        f"{block.id}: this block installs/removes software or rebuilds the venv; mark it "
        "<!-- doc-test: skip REASON --> instead of running it here")
    # The repository's files, but not its run outputs: commands write runs/ here, not in the checkout.
    for entry in REPO.iterdir():
        if not entry.name.startswith(".") and entry.name != "runs":
            (tmp_path / entry.name).symlink_to(entry)
    done = subprocess.run(["bash", "-eo", "pipefail", "-c", block.code], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, f"{block.id}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def _check_yaml(block: Block, tmp_path: Path) -> None:
    from skyrl_core.config.loader import structure_config

    data = yaml.safe_load(block.code)
    assert isinstance(data, dict), f"{block.id}: not a mapping"
    data.setdefault("model", {"config": {"model_type": "qwen3"}})
    structure_config(data, source=block.id)  # raises ConfigError naming every problem


def _check_toml(block: Block, tmp_path: Path) -> None:
    data = tomllib.loads(block.code)
    if "name" in data.get("project", {}):  # a whole pyproject, not a fragment of one
        assert "build-system" in data, f"{block.id}: a pyproject without [build-system] cannot be pip-installed"


CHECKS = {"python": _run_python, "bash": _run_bash, "yaml": _check_yaml, "toml": _check_toml}


# Blocks marked skip are left out here (not reported as skipped tests): the marker is the record.
@pytest.mark.parametrize("block", [b for b in RUN_BLOCKS if not b.skip], ids=lambda b: b.id)
def test_doc_block_runs(block: Block, tmp_path) -> None:
    CHECKS[block.language](block, tmp_path)
