"""What a rank hands the checkpoint writer: global names and the slices it owns.

This module has no third-party imports: the controller, the launcher and the workers all
use it. A tensor is identified by its global name and global shape; a rank owns the
rectangular slice ``[offset[i] : offset[i] + shape[i]]`` in every dimension.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, kw_only=True)
class TensorSlice:
    """One rectangular slice of a global tensor."""

    name: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, e.g. "float32"

    def __post_init__(self) -> None:
        if not (len(self.global_shape) == len(self.offset) == len(self.shape)):
            raise ValueError(f"{self.name}: rank mismatch {self.global_shape} {self.offset} {self.shape}")
        for g, o, s in zip(self.global_shape, self.offset, self.shape, strict=True):
            if o < 0 or s < 0 or o + s > g:
                raise ValueError(f"{self.name}: slice {self.offset}+{self.shape} outside {self.global_shape}")


class LiveArray(Protocol):
    """State a checkpoint reads when it writes, not when it is asked for (a live tensor).

    A task may export its live training state this way instead of copying it: a
    synchronous save writes ``current()`` at once; an asynchronous one lets its writer
    thread ``snapshot_into`` reusable buffers while training goes on, and the task waits
    for that snapshot (``CheckpointService.fence``) before it next changes the state.
    It may also offer ``host_view()`` and ``snapshot_flat_into(start, out)``, with which a
    synchronous save streams it piece by piece (core.checkpoint.stream).
    """

    shape: tuple[int, ...]  # the slice's shape

    def snapshot_into(self, out: Any) -> None:
        """Copy the current value into ``out`` (an array of the slice's shape and dtype)."""

    def current(self) -> Any:
        """The current value as an array of the slice's shape (a view where it can be)."""


def current(data: Any) -> Any:
    """``data`` as an array: a LiveArray's current value, or ``data`` itself."""
    return data.current() if hasattr(data, "snapshot_into") else data


@dataclass(frozen=True, kw_only=True)
class SliceAck:
    """Where a rank wrote one slice: a dataset of its shard file."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dataset: str


@dataclass(frozen=True, kw_only=True)
class ShardAck:
    """A rank's acknowledgement of one save: its shard file is durable, with this size and
    checksum, holding these slices. The controller commits a checkpoint from the acks of
    every rank (``core.checkpoint.manifest.commit``)."""

    file: str
    rank: int
    size_bytes: int
    checksum: str
    slices: tuple[SliceAck, ...] = ()


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The flat range ``[start, end)`` of a row-major array of ``shape`` as rectangular boxes.

    Returns ``(offset, box_shape, flat_start)`` per box, in flat order; each box is a
    contiguous run of the range (so its data is a view of a flat buffer), and together they
    cover the range exactly. A distributed optimizer owns flat ranges of each parameter;
    as boxes they are ordinary slices of the global tensor. At most ``2 * len(shape) - 1`` boxes.
    """
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,) * len(shape), (end - start,) * len(shape), start)]
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner  # the rows the range touches
    if first == last:  # within one row: recurse into it
        return [((first, *o), (1, *s), first * inner + f)
                for o, s, f in flat_range_boxes(shape[1:], start - first * inner, end - first * inner)]
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    if start % inner:  # the tail of a first, partial row
        out += flat_range_boxes(shape, start, (first + 1) * inner)
        first += 1
    full_end = last + 1 if end % inner == 0 else last  # rows covered whole
    if full_end > first:
        out.append(((first, *(0,) * (len(shape) - 1)), (full_end - first, *shape[1:]), first * inner))
    if end % inner:  # the head of a last, partial row
        out += flat_range_boxes(shape, last * inner, end)
    return out
