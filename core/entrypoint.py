"""Job-side entry point: ``python -m core.entrypoint controller|worker``.

Reads the environment contract (core.job.env), wires the adapters, runs the role, exits
with the role's code. Both backends (local processes, Slurm tasks) start exactly this.

Controller exit codes: 0 completed (or stopped: checkpointed while Slurm ends the job),
1 failed (state.json says why), 2 user error, 85 requeued (core.supervisor.contract.EXIT_REQUEUED:
checkpointed; on Slurm the job was requeued, locally the supervisor relaunches the next
epoch). Workers: core.worker.runtime's EXIT_* codes.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from core.errors import BatonRuntimeError, UserError
from core.job import logsetup, slurmctl
from core.job.env import JobEnv
from core.job.signals import PreemptionFlag
from core.record.runfolder import RunFolder, event
from core.spec import config as config_mod
from core.worker.task import Task, WorkerContext

log = logging.getLogger("baton.entrypoint")

EXIT_FAILED = 1
EXIT_USER_ERROR = 2


def task_factory(kind: str) -> Callable[[WorkerContext], Task]:
    """The model code a worker serves (imported lazily so the toy never loads torch),
    with the checkpoint methods added."""
    from core.checkpoint.service import CheckpointedTask

    if kind == "toy":
        from core.model.toy import ToyTask as cls
    else:
        from core.model.gpt.task import GPTTask as cls  # type: ignore[assignment]
    return lambda ctx: CheckpointedTask(cls(ctx), ctx)


def run_controller(env: JobEnv) -> int:
    """The controller role: run the program under core.controller.recovery; 0, 1, 2 or EXIT_REQUEUED."""
    from core.controller import stop
    from core.controller.group import WorkerGroup, publish_address
    from core.controller.program import Program
    from core.controller.recovery import Recovery
    from core.supervisor.contract import WorkerRequest, request_workers
    from core.wire.transport import ControllerSocket

    run = RunFolder(env.run_dir)
    logsetup.configure("controller", run.controller_log)
    signals = PreemptionFlag.install()  # before anything slow: a signal now is not lost
    cfg = config_mod.load(run.config)
    metrics = None
    if cfg.metrics.enabled:  # first: a port in use fails before the run is marked running
        from core.controller.metrics import Metrics

        metrics = Metrics()
        metrics.start(run, cfg.metrics.port, host=env.controller_host)
        metrics.set_restarts(env.epoch)
    state = run.read_state()
    state.update(status="running", epoch=env.epoch, restarts=env.epoch, total_steps=cfg.trainer.steps)
    state.pop("reason", None)
    event(state, "controller_started", node=env.node, epoch=env.epoch, pid=os.getpid())
    sock = ControllerSocket(run.keys)
    publish_address(run, sock, host=env.controller_host, epoch=env.epoch)
    request_workers(run, WorkerRequest(epoch=env.epoch, generation=0, reason="epoch start"))
    run.write_state(state)
    group = WorkerGroup(sock, world_size=cfg.trainer.world_size, epoch=env.epoch, dims=cfg.dims,
                        timeouts=cfg.timeouts, run=run, signals=signals)
    policy = stop.StopPolicy(signals, slurmctl.clock_for(os.environ),
                                 margin_s=cfg.recovery.walltime_margin_s)
    program = Program(cfg=cfg, run=run, group=group, state=state, stop=policy, metrics=metrics)
    recovery = Recovery(program, worker_restarts=env.worker_restarts, on_slurm=env.job_id is not None)
    try:
        outcome = recovery.run()
        if outcome.status == "completed":
            state.update(status="completed")
            event(state, "completed", step=state.get("step", 0))
            group.shutdown("run completed")
            return 0
        if outcome.status == "requeue":
            return _requeue(env, run, state, group, outcome)
        if outcome.status == "stopped":
            log.warning("%s", outcome.reason)
            state.update(status="stopped", reason=outcome.reason)
            event(state, "stopped", step=state.get("step", 0), reason=outcome.reason)
            group.shutdown(outcome.reason)
            return 0
        return _failed(state, group, outcome.reason, outcome.exit_code)
    except BatonRuntimeError as exc:  # a failure core.controller.recovery does not handle (e.g. a failed commit)
        return _failed(state, group, str(exc).splitlines()[0], EXIT_FAILED)
    finally:
        run.write_state(state)
        if metrics is not None:
            metrics.close()
        group.close()
        time.sleep(0.05)  # let the last broadcast leave the socket before it closes (linger is 0)
        sock.close()


def _failed(state: dict[str, Any], group: Any, reason: str, code: int) -> int:
    log.error("run failed: %s", reason)
    state.update(status="failed", reason=reason)
    event(state, "failed", reason=reason, step=state.get("step", 0))
    group.abort(f"controller: {reason}")
    return code


def _requeue(env: JobEnv, run: RunFolder, state: dict[str, Any], group: Any, outcome: Any) -> int:
    """Record the requeue, release the workers, and requeue: Slurm's ``scontrol requeue``
    (which ends this job at once), or locally the supervisor relaunches on EXIT_REQUEUED."""
    from core.supervisor.contract import EXIT_REQUEUED

    state.update(status="requeued")
    event(state, "requeued", step=state.get("step", 0), reason=outcome.reason, epoch=env.epoch,
          exclude=list(outcome.exclude), backend="slurm" if env.job_id else "local")
    run.write_state(state)
    if outcome.clean:
        group.shutdown(f"requeued: {outcome.reason}")
    else:
        group.abort(f"controller: requeued: {outcome.reason}")
    log.warning("requeueing at step %s: %s", state.get("step", 0), outcome.reason)
    if env.job_id is None:
        return EXIT_REQUEUED
    time.sleep(0.05)  # the shutdown must leave before scontrol ends the job
    het = os.environ.get("SLURM_HET_SIZE")  # the workers are component 1: raw id leader + 1
    component = str(int(env.job_id) + 1) if het and env.job_id.isdigit() else None
    result = slurmctl.requeue(env.job_id, exclude=outcome.exclude, component_id=component)
    if not result.ok:
        return _failed(state, group, f"requeue refused ({result.detail}); the latest checkpoint stands: "
                       "continue with `baton submit --resume RUN_DIR`", EXIT_FAILED)
    log.info("%s", result.detail)
    return EXIT_REQUEUED


def run_worker(env: JobEnv) -> int:
    from core.worker.runtime import WorkerRuntime

    run = RunFolder(env.run_dir)
    label = f"worker r{env.rank_hint}" if env.rank_hint >= 0 else "worker"
    # Until the controller assigns a rank, a worker without a rank hint logs under its pid.
    early_log = run.worker_log(env.rank_hint) if env.rank_hint >= 0 else run.logs / f"worker_{env.node}_{os.getpid()}.log"
    logsetup.configure(label, early_log)
    signals = PreemptionFlag.install()  # SIGUSR2/SIGTERM: logged once, never fatal (the controller decides)
    cfg = config_mod.load(run.config)
    runtime = WorkerRuntime(env, task_factory(cfg.model.kind), register_timeout_s=cfg.timeouts.register_s,
                            signals=signals)

    def welcomed(rank: int) -> None:
        logsetup.set_label(f"worker r{rank}")
        if rank != env.rank_hint:
            logsetup.switch_file(run.worker_log(rank))

    runtime.on_welcome = welcomed
    return runtime.run()


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in ("controller", "worker"):
        print("usage: python -m core.entrypoint controller|worker", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        env = JobEnv.from_environ()
        return run_controller(env) if argv[0] == "controller" else run_worker(env)
    except UserError as exc:
        logging.getLogger("baton").error("%s", exc)
        print(f"baton: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except BatonRuntimeError as exc:
        logging.getLogger("baton").error("%s", exc)
        return EXIT_FAILED


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
