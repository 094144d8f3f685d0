"""The worker process: read the run's config once, register, serve the task until shutdown."""
from __future__ import annotations

import os
from collections.abc import Callable

from core.config import run as config_mod
from core.config.run import RunConfig
from core.config.runplan import read_plan
from core.job import logsetup
from core.job.env import JobEnv
from core.job.signals import PreemptionFlag
from core.record.runfolder import RunFolder
from core.worker.runtime import WorkerRuntime
from core.worker.task import Task, WorkerContext

TaskFactory = Callable[[RunConfig], Callable[[WorkerContext], Task]]


def run_worker(env: JobEnv, task_factory: TaskFactory) -> int:
    """The worker role; its ExitCode. ``task_factory(cfg)`` picks the model code to serve."""
    run = RunFolder(env.run_dir)
    label = f"worker r{env.rank_hint}@{env.node}" if env.rank_hint >= 0 else f"worker@{env.node}"
    # Until the controller assigns a rank, a worker without a rank hint logs under its pid.
    early_log = run.worker_log(env.rank_hint) if env.rank_hint >= 0 else run.logs / f"worker_{env.node}_{os.getpid()}.log"
    logsetup.configure(label, early_log)
    signals = PreemptionFlag.install()  # SIGUSR2/SIGTERM: logged once, never fatal (the controller decides)
    cfg = config_mod.load(run.config)
    plan = read_plan(run.plan, cfg)
    runtime = WorkerRuntime(env, cfg, plan, task_factory(cfg), signals=signals)

    def welcomed(rank: int) -> None:
        role = plan.role_of(rank).name
        logsetup.set_label(f"{'worker' if role == 'trainer' else role} r{rank}@{env.node}")
        if rank != env.rank_hint:
            logsetup.switch_file(run.worker_log(rank))

    runtime.on_welcome = welcomed
    return runtime.run()
