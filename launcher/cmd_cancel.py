"""``baton cancel RUN_DIR``: end a run and record it: a Slurm run's job (both components), or
a local run's processes (launcher.localrun: on this host only)."""
from __future__ import annotations

import argparse

from core.config.inputs import arg_number
from core.errors import ExitCode
from core.record.runfolder import RunFolder
from launcher import localrun, slurm_jobs


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("cancel", help="cancel a run (its Slurm job, or its local processes)",
                       description="scancel the run's heterogeneous job (both components end), wait until Slurm "
                       "says so, and record the run as cancelled in its state.json. A local run (`baton submit "
                       "--backend local`, in the foreground elsewhere or in the background) is ended on this "
                       "host: its supervisor is told to stop (the controller checkpoints), then cancelled is "
                       "recorded.")
    p.add_argument("run_dir", help="the run folder `baton submit` printed, or its Slurm job id")
    p.add_argument("--timeout", type=arg_number(float, gt=0, le=1e7), default=60.0, metavar="S",
                   help="how long to wait for the run to end, > 0 (default: 60 s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    run_folder = slurm_jobs.resolve_status_target(args.run_dir)
    if _is_local(run_folder):
        done = localrun.cancel(run_folder, timeout_s=args.timeout)
        print(f"cancelled {run_folder.path}: {done}")
        return ExitCode.OK
    states = slurm_jobs.cancel(run_folder, timeout_s=args.timeout)
    shown = ", ".join(f"{comp} {state}" for comp, state in states.items()) or "no longer known to Slurm"
    print(f"cancelled {run_folder.path}: {shown}")
    return ExitCode.OK


def _is_local(run: RunFolder) -> bool:
    """The run's latest start was local: local.json, and no Slurm job recorded after it."""
    local = localrun.path(run)
    if not local.is_file():
        return False
    if slurm_jobs.job_id_of(run) is None:
        return True
    job = slurm_jobs.job_record(run)
    return not job.is_file() or local.stat().st_mtime >= job.stat().st_mtime
