"""What engine plugins' bootstraps inside their library's processes share (skyrl-vllm's in
``vllm.general_plugins``, skyrl-sglang's in ``sglang.srt.plugins``): the marker that says skyrl
started the library (a bootstrap does nothing without it, so installing a plugin never changes a
library skyrl did not start), and the check that the library's plugin allowlist lets it run.
"""

from __future__ import annotations

import os

# The bootstrap's entry-point name in the library's plugin group (what an allowlist must name).
ENTRY_POINT_NAME = "skyrl"


def marker_set(marker: str) -> bool:
    """Whether the environment variable ``marker`` is ``"1"`` (set by the engine before it starts
    the library; the library's processes inherit it)."""
    return os.environ.get(marker) == "1"


def allowlist_problem(variable: str, library: str, *, empty_loads_all: bool) -> str | None:
    """Why ``library`` would skip skyrl's bootstrap under its plugin allowlist ``variable``, or None
    if it will run. Unset loads every plugin; ``empty_loads_all`` says what an empty value does."""
    allow = os.environ.get(variable)
    if allow is None or (empty_loads_all and not allow):
        return None
    if ENTRY_POINT_NAME in {name.strip() for name in allow.split(",")}:
        return None
    return (
        f"{variable}={allow!r} does not include {ENTRY_POINT_NAME!r}, so {library} would skip skyrl's worker "
        f"bootstrap and plugins (e.g. IsoExec) would not run inside {library}; add {ENTRY_POINT_NAME!r} to "
        f"{variable} or unset it"
    )
