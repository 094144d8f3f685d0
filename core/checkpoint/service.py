"""Worker side of checkpoints: the rpc methods that write and read this rank's shard.

A task that can be checkpointed offers two functions:

    checkpoint_state() -> (items: list[(TensorSlice, np.ndarray | LiveArray)], blobs: dict)
    restore_state(read, blobs) -> None   # read(name, offset, shape) -> np.ndarray

and, optionally, ``restore_weights(read)`` (only the model weights of a checkpoint, the
optimizer fresh: ``init_from``) and ``restore_reference(read)`` (the model weights into a
frozen copy that is not part of the state: an RL run's reference policy); both are
``CKPT_LOAD`` with ``into="weights"`` / ``"reference"``; their ``step_dir`` may be
``hf:PATH``, a Hugging Face checkpoint folder read through core.hf.reader (the same
``read``, each rank reading only its boxes). Also optionally,
``bind_checkpoint_fence(fence)``. A task that binds the fence may export
its live state (views, ``core.checkpoint.spec.LiveArray``) and promises to call
``fence()`` before it next changes that state (before its optimizer step, before a
load): an async save then takes its snapshot on the writer thread while the next step's
forward and backward run, and training waits only if the copy is not done by the update.
A task without the fence must return private copies (host memory it never touches
again): an async save writes them as they are; LiveArrays are then copied at once.

``CheckpointService`` serves the checkpoint calls (``core.checkpoint.calls``: save, poll,
wait, load). The controller owns the commit (core.checkpoint.coordinator): a rank only
writes into the temporary step folder it is given and acknowledges with its ``ShardAck``.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from core.checkpoint import calls
from core.checkpoint.manifest import rank_file_name
from core.checkpoint.spec import ShardAck, TensorSlice
from core.config.modelcfg import ModelConfig
from core.errors import BatonRuntimeError
from core.hf import families, layout
from core.wire.contract import Method

log = logging.getLogger(__name__)

Items = list[tuple[TensorSlice, Any]]  # np.ndarray or LiveArray
ReadFn = Callable[[str, tuple[int, ...], tuple[int, ...]], np.ndarray]
HF = "hf:"  # a Load.step_dir that names a Hugging Face checkpoint folder (init_from: hf:PATH)



def _hdf5() -> tuple[Any, Any]:
    """The HDF5 shard modules (``hdf5``, ``async_writer``), imported once a save or a load is asked."""
    from core.checkpoint import async_writer, hdf5  # h5py: only on workers, only once a checkpoint is asked for

    return hdf5, async_writer

class CheckpointService:
    def __init__(
        self,
        rank: int,
        export: Callable[[], tuple[Items, dict[str, Any]]],
        restore: Callable[[ReadFn, dict[str, Any]], None],
        partial: dict[str, Callable[[ReadFn], None] | None] | None = None,
    ) -> None:
        self.rank = rank
        self.export = export
        self.restore = restore
        self.partial = partial or {}  # Load.into ("weights", "reference") → the task's restore_*
        self._writer: Any = None
        self._pending: Any = None  # handle of the async save in flight
        self._pending_step = -1
        self._acks: dict[int, ShardAck] = {}  # step → ack of a finished async save
        self.fenced = False  # set by CheckpointedTask when the task calls fence() before it updates
        self.snapshot_timeout_s = 600.0
        self.async_host_buffer_bytes: int | None = None  # an async snapshot's host memory (None: the state's)

    def handlers(self) -> dict[Method[Any, Any], Callable[[Any], Any]]:
        return {calls.CKPT_SAVE: self.save, calls.CKPT_POLL: lambda req: self.poll(req.step),
                calls.CKPT_WAIT: lambda req: self.wait(req.step), calls.CKPT_LOAD: self.load}

    def save(self, req: calls.Save) -> calls.Saved:
        """Write this rank's shard into ``req.tmp_dir``. Sync: the ack once durable. Async:
        snapshot the state and return at once (no ack); ``wait`` gives the ack later."""
        hdf5, async_writer = _hdf5()
        if self._pending is not None:
            self.wait(self._pending_step)  # never two saves in flight
        self._acks.clear()
        items, blobs = self.export()
        path = Path(req.tmp_dir) / rank_file_name(self.rank)
        attrs = {"step": req.attrs.step, "layout": req.attrs.layout, "config_hash": req.attrs.config_hash,
                 "rank": self.rank}
        if not req.async_save:
            # Streamed: each item is read while it is written, through one bounded buffer.
            return calls.Saved(ack=hdf5.write_shard(path, items, blobs, attrs))
        if self._writer is None:
            self._writer = async_writer.AsyncWriter(host_buffer_bytes=self.async_host_buffer_bytes)
        live = any(hasattr(a, "snapshot_into") for _, a in items)
        mode = "background" if self.fenced else ("now" if live else "none")
        self._pending = self._writer.submit(path, items, blobs, attrs, snapshot=mode)
        self._pending_step = req.step
        return calls.Saved(ack=None)

    def fence(self) -> None:
        """Return once the state an async save exported may change (its snapshot is taken).

        The task calls this right before it changes its state. Normally the snapshot is long
        done by then; if not, training waits for it, and a wait over 10 ms is logged.
        """
        handle = self._pending
        if handle is None or handle.snapshot_taken():
            return
        start = time.monotonic()
        if not handle.wait_snapshot(self.snapshot_timeout_s):
            raise BatonRuntimeError(f"rank {self.rank}: the checkpoint snapshot of step {self._pending_step} "
                                    f"is not taken after {self.snapshot_timeout_s:.0f} s; training cannot go on "
                                    "without overwriting it")
        waited = time.monotonic() - start
        if waited > 0.01:
            log.info("training waited %.3f s for the checkpoint snapshot of step %d", waited, self._pending_step)

    def poll(self, step: int) -> ShardAck | None:
        """The ack of the async save of ``step`` if it is durable, else None (repeatable)."""
        if step in self._acks:
            return self._acks[step]
        if self._pending is None or self._pending_step != step or not self._pending.done():
            return None
        return self.wait(step)

    def wait(self, step: int, timeout_s: float | None = None) -> ShardAck:
        """Block until the async save of ``step`` is durable; its ack (or its error)."""
        if step in self._acks:
            return self._acks[step]
        if self._pending is None or self._pending_step != step:
            raise RuntimeError(f"no asynchronous save of step {step} in flight on rank {self.rank}")
        handle, self._pending = self._pending, None
        ack: ShardAck = handle.result(timeout_s)
        self._acks[step] = ack
        return ack

    def load(self, req: calls.Load) -> calls.Loaded:
        """Read the slices this rank owns (in its current layout) from a committed checkpoint."""
        CheckpointReader = _hdf5()[0].CheckpointReader  # noqa: N806 - the class, as it is named
        partial = self.partial.get(req.into) if req.into != "state" else None
        if req.into != "state" and partial is None:
            raise BatonRuntimeError(f"rank {self.rank}: this task cannot load a checkpoint into {req.into!r}")
        if req.into != "reference":
            self.fence()  # restoring changes the state a pending async save may still be copying
        if req.step_dir.startswith(HF):
            return self._load_hf(req, partial)
        reader = CheckpointReader(Path(req.step_dir))
        try:
            if partial is not None:
                partial(reader.read)
                log.info("loaded the model weights of %s (into %s)", req.step_dir, req.into)
                return calls.Loaded(step=int(reader.manifest.step))
            saved_ranks = {f.rank for f in reader.manifest.files}
            # Per-rank blobs (RNG streams) map to the same rank when it existed; else rank 0's.
            blobs = reader.blobs(self.rank if self.rank in saved_ranks else 0)

            def read(name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
                return reader.read(name, offset, shape)

            self.restore(read, blobs)
        finally:
            reader.close()
        log.info("loaded checkpoint %s", req.step_dir)
        return calls.Loaded(step=int(reader.manifest.step))

    def _load_hf(self, req: calls.Load, partial: Callable[[ReadFn], None] | None) -> calls.Loaded:
        """The model weights of a Hugging Face checkpoint folder (``hf:PATH``), read box by box."""
        from core.hf.reader import HFReader  # torch and safetensors: only on workers, only for an hf: source

        folder = req.step_dir[len(HF):]
        if partial is None:
            raise BatonRuntimeError(f"rank {self.rank}: {req.step_dir} holds model weights only, not a training state")
        dims = layout.dims_of(ModelConfig(**families.model_section(folder).model))
        reader = HFReader(folder, dims)
        try:
            partial(reader)  # a ReadFn with read_into: each box straight into its parameter
        finally:
            reader.close()
        log.info("loaded the model weights of Hugging Face checkpoint %s (into %s)", folder, req.into)
        return calls.Loaded(step=0)

    def shutdown(self) -> None:
        if self._pending is not None:
            try:
                self.wait(self._pending_step)
            except Exception:  # noqa: BLE001 - an unfinished async save is simply not committed
                log.exception("async save did not finish before shutdown")


class CheckpointedTask:
    """A task's own handlers plus the checkpoint calls, as one task."""

    def __init__(self, task: Any, rank: int, *, async_buffer_bytes: int | None = None) -> None:
        """``async_buffer_bytes``: the most host memory an async save's snapshot holds (None:
        as much as the state; ``checkpoint.async_buffer_mb``)."""
        self.task = task
        self.service = CheckpointService(rank, task.checkpoint_state, task.restore_state, {
            "weights": getattr(task, "restore_weights", None), "reference": getattr(task, "restore_reference", None)})
        self.service.async_host_buffer_bytes = async_buffer_bytes
        bind = getattr(task, "bind_checkpoint_fence", None)
        if bind is not None:
            bind(self.service.fence)
            self.service.fenced = True

    def handlers(self) -> Mapping[Method[Any, Any], Callable[[Any], Any]]:
        return {**self.task.handlers(), **self.service.handlers()}

    def close(self) -> None:
        """Let an async save in flight finish, then close the task."""
        self.service.shutdown()
        self.task.close()

