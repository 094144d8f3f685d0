"""The contract between the controller and its supervisor, the process that starts things.

The supervisor is launcher/local.py locally and the batch script on Slurm. It starts the
controller and generation 0 of the workers; afterwards it acts only on what it is told:

``workers.json`` ``{"epoch": e, "generation": g, "exclude": [...], "ranks": [...], "reason": "...", "time": t}``
    written by the controller once it has declared workers lost and aborted the rest:
    "start generation g of the worker step of epoch e" (env ``BATON_GENERATION=g``). The
    supervisor first ends, by pid, whatever is left of the previous generation (a stopped
    process does not act on an abort), then starts the new one. ``ranks`` non-empty: only
    those workers are ended and started again (whole worker groups: a split generator's,
    which is one Slurm het component, restarted while the trainer's go on); the others keep
    running and count as generation g from then on.

the controller's exit, read from the run record (exit codes do not survive every wrapper)
    status ``requeued`` (exit ``ExitCode.REQUEUED``): start the next epoch (on Slurm the job
    was requeued; locally the supervisor relaunches with epoch + 1); a final status
    (completed, failed, stopped, cancelled): done; still ``running``: the controller died
    without a last word, so the supervisor requeues within ``recovery.max_retries``
    (``after_controller``).

A supervisor says it honours ``workers.json`` by setting ``BATON_WORKER_RESTARTS=1`` in
the controller's environment; without it, a lost worker costs a requeue instead.

The retry budget (``RunState.recovery``, a ``core.record.state.Budget``) is shared by both
sides: the controller spends it on worker failures, the supervisor on controller deaths.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from core.errors import ExitCode
from core.record import events as ev
from core.record.lock import controller_alive
from core.record.runfolder import RunFolder, read_json, write_json
from core.record.state import RunRecord, Status


def request_path(run: RunFolder) -> Path:
    return run.path / "workers.json"


@dataclass(frozen=True, kw_only=True)
class WorkerRequest:
    """Start generation ``generation`` of epoch ``epoch``'s worker step."""

    epoch: int
    generation: int
    exclude: tuple[str, ...] = ()
    reason: str = ""
    time: float = 0.0
    ranks: tuple[int, ...] = ()  # only these workers (whole groups); () every one

    def restarts(self, rank: int) -> bool:
        """Whether this request ends and starts again the worker of ``rank``."""
        return not self.ranks or rank in self.ranks


def request_workers(run: RunFolder, req: WorkerRequest) -> None:
    """The controller's side: ask for a (new) generation of workers."""
    write_json(request_path(run), {"epoch": req.epoch, "generation": req.generation, "exclude": list(req.exclude),
                                   "ranks": list(req.ranks), "reason": req.reason, "time": req.time or time.time()})


def read_request(run: RunFolder) -> WorkerRequest | None:
    """The supervisor's side: the latest request, None when there is none (or it is unreadable)."""
    try:
        d = read_json(request_path(run))
        return WorkerRequest(epoch=int(d["epoch"]), generation=int(d["generation"]),
                             exclude=tuple(d.get("exclude", ())), reason=str(d.get("reason", "")),
                             time=float(d.get("time", 0.0)), ranks=tuple(int(r) for r in d.get("ranks", ())))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def after_controller(run: RunFolder, exit_code: int, *, max_retries: int, committed_step: int | None,
                     ending: str = "") -> Status:
    """The supervisor's decision once the controller has exited: ``REQUEUED`` (start the next
    epoch) or the run's final status (stop).

    A controller that left any other status (``running``, or one from before it started)
    died: killed, OOM, a crash before its handlers ran. That spends one retry, recorded in
    the run's history with the exit code, unless the scheduler is ending the job (``ending``
    says how, e.g. a ``scancel`` that reached the job while its controller was starting):
    then the run stops, as a controller stops when Slurm ends its job, and is not requeued.
    One that exited with ``ExitCode.USER_ERROR`` said why on its way out (bad input, or
    another controller holding the run): nothing to retry, and the record is left as it is
    (it may be the other controller's).
    """
    record = RunRecord(run)
    if exit_code == ExitCode.USER_ERROR and controller_alive(run) is not None:
        return Status.FAILED  # this job's controller was refused; the run belongs to the live one
    with record.update() as s:
        if exit_code == ExitCode.USER_ERROR and not s.status.final and s.status is not Status.REQUEUED:
            record.append(ev.Failed(reason=f"the controller refused to start (bad input); see {run.controller_log}",
                                    step=s.step))
            return s.status
        if s.status is Status.REQUEUED or s.status.final:
            return s.status
        if ending:
            record.append(ev.Stopped(step=s.step, reason=(
                f"Slurm is ending the job ({ending}; scancel or the time limit) and its controller exited "
                f"({_how(exit_code)}) at step {s.step}: not requeued; continue with `baton submit --resume`")))
            return s.status
        s.recovery = s.recovery.spend(nodes=(), step=s.step, committed_step=committed_step)
        how = _how(exit_code)
        record.append(ev.ControllerDied(exit_code=exit_code, step=s.step, epoch=s.epoch, retry=s.recovery.retries,
                                        max_retries=max_retries))
        if s.recovery.retries > max_retries:
            record.append(ev.Failed(reason=(f"the controller died ({how}) with no retries left ({max_retries} used, "
                                            f"recovery.max_retries); see {run.controller_log}"), step=s.step))
        else:
            record.append(ev.Requeued(by="supervisor", reason=f"the controller died ({how})", step=s.step,
                                      epoch=s.epoch))
        return s.status


def _how(exit_code: int) -> str:
    return f"signal {-exit_code}" if exit_code < 0 else f"exit code {exit_code}"
