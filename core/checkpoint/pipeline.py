"""The threads that put a rank's shard data on disk: copy, pwrite, hash, side by side.

HDF5 (core.checkpoint.hdf5) lays the file out with every dataset allocated and unwritten;
``write_regions`` then fills the datasets at their file offsets. The calling thread copies
the items into bounded slots (core.checkpoint.stream) and writes those that need no copy
itself, a second thread pwrites each filled slot, a third computes the file's xxh3-64
checksum (what the controller verifies without h5py) from the same buffers, so the file is
never read back. A slot is reused once both are done with it.

Why ``pwrite`` rather than h5py: h5py lays out the file (datasets allocated early, never
filled) and writes all metadata at close; writing each buffer's bytes at its dataset's file
offset is the raw-write fast path, and the checksum can be computed from the buffers while
the disk works.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from core.checkpoint import stream
from core.checkpoint.manifest import CHECKSUM_ALGO, file_checksum
from core.checkpoint.spec import TensorSlice

logger = logging.getLogger(__name__)

Region = tuple[int, TensorSlice, Any]  # (file offset, slice, its data: an array or a LiveArray)
_WRITE_BLOCK = 256 << 20  # below Linux's 2 GiB per-call write limit


def write_regions(path: Path, regions: list[Region], slots: stream.Slots, copy_all: bool,
                  on_copied: Callable[[], None] | None) -> tuple[int, str]:
    """Write the regions at their offsets and checksum the file; fsync; return (size, checksum).

    This thread copies what must be copied into ``slots`` and hands each filled slot to a
    disk thread, so the next copy runs beside the last write; what is already host memory
    of the file's dtype it writes itself, from that memory. A third thread hashes everything
    in file order. ``on_copied`` runs once every item has been read (with ``copy_all``, the
    live state may change from then on)."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size  # HDF5 sets the file to its full allocated size at close
        hasher, disk = _Hasher(fd, size), _Disk(fd)
        try:
            for slot, pieces in stream.batches(regions, slots, copy_all=copy_all):
                release = _Release(slots, slot) if slot is not None else None
                hasher.feed(pieces, release)  # in file order: batches come in file order
                if release is None:
                    for offset, piece in pieces:
                        pwrite_all(fd, memoryview(piece), offset)
                    continue
                try:
                    disk.put(pieces, release)
                except BaseException:
                    release.done()  # never reached the disk thread: its half is done
                    raise
            if on_copied is not None:
                on_copied()
            disk.written()
            os.fsync(fd)  # while the hasher finishes
            checksum = hasher.finish()
        finally:
            disk.close()
            hasher.close()
        if os.fstat(fd).st_size != size:  # HDF5 did not size the file up front: hash what is on disk
            logger.warning("%s: file grew while writing data; checksumming it from disk", path)
            return os.fstat(fd).st_size, file_checksum(path)
        return size, checksum
    finally:
        os.close(fd)


class _Release:
    """A slot goes back to its ``Slots`` once both the disk and the hasher are done with it."""

    def __init__(self, slots: stream.Slots, slot: np.ndarray) -> None:
        self._slots, self._slot, self._left = slots, slot, 2
        self._lock = threading.Lock()

    def done(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self._slots.put(self._slot)


Pieces = list[tuple[int, np.ndarray]]  # (file offset, bytes)


class _Stage:
    """A thread that takes jobs (pieces, and the slot half to release after them) in order.

    After an error it keeps releasing slots (the copying thread must not wait forever for
    one) and handles nothing more; the owner raises the first error."""

    NAME = "ckpt-stage"

    def __init__(self) -> None:
        self._error: BaseException | None = None
        self._queue: queue.SimpleQueue[tuple[list[tuple[int, np.ndarray]], _Release | None] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=self.NAME, daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _handle(self, offset: int, piece: np.ndarray) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            pieces, release = job
            try:
                for offset, piece in pieces if self._error is None else ():
                    self._handle(offset, piece)
            except BaseException as exc:  # noqa: BLE001 - raised on the copying thread by its owner
                self._error = exc
            finally:
                if release is not None:
                    release.done()


class _Disk(_Stage):
    """The writing thread: pwrites each filled slot at its offsets, then releases its half;
    ``put`` and ``written`` raise the first error."""

    NAME = "ckpt-disk"

    def __init__(self, fd: int) -> None:
        self._fd = fd
        super().__init__()

    def put(self, pieces: Pieces, release: _Release) -> None:
        self._raise()
        self._queue.put((pieces, release))

    def written(self) -> None:
        """Wait until every slot is written (or raise the first error)."""
        self.close()
        self._raise()

    def _handle(self, offset: int, piece: np.ndarray) -> None:
        pwrite_all(self._fd, memoryview(piece), offset)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` (pwrite may write less than asked)."""
    while view:
        n = os.pwrite(fd, view[:_WRITE_BLOCK], offset)
        offset += n
        view = view[n:]


class _Hasher(_Stage):
    """xxh3-64 over the file as it will be, on its own thread: the metadata gaps read back
    (small), the data from the pieces as they are written, in file order.

    Equal to ``manifest.file_checksum`` of the finished file. xxhash releases the GIL, so
    this runs beside the writes. An error is raised by ``finish``.
    """

    NAME = "ckpt-hash"

    def __init__(self, fd: int, size: int) -> None:
        self._fd, self._size, self._pos = fd, size, 0
        self._h = xxhash.xxh3_64()
        super().__init__()

    def feed(self, pieces: list[tuple[int, np.ndarray]], release: _Release | None) -> None:
        self._queue.put((pieces, release))

    def finish(self) -> str:
        self.feed([(self._size, np.empty(0, np.uint8))], None)  # the metadata after the last dataset
        self.close()
        self._raise()
        return f"{CHECKSUM_ALGO}:{self._h.hexdigest()}"

    def _handle(self, offset: int, piece: np.ndarray) -> None:
        gap = offset - self._pos
        if gap > 0:
            data = os.pread(self._fd, gap, self._pos)
            self._h.update(data + bytes(gap - len(data)))  # short read: a hole reads as zeros
        self._h.update(memoryview(piece))
        self._pos = offset + piece.nbytes
