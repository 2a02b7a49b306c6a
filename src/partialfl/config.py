"""Configuration as data: frozen dataclasses loaded from TOML (or dicts) and validated on load.

:func:`from_dict` builds any (nested) frozen dataclass from a mapping; an unknown key, a value
of the wrong type or a bad choice gives a :class:`ConfigError` that names the key (with its
dotted path) and what is allowed. :func:`apply_overrides` applies ``a.b=value`` strings (the
command line's ``--set``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or not allowed."""


def did_you_mean(value: object, allowed) -> str:
    """``" (did you mean 'x'?)"`` naming the entry of ``allowed`` closest to ``value`` (by
    :func:`difflib.get_close_matches`), or ``""`` when none is close."""
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_key_error(key: str, allowed, where: str = "") -> ConfigError:
    """The error for a key that is not allowed: its dotted name quoted as a whole, the closest
    allowed key (if any), then every allowed key, e.g. ``unknown key 'algorithm.tua' (did you
    mean 'tau'?); allowed keys in [algorithm]: name, tau``."""
    dotted = f"{where}.{key}" if where else key
    table = f" in [{where}]" if where else ""
    return ConfigError(f"unknown key {dotted!r}{did_you_mean(key, allowed)}; allowed keys"
                       f"{table}: {', '.join(sorted(allowed))}")


def check_choice(key: str, value, allowed) -> None:
    """Raise a :class:`ConfigError` naming ``key``, the closest allowed value and all of them
    unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not allowed{did_you_mean(value, allowed)}; "
                          f"allowed: {', '.join(map(str, allowed))}")


#: how a TOML file sets an optional (``X | None``, X not a string) value to None
NONE = "none"


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp, where: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        if value == NONE and type(None) in args and str not in args and Any not in args:
            return None  # TOML has no null: "none" sets an optional value to None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
                if a in (int, float) and isinstance(value, int | float) \
                        and not isinstance(value, bool):
                    raise  # a number for a numeric type: its reason (NaN, range) is clearest
        if len(errors) == 1:  # one candidate type (X | None): its own reason is clearest
            raise ConfigError(errors[0])
        allowed = " or ".join(_type_name(a) for a in args)
        raise ConfigError(f"{where}: expected {allowed}, got {value!r}")
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(
                f"{where}: {value!r} is not allowed{did_you_mean(value, allowed)}; allowed: "
                f"{', '.join(map(repr, allowed))}"
            )
        return value
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (inner, *rest) = typing.get_args(tp) or (Any,)
        return tuple(_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp) or origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        if not dataclasses.is_dataclass(tp):  # a table of keyword arguments: string keys
            bad = next((k for k in value if not isinstance(k, str)), None)
            if bad is not None:
                raise ConfigError(f"{where}: keys must be strings, got {bad!r}")
            return dict(value)
        return from_dict(tp, value, where)
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if not -(2 ** 63) <= value < 2 ** 63:
            raise ConfigError(f"{where}: {value} is out of range (integers must lie in "
                              "[-2^63, 2^63))")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, validating keys and types recursively.

    A field with ``metadata["parse"]`` is read by that function ``parse(value, key)`` (a
    registry component: :func:`partialfl.spec.comp`). A
    class with ``__options_of__ = (name_field, kind)`` takes the keys it does not define as
    the options of the component its ``name_field`` names (e.g. ``[method] algorithm =
    "ditto"`` with ``lam = 0.1``), validated by that entry's ``Options`` into its
    ``options`` field. ``__post_init__`` validation errors are re-raised as
    :class:`ConfigError` with the path.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or cls.__name__}: expected a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    flat = getattr(cls, "__options_of__", None)
    kwargs: dict[str, Any] = {}
    if flat is not None and unknown:
        if "options" in data:
            raise unknown_key_error(unknown[0], fields, where)
        kwargs["options"] = {k: data[k] for k in unknown}
        unknown = []
    if unknown:
        raise unknown_key_error(unknown[0], fields, where)
    for name, value in data.items():
        if name not in fields:
            continue
        key = f"{where}.{name}" if where else name
        f = fields[name]
        parse = f.metadata.get("parse")
        kwargs[name] = parse(value, key) if parse else _coerce(value, hints[name], key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where or cls.__name__}: {e}") from e


def to_dict(obj) -> dict[str, Any]:
    """The plain-dict form of a config dataclass (for logging next to results and for
    :func:`from_dict` to read back): components as ``{name = …, …options}``, a class with
    ``__options_of__`` with its options flattened into its own table; a value set to None
    where the default is not None as ``"none"`` (TOML has no null)."""
    out: dict[str, Any] = {}
    flat = getattr(type(obj), "__options_of__", None)
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if flat is not None and f.name == "options":
            out.update(_plain(v) if v is not None else {})
            continue
        if v is None and f.default is not None and f.default is not dataclasses.MISSING:
            v = NONE
        out[f.name] = _plain(v)
    return out


def _plain(v: Any) -> Any:
    if hasattr(v, "to_dict") and dataclasses.is_dataclass(v) and not isinstance(v, type):
        return v.to_dict()
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return to_dict(v)
    if isinstance(v, tuple | list):
        return [_plain(x) for x in v]
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    return v


def load_toml(path: str | Path) -> dict[str, Any]:
    """The mapping in the TOML file ``path``; a :class:`ConfigError` if it is missing or invalid."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {path} is not a file (a folder?); give a .toml file")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
    except RecursionError:
        raise ConfigError(f"config file {path} is nested too deeply to be a config") from None


def _parse_scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare string
    except RecursionError:  # (a traceback before, as in load_toml)
        raise ConfigError(f"override value {text[:40]!r}... is nested too deeply") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (value parsed as TOML, else a string)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} is not of the form key=value")
        key, text = ov.split("=", 1)
        parts = key.strip().split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {ov!r}: {p!r} is not a table")
        node[parts[-1]] = _parse_scalar(text.strip())
    return out


def deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` merged in recursively (tables merged key by key, other values
    replaced); neither input is changed."""
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(
            out.get(k), dict) else v
    return out



def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()
                               if x is not None) + "}"
    return repr(v)


def toml_text(d: Mapping[str, Any], prefix: str = "") -> str:
    """``d`` as TOML (None values left out, nested tables as ``[a.b]`` sections); what
    :func:`load_toml` reads back to ``d`` (without its None values)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in d.items()
             if v is not None and not isinstance(v, Mapping)]
    for k, v in d.items():
        if isinstance(v, Mapping):
            name = f"{prefix}.{k}" if prefix else k
            lines += ["", f"[{name}]", toml_text(v, name)]
    return "\n".join(lines).replace("\n\n\n", "\n\n")
