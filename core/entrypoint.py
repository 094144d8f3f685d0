"""Job-side entry point: ``python -m core.entrypoint controller|worker``.

Reads the environment contract (core.job.env), picks the role, wires the model code a
worker serves, runs, exits with the role's ExitCode (core.errors). Both backends (local
processes, Slurm tasks) start exactly this; on Slurm the controller is started through
submitit as ``core.controller.main.slurm_main``.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from core.checkpoint.service import CheckpointedTask
from core.config.run import RunConfig
from core.controller.main import run_controller
from core.errors import BatonRuntimeError, ExitCode, UserError
from core.job import faults
from core.job.env import JobEnv
from core.model.gpt.task import GPTTask  # loads without torch: its roles are imported by a GPT worker
from core.model.toy import ToyTask
from core.worker.main import run_worker
from core.worker.task import Task, WorkerContext


def task_factory(cfg: RunConfig) -> Callable[[WorkerContext], Task]:
    """The model code a worker serves; a trainer's with the checkpoint calls added."""
    cls: Callable[[WorkerContext], Task] = ToyTask if cfg.model.kind == "toy" else GPTTask

    def build(ctx: WorkerContext) -> Task:
        if ctx.role.name == "trainer":
            mb = cfg.checkpoint.async_buffer_mb
            return CheckpointedTask(cls(ctx), ctx.rank, async_buffer_bytes=None if mb is None else mb << 20)
        return cls(ctx)  # a generator of its own processes holds nothing to checkpoint

    return build


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in ("controller", "worker"):
        print("usage: python -m core.entrypoint controller|worker", file=sys.stderr)
        return ExitCode.USER_ERROR
    faults.set_process(argv[0])
    try:
        env = JobEnv.from_environ()
        return run_controller(env) if argv[0] == "controller" else run_worker(env, task_factory)
    except UserError as exc:
        logging.getLogger("baton").error("%s", exc)
        print(f"baton: error: {exc}", file=sys.stderr)
        return ExitCode.USER_ERROR
    except BatonRuntimeError as exc:
        logging.getLogger("baton").error("%s", exc)
        return ExitCode.FAILED


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
