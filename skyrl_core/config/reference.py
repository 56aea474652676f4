"""Renders the config reference (docs/config.md's tables) from the schema's help text."""

from __future__ import annotations

import typing

import attrs

from skyrl_core.config.schema import Config, Selection


def _type_name(tp: typing.Any) -> str:
    text = getattr(tp, "__name__", None) if not typing.get_args(tp) else None
    return text or str(tp).replace("typing.", "")


def _default(field: attrs.Attribute) -> str:
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        value = default.factory()
        if isinstance(value, Selection):
            return f"`{value.name}`"
        return "(section)" if attrs.has(type(value)) else f"`{value!r}`"
    return "required" if default is attrs.NOTHING else f"`{default!r}`"


_PATH_NOTE = {"input": " (path; relative: to the config file)", "output": " (path; relative: to the current directory)"}


def config_reference() -> str:
    """Markdown tables: one per section, one row per key (dotted path, type, default, help)."""
    lines: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        attrs.resolve_types(cls)
        rows, nested = [], []
        for field in attrs.fields(cls):
            if field.name == "plugins":
                continue
            path = f"{prefix}{field.name}"
            if attrs.has(field.type) and field.type is not Selection:
                nested.append((field.type, f"{path}."))
                continue
            kind = "`{name, options}`" if field.type is Selection else f"`{_type_name(field.type)}`".replace("|", "\\|")
            meaning = field.metadata.get("help", "") + _PATH_NOTE.get(field.metadata.get("path"), "")
            rows.append(f"| `{path}` | {kind} | {_default(field)} | {meaning} |")
        if rows:
            lines.extend([f"### `{prefix.rstrip('.') or '(top level)'}`", "", "| key | type | default | meaning |",
                          "|---|---|---|---|", *rows, ""])
        for sub, sub_prefix in nested:
            walk(sub, sub_prefix)

    walk(Config, "")
    return "\n".join(lines)
