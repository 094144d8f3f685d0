"""``baton doctor RUN_DIR``: known symptoms in a run's metrics, with their likely cause and fix."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from core.errors import ExitCode
from core.record import steps
from core.record.runfolder import RunFolder
from core.record.state import RunRecord
from launcher import doctor

EPILOG = """\
rules: data loading (data waits over 25% of the step), gradient sync (all-reduce over
500 ms), memory varying across ranks or steps, stragglers (a rank over 1.5x the median
step time in half the steps, named with its node), and a failed run's reason.

exit status: 0 when there are no findings or only warnings and info; 1 when a finding is
an error (the run failed); 2 when RUN_DIR is not a run folder. A warning is advice, not a
failure, so `baton doctor` can run in scripts after every run."""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``doctor`` command."""
    p = sub.add_parser("doctor", help="diagnose a run: bottlenecks, stragglers, memory (from its metrics)",
                       description="Apply known symptom-to-cause rules to a run's metrics.jsonl and state.json "
                       "and print each finding with its evidence and advice.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="the run folder `baton submit` printed")
    p.add_argument("--json", action="store_true", help="print the findings as a JSON list")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the findings; exit 1 if any is an error."""
    run_folder = RunFolder.open(args.run_dir)
    records = steps.read(run_folder.metrics)
    state = RunRecord(run_folder).read()
    findings = doctor.diagnose(records, state)
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=1))
    else:
        print(f"{run_folder.path}: {state.status}, {len(records)} steps recorded")
        print(doctor.format_findings(findings))
    return ExitCode.FAILED if any(f.severity == doctor.ERROR for f in findings) else ExitCode.OK
