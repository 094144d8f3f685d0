"""``baton status RUN_DIR``: where a run stands, from its run folder."""
from __future__ import annotations

import argparse
import datetime
from pathlib import Path
from typing import Any

from core.runfolder import RunFolder


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("status", help="show a run's state, step, loss and history",
                       description="Show a run's status, step out of total, last loss, restarts and its event history.")
    p.add_argument("run_dir", type=Path, help="the run folder `baton submit` printed")
    p.set_defaults(func=run)


def _fmt_time(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def format_status(state: dict[str, Any]) -> str:
    lines = [
        f"status:   {state.get('status', 'unknown')}",
        f"step:     {state.get('step', 0)}/{state.get('total_steps', '?')}",
    ]
    if isinstance(state.get("last_loss"), float):
        lines.append(f"loss:     {state['last_loss']:.4f}")
    lines.append(f"restarts: {state.get('restarts', 0)}")
    if state.get("reason"):
        lines.append(f"reason:   {state['reason']}")
    history = state.get("history", [])
    if history:
        lines.append("history:")
        for ev in history:
            extra = ", ".join(f"{k}={v}" for k, v in ev.items() if k not in ("time", "event"))
            lines.append(f"  {_fmt_time(ev['time'])}  {ev['event']}" + (f" ({extra})" if extra else ""))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    run_folder = RunFolder.open(args.run_dir)
    print(format_status(run_folder.read_state()))
    return 0
