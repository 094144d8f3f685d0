"""The run record: the one module that reads and writes a run's state and history.

Two files in the run folder, one lock beside them:

    state.json     the current state (``RunState``): status, step, restarts, ranks, the
                   retry budget, goodput; replaced atomically (temporary file, fsync, rename)
    events.jsonl   the history, one ``core.record.events`` event per line, appended
    state.lock     held exclusively by every writer while it reads, changes and writes
                   (``RunRecord.update``, ``RunRecord.append``): flock, fcntl or a lease
                   file, whichever the filesystem gives across nodes (core.record.lock)

An event changes the state one way only: ``FOLD`` says what each kind sets, and every
event appended (``update``, ``append``, ``create``) is folded in; a writer sets by hand only
what no event carries (the step, the loss, goodput, the retry budget).

Every process goes through here: the CLI (submit, resume, cancel), the controller, the
batch script's supervisor, the local supervisor and the sweep ledger. Readers need no
lock (a replaced file is whole). A reader of a file from an older Baton (version 1: an
untyped state.json holding its history) converts it; a damaged or newer file is a
one-line ``RunFolderError`` naming the file.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from core.config.schema import build, to_data
from core.errors import RunFolderError
from core.record import events as ev
from core.record.events import RankInfo
from core.record.lock import exclusive
from core.record.runfolder import RunFolder, write_atomic

log = logging.getLogger(__name__)

VERSION = 2


class Status(enum.StrEnum):
    """Where a run stands."""

    CREATED = "created"  # the run folder is written; nothing started yet
    SUBMITTED = "submitted"  # Slurm holds the job
    RESUMING = "resuming"  # `baton submit --resume`: the next epoch is being started
    RUNNING = "running"  # a controller runs it
    REQUEUED = "requeued"  # checkpointed; the next epoch follows (Slurm's requeue, or the local supervisor)
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"  # checkpointed while Slurm ended the job (scancel, time limit): resume by hand
    CANCELLED = "cancelled"  # `baton cancel`

    @property
    def final(self) -> bool:
        """Nothing will run it again without the user (a resume)."""
        return self in (Status.COMPLETED, Status.FAILED, Status.STOPPED, Status.CANCELLED)


@dataclass(frozen=True, kw_only=True)
class Budget:
    """Retries spent since the run last made durable progress, and failures per node.

    Spent by the controller on worker failures and by the supervisors on controller
    deaths. It resets once a checkpoint newer than the last failure commits: a run that
    fails once a day is not a run that fails.
    """

    retries: int = 0
    node_failures: dict[str, int] = field(default_factory=dict)
    exclude: tuple[str, ...] = ()
    down: tuple[str, ...] = ()  # of ``exclude``: those excluded while Slurm had them down or drained
    last_failure_step: int = -1

    def spend(self, *, nodes: tuple[str, ...], step: int, committed_step: int | None) -> Budget:
        """One more failure at ``step`` on ``nodes``. The retries are forgiven first if a newer
        checkpoint committed (the run made progress); a node's failures are not: a node that
        fails now and then, however far apart, is still the node to exclude."""
        b = self
        if committed_step is not None and b.last_failure_step >= 0 and committed_step > b.last_failure_step:
            b = replace(b, retries=0)
        counts = dict(b.node_failures)
        for n in nodes:
            counts[n] = counts.get(n, 0) + 1
        return replace(b, retries=b.retries + 1, node_failures=counts, last_failure_step=step)


@dataclass(frozen=True, kw_only=True)
class Goodput:
    """Seconds the run held its allocation, and of those, spent in steps that survived."""

    allocated_s: float = 0.0
    useful_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class SlurmInfo:
    job_id: str | None = None
    controller_task: dict[str, str | int | None] = field(default_factory=dict)  # what component 0's task saw of Slurm


@dataclass(kw_only=True)
class RunState:
    """state.json. Mutable inside ``RunRecord.update``; a copy everywhere else."""

    version: int = VERSION
    status: Status = Status.CREATED
    backend: str = ""
    step: int = 0  # steps done
    total_steps: int = 0
    restarts: int = 0  # epochs after the first: requeues and resumes
    epoch: int = 0
    generation: int = 0  # which start of the workers within the epoch
    created: float = 0.0
    updated: float = 0.0
    last_loss: float | None = None
    reason: str = ""  # why it failed or stopped
    micro_batch_size: int | None = None  # as the workers resolved it
    from_scratch: bool = False  # granted by `--resume --from-scratch`, used up by the next controller
    checkpoints: tuple[int, ...] = ()  # the steps of the committed checkpoints retention has not deleted
    retired: tuple[int, ...] = ()  # the steps of those retention deleted
    ranks: tuple[RankInfo, ...] = ()
    recovery: Budget = field(default_factory=Budget)
    goodput: Goodput = field(default_factory=Goodput)
    slurm: SlurmInfo = field(default_factory=SlurmInfo)

    def copy(self) -> RunState:
        return dataclasses.replace(self)


# --- the fold: what each event changes in the state -----------------------------------------
# One entry per kind that changes the state: (state, event) → the fields it sets. Kinds not
# here only inform (damaged checkpoints, losses, decisions whose numbers the writer keeps by hand:
# the retry budget, the step). ``RunRecord`` folds every event it appends.
FOLD: dict[type[ev.Event], Callable[[RunState, Any], dict[str, Any]]] = {
    ev.Created: lambda s, e: {"status": Status.CREATED, "backend": e.backend},
    ev.ResumeRequested: lambda s, e: {"status": Status.RESUMING, "restarts": e.epoch, "from_scratch": e.from_scratch},
    ev.Submitted: lambda s, e: {"status": Status.SUBMITTED, "backend": e.backend,
                                "slurm": replace(s.slurm, job_id=e.job_id)},
    ev.SubmitFailed: lambda s, e: {"status": Status.FAILED, "reason": f"sbatch refused the job: {e.reason}"},
    ev.Cancelled: lambda s, e: {} if s.status in (Status.COMPLETED, Status.FAILED) else {"status": Status.CANCELLED},
    ev.ControllerStarted: lambda s, e: {"status": Status.RUNNING, "epoch": e.epoch, "restarts": e.epoch, "reason": "",
                                        **({} if e.total_steps is None else {"total_steps": e.total_steps})},
    ev.WorkersReady: lambda s, e: {"ranks": e.ranks, "generation": e.generation, "micro_batch_size": e.micro_batch_size},
    ev.RestartingWorkers: lambda s, e: {"generation": e.generation, **({} if e.step is None else {"step": e.step})},
    ev.CheckpointCommitted: lambda s, e: {
        "checkpoints": tuple(sorted({*s.checkpoints, e.step} - set(e.retired))),
        "retired": tuple(sorted({*s.retired, *e.retired} - {e.step}))},
    # A resume goes on from e.step: the checkpoints past it are gone (damaged, or given up by
    # --from-scratch) and will be saved again; from step 0, none of the old ones counts.
    ev.Resumed: lambda s, e: {"checkpoints": tuple(c for c in s.checkpoints if c <= e.step)},
    ev.RestartFromScratch: lambda s, e: {"checkpoints": ()},
    ev.Requeued: lambda s, e: {"status": Status.REQUEUED},
    ev.Completed: lambda s, e: {"status": Status.COMPLETED, "reason": ""},
    ev.Stopped: lambda s, e: {"status": Status.STOPPED, "reason": e.reason},
    ev.Failed: lambda s, e: {"status": Status.FAILED, "reason": e.reason},
}


def apply(state: RunState, event: ev.Event) -> None:
    """Fold ``event`` into ``state``, in place (a kind that changes nothing leaves it as it is)."""
    fold = FOLD.get(type(event))
    for name, value in (fold(state, event) if fold is not None else {}).items():
        setattr(state, name, value)


def state_to_data(state: RunState) -> dict[str, Any]:
    """state.json's content."""
    return to_data(state)  # type: ignore[no-any-return]


def state_from_data(data: Any, where: str) -> RunState:
    """The inverse of ``state_to_data``; a file of version 1 is converted (its history is dropped here)."""
    if not isinstance(data, dict):
        raise RunFolderError(f"{where}: holds a JSON {type(data).__name__}, not an object; the run folder is damaged")
    version = data.get("version", 1)
    if not isinstance(version, int) or version > VERSION:
        raise RunFolderError(f"{where}: version {version!r}, this Baton reads ≤ {VERSION}; upgrade Baton to read it")
    if version == 1:
        data = _from_version_1(data)
    return build(RunState, data, where, error=RunFolderError)


_V1_KEYS = {f.name for f in dataclasses.fields(RunState)}


def _from_version_1(data: dict[str, Any]) -> dict[str, Any]:
    """An untyped state.json of an older Baton: known keys kept, "requeue" read as "requeued"."""
    out = {k: v for k, v in data.items() if k in _V1_KEYS}
    out["version"] = VERSION
    if out.get("status") == "requeue":
        out["status"] = Status.REQUEUED.value
    if out.get("status") not in {s.value for s in Status}:
        out["status"] = Status.CREATED.value
    out["reason"] = out.get("reason") or ""
    if not isinstance(out.get("last_loss"), int | float):
        out.pop("last_loss", None)
    slurm = out.get("slurm")
    if isinstance(slurm, dict):
        out["slurm"] = {"job_id": None if slurm.get("job_id") is None else str(slurm["job_id"]),
                        "controller_task": dict(slurm.get("controller_task") or {})}
    ranks = out.get("ranks")
    if isinstance(ranks, list):
        known = {f.name for f in dataclasses.fields(RankInfo)}
        out["ranks"] = [{k: v for k, v in r.items() if k in known} for r in ranks if isinstance(r, dict)]
        for r in out["ranks"]:
            if isinstance(r.get("coords"), dict):
                r["coords"] = {"rank": r.get("rank", 0), **r["coords"]}
    return out


class RunRecord:
    """state.json and events.jsonl of one run folder, behind one lock."""

    def __init__(self, run: RunFolder) -> None:
        self.run = run
        self.path = run.state
        self.events_path = run.events
        self.lock_path = run.path / "state.lock"
        # What this process last wrote: (the file's bytes, state). A writer that finds the file
        # as it left it skips the parse and the typed build (the controller's per-step update).
        self._last: tuple[bytes, RunState] | None = None
        self._held = False
        self._state: RunState | None = None  # inside ``update``: the state being changed

    # --- reading: no lock ---------------------------------------------------------------------
    def exists(self) -> bool:
        return self.path.is_file()

    def read(self) -> RunState:
        """The current state; a missing, damaged or newer file is a RunFolderError."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            raise RunFolderError(f"{self.path}: missing; not a Baton run folder, or one from before "
                                 "`baton submit` finished writing it") from None
        except OSError as exc:
            raise RunFolderError(f"{self.path}: unreadable ({exc.strerror})") from None
        return state_from_data(_parse_json(raw, self.path), str(self.path))

    def events(self) -> list[ev.Event]:
        """The history, oldest first. A torn line (a crash mid-append) or a line that is not an
        event this Baton knows is skipped with a warning: the history informs, it never blocks."""
        out = []
        for n, d in self._event_lines():
            try:
                out.append(ev.from_data(d, f"{self.events_path} line {n}"))
            except RunFolderError as exc:
                log.warning("skipped: %s", exc)
        if not out and not self.events_path.exists():
            out = self._version_1_history()
        return out

    def _event_lines(self) -> Iterator[tuple[int, Any]]:
        try:
            raw = self.events_path.read_bytes()
        except FileNotFoundError:
            return
        for n, line in enumerate(raw.split(b"\n"), start=1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except ValueError:  # the part of an event a crash cut short; the appends after it go on
                log.warning("%s line %d: skipped a torn event (%d bytes)", self.events_path, n, len(line))

    def _version_1_history(self) -> list[ev.Event]:
        try:
            data = json.loads(self.path.read_bytes())
        except (OSError, ValueError):
            return []
        history = data.get("history") if isinstance(data, dict) else None
        return [ev.from_data(d, f"{self.path} history[{i}]") for i, d in enumerate(history or [])]

    # --- writing: under the lock ----------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if self._held:  # flock is per open file: a nested update would wait for itself
            raise RuntimeError(f"{self.lock_path}: already held by this RunRecord (an update inside an update)")
        with exclusive(self.lock_path):
            self._held = True
            try:
                yield
            finally:
                self._held = False

    @contextlib.contextmanager
    def update(self, *new_events: ev.Event) -> Iterator[RunState]:
        """Read, fold ``new_events`` in, let the caller change what no event carries, write:
        ``with record.update(ev.RestartingWorkers(...)) as s: s.step = 10``.

        ``new_events`` are appended to the history under the same lock, after state.json is
        written. An event ``append``ed inside the body is folded into ``s`` and appended at
        once. A missing state.json starts from a fresh ``RunState``. Nothing is written when
        the body raises.
        """
        with self._locked():
            state = self._read_for_update()
            for e in new_events:
                apply(state, e)
            self._state = state
            try:
                yield state
            finally:
                self._state = None
            self._write(state)
            if new_events:
                self._append(new_events)

    def append(self, *events: ev.Event) -> None:
        """Add ``events`` to the history, folding those that change the state into state.json
        (written first); inside ``update``, into the state being updated."""
        if self._state is not None:  # inside update
            for e in events:
                apply(self._state, e)
            self._append(events)
            return
        if not any(type(e) in FOLD for e in events):
            with self._locked():
                self._append(events)
            return
        with self.update(*events):
            pass

    def create(self, state: RunState, *events: ev.Event) -> None:
        """Write the first state of a new run folder, ``events`` folded in."""
        with self._locked():
            for e in events:
                apply(state, e)
            self._write(state)
            self._append(events)

    def _read_for_update(self) -> RunState:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return RunState()
        if self._last is not None and self._last[0] == raw:
            return self._last[1].copy()
        state = state_from_data(_parse_json(raw, self.path), str(self.path))
        if state.version == VERSION and not self.events_path.exists():
            self._migrate_history()
        return state

    def _migrate_history(self) -> None:
        """A version-1 state.json kept its history inside: move it to events.jsonl once."""
        history = self._version_1_history()
        if history:
            self._append(history)

    def _write(self, state: RunState) -> None:
        raw = (json.dumps(state_to_data(state), indent=1) + "\n").encode()
        write_atomic(self.path, raw)
        self._last = (raw, state.copy())

    def _append(self, events: tuple[ev.Event, ...] | list[ev.Event]) -> None:
        if not events:
            return
        data = "".join(json.dumps(ev.to_data(e)) + "\n" for e in events).encode()
        fd = os.open(self.events_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data  # a torn line stays alone: never glued to the next event
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)


def _parse_json(raw: bytes, path: Path) -> Any:
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise RunFolderError(f"{path}: not valid JSON ({exc}); the run folder is damaged") from None
    except RecursionError:
        raise RunFolderError(f"{path}: nested too deeply to be a Baton file; the run folder is damaged") from None
