"""Strict conversion between plain data (YAML, JSON, msgpack) and dataclasses.

``build(cls, data)`` checks every key and type against the dataclass annotations and
raises ``ConfigError`` (or the ``error`` class given: the run record and the call
contracts pass their own) naming the dotted path, the bad value and what would be valid;
unknown keys get the closest valid name. ``to_data(obj)`` is its inverse. A field whose
YAML key is not a Python identifier (``async``) declares it with ``metadata={"key": ...}``.

Types understood: bool, int, float, str, None, ``Any`` (taken as it is), Literal, enums
(by value), unions, ``list[X]`` and ``tuple[X, ...]`` (both built as tuples),
``dict[str, X]``, nested dataclasses, and any other class as it is (``np.ndarray`` in a
message: an instance of it, taken without a copy; its dataclass checks the rest).

User input (configs, sweep files) is built with ``finite=True``: NaN and the infinities
are refused in every float. Records and messages keep them (a diverged loss, the grad norm
of a skipped step). Ranges declared on fields (``bounded``, ``check_bounds``) live here
too, and so does how a value reads in a one-line error (``show``, ``escaped``); the checks
of text, command-line arguments and input files are ``core.config.inputs``.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import re
import reprlib
import types
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from core.errors import ConfigError

ErrorType = type[Exception]

T = TypeVar("T")
_MISSING = object()
_SHOW_MAX = 80
_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlevel = _SHOW_MAX, _SHOW_MAX, 3
# C0 and C1 controls (newline, carriage return, NUL, escape, ...) and the Unicode line and
# paragraph separators: each can end or corrupt a line of the batch script or a log.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def yaml_key(field: dataclasses.Field[Any]) -> str:
    """The key a field has in YAML (its name unless metadata says otherwise)."""
    return str(field.metadata.get("key", field.name))


def join_path(path: str, key: str) -> str:
    """``path.key``, or ``key`` at the top."""
    return f"{path}.{key}" if path else key


def show(value: Any) -> str:
    """``repr(value)`` cut to a readable length (nested values elided), for one-line error messages."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # an integer beyond Python's digit limit for str()
        return f"an integer of about {value.bit_length() * 3 // 10} digits"
    return text if len(text) <= _SHOW_MAX else text[: _SHOW_MAX - 3] + "..."


def control_char(text: str) -> str | None:
    """The first control character of ``text`` as an escape (``\\n``, ``\\x00``), or None."""
    m = _CONTROL.search(text)
    return None if m is None else repr(m.group())[1:-1]


def escaped(text: str) -> str:
    """``text`` with its control characters written as escapes (``\\n``): safe on one line."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


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
    if isinstance(tp, type) and tp.__module__ != "builtins" and not issubclass(tp, enum.Enum):
        return f"a {tp.__module__.split('.')[0]}.{tp.__name__}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _as_float(value: Any) -> float | None:
    """``value`` as a float if it is a number or a string spelling one, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:  # an integer beyond every float
            return math.inf
    if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _not_finite(path: str, value: Any) -> str:
    return f"{path}: {show(value)} is not a finite number; give a finite value"


def _convert(tp: Any, value: Any, path: str, error: ErrorType = ConfigError, finite: bool = False) -> Any:
    if tp is Any:
        return value
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        for option in get_args(tp):
            try:
                return _convert(option, value, path, error, finite)
            except error:
                if option is float and finite and (number := _as_float(value)) is not None \
                        and not math.isfinite(number):
                    raise
        raise error(f"{path}: {show(value)} is not {_describe(tp)}")
    if origin is Literal:
        if value in get_args(tp) and type(value) in {type(a) for a in get_args(tp)}:
            return value
        raise error(f"{path}: {show(value)} is not {_describe(tp)}")
    if tp is type(None):
        if value is None:
            return None
        raise error(f"{path}: {show(value)} is not null")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise error(f"{path}: {show(value)} is not {_describe(tp)}")
        item = get_args(tp)[0]
        return tuple(_convert(item, v, f"{path}[{i}]", error, finite) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise error(f"{path}: {show(value)} is not a mapping")
        _, val_tp = get_args(tp)
        return {str(k): _convert(val_tp, v, join_path(path, str(k)), error, finite) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, error=error, finite=finite)  # type: ignore[arg-type]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        try:
            return tp(value)
        except ValueError:
            raise error(f"{path}: {show(value)} is not {_describe(tp)}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = _as_float(value)
        if number is not None:
            if finite and not math.isfinite(number):
                raise error(_not_finite(path, value))
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and tp.__module__ != "builtins":  # a value class of its own (a numpy array)
        if isinstance(value, tp):
            return value
    else:  # pragma: no cover - a schema bug, not user input
        raise TypeError(f"unsupported schema type {tp!r} at {path}")
    raise error(f"{path}: {show(value)} is not {_describe(tp)}")


def convert(tp: Any, value: Any, path: str, *, error: ErrorType = ConfigError, finite: bool = False) -> Any:
    """``value`` checked (and built) against the type annotation ``tp``; bad data raises ``error``.

    ``finite``: refuse NaN and the infinities in floats (user input).
    """
    return _convert(tp, value, path, error, finite)


@functools.cache
def _schema_of(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field[Any]]]:
    return get_type_hints(cls), {yaml_key(f): f for f in dataclasses.fields(cls)}


def build(cls: type[T], data: Any, path: str = "", *, error: ErrorType = ConfigError, finite: bool = False) -> T:
    """Build dataclass ``cls`` from a mapping, strictly; bad data raises ``error``.

    ``finite``: refuse NaN and the infinities in floats (user input).
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise error(f"{path or 'config'}: expected a mapping, got {show(data)}")
    hints, fields = _schema_of(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean {join_path(path, close[0])!r}?" if close else ""
            valid = ", ".join(sorted(fields))
            raise error(f"{join_path(path, show(key) if not isinstance(key, str) else escaped(key))}: unknown key{hint} "
                        f"(valid keys: {valid})")
    kwargs = {}
    for key, field in fields.items():
        if key in data:
            kwargs[field.name] = _convert(hints[field.name], data[key], join_path(path, key), error, finite)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING and field.init:
            raise error(f"{join_path(path, key)}: missing (required)")
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
        p = join_path(prefix, yaml_key(f))
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(field_paths(tp, p))  # type: ignore[arg-type]
        else:
            out.append(p)
    return out


def set_dotted(data: dict[str, Any], parts: list[str], value: Any, *, where: str) -> None:
    """Set ``data[a][b]...[z] = value``, creating sections; ``where`` names it in errors."""
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{where}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


# --- ranges -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Range:
    """The numbers a field takes: above ``gt`` or from ``ge``, below ``lt`` or up to ``le`` (``why`` says why)."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    why: str = ""


def bounded(default: Any, **limits: Any) -> Any:
    """A dataclass field whose number ``check_bounds`` keeps in ``Range(**limits)`` (None and strings pass)."""
    return dataclasses.field(default=default, metadata={"range": Range(**limits)})


def _bound(n: float) -> str:
    """A bound as users read and type it: 65535, 1_048_576, 1e+07, 1e-08."""
    return (f"{n:_}" if n >= 10**6 else str(n)) if isinstance(n, int) else f"{n:g}"


def range_problem(value: float, rng: Range) -> str | None:
    """What is wrong with ``value`` for ``rng`` (``must be > 0``), or None when it fits."""
    for limit, sign, fits in ((rng.gt, ">", value > (rng.gt or 0)), (rng.ge, "≥", value >= (rng.ge or 0)),
                              (rng.lt, "<", value < (rng.lt or 0)), (rng.le, "≤", value <= (rng.le or 0))):
        if limit is not None and not fits:
            return f"must be {sign} {_bound(limit)}" + (rng.why if sign in "<≤" else "")
    return None


def check_bounds(obj: Any, section: str) -> None:
    """Check every ``bounded`` field of the dataclass ``obj``; the error names ``section.key``."""
    for f in dataclasses.fields(obj):
        rng, value = f.metadata.get("range"), getattr(obj, f.name)
        if rng is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
            problem = range_problem(value, rng)
            if problem is not None:
                raise ConfigError(f"{join_path(section, yaml_key(f))}: {show(value)} {problem}")
