"""Rows of different lengths as two numpy arrays: the RL calls' token rows and per-token numbers.

    Ragged(values=[5 6 7 8 9 | 5 6 7], lengths=[5, 3])   row 0 is values[0:5], row 1 values[5:8]

On the wire both arrays travel as side frames (core.wire.protocol: zero-copy, one
``np.frombuffer`` each on the receiver), so a request of 64 rows of 5,120 tokens costs a
few header bytes to encode and a length sum to check, where a tuple of Python numbers per
token cost seconds. Token rows are int32 (``TOKENS``); per-token numbers (log-probs,
advantages, values, returns) are float32 (``FLOATS``), the precision the workers compute
in. A request names the dtype each of its fields must have (``expect``): a payload of
another dtype, or whose lengths do not add up, is a ``ProtocolError`` naming the field.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.errors import ProtocolError

TOKENS = np.dtype(np.int32)
FLOATS = np.dtype(np.float32)


@dataclass(frozen=True, kw_only=True, eq=False)
class Ragged:
    """``values`` (1-D): every row's items one after another; ``lengths`` (1-D int32): each
    row's count. ``len()`` is the number of rows; rows read as read-only array views."""

    values: np.ndarray
    lengths: np.ndarray

    def __post_init__(self) -> None:
        values, lengths = self.values, self.lengths
        if not (isinstance(values, np.ndarray) and isinstance(lengths, np.ndarray)):
            raise ProtocolError(f"Ragged: values and lengths must be arrays, got {type(values).__name__} and "
                                f"{type(lengths).__name__}")
        if values.ndim != 1 or lengths.ndim != 1:
            raise ProtocolError(f"Ragged: values and lengths must be 1-D, got shapes {values.shape} and {lengths.shape}")
        if lengths.dtype != TOKENS:
            raise ProtocolError(f"Ragged: lengths must be int32, got {lengths.dtype}")
        if lengths.size and int(lengths.min()) < 0:
            raise ProtocolError(f"Ragged: a negative row length {int(lengths.min())}")
        total = int(lengths.sum(dtype=np.int64))
        if total != values.size:
            raise ProtocolError(f"Ragged: the row lengths add up to {total}, there are {values.size} values")

    @classmethod
    def of(cls, rows: Sequence[Sequence[Any] | np.ndarray], dtype: np.dtype[Any] | type) -> Ragged:
        """The rows (sequences of numbers or 1-D arrays) as one ``dtype`` array and their lengths."""
        dtype = np.dtype(dtype)
        lengths = np.fromiter((len(r) for r in rows), dtype=TOKENS, count=len(rows))
        parts = [np.asarray(r, dtype=dtype) for r in rows]
        values = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        return cls(values=values, lengths=lengths)

    @classmethod
    def empty(cls, dtype: np.dtype[Any] | type = FLOATS) -> Ragged:
        """No rows."""
        return cls(values=np.zeros(0, dtype=dtype), lengths=np.zeros(0, dtype=TOKENS))

    def __len__(self) -> int:
        return int(self.lengths.size)

    def __eq__(self, other: object) -> bool:
        """The same rows of the same dtype (exactly: NaN never equals)."""
        if not isinstance(other, Ragged):
            return NotImplemented
        return (self.values.dtype == other.values.dtype and np.array_equal(self.lengths, other.lengths)
                and np.array_equal(self.values, other.values))

    __hash__ = None  # type: ignore[assignment]

    @property
    def offsets(self) -> np.ndarray:
        """Where each row starts in ``values``, and the end: ``len(self) + 1`` int64."""
        out = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out

    def rows(self) -> Iterator[np.ndarray]:
        """Each row as a view of ``values``, in order."""
        return iter(np.split(self.values, self.offsets[1:-1]) if len(self) else ())

    def __iter__(self) -> Iterator[np.ndarray]:
        return self.rows()

    def take(self, index: Sequence[int] | np.ndarray | slice) -> Ragged:
        """The rows at ``index`` (row numbers or a slice), in that order."""
        picked = np.arange(len(self))[index if isinstance(index, slice) else np.asarray(index, dtype=np.int64)]
        lengths = np.ascontiguousarray(self.lengths[picked])
        ends = np.cumsum(lengths, dtype=np.int64)
        # item j of the result: its row's start in ``values`` plus how far it is into its row
        shift = np.repeat(self.offsets[picked] - (ends - lengths), lengths)
        return Ragged(values=self.values[np.arange(int(ends[-1]) if len(ends) else 0) + shift], lengths=lengths)

    def tolist(self) -> list[tuple[Any, ...]]:
        """Each row as a tuple of Python numbers (what a reward function or a JSON line takes)."""
        return [tuple(r.tolist()) for r in self.rows()]

    def expect(self, dtype: np.dtype[Any], where: str) -> None:
        """Refuse (``ProtocolError`` naming ``where``) values of any other dtype."""
        if self.values.dtype != dtype:
            raise ProtocolError(f"{where}: values must be {dtype}, got {self.values.dtype}")


def concat(parts: Sequence[Ragged]) -> Ragged:
    """The rows of ``parts`` one after another (at least one part; all of one dtype)."""
    return Ragged(values=np.concatenate([p.values for p in parts]),
                  lengths=np.concatenate([p.lengths for p in parts]))


def joined(left: Ragged, right: Ragged) -> Ragged:
    """Row ``i`` of ``left`` followed by row ``i`` of ``right`` (a prompt and its response)."""
    if len(left) != len(right):
        raise ValueError(f"{len(left)} rows to join to {len(right)}")
    return Ragged.of([np.concatenate(pair) for pair in zip(left.rows(), right.rows(), strict=True)],
                     np.result_type(left.values, right.values))


def gathered(parts: Sequence[Ragged], rows_of: Sequence[Sequence[int] | np.ndarray]) -> Ragged:
    """One Ragged from ``parts``, part ``k`` holding the whole's rows ``rows_of[k]`` in order
    (each row of the whole in exactly one part): what ``take`` split, put back together."""
    for k, (part, rows) in enumerate(zip(parts, rows_of, strict=True)):
        if len(part) != len(rows):
            raise ValueError(f"part {k} has {len(part)} rows, it should hold {len(rows)}")
    order = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows_of])
    return concat(parts).take(np.argsort(order, kind="stable"))


def matches(rows: Ragged, lengths: np.ndarray, where: str, what: str) -> None:
    """Refuse (naming ``where``) per-token ``rows`` whose row lengths are not ``lengths`` (``what`` names them)."""
    if not np.array_equal(rows.lengths, lengths):
        diff = next((i for i in range(min(len(rows), len(lengths))) if rows.lengths[i] != lengths[i]), None)
        at = (f"row {diff} has {int(rows.lengths[diff])} values for {int(lengths[diff])} {what}"
              if diff is not None else f"{len(rows)} rows for {len(lengths)}")
        raise ProtocolError(f"{where}: {at}")
