"""``baton status RUN_DIR``: where a run stands, from its run folder."""
from __future__ import annotations

import argparse
import datetime
import sys

from core.checkpoint import manifest
from core.config.inputs import arg_number
from core.errors import ExitCode
from core.record import events as ev
from core.record.state import RankInfo, RunRecord, RunState
from launcher import slurm_jobs
from launcher.cmd_watch import watch


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("status", help="show a run's state, step, loss and history",
                       description="Show a run's status, step out of total, last loss, restarts and its event history.")
    p.add_argument("run_dir", help="the run folder `baton submit` printed, or its Slurm job id")
    p.add_argument("--watch", action="store_true", help="redraw a live view (progress, ETA, tokens/s, loss) until the run ends")
    p.add_argument("--interval", type=arg_number(float, gt=0, le=86400), default=2.0, metavar="SECONDS",
                   help="with --watch: seconds between redraws (> 0, at most a day; default: 2)")
    p.set_defaults(func=run)


def _fmt_time(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _by_node(ranks: list[RankInfo]) -> str:
    """``4 on 2 nodes: node2 (ranks 0-1), node3 (ranks 2-3)``: where the ranks were last set up."""
    nodes: dict[str, list[int]] = {}
    for r in sorted(ranks, key=lambda r: r.rank):
        nodes.setdefault(r.node, []).append(r.rank)

    def span(ranks: list[int]) -> str:
        contiguous = ranks == list(range(ranks[0], ranks[-1] + 1))
        return (f"{ranks[0]}-{ranks[-1]}" if contiguous else ",".join(map(str, ranks))) if len(ranks) > 1 else str(ranks[0])

    where = ", ".join(f"{n} (rank{'s' if len(rs) > 1 else ''} {span(rs)})" for n, rs in nodes.items())
    return f"{len(ranks)} on {len(nodes)} node{'s' if len(nodes) > 1 else ''}: {where}"


# workers_ready's ranks stay in events.jsonl: the workers lines above show the last set-up's
_NOT_IN_HISTORY = ("time", "event", "ranks")


def format_status(state: RunState, history: list[ev.Event]) -> str:
    lines = [
        f"status:   {state.status.value}",
        f"step:     {state.step}/{state.total_steps or '?'}",
    ]
    if state.last_loss is not None:
        lines.append(f"loss:     {state.last_loss:.4f}")
    lines.append(f"restarts: {state.restarts}")
    for role, label in (("trainer", "workers: "), ("generator", "generator:")):  # by group
        ranks = [r for r in state.ranks if r.role == role]
        if ranks:
            lines.append(f"{label} {_by_node(ranks)}")
    if state.reason:
        lines.append(f"reason:   {state.reason}")
    if history:
        lines.append("history:")
        for e in history:
            extra = ", ".join(f"{k}={v}" for k, v in ev.to_data(e).items() if k not in _NOT_IN_HISTORY)
            lines.append(f"  {_fmt_time(e.time)}  {ev.kind_of(e)}" + (f" ({extra})" if extra else ""))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    run_folder = slurm_jobs.resolve_status_target(args.run_dir)
    if args.watch:
        return watch(run_folder.path, args.interval, stream=sys.stdout)
    record = RunRecord(run_folder)
    state = record.read()
    refusal, gone = manifest.vanished(run_folder.checkpoints, state.checkpoints)
    found = [*([refusal] if refusal else []), *gone, *manifest.findings(run_folder.checkpoints)]
    notes = [f"note:     {line}" for line in found]
    print("\n".join([format_status(state, record.events()), *notes,
                     *slurm_jobs.slurm_status_lines(run_folder)]))
    return ExitCode.OK
