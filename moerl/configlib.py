"""Generic config machinery: validation helpers and dict <-> dataclass conversion with CLI overrides.

``moerl.config`` defines the components; this module knows nothing about them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config value or key is invalid; the message names the field and what is allowed."""


def check_range(
    name: str,
    value: float,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> None:
    """Raise ``ConfigError`` unless ``lo <= value <= hi`` (or strict where ``*_open``) and ``value`` is
    finite: NaN and +-inf are refused whatever the bounds (no config field gives inf a meaning).

    Args:
        name: dotted field name used in the message, e.g. ``"trainer.lr"``.
        value: the value to check.
        lo, hi: bounds; ``None`` means unbounded on that side.
    """
    check_finite(name, value)
    bad = (lo is not None and (value <= lo if lo_open else value < lo)) or (
        hi is not None and (value >= hi if hi_open else value > hi)
    )
    if bad:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        rng = f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"
        raise ConfigError(f"{name}={value!r} is out of range; allowed: {rng}")


def check_finite(name: str, value: Any) -> None:
    """Raise ``ConfigError`` if the float ``value`` is NaN or +-inf (other types pass)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}={value!r} is not a finite number")


def yaml_problem(e: yaml.YAMLError) -> str:
    """``":LINE:COL: not valid YAML (problem)"`` of a PyYAML error (the position only when it has one),
    to follow the name of the file that held the text."""
    mark = getattr(e, "problem_mark", None)
    where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
    return f"{where}: not valid YAML ({getattr(e, 'problem', None) or e})"


def check_choice(name: str, value: Any, choices: typing.Iterable[Any]) -> None:
    """Raise ``ConfigError`` unless ``value`` is one of ``choices``."""
    choices = list(choices)
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not allowed; choose one of {choices}")


# ----------------------------------------------------------------------------------------------
# Loading


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown_key_error(prefix: str, key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {sorted(valid)}"
    return ConfigError(f"unknown config key '{prefix}{key}'{hint}")


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """Convert a YAML value to the field type ``tp`` or raise ConfigError naming the field."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(name, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{name}={value!r} has the wrong type")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            value = [value]
        (elem,) = typing.get_args(tp)[:1]
        return tuple(_coerce(f"{name}[]", v, elem) for v in value)
    if dataclasses.is_dataclass(tp):
        if value is None:  # YAML null (``--set model=null``, ``model: ~``) would silently mean "all defaults"
            raise ConfigError(
                f"{name}: a section cannot be null; set its fields instead ({name}.<field>=...)"
            )
        return from_dict(tp, value, prefix=f"{name}.")
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        check_finite(name, float(value))  # every float field: NaN/inf would only fail deep in a run
        return float(value)
    if tp is float and isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
        else:
            check_finite(name, number)
            return number
    if tp is int and isinstance(value, (str, float)) and not isinstance(value, bool):
        number = _integral(value)  # 1e3 (YAML 1.1 reads it as a string), 1000.0
        if number is not None:
            return number
    if tp in (int, float, str, bool) and not (
        isinstance(value, tp) and not (tp is int and isinstance(value, bool))
    ):
        raise ConfigError(f"{name}={value!r} has type {type(value).__name__}; expected {tp.__name__}")
    return value


def _integral(value: str | float) -> int | None:
    """``value`` as an int when it is a finite number with no fractional part (``"1e3"``, ``1000.0``)."""
    try:
        number = float(value)
    except ValueError:
        return None
    return int(number) if math.isfinite(number) and number.is_integer() else None


def from_dict(cls: type, data: dict[str, Any] | None, *, prefix: str = "") -> Any:
    """Build the dataclass ``cls`` from a nested dict, rejecting unknown keys with a suggestion.

    Raises:
        ConfigError: unknown key, wrong type, or a value that the component's validation refuses.
    """
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"'{prefix.rstrip('.') or 'config'}' must be a mapping, got {data!r}")
    types_ = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in types_:
            raise _unknown_key_error(prefix, key, list(types_))
        kwargs[key] = _coerce(f"{prefix}{key}", value, types_[key])
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - from_dict only passes known fields
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from e


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts/lists (tuples become lists), ready for YAML."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return plain(cfg)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.field=value`` overrides (value parsed as YAML) to a nested dict in place; a mapping
    given for a section is merged into it (``--set 'model={hidden_size: 32}'`` changes that field only).

    Raises:
        ConfigError: an override without ``=``, or whose value is not valid (safe) YAML.
    """
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like section.field=value")
        key, raw = item.split("=", 1)
        if not key.strip():
            raise ConfigError(f"override '{item}' names no field: it must look like section.field=value")
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a section")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:  # also a tag such as !!python/object, which safe_load refuses
            problem = getattr(e, "problem", None) or e
            raise ConfigError(f"--set {item!r}: the value {raw!r} is not valid YAML ({problem})") from None
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
            _merge(node[parts[-1]], value)  # --set 'model={hidden_size: 32}' keeps the section's other fields
        else:
            node[parts[-1]] = value
    return data


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    """Deep-merge mapping ``new`` into ``into`` in place (``new`` wins on a leaf)."""
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
