"""The environment contract between a backend and the processes it starts.

Both backends (local processes and Slurm) give every process the same variables; under
Slurm the ``SLURM_*`` ones fill in what the batch script does not set itself.

    BATON_RUN_DIR     the run folder (required)
    BATON_RANK        worker rank hint   (else SLURM_PROCID of the worker component)
    BATON_EPOCH       restart count      (else SLURM_RESTART_COUNT, else 0)
    BATON_GENERATION  which start of the worker step within the epoch (else 0)
    BATON_WORKER_RESTARTS  "1" when the supervisor restarts worker steps on request
                      (core.supervisor.contract); without it a lost worker means a requeue
    BATON_NODE        node name          (else SLURMD_NODENAME, else the host name)
    BATON_CONTROLLER_HOST  address the controller publishes (else the host name)
"""
from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from core.errors import UserError


@dataclass(frozen=True, kw_only=True)
class JobEnv:
    run_dir: Path
    rank_hint: int
    epoch: int
    generation: int = 0
    worker_restarts: bool = False
    node: str
    host: str
    controller_host: str
    job_id: str | None

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> JobEnv:
        env = os.environ if env is None else env
        run_dir = env.get("BATON_RUN_DIR")
        if not run_dir:
            raise UserError("BATON_RUN_DIR is not set; start Baton processes with `baton submit`")
        host = socket.gethostname()

        def as_int(name: str, value: str | None, default: int) -> int:
            if value in (None, ""):
                return default
            try:
                return int(value)
            except ValueError:
                raise UserError(f"{name}={value!r} is not an integer") from None

        rank_var = "BATON_RANK" if "BATON_RANK" in env else "SLURM_PROCID"
        epoch_var = "BATON_EPOCH" if "BATON_EPOCH" in env else "SLURM_RESTART_COUNT"
        return cls(
            run_dir=Path(run_dir),
            rank_hint=as_int(rank_var, env.get(rank_var), -1),
            epoch=as_int(epoch_var, env.get(epoch_var), 0),
            generation=as_int("BATON_GENERATION", env.get("BATON_GENERATION"), 0),
            worker_restarts=env.get("BATON_WORKER_RESTARTS") == "1",
            node=env.get("BATON_NODE") or env.get("SLURMD_NODENAME") or host,
            host=host,
            controller_host=env.get("BATON_CONTROLLER_HOST") or host,
            job_id=env.get("SLURM_JOB_ID"),
        )
