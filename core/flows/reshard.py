"""Moving a model's weights from one layout to another, planned by the controller.

The same geometry as a checkpoint loaded into another layout, without the file: each rank
of the source group says which slices of which global tensors it owns (``TensorSlice``,
only the first replica of each), each rank of the target group which slices it needs (all
of its parameters: every replica receives). ``plan`` intersects them into ``Piece``s, one
rectangular box of one tensor from one rank to another, ordered and cut into buckets of at
most ``bucket_bytes`` (a piece larger than a bucket is split along its first axis). Every
rank executes its own pieces bucket by bucket, so no rank ever holds more than one bucket
of transfer buffers beside its model.

This module is pure Python (no numpy): the controller computes the plan once per pair of
layouts and sends each rank its part.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from core.checkpoint.spec import TensorSlice
from core.errors import LayoutError

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True, kw_only=True)
class Piece:
    """``shape`` elements at global ``offset`` of tensor ``name``, from rank ``src`` to ``dst``."""

    bucket: int
    name: str
    src: int
    dst: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int
    dtype: str  # the target's: what travels
    direct: bool = False  # contiguous in both ranks' parameters, one dtype: sent and received in place


def _overlap(a: TensorSlice, b: TensorSlice) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(x, y) for x, y in zip(a.offset, b.offset, strict=True))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a.offset, a.shape, b.offset, b.shape, strict=True))
    if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True))


def _split(offset: tuple[int, ...], shape: tuple[int, ...], row_bytes: int,
           limit: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offset, shape)`` cut along its first axis into boxes of at most ``limit`` bytes."""
    rows = max(1, limit // max(1, row_bytes))
    return [((offset[0] + i, *offset[1:]), (min(rows, shape[0] - i), *shape[1:])) for i in range(0, shape[0], rows)]


def _contiguous(s: TensorSlice, offset: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether the box is one contiguous run of the slice's (row-major) elements."""
    axes = [i for i, (n, m) in enumerate(zip(shape, s.shape, strict=True)) if n != m]
    return not axes or all(shape[i] == 1 for i in range(axes[0])) and all(
        shape[i] == s.shape[i] for i in range(axes[0] + 1, len(shape)))


def _pieces(src_slices: Sequence[tuple[int, TensorSlice]], dst: int, want: TensorSlice) -> list[tuple[int, tuple, tuple, TensorSlice]]:
    found: list[tuple[int, tuple, tuple, TensorSlice]] = []
    covered = 0
    for src, have in src_slices:
        if have.global_shape != want.global_shape:
            raise LayoutError(f"weight sync: {want.name} is {want.global_shape} on target rank {dst} but "
                              f"{have.global_shape} on source rank {src}: the two groups hold different models")
        box = _overlap(have, want)
        if box is not None:
            found.append((src, *box, have))
            covered += math.prod(box[1])
    if covered != math.prod(want.shape):
        raise LayoutError(f"weight sync: the source group holds {covered} of the {math.prod(want.shape)} elements "
                          f"of {want.name} at {want.offset} that target rank {dst} needs")
    return found


def plan(sources: Mapping[int, Sequence[TensorSlice]], targets: Mapping[int, Sequence[TensorSlice]], *,
         bucket_bytes: int) -> list[Piece]:
    """Every piece that moves the sources' weights into the targets' slices, in buckets.

    ``sources``: global rank → the slices it owns (one owner per element); ``targets``:
    global rank → the slices it needs. A target slice nobody owns, or a tensor with
    another global shape, raises ``LayoutError`` naming it.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    by_name: dict[str, list[tuple[int, TensorSlice]]] = {}
    for src, slices in sorted(sources.items()):
        for s in slices:
            by_name.setdefault(s.name, []).append((src, s))
    pieces: list[Piece] = []
    bucket, used = 0, 0
    for dst, wants in sorted(targets.items()):
        for want in wants:
            if want.name not in by_name:
                raise LayoutError(f"weight sync: target rank {dst} needs {want.name}, which no source rank holds")
            item = ITEMSIZE[want.dtype]
            for src, offset, shape, have in _pieces(by_name[want.name], dst, want):
                row = item * math.prod(shape[1:])
                for off, shp in _split(offset, shape, row, bucket_bytes):
                    nbytes = item * math.prod(shp)
                    if used and used + nbytes > bucket_bytes:
                        bucket, used = bucket + 1, 0
                    pieces.append(Piece(bucket=bucket, name=want.name, src=src, dst=dst, offset=off, shape=shp,
                                        nbytes=nbytes, dtype=want.dtype,
                                        direct=have.dtype == want.dtype and _contiguous(have, off, shp)
                                        and _contiguous(want, off, shp)))
                    used += nbytes
    return pieces


def for_rank(pieces: Sequence[Piece], rank: int) -> list[Piece]:
    """The pieces ``rank`` sends or receives, in plan order (both ends agree on it)."""
    return [p for p in pieces if rank in (p.src, p.dst)]
