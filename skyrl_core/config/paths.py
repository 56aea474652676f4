"""Which config values are file paths, and what a relative one is relative to.

A field whose metadata has ``path`` is a path. ``path="input"`` marks what a run reads (datasets,
the model, a tokenizer, a corpus): relative to the directory of the config file that says it, so a
config works from any directory. ``path="output"`` marks where a run writes or what an earlier run
wrote (``trainer.output_dir``, ``trainer.resume``): relative to the current directory, like the
outputs of any command. A path given as a command-line override is relative to the current
directory whatever its kind: it was typed there. Every path comes out absolute, with ``~``
expanded, so ``skyrl config show`` and a run's ``config.yaml`` say exactly what was used.

Plugins mark their own options' paths the same way:
``attrs.field(default="", metadata={"help": "...", "path": "input"})``.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import attrs

PATH_KINDS = ("input", "output")


def path_kind(field: attrs.Attribute) -> str | None:
    """``"input"``, ``"output"`` or ``None`` (not a path) for an attrs field."""
    kind = field.metadata.get("path")
    if kind is None:
        return None
    if kind not in PATH_KINDS:
        raise ValueError(f"field {field.name!r}: metadata path={kind!r} is not one of {PATH_KINDS}")
    return kind


def resolve_paths(value: Any, *, config_dir: str, overridden: Iterable[str] = (), prefix: str = "") -> Any:
    """``value`` (an attrs instance, with nested attrs values, dicts of them and selections) with
    every relative path field made absolute. ``overridden`` are the dotted keys set on the command
    line: a path at or below one of them is relative to the current directory."""
    overridden = tuple(overridden)
    if not attrs.has(type(value)):
        if isinstance(value, dict):
            return {k: resolve_paths(v, config_dir=config_dir, overridden=overridden, prefix=_join(prefix, str(k)))
                    for k, v in value.items()}
        return value
    changes: dict[str, Any] = {}
    for field in attrs.fields(type(value)):
        current = getattr(value, field.name)
        key = _join(prefix, field.name)
        kind = path_kind(field)
        if kind is not None:
            if isinstance(current, str) and current:
                typed_here = any(key == o or key.startswith(o + ".") for o in overridden)
                base = os.getcwd() if kind == "output" or typed_here else config_dir
                resolved = absolute_path(current, base)
                if resolved != current:
                    changes[field.name] = resolved
            continue
        # ``plugins`` holds top-level plugin sections: their keys are not below ``plugins.``
        nested_prefix = prefix if (not prefix and field.name == "plugins") else key
        resolved = resolve_paths(current, config_dir=config_dir, overridden=overridden, prefix=nested_prefix)
        if resolved is not current:
            changes[field.name] = resolved
    return attrs.evolve(value, **changes) if changes else value


def absolute_path(path: str, base: str) -> str:
    """``path`` with ``~`` expanded, joined to ``base`` when relative, normalised."""
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key
