"""attrs validators for the options classes of the core and of plugins (one wording everywhere).

A validator raises ``ValueError("<field> must be ...; got <value>")``. Used by the config loader, the
message follows the key path it already shows (``engine.options.device: 'tpu' is invalid: device
must be one of cpu, cuda; got 'tpu'``); used directly in Python, the field is named with its class
(``TorchEngineOptions.device``). A choice validator carries ``allowed``, from which the loader lists
the allowed values and suggests the closest one. Importing this module imports only attrs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable

import attrs

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def field_name(instance: Any, attribute: attrs.Attribute) -> str:
    """``Class.field`` for an attrs instance; the bare field name when the loader validates a value
    before building the instance (it passes a stand-in, and its message carries the key path)."""
    return f"{type(instance).__name__}.{attribute.name}" if attrs.has(type(instance)) else attribute.name


def is_integer(value: Any) -> bool:
    """An int that is not a bool (``True`` is an int to Python, not a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    """An int or float that is not a bool, NaN or an infinity."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def one_of(*allowed: Any, optional: bool = False) -> Validator:
    """The value is one of ``allowed`` (or None, with ``optional``)."""
    shown = ", ".join(map(str, allowed)) + (" or null" if optional else "")

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if (value is None and optional) or value in allowed:
            return
        raise ValueError(f"{field_name(instance, attribute)} must be one of {shown}; got {value!r}")

    check.allowed = allowed  # type: ignore[attr-defined]
    return check


def positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_integer(value) or value < 1:
        raise ValueError(f"{field_name(instance, attribute)} must be an integer >= 1; got {value!r}")


def optional_positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not is_integer(value) or value < 1):
        raise ValueError(f"{field_name(instance, attribute)} must be a positive integer or null; got {value!r}")


def non_negative_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_integer(value) or value < 0:
        raise ValueError(f"{field_name(instance, attribute)} must be an integer >= 0; got {value!r}")


def boolean(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{field_name(instance, attribute)} must be true or false; got {value!r}")


def positive_number(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{field_name(instance, attribute)} must be a number > 0; got {value!r}")


def nested(cls: type) -> Any:
    """Converter of a field that holds options class ``cls``: a mapping given in Python
    (``AlgorithmConfig(kl={"coef": 0.1})``) becomes ``cls``, its keys and values checked as the
    config loader checks them (it was kept as a raw dict, checked by nothing); an instance or
    None passes (``holds`` then checks the type)."""

    def convert(value: Any) -> Any:
        if isinstance(value, Mapping):
            allowed = [f.alias for f in attrs.fields(cls)]
            unknown = [key for key in value if key not in allowed]
            if unknown:
                raise ValueError(f"{cls.__name__}: unknown key {unknown[0]!r}; allowed: {', '.join(allowed)}")
            return cls(**value)
        return value

    return convert


def holds(cls: type, *, optional: bool = False) -> Validator:
    """The value is a ``cls`` (or None, with ``optional``): for fields converted by ``nested``."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if (value is None and optional) or isinstance(value, cls):
            return
        raise ValueError(f"{field_name(instance, attribute)} must be a mapping of {cls.__name__} options"
                         f"{' or null' if optional else ''}; got {value!r}")

    return check
