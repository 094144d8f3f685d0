"""The local backend: the controller and N workers as processes on this machine.

Same entry point and environment contract as the Slurm backend (core.jobenv); CPU and
gloo. Every process started here is ended here, by pid, also on Ctrl-C.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from core.config import RunConfig
from core.runfolder import RunFolder

log = logging.getLogger(__name__)

_GRACE_S = 10.0


def child_env(run: RunFolder, *, epoch: int, rank: int | None) -> dict[str, str]:
    """The environment contract for one process (see core.jobenv)."""
    env = dict(os.environ)
    env.update(
        BATON_RUN_DIR=str(run.path),
        BATON_EPOCH=str(epoch),
        BATON_NODE="local",
        BATON_CONTROLLER_HOST="127.0.0.1",
        OMP_NUM_THREADS="1",  # one thread per process: oversubscription ruins CPU steps
        PYTHONUNBUFFERED="1",
    )
    env.pop("BATON_RANK", None)
    if rank is not None:
        env["BATON_RANK"] = str(rank)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _spawn(run: RunFolder, role: str, *, epoch: int, rank: int | None) -> subprocess.Popen[bytes]:
    name = "controller" if rank is None else f"worker_r{rank:05d}"
    out = open(run.logs / f"{name}.out", "ab")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "core.entrypoint", role],
            env=child_env(run, epoch=epoch, rank=rank),
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches only us; we end the children in order
        )
    finally:
        out.close()


def _end(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM, wait up to grace_s, then SIGKILL: only our own children, by pid."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_local(run: RunFolder, cfg: RunConfig, *, epoch: int = 0) -> int:
    """Start the run, wait for the controller, clean up; return the controller's exit code."""
    controller = _spawn(run, "controller", epoch=epoch, rank=None)
    workers = [_spawn(run, "worker", epoch=epoch, rank=r) for r in range(cfg.trainer.world_size)]
    procs = [controller, *workers]
    try:
        code = controller.wait()
        # Workers exit on the controller's shutdown/abort, or by themselves once it is silent.
        deadline = time.monotonic() + cfg.timeouts.controller_lost_s + _GRACE_S
        for w in workers:
            try:
                w.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker pid %d still running after the controller exited; ending it", w.pid)
        return code
    except KeyboardInterrupt:
        log.warning("interrupted: ending the controller and %d workers", len(workers))
        return 130
    finally:
        _end(procs, _GRACE_S)
