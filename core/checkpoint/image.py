"""An HDF5 file laid out in memory: what h5py's file-object driver writes into when a shard
is made (core.checkpoint.hdf5), before any byte reaches the disk.

HDF5 writes a file's metadata when it flushes or closes it; on a full disk a failed write
there surfaces as a RuntimeError, an OSError or a segfault, depending on which write it
was. Laid out here, nothing can fail; the pages written (the metadata, kilobytes) reach the
disk afterwards by plain ``pwrite``, whose failure is an ``OSError`` with its errno.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from core.checkpoint.pipeline import pwrite_all


class SparseImage:
    """A file in memory for h5py's file-object driver, kept in pages of what was written:
    the data regions HDF5 allocates but never fills cost nothing."""

    PAGE = 1 << 12  # the metadata's pages; a larger page writes more of the data regions' zeros

    def __init__(self) -> None:
        self.pages: dict[int, bytearray] = {}
        self.size = 0
        self.pos = 0

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        """Move to ``pos`` (from the start, or the end with SEEK_END, as h5py asks for the size)."""
        self.pos = pos + (self.size if whence == os.SEEK_END else self.pos if whence == os.SEEK_CUR else 0)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, data: Any) -> int:
        """Write ``data`` at the position, page by page."""
        view = memoryview(data).cast("B")
        pos, n = self.pos, len(view)
        while view:
            page, at = divmod(pos, self.PAGE)
            take = min(len(view), self.PAGE - at)
            self.pages.setdefault(page, bytearray(self.PAGE))[at:at + take] = view[:take]
            view, pos = view[take:], pos + take
        self.pos, self.size = pos, max(self.size, pos)
        return n

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes from the position (all that is left when negative)."""
        out = bytearray(max(0, self.size - self.pos) if size < 0 else size)
        return bytes(out[:self.readinto(out)])

    def readinto(self, buffer: Any) -> int:
        """Read back what was written (zeros where nothing was), up to the end of the file."""
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), self.size - self.pos))
        done = 0
        while done < n:
            page, at = divmod(self.pos + done, self.PAGE)
            take = min(n - done, self.PAGE - at)
            data = self.pages.get(page)
            out[done:done + take] = data[at:at + take] if data is not None else bytes(take)
            done += take
        self.pos += n
        return n

    def truncate(self, size: int | None = None) -> int:
        """Set the file's size (HDF5 does, to its end of allocation, at close)."""
        self.size = self.pos if size is None else size
        return self.size

    def flush(self) -> None:
        """Nothing to flush: the disk sees the image only in ``runs``."""

    def runs(self) -> list[tuple[int, bytes]]:
        """What was written, as (offset, bytes) runs of adjacent pages, cut at the file's size."""
        runs: list[tuple[int, list[bytes]]] = []
        end = -1
        for page in sorted(self.pages):
            start = page * self.PAGE
            data = bytes(self.pages[page][:max(0, self.size - start)])
            if not data:
                continue
            if start == end:
                runs[-1][1].append(data)
            else:
                runs.append((start, [data]))
            end = start + len(data)
        return [(start, b"".join(chunks)) for start, chunks in runs]

    def create_file(self, path: Path) -> None:
        """Create ``path`` (which must not exist) sized as HDF5 left the image, with what was
        written (the metadata) in place; the data regions stay holes for the caller's pwrite."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.ftruncate(fd, self.size)
            for offset, data in self.runs():
                pwrite_all(fd, memoryview(data), offset)
        finally:
            os.close(fd)
