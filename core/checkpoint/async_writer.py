"""Asynchronous shard saves: the snapshot and the write both off the training thread.

``submit`` hands one rank's items to a long-lived writer thread and returns. How the
snapshot (the values the file will hold) is taken is the caller's choice:

  "background"  the writer thread copies every item (an array or a ``LiveArray``), a
                bucket at a time, into host buffers while training goes on, and a disk
                thread writes each filled buffer meanwhile (core.checkpoint.stream,
                core.checkpoint.pipeline); the caller must not change its state until
                ``SaveHandle.wait_snapshot()`` returns, which it calls right before its
                next update (the optimizer step). Training is blocked only for what is
                left of the copy at that point: usually nothing. With ``host_buffer_bytes``
                the buffers hold at most that much: a larger state is copied as fast as
                the disk frees them, so the update may also wait for the disk.
  "now"         the copy is made on the caller's thread before ``submit`` returns.
  "none"        the arrays are already private copies nobody changes: written as they are.

Snapshot buffers are allocated once and reused by every later save (fresh memory is slow
to touch; a warm buffer copies at memory speed). The writer thread runs the very same
``write_shard`` as a synchronous save, so the files are byte-identical.

At most one save is in flight: the next ``submit`` first waits (with a deadline) for the
previous write, because it reuses the same buffers. A failed snapshot or write never
yields an ack: ``result()`` re-raises its error (``write_shard`` removes the partial file).
"""
from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np

from core.checkpoint import stream
from core.checkpoint.hdf5 import write_shard
from core.checkpoint.spec import ShardAck, TensorSlice, current
from core.errors import BatonRuntimeError, CheckpointError

logger = logging.getLogger(__name__)


class SaveHandle:
    """The future of one background save: ``done()``, ``result(timeout)``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._snapshot = threading.Event()  # set once the values to write are copied (or failed to be)
        self._finished = threading.Event()
        self._ack: ShardAck | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the write has finished, successfully or not."""
        return self._finished.is_set()

    def snapshot_taken(self) -> bool:
        """True once the caller may change the state it submitted."""
        return self._snapshot.is_set()

    def wait_snapshot(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds until the caller may change its state; True when it may.

        Also True when the snapshot failed: its error comes from ``result()``, never an ack.
        """
        return self._snapshot.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the write to finish; True when it has."""
        return self._finished.wait(timeout)

    def result(self, timeout: float | None = None) -> ShardAck:
        """The ack of the finished write; re-raises the background error; TimeoutError if still running."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"{self.path}: background checkpoint write still running after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._ack is not None
        return self._ack

    def _finish(self, ack: ShardAck | None, error: BaseException | None) -> None:
        self._ack, self._error = ack, error
        self._snapshot.set()
        self._finished.set()


def _check_shape(item: TensorSlice, data: Any) -> None:
    if tuple(data.shape) != tuple(item.shape):
        raise CheckpointError(f"{item.name}: array shape {tuple(data.shape)} is not the slice shape {item.shape}")


Snapshot = Literal["background", "now", "none"]
Job = tuple[SaveHandle, list[tuple[TensorSlice, Any]], dict[str, Any], dict[str, Any], bool]


class AsyncWriter:
    """Writes one rank's shards in the background from reusable snapshot buffers."""

    def __init__(self, *, previous_timeout_s: float = 600.0, host_buffer_bytes: int | None = None) -> None:
        """``previous_timeout_s``: how long ``submit`` waits for the previous save to finish.
        ``host_buffer_bytes``: the most host memory a background snapshot holds (None: as much
        as the state, so the copy never waits for the disk)."""
        self.previous_timeout_s = previous_timeout_s
        self._buffers: list[np.ndarray] = []  # "now" snapshots: flat uint8, one per item position, reused
        count = sys.maxsize if host_buffer_bytes is None else max(2, host_buffer_bytes // stream.BUCKET_BYTES)
        bucket = stream.BUCKET_BYTES if host_buffer_bytes is None else min(stream.BUCKET_BYTES, host_buffer_bytes // 2)
        self._slots = stream.Slots(max(1, bucket), count)  # "background" snapshots, reused across saves
        self._pending: SaveHandle | None = None
        # One long-lived thread fed by a queue: starting a thread per save costs the caller a
        # GIL hand-off (up to the 5 ms switch interval) before start() returns.
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, path: Path, items: list[tuple[TensorSlice, Any]], blobs: dict[str, Any],
               attrs: dict[str, Any], *, snapshot: Snapshot = "now") -> SaveHandle:
        """Write ``items``, ``blobs`` and ``attrs`` to ``path`` in the background.

        Arguments as for ``write_shard``, except that an item's data may be a ``LiveArray``;
        ``blobs`` and ``attrs`` are captured now (one that is not JSON-able raises here, on
        the caller's thread). ``snapshot`` says when the item values are taken (module
        docstring): with "background", change nothing submitted before ``wait_snapshot()``.
        """
        if snapshot not in ("background", "now", "none"):
            raise ValueError(f"snapshot={snapshot!r}; use 'background', 'now' or 'none'")
        self._wait_previous()
        blobs = json.loads(json.dumps(blobs, allow_nan=True))
        attrs = json.loads(json.dumps(attrs))
        for item, data in items:
            _check_shape(item, data)
        handle = SaveHandle(Path(path))
        if snapshot == "now":
            items = self._snapshot(items)
        elif snapshot == "none":
            items = [(item, current(data)) for item, data in items]
        if snapshot != "background":
            handle._snapshot.set()
        self._pending = handle
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="ckpt-writer", daemon=True)
            self._thread.start()
        self._jobs.put((handle, items, blobs, attrs, snapshot == "background"))
        return handle

    def _wait_previous(self) -> None:
        previous = self._pending
        if previous is None:
            return
        start = time.monotonic()
        if not previous.wait(self.previous_timeout_s):
            raise BatonRuntimeError(f"{previous.path}: the previous checkpoint write is still running after "
                                    f"{self.previous_timeout_s:.0f} s; cannot reuse its buffers (disk stalled?)")
        waited = time.monotonic() - start
        if waited > 0.01:
            logger.info("checkpoint submit waited %.2f s for the previous write to %s", waited, previous.path)

    def _snapshot(self, items: list[tuple[TensorSlice, Any]]) -> list[tuple[TensorSlice, np.ndarray]]:
        """Copy every item into its reusable buffer; the snapshot views, in order."""
        out = [(item, self._copy(i, item, data)) for i, (item, data) in enumerate(items)]
        del self._buffers[len(items):]  # a smaller state than last time: drop buffers no item uses
        return out

    def _copy(self, index: int, item: TensorSlice, data: Any) -> np.ndarray:
        """Copy ``data`` into the reusable buffer for item ``index``; return the snapshot view."""
        dtype = np.dtype(item.dtype)
        nbytes = dtype.itemsize * int(np.prod(item.shape, dtype=np.int64))
        if index < len(self._buffers) and self._buffers[index].nbytes == nbytes:
            buffer = self._buffers[index]
        else:
            buffer = np.empty(nbytes, dtype=np.uint8)
            if index < len(self._buffers):
                self._buffers[index] = buffer
            else:
                self._buffers.append(buffer)
        view = buffer.view(dtype).reshape(item.shape)
        if hasattr(data, "snapshot_into"):
            data.snapshot_into(view)
        else:
            np.copyto(view, data, casting="same_kind")
        return view

    def _serve(self) -> None:
        """The background thread: snapshot (when asked) and write each submitted save; None ends it."""
        while (job := self._jobs.get()) is not None:
            handle, items, blobs, attrs, background = job
            try:
                if background:
                    try:
                        ack = write_shard(handle.path, items, blobs, attrs, slots=self._slots, copy_all=True,
                                          on_copied=handle._snapshot.set)
                    finally:
                        handle._snapshot.set()  # the caller may go on, also when the copy failed
                else:
                    ack = write_shard(handle.path, items, blobs, attrs)
            except BaseException as exc:  # reported through the handle, never as an ack
                logger.error("background checkpoint write to %s failed: %s", handle.path, exc)
                handle._finish(None, exc)
            else:
                handle._finish(ack, None)

    def close(self, timeout_s: float = 600.0) -> None:
        """Wait for the write in flight (if any) and release the snapshot buffers."""
        if self._pending is not None and not self._pending.wait(timeout_s):
            raise BatonRuntimeError(f"{self._pending.path}: checkpoint write still running after {timeout_s:.0f} s")
        self._pending = None
        self._buffers.clear()
        self._slots = stream.Slots(self._slots.bucket_bytes, self._slots.count)
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout_s)
            self._thread = None
