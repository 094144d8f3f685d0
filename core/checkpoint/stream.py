"""A rank's items as the bytes its shard file holds, copied through a bounded set of buffers.

A synchronous save used to turn every item into a host array before the first byte was
written: for a bf16 model (fp32 in the checkpoint) or a GPU's state, a copy of the whole
rank state in host memory at once. ``batches`` instead gives the bytes in file order: an
item that already is host memory of the file's dtype (an fp32 CPU tensor, an array) as it
is, anything else copied ``bucket_bytes`` at a time into ``Slots``, which the writer
(core.checkpoint.pipeline) hands back once it has written and hashed them. The copying thread
fills the next slot while the disk takes the last: the extra host memory of a save is
``Slots.nbytes`` (two buckets for a synchronous save), whatever the state's size.

An asynchronous save (core.checkpoint.async_writer) copies every item (``copy_all``: its
snapshot of a state that changes once training goes on) into its own long-lived slots: as
many as its budget allows, so the copy runs ahead of the disk by that much.

An item's data is an array or a ``LiveArray`` (core.checkpoint.spec); a LiveArray may offer
``host_view()`` (its value as host memory of the slice's dtype, or None) and
``snapshot_flat_into(start, out)`` (copy its flat elements ``[start, start + out.size)``);
one without it is copied whole with ``snapshot_into`` (``_filler``).
"""
from __future__ import annotations

import queue
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from core.checkpoint.spec import TensorSlice, current
from core.errors import CheckpointError

BUCKET_BYTES = 32 << 20  # a save's host buffer: big enough for fast writes, small beside any model


def dtype_of(item: TensorSlice) -> np.dtype:
    """The slice's dtype in native byte order, or a CheckpointError for one that cannot be saved."""
    dtype = np.dtype(item.dtype)
    if dtype.hasobject or dtype.kind in "USV":
        raise CheckpointError(f"{item.name}: dtype {dtype} cannot be checkpointed; use a numeric dtype")
    return dtype.newbyteorder("=")


def check(item: TensorSlice, data: Any) -> None:
    """Refuse data whose shape is not the slice's (before anything is written)."""
    dtype_of(item)
    if tuple(data.shape) != tuple(item.shape):
        raise CheckpointError(f"{item.name}: array shape {tuple(data.shape)} is not the slice shape {item.shape}")


def whole(item: TensorSlice, data: Any) -> np.ndarray:
    """The item as one C-contiguous native array (a copy where it must be): for tiny datasets."""
    return np.asarray(current(data), dtype=dtype_of(item), order="C")


def zero_copy(item: TensorSlice, data: Any) -> np.ndarray | None:
    """The item's data as it is, when it already is C-contiguous host memory of the file's dtype."""
    if hasattr(data, "snapshot_into"):
        view = getattr(data, "host_view", None)
        data = view() if view is not None else None
    if isinstance(data, np.ndarray) and data.dtype == dtype_of(item) and data.flags.c_contiguous:
        return data
    return None


class Slots:
    """``count`` host buffers of ``bucket_bytes``, filled by the copying thread and returned by
    the writing one once their bytes are on their way to disk. Allocated on first use, kept
    for the next save (warm memory copies at memory speed): an async writer keeps its own."""

    def __init__(self, bucket_bytes: int = BUCKET_BYTES, count: int = 2) -> None:
        if bucket_bytes <= 0 or count < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes}, count={count}: both must be positive")
        self.bucket_bytes, self.count = bucket_bytes, count
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self._made = 0

    @property
    def nbytes(self) -> int:
        """The most host memory these slots hold."""
        return self.bucket_bytes * self.count

    def get(self) -> np.ndarray:
        """A free slot (uint8), waiting for the writer to return one when all are in use."""
        if self._free.empty() and self._made < self.count:
            self._made += 1
            return np.empty(self.bucket_bytes, dtype=np.uint8)
        return self._free.get()

    def put(self, slot: np.ndarray) -> None:
        self._free.put(slot)


Batch = tuple[np.ndarray | None, list[tuple[int, np.ndarray]]]  # (its slot or None, [(file offset, bytes)])


def batches(regions: Iterable[tuple[int, TensorSlice, Any]], slots: Slots, *, copy_all: bool) -> Iterator[Batch]:
    """The regions' bytes in file order, as batches for the writer: a slot filled with copies
    (handed back to ``slots`` by the writer once written), or one item's own memory (no slot),
    unless ``copy_all`` (an async snapshot: the live state changes once it is taken)."""
    slot, pos, batch = None, 0, []
    try:
        for offset, item, data in regions:
            direct = None if copy_all else zero_copy(item, data)
            if direct is not None:
                if slot is not None:  # the writer hashes in file order: what is before goes first
                    full, slot = slot, None
                    yield full, batch
                yield None, [(offset, direct.reshape(-1).view(np.uint8))]
                continue
            dtype = dtype_of(item)
            n = int(np.prod(item.shape, dtype=np.int64))
            per = max(1, slots.bucket_bytes // dtype.itemsize)
            fill = _filler(item, data, n <= per)
            for start in range(0, n, per):
                m = min(per, n - start)
                if slot is None or pos + m * dtype.itemsize > slots.bucket_bytes:
                    if slot is not None:
                        full, slot = slot, None  # the writer's from here on
                        yield full, batch
                    slot, pos, batch = slots.get(), 0, []
                out = slot[pos:pos + m * dtype.itemsize].view(dtype)
                fill(start, out)
                batch.append((offset + start * dtype.itemsize, out.view(np.uint8)))
                pos += m * dtype.itemsize
        if slot is not None:
            full, slot = slot, None
            yield full, batch
    finally:
        if slot is not None:  # a copy failed (or the writer stopped): the slot is nobody's
            slots.put(slot)


def _filler(item: TensorSlice, data: Any, fits: bool) -> Callable[[int, np.ndarray], None]:
    """How to copy the flat elements ``[start, start + out.size)`` of an item into ``out``.

    A LiveArray with ``snapshot_flat_into`` copies each piece itself; one with only
    ``snapshot_into`` copies whole, straight into the slot when it ``fits`` in one, else into
    a temporary array of its size first; an array converts a piece at a time."""
    chunked = getattr(data, "snapshot_flat_into", None)
    if chunked is not None:
        return chunked
    if hasattr(data, "snapshot_into"):
        if fits:
            return lambda start, out: data.snapshot_into(out.reshape(item.shape))
        whole = np.empty(item.shape, dtype=dtype_of(item))
        data.snapshot_into(whole)
        data = whole
    flat = np.asarray(data).reshape(-1)

    def convert(start: int, out: np.ndarray) -> None:
        out[...] = flat[start:start + out.size]

    return convert
