"""The controller process: wire the adapters, run the program under recovery, say how it ended.

Started by ``python -m core.entrypoint controller`` (the local backend) or, on Slurm, by
submitit in component 0 of the het job (``run_on_slurm``). Exit codes (core.errors.ExitCode):
OK completed (or stopped: checkpointed while Slurm ends the job), FAILED (the run record
says why), USER_ERROR, REQUEUED (checkpointed; on Slurm the job was requeued, locally the
supervisor relaunches the next epoch).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.checkpoint.coordinator import CheckpointCoordinator
from core.config import run as config_mod
from core.config.runplan import RunPlan, read_plan
from core.controller.group import WorkerGroup
from core.controller.program import Program
from core.controller.recovery import Outcome, Recovery
from core.controller.roles import RoleGroup
from core.controller.stop import StopPolicy
from core.errors import BatonError, BatonRuntimeError, ExitCode
from core.job import logsetup, process, slurmctl
from core.job.env import JobEnv
from core.job.signals import PreemptionFlag
from core.record import events as ev
from core.record.lock import ControllerLockLost, controller_lock
from core.record.runfolder import RunFolder, write_json
from core.record.state import RunRecord, SlurmInfo, Status
from core.supervisor.contract import WorkerRequest, request_workers
from core.wire.transport import ControllerSocket

if TYPE_CHECKING:
    from core.controller.metrics import Metrics  # prometheus_client: imported only when metrics are on

log = logging.getLogger("baton.controller")


def publish_address(run: RunFolder, sock: ControllerSocket, *, host: str, epoch: int) -> dict[str, Any]:
    """Write controller.json so workers can find this controller."""
    info = {
        "address": f"tcp://{host}:{sock.port}", "host": host, "port": sock.port, "epoch": epoch,
        "pid": os.getpid(), "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()), "started": time.time(),
        "job_id": os.environ.get("SLURM_JOB_ID"),  # core.record.lock: a later start of this job waits out this one
        "cluster": os.environ.get("SLURM_CLUSTER_NAME") or None,  # ... asking Slurm only of this cluster's jobs
    }
    write_json(run.controller, info)
    return info


def run_controller(env: JobEnv, *, locked: Callable[[RunFolder], None] | None = None) -> int:
    """The controller role; its ExitCode. ``locked``: what to record once the lock is held."""
    run = RunFolder(env.run_dir)
    logsetup.configure("controller", run.controller_log)
    signals = PreemptionFlag.install()  # before anything slow: a signal now is not lost
    # One controller per run folder, for this whole process; nothing is written before it is held.
    with controller_lock(run, job_id=env.job_id, epoch=env.epoch) as held:
        if locked is not None:
            locked(run)
        try:
            return _run_locked(env, run, signals)
        except ControllerLockLost as exc:
            return _fenced(env, run, str(exc), taken=held.taken_over())


def _fenced(env: JobEnv, run: RunFolder, reason: str, *, taken: bool) -> int:
    """This controller's lease was lost: stop, committing nothing more. Taken over by another
    controller: USER_ERROR (the supervisor leaves the record, now the live one's, and
    requeues nothing). Only a storage stall (no heartbeat written for STALE_S, nobody took
    over): FAILED, a controller death the supervisor retries."""
    log.error("%s", reason)
    try:
        RunRecord(run).append(ev.ControllerFenced(reason=reason, epoch=env.epoch, pid=os.getpid(), node=env.node))
    except (OSError, BatonError) as exc:
        log.warning("could not record the fencing: %s", exc)
    return ExitCode.USER_ERROR if taken else ExitCode.FAILED


def _run_locked(env: JobEnv, run: RunFolder, signals: PreemptionFlag) -> int:
    cfg = config_mod.load(run.config)
    plan = read_plan(run.plan, cfg)
    metrics = None
    if cfg.metrics.enabled:  # first: a port in use fails before the run is marked running
        from core.controller.metrics import Metrics  # prometheus_client: only when metrics are on

        metrics = Metrics()
        metrics.start(run, cfg.metrics.port, host=env.controller_host, bind=cfg.metrics.bind,
                      sd_dir=cfg.metrics.sd_dir)
        metrics.set_restarts(env.epoch)
    try:
        return _run_program(env, run, signals, cfg, plan, metrics)
    finally:
        if metrics is not None:
            metrics.close()  # withdraws the file_sd target too, however the controller ends


def _run_program(env: JobEnv, run: RunFolder, signals: PreemptionFlag, cfg: config_mod.RunConfig, plan: RunPlan,
                 metrics: Metrics | None) -> int:
    record = RunRecord(run)
    started = process.started_at()
    record.append(ev.ControllerStarted(node=env.node, epoch=env.epoch, pid=os.getpid(), started_at=round(started, 3),
                                       total_steps=cfg.trainer.steps))
    sock = ControllerSocket(run.keys)
    publish_address(run, sock, host=env.controller_host, epoch=env.epoch)
    request_workers(run, WorkerRequest(epoch=env.epoch, generation=0, reason="epoch start"))
    group = WorkerGroup(sock, world_size=plan.workers, epoch=env.epoch, timeouts=cfg.timeouts, run=run, signals=signals)
    trainer = RoleGroup(group, plan.trainer)
    checkpoints = CheckpointCoordinator(
        trainer, record, root=run.checkpoints, model_hash=config_mod.model_hash(cfg), keep_last=cfg.checkpoint.keep_last,
        async_save=cfg.checkpoint.async_save, timeout_s=cfg.timeouts.checkpoint_s, poll_timeout_s=cfg.timeouts.call_s,
        on_commit=metrics.observe_checkpoint if metrics is not None else None)
    program = Program(cfg=cfg, plan=plan, run=run, record=record, workers=group, trainer=trainer,
                      checkpoints=checkpoints, metrics=metrics,
                      stop=StopPolicy(signals, slurmctl.clock_for(os.environ), margin_s=cfg.recovery.walltime_margin_s))
    program.started_at(slurmctl.allocation_start(os.environ, started))  # goodput: Slurm's job start, else ours
    try:
        return _end(env, program, Recovery(program, worker_restarts=env.worker_restarts,
                                           on_slurm=env.job_id is not None).run())
    except BatonRuntimeError as exc:  # a failure recovery does not handle (e.g. a failed commit)
        return _failed(program, str(exc).splitlines()[0], ExitCode.FAILED)
    finally:
        program.close()
        group.close()
        time.sleep(0.05)  # let the last broadcast leave the socket before it closes (linger is 0)
        sock.close()


def _end(env: JobEnv, program: Program, outcome: Outcome) -> int:
    """Record how the run ended and release the workers; the exit code."""
    program.save_progress()
    if outcome.status is Status.REQUEUED:
        return _requeue(env, program, outcome)
    if outcome.status is Status.FAILED:
        return _failed(program, outcome.reason, outcome.exit_code)
    done: ev.Event = ev.Completed(step=program.step)
    if outcome.status is Status.STOPPED:
        log.warning("%s", outcome.reason)
        done = ev.Stopped(step=program.step, reason=outcome.reason)
    program.record.append(done)
    program.workers.shutdown(outcome.reason or "run completed")
    return ExitCode.OK


def _failed(program: Program, reason: str, code: ExitCode) -> int:
    log.error("run failed: %s", reason)
    try:
        program.save_progress()  # goodput: this epoch's time counts, failed or not
    except OSError as exc:
        log.warning("could not record progress: %s", exc)
    program.record.append(ev.Failed(reason=reason, step=program.step))
    program.workers.abort(f"controller: {reason}")
    return code


def _requeue(env: JobEnv, program: Program, outcome: Outcome) -> int:
    """Record the requeue, release the workers, and requeue: Slurm's ``scontrol requeue``
    (which ends this job at once), or locally the supervisor relaunches on REQUEUED."""
    program.record.append(ev.Requeued(step=program.step, reason=outcome.reason, epoch=env.epoch,
                                      exclude=outcome.exclude, backend="slurm" if env.job_id else "local"))
    group = program.workers
    if outcome.clean:
        group.shutdown(f"requeued: {outcome.reason}")
    else:
        group.abort(f"controller: requeued: {outcome.reason}")
    log.warning("requeueing at step %s: %s", program.step, outcome.reason)
    if env.job_id is None:
        return ExitCode.REQUEUED
    time.sleep(0.05)  # the shutdown must leave before scontrol ends the job
    het = os.environ.get("SLURM_HET_SIZE")  # the workers are component 1: raw id leader + 1
    component = str(int(env.job_id) + 1) if het and env.job_id.isdigit() else None
    floor = slurmctl.split_hostlist(program.cfg.slurm.workers.exclude or "")  # the user's own: kept whatever happens
    exclude = program.record.read().recovery.exclude if (outcome.exclude or outcome.readmit) else ()
    result = slurmctl.requeue(env.job_id, exclude=exclude, readmit=outcome.readmit, floor=floor,
                              component_id=component,
                              on_note=lambda why, nodes: program.record.append(ev.ExcludeAdjusted(why=why, exclude=nodes)))
    if not result.ok:
        return _failed(program, f"requeue refused ({result.detail}); the latest checkpoint stands: "
                       "continue with `baton submit --resume RUN_DIR`", ExitCode.FAILED)
    log.info("%s", result.detail)
    return ExitCode.REQUEUED


def run_on_slurm(run_dir: str) -> int:
    """Component 0's task on Slurm (core.controller.slurm_entry): the controller, in-process.

    Runs ``run_controller`` under the env contract (core.job.env), which records what the
    task sees of Slurm in the run's state (``slurm.controller_task``) once it holds the
    controller lock (a refused second controller writes nothing). A non-zero exit raises,
    so that Slurm and submitit record the component as failed.
    """
    os.environ["BATON_RUN_DIR"] = run_dir
    run = RunFolder(Path(run_dir))
    seen = {k: os.environ.get(k) for k in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURMD_NODENAME",
                                           "SLURM_RESTART_COUNT", "SLURM_HET_SIZE", "SLURM_JOB_NODELIST_HET_GROUP_1")}

    def record_slurm(run: RunFolder) -> None:
        with RunRecord(run).update() as s:
            s.slurm = SlurmInfo(job_id=seen["SLURM_JOB_ID"], controller_task={"het_group": 0, **seen})

    # submitit logs and ignores SIGTERM; scancel should end the controller now, through its finally.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    code = run_controller(JobEnv.from_environ(), locked=record_slurm)
    if code != 0:
        raise RuntimeError(f"controller exited with code {code}; see {run.controller_log}")
    return code
