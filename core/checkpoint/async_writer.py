"""Asynchronous shard saves: snapshot on the training thread, write on a background thread.

``submit`` copies every array into host buffers that are allocated once and reused by
every later save of the same state (fresh memory is slow to touch; a warm buffer copies
at memory speed), then returns; the background thread runs the very same
``write_shard`` as a synchronous save, so the files are byte-identical. Training is
blocked only for the copy.

At most one save is in flight: the next ``submit`` first waits (with a deadline) for the
previous write, because it reuses the same buffers. A failed background write never
yields an ack: ``result()`` re-raises its error (``write_shard`` removes the partial file).
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from core.checkpoint.hdf5 import write_shard
from core.checkpoint.spec import TensorSlice
from core.errors import BatonRuntimeError, CheckpointError

logger = logging.getLogger(__name__)


class SaveHandle:
    """The future of one background save: ``done()``, ``result(timeout)``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._finished = threading.Event()
        self._ack: dict[str, Any] | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the write has finished, successfully or not."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the write to finish; True when it has."""
        return self._finished.wait(timeout)

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """The ack of the finished write; re-raises the background error; TimeoutError if still running."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"{self.path}: background checkpoint write still running after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._ack is not None
        return self._ack

    def _finish(self, ack: dict[str, Any] | None, error: BaseException | None) -> None:
        self._ack, self._error = ack, error
        self._finished.set()


def _check_shape(item: TensorSlice, array: np.ndarray) -> None:
    if tuple(array.shape) != tuple(item.shape):
        raise CheckpointError(f"{item.name}: array shape {tuple(array.shape)} is not the slice shape {item.shape}")


class AsyncWriter:
    """Writes one rank's shards in the background from reusable snapshot buffers."""

    def __init__(self, *, previous_timeout_s: float = 600.0) -> None:
        """``previous_timeout_s``: how long ``submit`` waits for the previous save to finish."""
        self.previous_timeout_s = previous_timeout_s
        self._buffers: list[np.ndarray] = []  # flat uint8, one per item position, reused across saves
        self._pending: SaveHandle | None = None
        # One long-lived thread fed by a queue: starting a thread per save costs the caller a
        # GIL hand-off (up to the 5 ms switch interval) before start() returns.
        self._jobs: queue.SimpleQueue[tuple[SaveHandle, list[tuple[TensorSlice, np.ndarray]], dict[str, Any],
                                            dict[str, Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, path: Path, items: list[tuple[TensorSlice, np.ndarray]], blobs: dict[str, Any],
               attrs: dict[str, Any], *, copy: bool = True) -> SaveHandle:
        """Snapshot ``items``, ``blobs`` and ``attrs`` now and write them to ``path`` in the background.

        When this returns, the caller may change its arrays. Arguments as for
        ``write_shard``; a blob that is not JSON-able raises here, on the caller's thread.
        ``copy=False``: the arrays are already private copies that nobody changes (what a
        task's ``checkpoint_state`` returns): they are written as they are, without a second copy.
        """
        self._wait_previous()
        blobs = json.loads(json.dumps(blobs, allow_nan=True))
        attrs = json.loads(json.dumps(attrs))
        if copy:
            snapshot = [(item, self._copy(i, item, array)) for i, (item, array) in enumerate(items)]
            del self._buffers[len(items):]  # a smaller state than last time: drop buffers no item uses
        else:
            for item, array in items:
                _check_shape(item, array)
            snapshot = list(items)
        handle = SaveHandle(Path(path))
        self._pending = handle
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="ckpt-writer", daemon=True)
            self._thread.start()
        self._jobs.put((handle, snapshot, blobs, attrs))
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

    def _copy(self, index: int, item: TensorSlice, array: np.ndarray) -> np.ndarray:
        """Copy ``array`` into the reusable buffer for item ``index``; return the snapshot view."""
        dtype = np.dtype(item.dtype)
        _check_shape(item, array)
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
        np.copyto(view, array, casting="same_kind")
        return view

    def _serve(self) -> None:
        """The background thread: write each submitted snapshot; None ends it."""
        while (job := self._jobs.get()) is not None:
            handle, snapshot, blobs, attrs = job
            try:
                ack = write_shard(handle.path, snapshot, blobs, attrs)
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
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout_s)
            self._thread = None
