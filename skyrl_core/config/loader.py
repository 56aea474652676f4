"""YAML + dotted overrides -> a validated ``Config``.

Structuring walks the attrs schema itself (so every problem knows its key path and can suggest a
close key) and hands leaf values to one cattrs converter with strict scalar hooks. ``{name,
options}`` selections are checked against the plugin registry, then their ``options`` are structured
with the selected plugin's options class. All problems are collected and raised together as one
``ConfigError`` before anything runs.
"""

from __future__ import annotations

import math
import os
import types
import typing
from typing import TYPE_CHECKING, Any, Mapping

import attrs
import cattrs
import yaml

from skyrl_core.config.errors import ConfigError, ConfigIssue, show, suggest
from skyrl_core.config.schema import Config, EngineConfig, Selection

if TYPE_CHECKING:
    from skyrl_core.plugins.manager import SkyrlPluginManager

# Which registry kind each selectable section chooses from.
SELECTIONS: dict[str, str] = {
    "engine": "inference_engine",
    "backend": "training_backend",
    "environment": "environment",
    "algorithm.policy_loss": "policy_loss",
    "algorithm.advantage": "advantage_estimator",
}


def _strict_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)

    def to_bool(value: Any, _: type) -> bool:
        if isinstance(value, bool):
            return value
        raise ValueError("expected true or false")

    def to_int(value: Any, _: type) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError("expected an integer")
        try:
            number = float(value) if isinstance(value, str) else value
            if isinstance(number, float) and not number.is_integer():
                raise ValueError
            number = int(number)
        except (ValueError, OverflowError):
            raise ValueError("expected an integer") from None
        if not -(2**63) <= number < 2**63:
            raise ValueError("expected an integer of at most 64 bits")
        return number

    def to_float(value: Any, _: type) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError("expected a number")
        try:
            number = float(value)
        except ValueError:
            raise ValueError("expected a number") from None
        except OverflowError:  # an integer beyond the float range
            raise ValueError("expected a finite number") from None
        # inf or nan would train silently into NaN weights: every float in a config must be finite
        if not math.isfinite(number):
            raise ValueError("expected a finite number")
        return number

    def to_str(value: Any, _: type) -> str:
        if not isinstance(value, str):
            raise ValueError("expected a string")
        return value

    def to_str_tuple(value: Any, _: type) -> tuple[str, ...]:
        # A bare string would otherwise become a tuple of its characters.
        if not isinstance(value, (list, tuple)):
            raise ValueError("expected a list of strings")
        return tuple(to_str(v, str) for v in value)

    conv.register_structure_hook(bool, to_bool)
    conv.register_structure_hook_func(lambda tp: tp == tuple[str, ...], to_str_tuple)
    conv.register_structure_hook(int, to_int)
    conv.register_structure_hook(float, to_float)
    conv.register_structure_hook(str, to_str)
    return conv


CONVERTER = _strict_converter()


class _Walker:
    """Structures plain data into attrs classes, collecting ``ConfigIssue``s instead of stopping."""

    def __init__(self, plugin_manager: SkyrlPluginManager | None = None) -> None:
        self.pm = plugin_manager
        self.issues: list[ConfigIssue] = []

    def fail(self, path: str, message: str, allowed: tuple[str, ...] = (), suggestion: str | None = None) -> None:
        self.issues.append(ConfigIssue(path, message, allowed, suggestion))

    def attrs_class(self, cls: type, data: Any, path: str, extra_keys: tuple[str, ...] = (), hidden: tuple[str, ...] = ()) -> Any:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            self.fail(path, f"expected a mapping of {cls.__name__} fields, got {show(data)}")
            return None
        attrs.resolve_types(cls)
        fields = {f.name: f for f in attrs.fields(cls) if f.name not in hidden}
        for key in data:
            if key not in fields:
                allowed = tuple(sorted([*fields, *extra_keys]))
                from skyrl_core.plugins.installation import provider_hint

                hint = None if path else provider_hint("config_section", str(key))
                head = str(key).split(".", 1)[0]
                if hint:
                    message = f"unknown key: a section {hint}, which is not installed"
                elif "." in str(key) and head in fields:  # `trainer.lr: 1` in a file
                    message = (f"unknown key: dotted paths are for command-line overrides; in a file write "
                               f"{head}: {{{str(key).split('.', 1)[1]}: ...}}")
                else:
                    message = "unknown key"
                self.fail(_join(path, str(key)), message, allowed, suggest(str(key), allowed))
        kwargs: dict[str, Any] = {}
        ok = True
        for name, field in fields.items():
            if name not in data:
                if field.default is attrs.NOTHING:
                    self.fail(_join(path, name), "required key is missing")
                    ok = False
                continue
            before = len(self.issues)
            value = self.value(field.type, data[name], _join(path, name))
            if len(self.issues) > before:
                ok = False
                continue
            if field.validator is not None:
                try:
                    # Cross-field validators read other fields from the instance: give them the
                    # values seen so far, over the class defaults.
                    field.validator(_partial_instance(fields, kwargs, name, value), field, value)
                except (ValueError, TypeError) as exc:
                    allowed = tuple(map(str, getattr(field.validator, "allowed", ())))
                    given = data[name]
                    self.fail(_join(path, name), f"{show(given)} is invalid: {exc}", allowed, suggest(str(given), allowed) if allowed else None)
                    ok = False
                    continue
            kwargs[name] = value
        if not ok:
            return None
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as exc:
            self.fail(path, str(exc))
            return None

    def value(self, tp: Any, data: Any, path: str) -> Any:
        if tp is Any or tp is None or typing.get_origin(tp) is dict:
            # free-form values (a transformers config, plugin extras): still no inf or nan anywhere
            where = _first_non_finite(data, path)
            if where is not None:
                self.fail(where[0], f"{show(where[1])} is invalid: expected a finite number")
                return None
            if tp is Any or tp is None:
                return data
        if attrs.has(tp):
            return self.attrs_class(tp, data, path)
        origin = typing.get_origin(tp)
        if origin in (typing.Union, types.UnionType):
            args = typing.get_args(tp)
            if data is None and type(None) in args:
                return None
            non_none = [a for a in args if a is not type(None)]
            if len(non_none) == 1:
                return self.value(non_none[0], data, path)
        try:
            return CONVERTER.structure(data, tp)
        except Exception as exc:
            self.fail(path, f"{show(data)} is invalid: {_leaf_message(exc)}")
            return None

    def selection(self, kind: str, data: Any, path: str) -> Selection | None:
        if isinstance(data, str):  # shorthand: `engine: vllm`
            data = {"name": data}
        sel = self.attrs_class(EngineConfig if path == "engine" else Selection, data, path)
        if sel is None:
            return None
        if self.pm is None:
            return sel
        from skyrl_core.plugins.manager import UnknownComponentError

        try:
            spec = self.pm.spec(kind, sel.name)
        except UnknownComponentError as exc:
            from skyrl_core.plugins.installation import provider_hint

            title = exc.args[0].split(" is not a registered ", 1)[1].split(";", 1)[0]
            hint = provider_hint(kind, sel.name)
            if hint:  # a known component whose package is not installed: say what to install
                self.fail(_join(path, "name"), f"{show(sel.name)} is {hint}, which is not installed")
                return None
            self.fail(_join(path, "name"), f"{show(sel.name)} is not a registered {title}",
                      tuple(exc.allowed), suggest(sel.name, exc.allowed))
            return None
        options = self.options(spec, sel.options, _join(path, "options"))
        return None if options is _INVALID else attrs.evolve(sel, options=options)

    def options(self, spec: Any, data: Any, path: str) -> Any:
        try:
            cls = spec.load_options_class()
        except Exception as exc:
            self.fail(path, f"cannot load the options class {spec.options!r} of {spec.kind_title} {spec.name!r}: {exc}")
            return _INVALID
        if cls is None:
            if data:
                self.fail(path, f"{spec.kind_title} {spec.name!r} takes no options, got {show(data)}")
                return _INVALID
            return None
        before = len(self.issues)
        result = self.attrs_class(cls, data, path)
        return _INVALID if len(self.issues) > before else result


_INVALID = object()


def _partial_instance(fields: Mapping[str, Any], kwargs: Mapping[str, Any], name: str, value: Any) -> Any:
    """A stand-in for the instance being built, for validators that compare fields."""
    values: dict[str, Any] = {}
    for other, field in fields.items():
        default = field.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory() if not default.takes_self else attrs.NOTHING
        if default is not attrs.NOTHING:
            values[other] = default
    values.update(kwargs)
    values[name] = value
    return types.SimpleNamespace(**values)


def _first_non_finite(data: Any, path: str) -> tuple[str, float] | None:
    """The key path and value of the first inf or nan float in ``data`` (nested), else None."""
    if isinstance(data, float) and not math.isfinite(data):
        return path, data
    if isinstance(data, Mapping):
        items = ((_join(path, str(k)), v) for k, v in data.items())
    elif isinstance(data, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(data))
    else:
        return None
    for where, value in items:
        found = _first_non_finite(value, where)
        if found is not None:
            return found
    return None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _leaf_message(exc: BaseException) -> str:
    if isinstance(exc, cattrs.BaseValidationError) and exc.exceptions:
        return _leaf_message(exc.exceptions[0])
    return str(exc) or type(exc).__name__


# --- public API ------------------------------------------------------------------------------------


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML config file; a missing or malformed file is a ``ConfigError``."""
    from skyrl_core.config.yaml_limits import MAX_BYTES, YAMLLimitError, load_bounded

    if not os.path.exists(path):
        raise ConfigError([ConfigIssue("", "the file does not exist")], source=path)
    if os.path.isdir(path):
        raise ConfigError([ConfigIssue("", "is a directory; give a YAML config file")], source=path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
        data = load_bounded(raw.decode("utf-8"))
    except OSError as exc:
        raise ConfigError([ConfigIssue("", f"cannot be read: {exc.strerror or exc}")], source=path) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([ConfigIssue("", f"is not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})")],
                          source=path) from None
    except YAMLLimitError as exc:
        raise ConfigError([ConfigIssue("", f"refused: the YAML {exc}")], source=path) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([ConfigIssue("", f"not valid YAML{where}: {getattr(exc, 'problem', exc)}")], source=path) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([ConfigIssue("", f"the top level must be a mapping, got {type(data).__name__}")], source=path)
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"trainer.lr=1e-6"`` -> (["trainer", "lr"], 1e-6). Values are YAML (``[a, b]``, ``true``, ``null``)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError([ConfigIssue("", f"override {text!r} must look like key.path=value")])
    from skyrl_core.config.yaml_limits import YAMLLimitError, load_bounded

    try:
        value = load_bounded(raw) if raw != "" else ""
    except YAMLLimitError as exc:
        raise ConfigError([ConfigIssue(key, f"override value refused: the YAML {exc}")]) from None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of ``data`` with each dotted override set (creating intermediate mappings)."""
    import copy

    out = copy.deepcopy(data)
    for text in overrides:
        keys, value = parse_override(text)
        node = out
        for i, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            elif isinstance(child, str) and ".".join(keys[: i + 1]) in SELECTIONS:
                child = node[key] = {"name": child}
            elif not isinstance(child, dict):
                raise ConfigError([ConfigIssue(".".join(keys[: i + 1]), f"override {text!r} goes below a {type(child).__name__} value")])
            node = child
        node[keys[-1]] = value
    return out


def structure_config(data: dict[str, Any], *, plugin_manager: SkyrlPluginManager | None = None,
                     source: str | None = None) -> Config:
    """Validate plain data into a ``Config``; every problem is reported at once."""
    if plugin_manager is None:
        from skyrl_core.plugins.manager import get_plugin_manager

        plugin_manager = get_plugin_manager()
    walker = _Walker(plugin_manager)
    data = dict(data)
    sections = plugin_manager.registry.entries["config_section"]
    plugin_sections = {name: data.pop(name) for name in list(data) if name in sections}
    raw_selections: dict[str, Any] = {}
    for dotted in SELECTIONS:
        parent, _, leaf = dotted.rpartition(".")
        holder = data.get(parent) if parent else data
        if isinstance(holder, dict) and leaf in holder:
            holder = dict(holder)
            raw_selections[dotted] = holder.pop(leaf)
            if parent:
                data[parent] = holder
            else:
                data = holder
    base = walker.attrs_class(Config, data, "", extra_keys=tuple(sections), hidden=("plugins",))
    chosen: dict[str, Selection | None] = {}
    for dotted, kind in SELECTIONS.items():
        if dotted in raw_selections:
            raw = raw_selections[dotted]
            if isinstance(raw, Mapping) and "name" not in raw:  # `engine.placement=separate` alone: the default's name
                raw = {"name": _default_selection(dotted).name, **raw}
            chosen[dotted] = walker.selection(kind, raw, dotted)
        else:
            default = _default_selection(dotted)
            chosen[dotted] = walker.selection(kind, attrs.asdict(default), dotted)
    plugin_values: dict[str, Any] = {}
    for name, spec_owner in sorted(sections.items()):
        spec = spec_owner[0]
        result = walker.options(spec, plugin_sections.get(name) or {}, name)
        if result is not _INVALID:
            plugin_values[name] = result
    if base is not None:
        _check_loggers(walker, base.trainer.loggers, plugin_manager)
    if walker.issues or base is None:
        raise ConfigError(walker.issues or [ConfigIssue("", "invalid config")], source)
    try:  # AlgorithmConfig checks its settings against the selected loss's options
        algorithm = attrs.evolve(base.algorithm, policy_loss=chosen["algorithm.policy_loss"],
                                 advantage=chosen["algorithm.advantage"])
    except ValueError as exc:
        raise ConfigError([ConfigIssue("algorithm", str(exc))], source) from None
    return attrs.evolve(
        base,
        engine=chosen["engine"],
        backend=chosen["backend"],
        environment=chosen["environment"],
        algorithm=algorithm,
        plugins=plugin_values,
    )


def _check_loggers(walker: _Walker, names: tuple[str, ...], plugin_manager: SkyrlPluginManager) -> None:
    """``trainer.loggers``: registered names (``skyrl_register_loggers``), each at most once."""
    registered = plugin_manager.registry.names("logger")
    for i, name in enumerate(names):
        if name not in registered:
            walker.fail(f"trainer.loggers[{i}]", f"{show(name)} is not a registered logger",
                        tuple(registered), suggest(name, registered))
        elif name in names[:i]:
            walker.fail(f"trainer.loggers[{i}]", f"{show(name)} is listed twice")


def _default_selection(dotted: str) -> Selection:
    if dotted.startswith("algorithm."):
        from skyrl_core.config.schema import AlgorithmConfig

        return getattr(AlgorithmConfig(), dotted.split(".", 1)[1])
    field = attrs.fields_dict(Config)[dotted]
    return field.default.factory()


def load_config(path: str | None, overrides: list[str] | None = None, *,
                plugin_manager: SkyrlPluginManager | None = None) -> Config:
    """The validated config from a YAML file (or nothing) plus dotted overrides. Relative paths
    are made absolute: the file's against its directory, the overrides' against the current one
    (see ``skyrl_core.config.paths``)."""
    from skyrl_core.config.paths import resolve_paths

    data = load_yaml(path) if path else {}
    data = apply_overrides(data, overrides or [])
    cfg = structure_config(data, plugin_manager=plugin_manager, source=path)
    config_dir = os.path.dirname(os.path.abspath(path)) if path else os.getcwd()
    typed = [".".join(parse_override(text)[0]) for text in overrides or []]
    return resolve_paths(cfg, config_dir=config_dir, overridden=typed)


def structure_options(spec: Any, options: Mapping[str, Any], path: str) -> Any:
    """``options`` structured with ``spec``'s options class (None if it has none); ``ConfigError`` if invalid."""
    walker = _Walker()
    result = walker.options(spec, dict(options), path)
    if walker.issues:
        raise ConfigError(walker.issues)
    return result


def unstructure(value: Any) -> Any:
    """Plain data (for YAML/JSON) from a config or any attrs value."""
    if attrs.has(type(value)):
        return {f.name: unstructure(getattr(value, f.name)) for f in attrs.fields(type(value))}
    if isinstance(value, dict):
        return {k: unstructure(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [unstructure(v) for v in value]
    return value
