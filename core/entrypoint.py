"""Job-side entry point: ``python -m core.entrypoint controller|worker``.

Reads the environment contract (core.jobenv), wires the adapters, runs the role, exits
with the role's code. Both backends (local processes, Slurm tasks) start exactly this.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable

from core import config as config_mod
from core import logsetup
from core.errors import BatonRuntimeError, UserError
from core.jobenv import JobEnv
from core.runfolder import RunFolder, event
from core.task import Task, WorkerContext

log = logging.getLogger("baton.entrypoint")

EXIT_FAILED = 1
EXIT_USER_ERROR = 2


def task_factory(kind: str) -> Callable[[WorkerContext], Task]:
    """The model code a worker serves (imported lazily so the toy never loads torch),
    with the checkpoint methods added."""
    from core.ckpt_worker import CheckpointedTask

    if kind == "toy":
        from core.toy import ToyTask as cls
    else:
        from core.gpt.task import GPTTask as cls  # type: ignore[assignment]
    return lambda ctx: CheckpointedTask(cls(ctx), ctx)


def run_controller(env: JobEnv) -> int:
    from core.controller import WorkerGroup, publish_address
    from core.program import Program
    from core.transport import ControllerSocket

    run = RunFolder(env.run_dir)
    logsetup.configure("controller", run.controller_log)
    cfg = config_mod.load(run.config)
    state = run.read_state()
    state.update(status="running", epoch=env.epoch, restarts=env.epoch, total_steps=cfg.trainer.steps)
    event(state, "controller_started", node=env.node, epoch=env.epoch)
    sock = ControllerSocket(run.keys)
    publish_address(run, sock, host=env.controller_host, epoch=env.epoch)
    run.write_state(state)
    group = WorkerGroup(sock, world_size=cfg.trainer.world_size, epoch=env.epoch, dims=cfg.dims,
                        timeouts=cfg.timeouts, run=run)
    program = Program(cfg=cfg, run=run, group=group, state=state)
    try:
        program.run_all()
        state.update(status="completed")
        event(state, "completed", step=state.get("step", 0))
        group.shutdown("run completed")
        return 0
    except BatonRuntimeError as exc:
        log.error("run failed: %s", exc)
        state.update(status="failed", reason=str(exc).splitlines()[0])
        event(state, "failed", reason=str(exc).splitlines()[0], step=state.get("step", 0))
        group.abort(f"controller: {str(exc).splitlines()[0]}")
        return EXIT_FAILED
    finally:
        run.write_state(state)
        group.close()
        time.sleep(0.05)  # let the last broadcast leave the socket before it closes (linger is 0)
        sock.close()


def run_worker(env: JobEnv) -> int:
    from core.worker import WorkerRuntime

    run = RunFolder(env.run_dir)
    label = f"worker r{env.rank_hint}" if env.rank_hint >= 0 else "worker"
    # Until the controller assigns a rank, a worker without a rank hint logs under its pid.
    early_log = run.worker_log(env.rank_hint) if env.rank_hint >= 0 else run.logs / f"worker_{env.node}_{os.getpid()}.log"
    logsetup.configure(label, early_log)
    cfg = config_mod.load(run.config)
    runtime = WorkerRuntime(env, task_factory(cfg.model.kind), register_timeout_s=cfg.timeouts.register_s)

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
