"""Moving a model's weights from one layout to another, planned by the controller.

The same geometry as a checkpoint loaded into another layout, without the file: each rank
of the source group says which slices of which global tensors it holds (``TensorSlice``,
every replica: data-parallel copies and tensor-parallel copies of a norm alike), each rank of
the target group which slices it needs (all of its parameters: every replica receives).
``plan`` intersects them into ``Piece``s, one rectangular box of one tensor from one rank to
another.

Where several source ranks hold a box (copies), the plan picks one: the target's own rank
when it holds it (a local copy: colocated, the generator's slice in the trainer's process),
else the target's turn among the copies (the k-th target to ask for a box gets the k-th copy:
target replica j from source replica j mod replicas), unless that copy's rank already sends
more than one bucket beyond the least loaded copy's, then the least loaded. So every trainer
replica sends its share, and the choice is a function of the slices alone (deterministic).

Pieces are cut into buckets: a piece larger than a bucket is split along its first axis
longer than 1 (a layer's box: its second), and each bucket holds at most ``bucket_bytes``
sent or received by any one rank (local copies use no transfer buffer). Every rank executes its own pieces bucket by bucket, so no rank ever
holds more than one bucket of transfer buffers beside its model, and one bucket's transfers
between different pairs of ranks run at the same time.

This module is pure Python (no numpy): the controller computes the plan once per pair of
layouts and sends each rank its part.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from core.checkpoint.spec import TensorSlice
from core.errors import LayoutError

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offset, shape)


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


def _overlap(a: Box, b: Box) -> Box | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1], strict=True))
    if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True))


def _inside(box: Box, outer: Box) -> bool:
    return all(o <= x and x + n <= o + m for x, n, o, m in zip(box[0], box[1], outer[0], outer[1], strict=True))


def _split(offset: tuple[int, ...], shape: tuple[int, ...], itemsize: int, limit: int) -> list[Box]:
    """``(offset, shape)`` cut into boxes of at most ``limit`` bytes along its first axis longer
    than 1 (a layer's box of stacked layers: its second; one row is never cut)."""
    axis = next((a for a, n in enumerate(shape) if n > 1), 0)
    rows = max(1, limit // max(1, itemsize * math.prod(shape[axis + 1:])))
    cut = offset[:axis], shape[:axis]
    return [((*cut[0], offset[axis] + i, *offset[axis + 1:]), (*cut[1], min(rows, shape[axis] - i), *shape[axis + 1:]))
            for i in range(0, shape[axis], rows)]


def _contiguous(s: TensorSlice, offset: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether the box is one contiguous run of the slice's (row-major) elements."""
    axes = [i for i, (n, m) in enumerate(zip(shape, s.shape, strict=True)) if n != m]
    return not axes or all(shape[i] == 1 for i in range(axes[0])) and all(
        shape[i] == s.shape[i] for i in range(axes[0] + 1, len(shape)))


def _tiles(held: Sequence[tuple[int, TensorSlice]], dst: int,
           want: TensorSlice) -> list[tuple[Box, list[tuple[int, TensorSlice]]]]:
    """``want`` cut into boxes each some source ranks hold whole, with those ranks (by rank):
    the largest boxes first, each kept unless it overlaps one already kept."""
    over: list[tuple[int, TensorSlice, Box]] = []
    lo, hi = want.offset[0] if want.offset else 0, want.offset[0] + want.shape[0] if want.offset else 1
    for src, have in held:
        if have.offset and (have.offset[0] >= hi or have.offset[0] + have.shape[0] <= lo):
            continue  # another layer (a quick test before the whole box's)
        if have.global_shape != want.global_shape:
            raise LayoutError(f"weight sync: {want.name} is {want.global_shape} on target rank {dst} but "
                              f"{have.global_shape} on source rank {src}: the two groups hold different models")
        box = _overlap((have.offset, have.shape), (want.offset, want.shape))
        if box is not None:
            over.append((src, have, box))
    kept: list[Box] = []
    for box in sorted({b for _, _, b in over}, key=lambda b: (-math.prod(b[1]), b)):
        if all(_overlap(box, k) is None for k in kept):
            kept.append(box)
    covered = sum(math.prod(b[1]) for b in kept)
    if covered != math.prod(want.shape):
        raise LayoutError(f"weight sync: the source group holds {covered} of the {math.prod(want.shape)} elements "
                          f"of {want.name} at {want.offset} that target rank {dst} needs")
    out = []
    for box in sorted(kept):
        copies: dict[int, TensorSlice] = {}
        for src, have, b in over:
            if _inside(box, b):
                copies.setdefault(src, have)
        out.append((box, sorted(copies.items())))
    return out


class _Chooser:
    """Which copy of a box each target gets (the module docstring's rule), and the bytes each
    source rank sends so far."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.sent: dict[int, int] = {}
        self.turns: dict[tuple, int] = {}

    def home(self, name: str, box: Box, ranks: tuple[int, ...], dst: int) -> int:
        """The target's own rank if it holds the box, else the copy whose turn it is."""
        if dst in ranks:
            return dst
        key = (name, box, ranks)
        turn = self.turns.get(key, 0)
        self.turns[key] = turn + 1
        return ranks[turn % len(ranks)]

    def pick(self, ranks: tuple[int, ...], home: int, dst: int, nbytes: int) -> int:
        if home == dst:
            return home
        least = min(self.sent.get(r, 0) for r in ranks)
        if self.sent.get(home, 0) + nbytes > least + self.bucket_bytes:
            at = ranks.index(home)
            home = min(ranks[at:] + ranks[:at], key=lambda r: self.sent.get(r, 0))  # ties: the next in turn
        self.sent[home] = self.sent.get(home, 0) + nbytes
        return home


def plan(sources: Mapping[int, Sequence[TensorSlice]], targets: Mapping[int, Sequence[TensorSlice]], *,
         bucket_bytes: int) -> list[Piece]:
    """Every piece that moves the sources' weights into the targets' slices, in buckets.

    ``sources``: global rank → the slices it holds (copies of an element on several ranks
    are identical: any of them may send it); ``targets``: global rank → the slices it
    needs. A target slice nobody holds, or a tensor with another global shape, raises
    ``LayoutError`` naming it.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    by_name: dict[str, list[tuple[int, TensorSlice]]] = {}
    for src, slices in sorted(sources.items()):
        for s in slices:
            by_name.setdefault(s.name, []).append((src, s))
    chooser = _Chooser(bucket_bytes)
    order: dict[str, int] = {}
    work = []  # every piece before its source is picked, keyed by tensor, then global offset, then target
    for dst, wants in sorted(targets.items()):
        for want in wants:
            if want.name not in by_name:
                raise LayoutError(f"weight sync: target rank {dst} needs {want.name}, which no source rank holds")
            n = order.setdefault(want.name, len(order))
            for box, copies in _tiles(by_name[want.name], dst, want):
                ranks, held = tuple(r for r, _ in copies), dict(copies)
                home = chooser.home(want.name, box, ranks, dst)
                work += [((n, off, dst), want, ranks, held, home, off, shp) for off, shp in _split(
                    *box, ITEMSIZE[want.dtype], bucket_bytes)]
    pieces: list[Piece] = []
    for (_, _, dst), want, ranks, held, home, off, shp in sorted(work, key=lambda w: w[0]):
        # the same box for every target in turn: the sources' loads stay even as they fill
        nbytes = ITEMSIZE[want.dtype] * math.prod(shp)
        src = chooser.pick(ranks, home, dst, nbytes)
        pieces.append(Piece(bucket=-1, name=want.name, src=src, dst=dst, offset=off, shape=shp, nbytes=nbytes,
                            dtype=want.dtype, direct=held[src].dtype == want.dtype
                            and _contiguous(held[src], off, shp) and _contiguous(want, off, shp)))
    return _bucketed(pieces, bucket_bytes)


def _bucketed(pieces: Sequence[Piece], limit: int) -> list[Piece]:
    """``pieces`` with their buckets, ordered by bucket (plan order within one): each piece
    in the first bucket where its two ranks each send and receive at most ``limit`` bytes
    with it (a local copy: bucket 0, it needs no transfer buffer)."""
    loads: list[dict[int, int]] = []
    start: dict[int, int] = {}  # rank → the first bucket with room left for it (< 1/16 of one: full)
    placed: list[tuple[int, int, Piece]] = []
    for i, p in enumerate(pieces):
        b, ends = 0, (p.src, p.dst)
        if p.src != p.dst:
            b = max(start.get(r, 0) for r in ends)
            while b < len(loads) and any(loads[b].get(r, 0) + p.nbytes > limit for r in ends):
                b += 1
            if b == len(loads):
                loads.append({})
            for r in ends:
                loads[b][r] = loads[b].get(r, 0) + p.nbytes
                while start.get(r, 0) < len(loads) and loads[start.get(r, 0)].get(r, 0) > limit - limit // 16:
                    start[r] = start.get(r, 0) + 1
        placed.append((b, i, p))
    return [dataclasses.replace(p, bucket=b) for b, _, p in sorted(placed, key=lambda x: x[:2])]


def sent_by(pieces: Sequence[Piece]) -> dict[int, int]:
    """Rank → the bytes it sends to other ranks under ``pieces`` (local copies excluded)."""
    out: dict[int, int] = {}
    for p in pieces:
        if p.src != p.dst:
            out[p.src] = out.get(p.src, 0) + p.nbytes
    return out


def for_rank(pieces: Sequence[Piece], rank: int) -> list[Piece]:
    """The pieces ``rank`` sends or receives, in plan order (both ends agree on it)."""
    return [p for p in pieces if rank in (p.src, p.dst)]
