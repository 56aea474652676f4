"""An options class read off an environment factory's keyword parameters.

An environment registered without an options class (typically through the one-line
``skyrl.environments`` entry point) still has options: the keyword parameters of its factory, a
class's ``__init__`` or a function. Each parameter with a type annotation, or with a default of a
plain type (``bool``, ``int``, ``float``, ``str``) to take the type from, becomes a field of a
frozen attrs class with that type and default, so ``environment: {name: guess-number, options:
{max_turns: 8}}`` is validated like every other option (unknown keys, wrong types) before a run
starts. Parameters with neither (``**kwargs``, positional-only ones, untyped ones) cannot be set
from a config.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any

import attrs

_PLAIN = (bool, int, float, str)


@functools.lru_cache(maxsize=None)
def options_class_from_signature(factory: Any, name: str) -> type | None:
    """A frozen attrs class of ``factory``'s settable keyword parameters; None when it has none."""
    target = factory.__init__ if inspect.isclass(factory) else factory
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return None
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # annotations naming what cannot be imported: fall back to the defaults' types
        hints = {}
    fields: dict[str, Any] = {}
    for param in signature.parameters.values():
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            continue
        has_default = param.default is not param.empty
        tp = hints.get(param.name)
        if tp is None and has_default and type(param.default) in _PLAIN:
            tp = type(param.default)
        if tp is None:
            continue
        help_text = f"keyword parameter {param.name!r} of {getattr(factory, '__qualname__', factory)!r}"
        default = param.default if has_default else attrs.NOTHING
        fields[param.name] = attrs.field(type=tp, default=default, metadata={"help": help_text})
    if not fields:
        return None
    cls_name = "".join(part.capitalize() for part in name.replace("-", "_").split("_")) + "Options"
    return attrs.make_class(cls_name, fields, frozen=True, kw_only=True)
