"""``python -m core.supervisor after-controller RUN_DIR EXIT_CODE``: the batch script's last word.

Prints ``requeue`` or ``stop``; on Slurm a ``requeue`` of a controller that died is done
here (a controller requeues itself otherwise). Exit 0 either way.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from core.checkpoint import manifest
from core.config import run as config_mod
from core.errors import ExitCode
from core.job import slurmctl
from core.record.runfolder import RunFolder
from core.record.state import RunRecord, Status
from core.supervisor.contract import after_controller


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "after-controller":
        print("usage: python -m core.supervisor after-controller RUN_DIR EXIT_CODE", file=sys.stderr)
        return ExitCode.USER_ERROR
    run = RunFolder.open(Path(argv[1]))
    cfg = config_mod.load(run.config)
    steps = manifest.committed_steps(run.checkpoints)
    before = RunRecord(run).read().status
    job_id = os.environ.get("SLURM_JOB_ID")
    status = after_controller(run, int(argv[2]), max_retries=cfg.recovery.max_retries,
                              committed_step=steps[-1] if steps else None, ending=_ending())
    if status is Status.REQUEUED and before is not Status.REQUEUED and job_id:
        result = slurmctl.requeue(job_id)
        if not result.ok:
            print(f"baton: requeue failed: {result.detail}", file=sys.stderr)
    print("requeue" if status is Status.REQUEUED else "stop")
    return ExitCode.OK


def _ending() -> str:
    """How Slurm is ending this job ("" when it is not, or no scheduler answers): a job that is
    no longer RUNNING, neither preempted nor requeued by Slurm, is being cancelled or timed out."""
    clock = slurmctl.clock_for(os.environ)
    if clock is None or clock.classify_signal() != "ending":
        return ""
    times = clock.times()
    return f"job state {times.state if times else 'unknown'}"


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
