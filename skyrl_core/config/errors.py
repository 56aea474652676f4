"""Config errors: every problem names the key path, what was given and what is allowed."""

from __future__ import annotations

import difflib
from typing import Any, Iterable

import attrs

MAX_ALLOWED_SHOWN = 32


@attrs.frozen
class ConfigIssue:
    path: str
    message: str
    allowed: tuple[str, ...] = ()
    suggestion: str | None = None

    def render(self) -> str:
        line = f"  {self.path}: {self.message}" if self.path else f"  {self.message}"
        if self.allowed:
            shown = list(self.allowed[:MAX_ALLOWED_SHOWN])
            more = len(self.allowed) - len(shown)
            line += f"\n      allowed: {', '.join(shown)}" + (f", ... ({more} more)" if more > 0 else "")
        if self.suggestion:
            line += f"\n      did you mean {self.suggestion!r}?"
        return line


class ConfigError(Exception):
    """One or more config problems, found before anything starts."""

    def __init__(self, issues: Iterable[ConfigIssue], source: str | None = None) -> None:
        self.issues = list(issues)
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        where = f" in {self.source}" if self.source else ""
        n = len(self.issues)
        head = f"config error{where}: {n} problem{'s' if n != 1 else ''}"
        return "\n".join([head, *(issue.render() for issue in self.issues)])


def suggest(name: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to a misspelt ``name``, or None; a prefix counts as close (``ppo_clip`` -> ``ppo``)."""
    candidates = list(candidates)
    close = difflib.get_close_matches(str(name), candidates, n=1, cutoff=0.6)
    if close:
        return close[0]
    prefixed = [c for c in candidates if len(c) >= 3 and (str(name).startswith(c) or c.startswith(str(name)))]
    return max(prefixed, key=len) if prefixed else None


def show(value: Any) -> str:
    """A short, stable rendering of a user value for messages."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
