"""``baton logs RUN_DIR``: the controller's and workers' logs, merged, one rank or one group."""
from __future__ import annotations

import argparse
import heapq
from pathlib import Path

from core.config.inputs import arg_number
from core.errors import ExitCode, UserError
from core.record.runfolder import RunFolder
from core.record.state import RunRecord


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("logs", help="print the run's logs (all ranks merged, or one)",
                       description="Print the run's log lines, each tagged with role and rank, merged in time "
                       "order; --rank N shows one worker, --controller the controller.")
    p.add_argument("run_dir", type=Path)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--rank", type=arg_number(int, ge=0, le=2**20), help="only this worker rank (≥ 0)")
    group.add_argument("--controller", action="store_true", help="only the controller")
    group.add_argument("--group", choices=("trainer", "generator"), help="only this worker group's ranks")
    p.add_argument("--tail", type=arg_number(int, ge=0), default=0, metavar="N", help="only the last N lines (0: all)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    run_folder = RunFolder.open(args.run_dir)
    if args.rank is not None:
        files = [run_folder.worker_log(args.rank)]
    elif args.controller:
        files = [run_folder.controller_log]
    elif args.group is not None:
        ranks = RunRecord(run_folder).read().ranks
        files = [run_folder.worker_log(r.rank) for r in ranks if r.role == args.group]
        if not files:
            raise UserError(f"--group {args.group}: no ranks of that group were set up in {run_folder.path}; "
                            f"groups: {sorted({r.role for r in ranks}) or 'none yet'}")
    else:
        files = sorted(run_folder.logs.glob("*.log"))
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise UserError(f"{missing[0]}: no such log yet; present: {sorted(p.name for p in run_folder.logs.glob('*.log'))}")
    # Each line starts with an ISO timestamp, so a k-way merge orders them in time.
    streams = [f.open(errors="replace") for f in files]
    try:
        lines = list(heapq.merge(*streams))
    finally:
        for s in streams:
            s.close()
    for line in lines[-args.tail:] if args.tail else lines:
        print(line, end="")
    return ExitCode.OK
