"""The events of a run's history: one frozen dataclass per kind, and an explicit kind table.

Every process that changes a run appends events (the CLI at submit, resume and cancel;
the controller as the run goes; the supervisors when a controller dies); `baton status`
shows them. On disk (``events.jsonl``, one JSON object a line, written by
``core.record.state``) an event is flat: ``{"time": 1.7e9, "event": "resumed", "step": 10, ...}``.

``to_data`` and ``from_data`` are inverses. A line of a kind this Baton does not know
(written by a newer one) is kept as ``OtherEvent`` and written back unchanged. What an
event changes in the run's state is ``core.record.state.FOLD``'s: the events here carry
every value the state takes from them (fields added later have defaults, so older
events.jsonl files still read).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from core.config.dims import Coords
from core.config.schema import build
from core.config.schema import to_data as _plain
from core.errors import RunFolderError


@dataclass(frozen=True, kw_only=True)
class Event:
    """When it happened (unix seconds); each kind adds its own fields."""

    KIND: ClassVar[str] = ""
    time: float = field(default_factory=time.time)


# --- the CLI -------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Created(Event):
    KIND: ClassVar[str] = "created"
    backend: str


@dataclass(frozen=True, kw_only=True)
class ResumeRequested(Event):
    KIND: ClassVar[str] = "resume_requested"
    epoch: int
    overrides: tuple[str, ...] = ()
    from_scratch: bool = False  # `--from-scratch`: start again at step 0 if no checkpoint verifies


@dataclass(frozen=True, kw_only=True)
class Submitted(Event):
    KIND: ClassVar[str] = "submitted"
    backend: str
    job_id: str
    epoch: int


@dataclass(frozen=True, kw_only=True)
class SubmitFailed(Event):
    """sbatch refused the job (``reason``: its last line of output)."""

    KIND: ClassVar[str] = "submit_failed"
    reason: str


@dataclass(frozen=True, kw_only=True)
class Cancelled(Event):
    KIND: ClassVar[str] = "cancelled"
    job_id: str
    slurm: dict[str, str] = field(default_factory=dict)


# --- the controller ------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ControllerStarted(Event):
    KIND: ClassVar[str] = "controller_started"
    node: str
    epoch: int
    pid: int
    started_at: float | None = None  # unix time the controller process started: its epoch's allocated time begins
    total_steps: int | None = None  # trainer.steps of this epoch's config (None: an older Baton's event)


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """One worker as the controller last saw it set up."""

    rank: int
    node: str
    host: str
    pid: int
    coords: Coords | None = None
    layers: tuple[int, ...] = ()
    num_params: int = 0
    device: str = ""
    role: str = "trainer"  # or "generator": a split generator's rank (its coords in the generator's layout)


@dataclass(frozen=True, kw_only=True)
class WorkersReady(Event):
    KIND: ClassVar[str] = "workers_ready"
    world_size: int
    epoch: int
    generation: int
    micro_batch_size: int | None = None  # as the workers resolved it (``auto``)
    ranks: tuple[RankInfo, ...] = ()  # every worker, set up (none in an older Baton's event)


@dataclass(frozen=True, kw_only=True)
class Resumed(Event):
    KIND: ClassVar[str] = "resumed"
    step: int
    checkpoint: str
    saved_layout: Any
    layout: str
    seconds: float


@dataclass(frozen=True, kw_only=True)
class CheckpointDamaged(Event):
    """A committed checkpoint failed verification: set aside (kept), never loaded."""

    KIND: ClassVar[str] = "checkpoint_damaged"
    step: int
    folder: str  # where it was set aside
    problems: str


@dataclass(frozen=True, kw_only=True)
class InitialisedFrom(Event):
    """``init_from``: a new run's model weights came from another run's checkpoint."""

    KIND: ClassVar[str] = "initialised_from"
    checkpoint: str
    step: int


@dataclass(frozen=True, kw_only=True)
class RestartFromScratch(Event):
    KIND: ClassVar[str] = "restart_from_scratch"
    reason: str


@dataclass(frozen=True, kw_only=True)
class SyncPeriodChanged(Event):
    """``parallel.sync.adaptive_latency_ms``: the replicas now average every ``every`` steps
    (was ``was``): the median of the last averaging all-reduces was ``median_ms``."""

    KIND: ClassVar[str] = "sync_period_changed"
    step: int
    every: int
    was: int
    median_ms: float


@dataclass(frozen=True, kw_only=True)
class Preempted(Event):
    """A stop at a step boundary: a signal arrived (preemption, walltime warning, scancel)."""

    KIND: ClassVar[str] = "preempted"
    step: int
    cause: str
    signal: str
    detail: str
    time_left_s: float | None = None
    signal_at: float | None = None


@dataclass(frozen=True, kw_only=True)
class TimeRunningOut(Preempted):
    """A stop at a step boundary before Slurm had to send anything: the walltime is near."""

    KIND: ClassVar[str] = "time_running_out"


@dataclass(frozen=True, kw_only=True)
class CheckpointStarted(Event):
    KIND: ClassVar[str] = "checkpoint_started"
    step: int
    blocked_s: float


@dataclass(frozen=True, kw_only=True)
class CheckpointCommitted(Event):
    """A checkpoint committed; ``retired``: the older ones retention deleted after it."""

    KIND: ClassVar[str] = "checkpoint_committed"
    step: int
    folder: str
    seconds: float
    bytes: int
    retired: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class NodeReadmitted(Event):
    """A node Baton had excluded is back in service in Slurm: the next requeue no longer
    excludes it (``failures``: what it now counts, one short of the limit)."""

    KIND: ClassVar[str] = "node_readmitted"
    node: str
    step: int
    failures: int


@dataclass(frozen=True, kw_only=True)
class ExcludeAdjusted(Event):
    """How a requeue's exclusion list was made where it could not simply add Baton's nodes
    (the job's list unreadable, nodes back in service, a partition too small)."""

    KIND: ClassVar[str] = "exclude_adjusted"
    why: str
    exclude: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class CheckpointAbandoned(Event):
    """A stop could not wait for an async save in flight (Slurm ends the job first): the
    next epoch resumes from ``resume_step`` (None: from the start)."""

    KIND: ClassVar[str] = "checkpoint_abandoned"
    step: int
    waited_s: float
    resume_step: int | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class WorkerLost(Event):
    KIND: ClassVar[str] = "worker_lost"
    failure: str  # "worker_lost" | "timeout" | "registration" | "remote_error"
    rank: int | None
    node: str | None
    pid: int | None
    why: str
    step: int
    epoch: int
    generation: int


@dataclass(frozen=True, kw_only=True)
class NodeFailed(Event):
    """A node of the run that Slurm took out of service (down, drained, failing) when it requeued the job."""

    KIND: ClassVar[str] = "node_failed"
    node: str
    state: str  # Slurm's (sinfo %T): down, down*, drained, draining, fail, ...
    why: str  # the node's reason in Slurm (sinfo %E)
    step: int
    failures: int  # this node's failures so far (recovery.node_failure_limit excludes it)


@dataclass(frozen=True, kw_only=True)
class RequeueDecided(Event):
    KIND: ClassVar[str] = "requeue_decided"
    reason: str
    exclude: tuple[str, ...]
    retry: int
    max_retries: int


@dataclass(frozen=True, kw_only=True)
class RestartingWorkers(Event):
    KIND: ClassVar[str] = "restarting_workers"
    generation: int
    backoff_s: float
    retry: int
    max_retries: int
    step: int | None = None  # steps done: the new generation resumes from the latest checkpoint (None: an older Baton's)
    ranks: tuple[int, ...] = ()  # the only ranks restarted (a split generator's; the trainer's went on), () all


@dataclass(frozen=True, kw_only=True)
class Requeued(Event):
    """The run goes to its next epoch: asked by the controller, or by a supervisor whose
    controller died without a last word (``by``)."""

    KIND: ClassVar[str] = "requeued"
    step: int
    reason: str
    epoch: int | None = None
    exclude: tuple[str, ...] = ()
    by: str = "controller"
    backend: str = ""


@dataclass(frozen=True, kw_only=True)
class Completed(Event):
    KIND: ClassVar[str] = "completed"
    step: int


@dataclass(frozen=True, kw_only=True)
class Stopped(Event):
    KIND: ClassVar[str] = "stopped"
    step: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class Failed(Event):
    KIND: ClassVar[str] = "failed"
    reason: str
    step: int


@dataclass(frozen=True, kw_only=True)
class ControllerFenced(Event):
    """A controller found its lock taken over (core.record.lock.check_fence): it stopped, with
    nothing more committed; the run's status is the live controller's to set."""

    KIND: ClassVar[str] = "controller_fenced"
    reason: str
    epoch: int
    pid: int
    node: str


# --- the supervisors -----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ControllerDied(Event):
    KIND: ClassVar[str] = "controller_died"
    exit_code: int
    step: int
    epoch: int | None
    retry: int
    max_retries: int


@dataclass(frozen=True, kw_only=True)
class OtherEvent(Event):
    """An event of a kind this Baton does not know, kept as it was read."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)


KINDS: dict[str, type[Event]] = {cls.KIND: cls for cls in (
    Created, ResumeRequested, Submitted, SubmitFailed, Cancelled, ControllerStarted, WorkersReady, Resumed,
    CheckpointDamaged, InitialisedFrom, RestartFromScratch, SyncPeriodChanged, Preempted, TimeRunningOut, CheckpointStarted, CheckpointCommitted, CheckpointAbandoned, WorkerLost, NodeReadmitted, ExcludeAdjusted,
    NodeFailed, RequeueDecided, RestartingWorkers, Requeued, Completed, Stopped, Failed, ControllerDied,
    ControllerFenced,
)}


def kind_of(event: Event) -> str:
    """The event's kind as written on disk."""
    return event.kind if isinstance(event, OtherEvent) else event.KIND


def to_data(event: Event) -> dict[str, Any]:
    """``{"time": t, "event": kind, **fields}``: the line written to events.jsonl."""
    if isinstance(event, OtherEvent):
        return {"time": event.time, "event": event.kind, **event.fields}
    fields = {f.name: _plain(getattr(event, f.name)) for f in dataclasses.fields(event) if f.name != "time"}
    return {"time": event.time, "event": event.KIND, **fields}


def from_data(data: Any, where: str) -> Event:
    """The inverse of ``to_data``; ``where`` names the file and line in errors."""
    if not isinstance(data, dict) or not isinstance(data.get("event"), str):
        raise RunFolderError(f"{where}: not an event (a JSON object with an \"event\" name): {str(data)[:80]}")
    fields = {k: v for k, v in data.items() if k != "event"}
    cls = KINDS.get(data["event"])
    if cls is None:
        t = fields.pop("time", 0.0)
        return OtherEvent(time=float(t) if isinstance(t, int | float) else 0.0, kind=data["event"], fields=fields)
    return build(cls, fields, f"{where}: {data['event']}", error=RunFolderError)
