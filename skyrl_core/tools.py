"""A small tool mechanism for environments.

A model calls a tool by writing ``<name>argument</name>`` in its turn (``<sql>SELECT 1</sql>``,
``<search>capital of France</search>``). A ``Tool`` pairs that tag name with a description (shown
to the model) and an executor (argument text -> observation text). A ``ToolBox`` finds the first
call to any of its tools in a turn and runs it, turning executor exceptions into error text so
that a bad call is an observation the model can react to, never a crash of the rollout. The
one exception is ``ToolUnavailable``: an executor raises it when the tool cannot work on this
machine at all (a sandbox the OS cannot build), and that must stop the run, not train on it.

An unclosed last tag (``<sql>SELECT 1`` at the very end of the text) counts as a call: engines
usually strip the stop string, so a rollout that stops on ``</sql>`` hands over text without it.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

import attrs


def _check_tag_name(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", value):
        raise ValueError(f"tool name must be a tag-like word (letters, digits, _ or -), got {value!r}")


class ToolUnavailable(RuntimeError):
    """The tool cannot run on this machine; ``ToolBox.execute`` lets it propagate."""


@attrs.frozen(kw_only=True)
class Tool:
    """A tool the model calls as ``<name>argument</name>``; ``run(argument) -> observation``."""

    name: str = attrs.field(validator=_check_tag_name)
    description: str
    run: Callable[[str], str]


@attrs.frozen(kw_only=True)
class ToolCall:
    """One call found in a turn: the tool's name, the text between its tags, and its span."""

    name: str
    argument: str
    start: int
    end: int
    closed: bool


def find_tag_calls(text: str, names: Iterable[str]) -> list[ToolCall]:
    """Every ``<name>...</name>`` in ``text`` for the given tag names, in order of appearance.

    Tags are matched case-insensitively and never nest; a last opening tag without its closing
    tag takes the rest of the text (``closed=False``).
    """
    names = list(names)
    if not names:
        return []
    alternatives = "|".join(re.escape(n) for n in names)
    opening = re.compile(rf"<({alternatives})>", re.IGNORECASE)
    calls: list[ToolCall] = []
    pos = 0
    while True:
        match = opening.search(text, pos)
        if match is None:
            return calls
        name = next(n for n in names if n.lower() == match.group(1).lower())
        closing = re.compile(rf"</{re.escape(name)}>", re.IGNORECASE).search(text, match.end())
        if closing is None:
            calls.append(ToolCall(name=name, argument=text[match.end():].strip(), start=match.start(),
                                  end=len(text), closed=False))
            return calls
        calls.append(ToolCall(name=name, argument=text[match.end():closing.start()].strip(),
                              start=match.start(), end=closing.end(), closed=True))
        pos = closing.end()


def last_tag_content(text: str, name: str) -> str | None:
    """The argument of the last ``<name>...</name>`` in ``text`` (``None`` when there is none)."""
    calls = find_tag_calls(text, [name])
    return calls[-1].argument if calls else None


class ToolBox:
    """The tools an environment offers; parses and runs one call per turn."""

    def __init__(self, tools: Iterable[Tool]):
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool

    def describe(self) -> str:
        """One line per tool, for the system prompt: ``<name>...</name>: description``."""
        return "\n".join(f"<{t.name}>...</{t.name}>: {t.description}" for t in self.tools.values())

    def first_call(self, text: str) -> ToolCall | None:
        """The first call to any of these tools in ``text``, or ``None``."""
        calls = find_tag_calls(text, self.tools)
        return calls[0] if calls else None

    def execute(self, call: ToolCall) -> str:
        """Run ``call``; an exception in the executor (but ``ToolUnavailable``) becomes ``"Error: ..."`` text."""
        tool = self.tools.get(call.name)
        if tool is None:
            return f"Error: unknown tool {call.name!r}; available: {', '.join(self.tools)}"
        try:
            return tool.run(call.argument)
        except ToolUnavailable:
            raise
        except Exception as error:  # the model sees its mistake instead of the rollout crashing
            return f"Error: {type(error).__name__}: {error}"


__all__ = ["Tool", "ToolBox", "ToolCall", "ToolUnavailable", "find_tag_calls", "last_tag_content"]
