"""Strict conversion between plain data (YAML, JSON, msgpack) and dataclasses.

``build(cls, data)`` checks every key and type against the dataclass annotations and
raises ``ConfigError`` (or the ``error`` class given: the run record and the call
contracts pass their own) naming the dotted path, the bad value and what would be valid;
unknown keys get the closest valid name. ``to_data(obj)`` is its inverse. A field whose
YAML key is not a Python identifier (``async``) declares it with ``metadata={"key": ...}``.

Types understood: bool, int, float, str, None, ``Any`` (taken as it is), Literal, enums
(by value), unions, ``list[X]`` and ``tuple[X, ...]`` (both built as tuples),
``dict[str, X]`` and nested dataclasses.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import types
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from core.errors import ConfigError

ErrorType = type[Exception]

T = TypeVar("T")
_MISSING = object()


def yaml_key(field: dataclasses.Field[Any]) -> str:
    """The key a field has in YAML (its name unless metadata says otherwise)."""
    return str(field.metadata.get("key", field.name))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin in (list, tuple):
        return f"a list of {_describe(get_args(tp)[0])}"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " or ".join(repr(m.value) for m in tp)
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _convert(tp: Any, value: Any, path: str, error: ErrorType = ConfigError) -> Any:
    if tp is Any:
        return value
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        for option in get_args(tp):
            try:
                return _convert(option, value, path, error)
            except error:
                pass
        raise error(f"{path}: {value!r} is not {_describe(tp)}")
    if origin is Literal:
        if value in get_args(tp) and type(value) in {type(a) for a in get_args(tp)}:
            return value
        raise error(f"{path}: {value!r} is not {_describe(tp)}")
    if tp is type(None):
        if value is None:
            return None
        raise error(f"{path}: {value!r} is not null")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise error(f"{path}: {value!r} is not {_describe(tp)}")
        item = get_args(tp)[0]
        return tuple(_convert(item, v, f"{path}[{i}]", error) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise error(f"{path}: {value!r} is not a mapping")
        _, val_tp = get_args(tp)
        return {str(k): _convert(val_tp, v, _join(path, str(k)), error) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, error=error)  # type: ignore[arg-type]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        try:
            return tp(value)
        except ValueError:
            raise error(f"{path}: {value!r} is not {_describe(tp)}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a schema bug, not user input
        raise TypeError(f"unsupported schema type {tp!r} at {path}")
    raise error(f"{path}: {value!r} is not {_describe(tp)}")


def convert(tp: Any, value: Any, path: str, *, error: ErrorType = ConfigError) -> Any:
    """``value`` checked (and built) against the type annotation ``tp``; bad data raises ``error``."""
    return _convert(tp, value, path, error)


@functools.cache
def _schema_of(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field[Any]]]:
    return get_type_hints(cls), {yaml_key(f): f for f in dataclasses.fields(cls)}


def build(cls: type[T], data: Any, path: str = "", *, error: ErrorType = ConfigError) -> T:
    """Build dataclass ``cls`` from a mapping, strictly; bad data raises ``error``."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise error(f"{path or 'config'}: expected a mapping, got {data!r}")
    hints, fields = _schema_of(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean {_join(path, close[0])!r}?" if close else ""
            valid = ", ".join(sorted(fields))
            raise error(f"{_join(path, str(key))}: unknown key{hint} (valid keys: {valid})")
    kwargs = {}
    for key, field in fields.items():
        if key in data:
            kwargs[field.name] = _convert(hints[field.name], data[key], _join(path, key), error)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING and field.init:
            raise error(f"{_join(path, key)}: missing (required)")
    try:
        return cls(**kwargs)
    except (ConfigError, error):
        raise
    except TypeError as exc:  # pragma: no cover - a schema bug: required fields are checked above
        raise error(f"{path or 'config'}: {exc}") from None


def to_data(obj: Any) -> Any:
    """Inverse of ``build``: plain dicts, lists and scalars with YAML keys."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {yaml_key(f): to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_data(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_data(v) for k, v in obj.items()}
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj


def field_paths(cls: type, prefix: str = "") -> list[str]:
    """Every dotted path the schema accepts (for error hints)."""
    out: list[str] = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        p = _join(prefix, yaml_key(f))
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(field_paths(tp, p))  # type: ignore[arg-type]
        else:
            out.append(p)
    return out

