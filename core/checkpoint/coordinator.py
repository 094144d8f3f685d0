"""The controller's side of checkpoints: ask every rank, collect the acks, commit, keep.

    resume_point()   the newest committed checkpoint that verifies, checked against the model
    load(step_dir)   every rank reads its slices in its own layout (CKPT_LOAD)
    save(step)       every rank writes its shard (CKPT_SAVE); sync: committed on return;
                     async: the ranks snapshot and return, the commit follows later
    poll()           after a step: commit an async save whose ranks are all durable
    drain()          wait for an async save in flight and commit it (before a stop, at the end);
                     a stop waits only as long as Slurm leaves, else the save is abandoned
    forget()         after a failure: an async save in flight will never be committed

The commit itself (manifest last, rename, ``latest``, retention) is core.checkpoint.commit;
each commit and each async start is an event in the run's history. No torch, no h5py:
this runs in the controller.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from core.checkpoint import calls, manifest
from core.checkpoint.commit import commit, quarantine, tmp_step_dir
from core.checkpoint.loop import LoopState
from core.checkpoint.spec import ShardAck
from core.config.dims import ParallelDims
from core.errors import CheckpointError, ConfigError, TransientIOError, is_transient
from core.record import events as ev
from core.record.runfolder import write_atomic
from core.record.state import RunRecord
from core.wire.calls import Step
from core.wire.contract import Method

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often a bounded drain asks the ranks whether their shards are durable


class Group(Protocol):
    """What the coordinator needs of the group whose ranks checkpoint (the trainer's role
    group, core.controller.roles.RoleGroup)."""

    @property
    def dims(self) -> ParallelDims: ...

    @property
    def epoch(self) -> int: ...

    @property
    def generation(self) -> int: ...

    def call(self, method: Method[Any, Any], request: Any = ..., *, timeout_s: float | None = None) -> list[Any]: ...


@dataclass(frozen=True, kw_only=True)
class Pending:
    """An async save the ranks are still writing."""

    step: int
    tmp: Path
    started: float  # perf_counter
    loop: LoopState  # what the manifest records of the controller's loop
    attached: dict[str, Any] = dataclasses.field(default_factory=dict)  # the controller's files: name → size, checksum


class CheckpointCoordinator:
    def __init__(self, group: Group, record: RunRecord, *, root: Path, model_hash: str, keep_last: int,
                 async_save: bool, timeout_s: float, poll_timeout_s: float,
                 on_commit: Callable[[float, int], None] | None = None,
                 now: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.group = group
        self.record = record
        self.root = root
        self.model_hash = model_hash
        self.keep_last = keep_last
        self.async_save = async_save
        self.timeout_s = timeout_s
        self.poll_timeout_s = poll_timeout_s
        self.on_commit = on_commit  # (seconds, bytes): the metrics endpoint
        self._now, self._sleep = now, sleep  # a bounded drain's clock
        self.last_save_s: float | None = None  # how long the last save took to commit
        self._pending: Pending | None = None
        self.pinned: set[int] = set()  # steps retention keeps for the run's life (an RL run's reference)

    # --- resume -----------------------------------------------------------------------------
    def resume_point(self, *, from_scratch: bool = False, recorded: Sequence[int] = ()) -> Path | None:
        """The newest committed checkpoint that verifies (any layout), or None when there is none.

        ``recorded``: the steps the run's record says are committed and not retired. When the
        newest of them is gone (moved, purged) the resume would go back: a CheckpointError
        naming it, unless ``from_scratch`` (`baton submit --resume RUN --from-scratch`). Each
        newer one that fails verification is set aside (kept, named in an event); a storage
        error reading one is raised (TransientIOError: recovery retries it), never taken for
        damage. When checkpoints existed but none verifies, the run does not start again from
        step 0 unless ``from_scratch``: a CheckpointError naming them. One saved with another
        model is a ConfigError: it would load wrong shapes."""
        refusal, notes = manifest.vanished(self.root, recorded)
        if refusal is not None and not from_scratch:
            raise CheckpointError(refusal)
        for note in notes:
            log.warning("%s", note)
        step_dir = None
        for step in reversed(manifest.committed_steps(self.root)):
            candidate = self.root / manifest.step_dir_name(step)
            problems = manifest.verify(candidate)
            if not problems:
                step_dir = candidate
                break
            aside = quarantine(candidate, "; ".join(problems))
            self.record.append(ev.CheckpointDamaged(step=step, folder=aside.name, problems="; ".join(problems)))
        if step_dir is None:
            damaged = manifest.damaged(self.root)
            if damaged and not from_scratch:
                raise CheckpointError(
                    f"{self.root}: no checkpoint verifies ({', '.join(p.name for p in damaged)} failed and are kept); "
                    "the run does not start over by itself: `baton submit --resume RUN --from-scratch` starts it "
                    "again from step 0")
            return None
        saved = manifest.read_manifest(step_dir)
        if saved.config_hash not in (None, self.model_hash):
            raise ConfigError(
                f"{step_dir}: saved with another model (config hash {saved.config_hash}, "
                f"this config {self.model_hash}); resume with the run's own model section")
        return step_dir

    def load(self, step_dir: Path) -> int:
        """Every rank loads ``step_dir``; the step it holds."""
        t0 = time.perf_counter()
        self.group.call(calls.CKPT_LOAD, calls.Load(step_dir=str(step_dir)), timeout_s=self.timeout_s)
        saved = manifest.read_manifest(step_dir)
        self.record.append(ev.Resumed(step=saved.step, checkpoint=step_dir.name, saved_layout=saved.layout,
                                      layout=self.group.dims.describe(), seconds=round(time.perf_counter() - t0, 3)))
        log.info("resumed from %s (saved as %s, now %s)", step_dir, saved.layout, self.group.dims.describe())
        return saved.step

    def committed(self, step: int) -> bool:
        return step in manifest.committed_steps(self.root)

    # --- save -------------------------------------------------------------------------------
    def save(self, loop: LoopState, *, blocking: bool = False, timeout_s: float | None = None,
             attachments: Mapping[str, bytes] | None = None) -> None:
        """Order every rank to write its shard of ``loop.step``; commit once all have acked.
        ``attachments``: files of the controller's (name → bytes) written into the step's folder
        first, their sizes and checksums in the manifest (``meta.attachments``), verified with it."""
        self.drain()
        step = loop.step
        loop = dataclasses.replace(loop, epoch=self.group.epoch, generation=self.group.generation)
        tmp = tmp_step_dir(self.root, step)
        attached = {name: _attach(tmp / name, data) for name, data in (attachments or {}).items()}
        attrs = calls.ShardAttrs(step=step, layout=self.group.dims.describe(), config_hash=self.model_hash)
        async_save = self.async_save and not blocking
        t0 = time.perf_counter()
        saved = self.group.call(calls.CKPT_SAVE, calls.Save(step=step, tmp_dir=str(tmp), attrs=attrs,
                                                            async_save=async_save),
                                timeout_s=timeout_s or self.timeout_s)
        if async_save:
            self._pending = Pending(step=step, tmp=tmp, started=t0, loop=loop, attached=attached)
            self.record.append(ev.CheckpointStarted(step=step, blocked_s=round(time.perf_counter() - t0, 3)))
            return
        self._commit(Pending(step=step, tmp=tmp, started=t0, loop=loop, attached=attached), [s.ack for s in saved])

    def poll(self) -> None:
        """Commit the async save in flight if every rank has made its shard durable."""
        p = self._pending
        if p is None:
            return
        acks = self.group.call(calls.CKPT_POLL, Step(step=p.step), timeout_s=self.poll_timeout_s)
        if all(a is not None for a in acks):
            self._pending = None
            self._commit(p, acks)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for the async save in flight (if any) and commit it; True when none is left.

        ``timeout_s`` shorter than the checkpoint timeout (the time Slurm leaves a stop): the
        ranks are polled until then, each left free to be released; a save not durable by
        then is abandoned (an event says so; its folder is debris, the last committed
        checkpoint stands) and False returned."""
        p = self._pending
        if p is None:
            return True
        if timeout_s is None or timeout_s >= self.timeout_s:
            self._pending = None
            self._commit(p, self.group.call(calls.CKPT_WAIT, Step(step=p.step), timeout_s=self.timeout_s))
            return True
        start = self._now()
        while True:
            acks = self.group.call(calls.CKPT_POLL, Step(step=p.step), timeout_s=self.poll_timeout_s)
            if all(a is not None for a in acks):
                self._pending = None
                self._commit(p, acks)
                return True
            waited = self._now() - start
            if waited >= timeout_s:
                break
            self._sleep(min(POLL_S, timeout_s - waited))
        self._pending = None
        self.abandon(p.step, waited, f"the async save of step {p.step} was not durable within {timeout_s:.0f} s, "
                                     "the time the job has left")
        return False

    def abandon(self, step: int, waited_s: float, reason: str) -> None:
        """Record that ``step`` will not be saved (no time is left): the next epoch resumes from
        the newest committed checkpoint."""
        last = manifest.committed_steps(self.root)
        self.record.append(ev.CheckpointAbandoned(step=step, waited_s=round(waited_s, 3),
                                                  resume_step=last[-1] if last else None, reason=reason))
        log.warning("checkpoint of step %d abandoned after %.1f s: %s", step, waited_s, reason)

    def forget(self) -> None:
        """After a failure: the async save in flight will never be committed (its folder is debris)."""
        self._pending = None

    def _commit(self, p: Pending, acks: list[ShardAck]) -> None:
        dims = self.group.dims
        meta = {
            "layout": dims.describe(),
            "dims": {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp},
            "config_hash": self.model_hash,
            "loop": p.loop.to_meta(),
            **({"attachments": p.attached} if p.attached else {}),
        }
        retired: list[int] = []
        try:
            final = commit(self.root, p.step, p.tmp, acks, meta, world_size=self.group.dims.world_size,
                           keep_last=self.keep_last, pinned=frozenset(self.pinned), retired=retired)
        except OSError as exc:
            if is_transient(exc):
                raise TransientIOError(f"{p.tmp}: the commit of step {p.step} failed ({exc}); a storage fault: "
                                       "retried within recovery.max_retries") from exc
            raise
        seconds = time.perf_counter() - p.started
        self.last_save_s = seconds
        nbytes = sum(a.size_bytes for a in acks)
        self.record.append(ev.CheckpointCommitted(step=p.step, folder=final.name, seconds=round(seconds, 3),
                                                  bytes=nbytes, retired=tuple(retired)))
        log.info("checkpoint of step %d committed in %.2f s (%.1f MB)", p.step, seconds, nbytes / 1e6)
        if self.on_commit is not None:
            self.on_commit(seconds, nbytes)


def _attach(path: Path, data: bytes) -> dict[str, Any]:
    """Write one of the controller's files into a save's folder (durable before the commit)."""
    write_atomic(path, data, mode=0o600)
    return {"size_bytes": len(data), "checksum": manifest.file_checksum(path)}
