"""The batch script's supervisor of worker steps (the Slurm side of core.supervisor.contract).

    python -m core.supervisor.worker_steps RUN_DIR -- srun --het-group=1 ... python -m core.entrypoint worker

Starts the command (the worker step) with ``BATON_GENERATION=0``, then follows
``workers.json``: when the controller asks for generation g (after it declared workers
lost and aborted the rest), the running step is ended and the command is started again
with ``BATON_GENERATION=g``, inside the same allocation. A request that names ranks
restarts only the steps whose first rank (``BATON_RANK_BASE``) it names: each worker group
is one component, so a split generator restarts while the trainer's step goes on. Ending a step is SIGTERM to its
srun: Slurm then cancels the step and kills the tasks, also those that ignore SIGTERM or
are stopped (observed on 22.05). Exits once the step has ended and the controller no
longer runs (the run record), or on SIGTERM/SIGINT, which it passes on to the step first.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from core.errors import ExitCode
from core.record.runfolder import RunFolder
from core.record.state import RunRecord, Status
from core.supervisor.contract import read_request

log = logging.getLogger("baton.worker_steps")

POLL_S = 0.2
END_GRACE_S = 20.0  # srun waits up to KillWait + 2 s for the step's tasks


class _Stop:
    requested = False

    @classmethod
    def handler(cls, signum: int, frame: FrameType | None) -> None:
        cls.requested = True


def _start(cmd: list[str], generation: int) -> subprocess.Popen[bytes]:
    log.info("starting generation %d of the worker step", generation)
    return subprocess.Popen(cmd, env={**os.environ, "BATON_GENERATION": str(generation)}, stdin=subprocess.DEVNULL)


def _end(step: subprocess.Popen[bytes], why: str) -> None:
    if step.poll() is not None:
        return
    log.info("ending the worker step (srun pid %d): %s", step.pid, why)
    step.send_signal(signal.SIGTERM)
    try:
        step.wait(timeout=END_GRACE_S)
    except subprocess.TimeoutExpired:
        step.kill()
        step.wait()


def supervise(run: RunFolder, cmd: list[str], *, epoch: int, first_rank: int = 0) -> int:
    """Run worker-step generations until the controller is done with them; the last step's code."""
    generation = 0
    record = RunRecord(run)
    step = _start(cmd, generation)
    try:
        while not _Stop.requested:
            req = read_request(run)
            if req is not None and req.epoch == epoch and req.generation > generation:
                if req.restarts(first_rank):
                    _end(step, f"generation {req.generation} requested: {req.reason}")
                    step = _start(cmd, req.generation)
                generation = req.generation
            elif step.poll() is not None and record.read().status is not Status.RUNNING:
                break  # the step ended and no controller is left to ask for another
            time.sleep(POLL_S)  # polling a file another node writes; nothing to wait on instead
    finally:
        _end(step, "the supervisor is stopping")
    return step.returncode or 0


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m core.supervisor.worker_steps RUN_DIR -- COMMAND...", file=sys.stderr)
        return ExitCode.USER_ERROR
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [worker-steps] %(message)s")
    signal.signal(signal.SIGTERM, _Stop.handler)
    signal.signal(signal.SIGINT, _Stop.handler)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # the preemption notice is the controller's to answer
    epoch = int(os.environ.get("BATON_EPOCH") or os.environ.get("SLURM_RESTART_COUNT") or 0)
    return supervise(RunFolder(Path(argv[0])), argv[2:], epoch=epoch,
                     first_rank=int(os.environ.get("BATON_RANK_BASE") or 0))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
