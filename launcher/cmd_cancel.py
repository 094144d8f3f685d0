"""``baton cancel RUN_DIR``: end a Slurm run (both components of its job) and record it."""
from __future__ import annotations

import argparse

from core.config.inputs import arg_number
from core.errors import ExitCode
from launcher import slurm_jobs


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("cancel", help="cancel a run's Slurm job (controller and workers)",
                       description="scancel the run's heterogeneous job (both components end), wait until Slurm "
                       "says so, and record the run as cancelled in its state.json.")
    p.add_argument("run_dir", help="the run folder `baton submit` printed, or its Slurm job id")
    p.add_argument("--timeout", type=arg_number(float, gt=0, le=1e7), default=60.0, metavar="S",
                   help="how long to wait for Slurm to end the job, > 0 (default: 60 s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    run_folder = slurm_jobs.resolve_status_target(args.run_dir)
    states = slurm_jobs.cancel(run_folder, timeout_s=args.timeout)
    shown = ", ".join(f"{comp} {state}" for comp, state in states.items()) or "no longer known to Slurm"
    print(f"cancelled {run_folder.path}: {shown}")
    return ExitCode.OK
