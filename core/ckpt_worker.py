"""Worker side of checkpoints: the rpc methods that write and read this rank's shard.

A task that can be checkpointed offers two functions:

    checkpoint_state() -> (items: list[(TensorSlice, np.ndarray)], blobs: dict)
    restore_state(read, blobs) -> None   # read(name, offset, shape) -> np.ndarray

The arrays ``checkpoint_state`` returns are private copies (host memory the task never
touches again), never views of live training state: that copy is the snapshot, so an
async save writes them in the background as they are, without copying them a second time.

``CheckpointService`` turns them into ``ckpt_save`` / ``ckpt_poll`` / ``ckpt_wait`` /
``ckpt_load``. The controller owns the commit (core.checkpoint.manifest.commit): a rank
only writes into the temporary step folder it is given and acknowledges with its ack.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from core.checkpoint.manifest import rank_file_name
from core.checkpoint.spec import TensorSlice
from core.task import WorkerContext

log = logging.getLogger(__name__)

Items = list[tuple[TensorSlice, np.ndarray]]
ReadFn = Callable[[str, tuple[int, ...], tuple[int, ...]], np.ndarray]


class CheckpointService:
    def __init__(
        self,
        ctx: WorkerContext,
        export: Callable[[], tuple[Items, dict[str, Any]]],
        restore: Callable[[ReadFn, dict[str, Any]], None],
    ) -> None:
        self.ctx = ctx
        self.export = export
        self.restore = restore
        self._writer: Any = None
        self._pending: Any = None  # handle of the async save in flight
        self._pending_step = -1
        self._acks: dict[int, dict[str, Any]] = {}  # step → ack of a finished async save

    def rpc_table(self) -> Mapping[str, Callable[..., Any]]:
        return {"ckpt_save": self.save, "ckpt_poll": self.poll, "ckpt_wait": self.wait, "ckpt_load": self.load}

    def save(self, step: int, tmp_dir: str, attrs: dict[str, Any], async_save: bool = False) -> dict[str, Any]:
        """Write this rank's shard into ``tmp_dir``. Sync: return the ack once durable.
        Async: snapshot the state, return ``{"pending": step}`` at once; ``ckpt_wait``
        gives the ack later."""
        from core.checkpoint import hdf5

        if self._pending is not None:
            self.wait(self._pending_step)  # never two saves in flight
        self._acks.clear()
        items, blobs = self.export()
        path = Path(tmp_dir) / rank_file_name(self.ctx.rank)
        attrs = {**attrs, "rank": self.ctx.rank}
        if not async_save:
            return hdf5.write_shard(path, items, blobs, attrs)  # type: ignore[no-any-return]
        from core.checkpoint.async_writer import AsyncWriter

        if self._writer is None:
            self._writer = AsyncWriter()
        self._pending = self._writer.submit(path, items, blobs, attrs, copy=False)
        self._pending_step = step
        return {"pending": step}

    def poll(self, step: int) -> dict[str, Any] | None:
        """The ack of the async save of ``step`` if it is durable, else None (repeatable)."""
        if step in self._acks:
            return self._acks[step]
        if self._pending is None or self._pending_step != step or not self._pending.done():
            return None
        return self.wait(step)

    def wait(self, step: int, timeout_s: float | None = None) -> dict[str, Any]:
        """Block until the async save of ``step`` is durable; its ack (or its error)."""
        if step in self._acks:
            return self._acks[step]
        if self._pending is None or self._pending_step != step:
            raise RuntimeError(f"no asynchronous save of step {step} in flight on rank {self.ctx.rank}")
        handle, self._pending = self._pending, None
        ack: dict[str, Any] = handle.result(timeout_s)
        self._acks[step] = ack
        return ack

    def load(self, step_dir: str) -> dict[str, Any]:
        """Read the slices this rank owns (in its current layout) from a committed checkpoint."""
        from core.checkpoint.hdf5 import CheckpointReader

        reader = CheckpointReader(Path(step_dir))
        try:
            saved_ranks = {f.rank for f in reader.manifest.files}
            # Per-rank blobs (RNG streams) map to the same rank when it existed; else rank 0's.
            blobs = reader.blobs(self.ctx.rank if self.ctx.rank in saved_ranks else 0)

            def read(name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
                return reader.read(name, offset, shape)

            self.restore(read, blobs)
        finally:
            reader.close()
        log.info("loaded checkpoint %s", step_dir)
        return {"step": int(reader.manifest.step)}

    def shutdown(self) -> None:
        if self._pending is not None:
            try:
                self.wait(self._pending_step)
            except Exception:  # noqa: BLE001 - an unfinished async save is simply not committed
                log.exception("async save did not finish before shutdown")


class CheckpointedTask:
    """A task's own rpc methods plus the checkpoint methods, as one table."""

    def __init__(self, task: Any, ctx: WorkerContext) -> None:
        self.task = task
        self.service = CheckpointService(ctx, task.checkpoint_state, task.restore_state)

    def rpc_table(self) -> Mapping[str, Callable[..., Any]]:
        table = {**self.task.rpc_table(), **self.service.rpc_table()}
        task_shutdown = table.get("shutdown")

        def shutdown() -> None:
            self.service.shutdown()
            if task_shutdown is not None:
                task_shutdown()

        table["shutdown"] = shutdown
        return table
