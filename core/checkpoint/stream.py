"""A rank's items as the bytes its shard file holds, produced piece by piece in one bounded buffer.

A synchronous save used to turn every item into a host array before the first byte was
written: for a bf16 model (fp32 in the checkpoint) or a GPU's state that is a copy of the
whole rank state in host memory at once. ``pieces`` instead gives each item's bytes in file
order: the item itself when it already is host memory of the file's dtype (an fp32 CPU
tensor, an array), else a copy of at most ``Ring.nbytes`` of it at a time into one reusable
buffer. The writer (core.checkpoint.hdf5) writes and hashes each piece before the buffer
wraps around, so the extra host memory of a save is one bucket, whatever the state's size.

An item's data is an array or a ``LiveArray`` (core.checkpoint.spec); a LiveArray may offer
``host_view()`` (its value as host memory of the slice's dtype, or None) and
``snapshot_flat_into(start, out)`` (copy its flat elements ``[start, start + out.size)``);
one that offers neither is copied whole through ``current()``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
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


class Ring:
    """One host buffer of ``nbytes`` handed out in order; before it wraps around, ``wait``
    (given to ``take``) must return once every piece handed out so far is consumed."""

    def __init__(self, nbytes: int = BUCKET_BYTES) -> None:
        self.nbytes = nbytes
        self._buffer: np.ndarray | None = None  # allocated on first use: a save of views needs none
        self._pos = 0

    def take(self, nbytes: int, wait: Callable[[], None]) -> np.ndarray:
        """``nbytes`` (≤ the ring's size) of the buffer, as uint8."""
        if self._buffer is None:
            self._buffer = np.empty(self.nbytes, dtype=np.uint8)
        if self._pos + nbytes > self.nbytes:
            wait()
            self._pos = 0
        out = self._buffer[self._pos:self._pos + nbytes]
        self._pos += nbytes
        return out


def pieces(item: TensorSlice, data: Any, ring: Ring, wait: Callable[[], None]) -> Iterator[np.ndarray]:
    """The item's bytes in order (flat uint8 arrays), each at most the ring's size unless it is
    the item's own memory. A piece in the ring is valid until ``wait`` is next called."""
    direct = zero_copy(item, data)
    if direct is not None:
        yield direct.reshape(-1).view(np.uint8)
        return
    dtype = dtype_of(item)
    n = int(np.prod(item.shape, dtype=np.int64))
    per = max(1, ring.nbytes // dtype.itemsize)
    chunked = getattr(data, "snapshot_flat_into", None)
    # Arrays (of another dtype or order) convert a chunk at a time; a LiveArray without
    # chunked copies gives its whole value once (``current``), then the same.
    flat = None if chunked is not None else np.asarray(current(data)).reshape(-1)
    for start in range(0, n, per):
        m = min(per, n - start)
        out = ring.take(m * dtype.itemsize, wait).view(dtype)
        if chunked is not None:
            chunked(start, out)
        else:
            out[...] = flat[start:start + m]
        yield out.view(np.uint8)
