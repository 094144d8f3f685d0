"""The checks of user input that the config's dataclasses, the CLI and the sweeps share.

Text: no control characters in a string (``check_text``), nor in any string of a config
(``check_strings``); a run's or sweep's name (``check_name``, ``NAME``). Command-line
arguments: numbers in the same ranges as the config's fields (``arg_number``), text on one
line (``arg_text``). Input files: an existing regular file (``check_file``), the strict
reading of a config or sweep file (``read_text``: a regular file of UTF-8 text, at most
1 MiB), its parser's error on one line (``parse_problem``), a file that sets nothing
(``sets_nothing``) and one whose aliases expand past ``MAX_VALUES`` (``too_many_values``).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.config.schema import ErrorType, Range, control_char, escaped, join_path, range_problem, show, yaml_key
from core.errors import ConfigError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a run's or sweep's name: a folder, a Slurm job
MAX_FILE_BYTES = 1 << 20  # an experiment or sweep file: a few hundred lines
MAX_VALUES = 100_000  # values in one such file once its aliases are expanded


def check_text(path: str, value: str, *, error: ErrorType = ConfigError) -> str:
    """``value`` when it holds no control character, else ``error`` naming ``path``."""
    bad = control_char(value)
    if bad is not None:
        raise error(f"{path}: {show(value)} contains the control character {bad}; "
                    "write the value on one line, without control characters")
    return value


def check_strings(data: Any, path: str, *, error: ErrorType = ConfigError) -> None:
    """``check_text`` on every string (keys included) of a dataclass, mapping or list, recursively."""
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        for f in dataclasses.fields(data):
            check_strings(getattr(data, f.name), join_path(path, yaml_key(f)), error=error)
    elif isinstance(data, dict):
        for key, value in data.items():
            if isinstance(key, str):
                check_text(join_path(path, escaped(key)), key, error=error)
            check_strings(value, join_path(path, escaped(str(key))), error=error)
    elif isinstance(data, (list, tuple)):
        for i, value in enumerate(data):
            check_strings(value, f"{path}[{i}]", error=error)
    elif isinstance(data, str):
        check_text(path, data, error=error)


def arg_number(kind: type[int] | type[float], *, gt: float | None = None, ge: float | None = None,
               le: float | None = None) -> Callable[[str], Any]:
    """An argparse ``type=``: ``kind`` from the text, finite and in range, else ArgumentTypeError."""
    name = "an integer" if kind is int else "a number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{show(text)} is not {name}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{show(text)} is not a finite number; give a finite value")
        problem = range_problem(value, Range(gt=gt, ge=ge, le=le))
        if problem is not None:
            raise argparse.ArgumentTypeError(f"{show(value)} {problem}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def arg_text(text: str) -> str:
    """An argparse ``type=``: ``text`` when it holds no control character."""
    bad = control_char(text)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"{show(text)} contains the control character {bad}; "
                                          "give the value on one line, without control characters")
    return text


def check_name(path: str, name: str, *, error: ErrorType = ConfigError) -> str:
    """``name`` if it can name a folder and a Slurm job (``NAME``), else ``error`` naming ``path``."""
    if not NAME.fullmatch(name):
        raise error(f"{path}: {show(name)} must be 1 to 128 of A-Z a-z 0-9 . _ - starting with a letter "
                    "or digit (it names a folder and a Slurm job)")
    return name


def check_file(path: str, value: str, hint: str, *, error: ErrorType = ConfigError) -> None:
    """Raise ``error`` naming ``path`` unless ``value`` is an existing regular file; ``hint`` is the fix."""
    try:
        found = os.stat(check_text(path, value, error=error))
    except (OSError, ValueError) as exc:
        why = "does not exist" if isinstance(exc, FileNotFoundError) else f"cannot be read ({exc})"
        raise error(f"{path}: {value!r} {why}; {hint}") from None
    if not stat.S_ISREG(found.st_mode):
        raise error(f"{path}: {value!r} is not a file; {hint}")


def read_text(path: str | Path, *, error: ErrorType = ConfigError) -> str:
    """The text of a config or sweep file: a regular file of UTF-8 text, at most 1 MiB; else a
    one-line ``error`` naming the file."""
    p = Path(path)
    try:
        found = os.stat(p)  # before open: opening a FIFO would wait for a writer
        raw = p.read_bytes() if stat.S_ISREG(found.st_mode) and found.st_size <= MAX_FILE_BYTES else b""
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise error(f"{p}: cannot read config ({getattr(exc, 'strerror', None) or exc}); check the path") from None
    if not stat.S_ISREG(found.st_mode):
        raise error(f"{p}: not a regular file; give a YAML file")
    if found.st_size > MAX_FILE_BYTES:
        raise error(f"{p}: {found.st_size} bytes, more than a config holds (1 MiB); check the path")
    if b"\x00" in raw:
        raise error(f"{p}: not UTF-8 text (a NUL byte at offset {raw.index(0)}: UTF-16 or binary?); save it as UTF-8")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{p}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                    "save it as UTF-8") from None


def parse_problem(exc: Exception) -> str:
    """Where and what of a parser's error (yaml's, by its attributes), on one line."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem, context = getattr(exc, "problem", None), getattr(exc, "context", None)
    if mark is not None:
        what = problem or context or "syntax error"
        if problem and context:
            context_mark = getattr(exc, "context_mark", None)
            what += f" ({context}" + (f" at line {context_mark.line + 1})" if context_mark else ")")
        return f" at line {mark.line + 1}, column {mark.column + 1}: {what}"
    character = getattr(exc, "character", None)
    if isinstance(character, int):  # yaml's ReaderError: a character YAML refuses
        where = getattr(exc, "position", "?")
        return f" at character {where}: the control character #x{character:02x} is not allowed; remove it"
    if isinstance(exc, RecursionError):
        return ": nested too deeply"
    if isinstance(exc, ValueError) and "digits" in str(exc):  # Python's limit on the digits of an integer
        return ": a number of more than 4300 digits; use a smaller one"
    return f": {escaped(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)}"


def sets_nothing(data: Any) -> bool:
    """Whether ``data`` is None or a mapping of only such values (a file of comments, ``trainer:``)."""
    return data is None or (isinstance(data, dict) and all(sets_nothing(v) for v in data.values()))


def too_many_values(data: Any, limit: int = MAX_VALUES) -> bool:
    """Whether ``data`` holds more than ``limit`` values, shared ones counted each time (YAML aliases)."""
    stack, count = [data], 0
    while stack and count <= limit:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count > limit
