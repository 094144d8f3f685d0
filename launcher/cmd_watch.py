"""``baton status RUN_DIR --watch``: a live view of a run, redrawn until it ends.

    toy/20260101-120000-ab12  running  (restarts 0)
    [##############----------------]  45%  step 9000/20000  ETA 0:03:12
    loss 0.1234  tokens/s 12,345  step 0.021 s  (mean of the last 20)

The view reads state.json and only the new part of metrics.jsonl on each redraw (a
long run's file is never re-read from the start). On a terminal it redraws in place;
into a file or pipe it writes one line per redraw, so it also works as a progress log.
Exit status: 0 when the run completed or stopped (or ``max_iterations`` ran out first), 1 when it
failed or was cancelled.
"""
from __future__ import annotations

import collections
import datetime
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from core.errors import ExitCode, RunFolderError
from core.record import steps
from core.record.runfolder import RunFolder
from core.record.state import RunRecord, RunState, Status
from core.record.steps import StepRecord

ENDED = {Status.COMPLETED: ExitCode.OK, Status.STOPPED: ExitCode.OK, Status.FAILED: ExitCode.FAILED,
         Status.CANCELLED: ExitCode.FAILED}
RECENT = 20  # records the ETA and the rates average over
_CLEAR = "\x1b[H\x1b[2J"


@dataclass
class MetricsTail:
    """The last ``keep`` records of a growing metrics.jsonl, read incrementally."""

    path: Path
    keep: int = RECENT
    offset: int = 0
    recent: collections.deque[StepRecord] = field(default_factory=collections.deque)

    def poll(self) -> list[StepRecord]:
        """Read what was appended since the last poll (whole lines only); return the recent records."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return list(self.recent)
        if size < self.offset:  # replaced or truncated: start over
            self.offset = 0
            self.recent.clear()
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self.offset += end
        for line in chunk[:end].splitlines():
            try:
                data = json.loads(line)
                if isinstance(data, dict) and steps.MARKER in data:  # a resume redoes these steps
                    self.recent = collections.deque(r for r in self.recent if r.step < int(data[steps.MARKER]))
                    continue
                rec = steps.from_data(data, str(self.path))
            except (ValueError, TypeError, RecursionError):  # RunFolderError is a ValueError too
                continue
            self.recent.append(rec)
            while len(self.recent) > self.keep:
                self.recent.popleft()
        return list(self.recent)


def _hms(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(0.0, seconds))))


def seconds_per_step(recent: list[StepRecord]) -> float | None:
    """Recent wall time per step: from record timestamps (includes checkpoints and pauses)
    when there are two or more records, else the controller's step time."""
    stamped = [r for r in recent if r.time > 0]  # 0: a record that carries no timestamp
    if len(stamped) >= 2 and stamped[-1].step > stamped[0].step:
        return (stamped[-1].time - stamped[0].time) / (stamped[-1].step - stamped[0].step)
    times = [r.step_time_s for r in recent]
    return statistics.fmean(times) if times else None


def _detail(recent: list[StepRecord]) -> str:
    if not recent:
        return "waiting for the first step"
    parts = [f"loss {recent[-1].loss:.4g}"]
    parts.append(f"tokens/s {statistics.fmean(r.tokens_per_s for r in recent):,.0f}")
    parts.append(f"step {statistics.fmean(r.step_time_s for r in recent):.3f} s")
    return "  ".join(parts) + f"  (mean of the last {len(recent)})"


def render(name: str, state: RunState | None, recent: list[StepRecord], *, width: int = 30) -> list[str]:
    """The view as lines: header, progress bar with ETA, last loss and rates.

    ``state`` is None when state.json could not be read this round (missing, or mid-replace)."""
    status = str(state.status) if state is not None else "unknown"
    state = state if state is not None else RunState()
    total = state.total_steps
    step = state.step
    if recent:
        step = max(step, recent[-1].step + 1)  # metrics run ahead of state.json's save interval
    header = f"{name}  {status}  (restarts {state.restarts})"
    if state.reason:
        header += f"  reason: {state.reason}"
    if total > 0:
        frac = min(1.0, step / total)
        filled = int(frac * width)
        per_step = seconds_per_step(recent)
        eta = "ETA " + _hms(per_step * (total - step)) if per_step is not None and status == Status.RUNNING else ""
        bar = f"[{'#' * filled}{'-' * (width - filled)}] {frac:4.0%}  step {step}/{total}  {eta}".rstrip()
    else:
        bar = f"step {step}/?"
    return [header, bar, _detail(recent)]


def watch(
    run_dir: Path,
    interval_s: float,
    *,
    stream: TextIO,
    max_iterations: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Redraw the view every ``interval_s`` until the run ends; return 0 completed, 1 failed/cancelled."""
    run = RunFolder.open(Path(run_dir))
    record = RunRecord(run)
    name = f"{run.path.parent.name}/{run.path.name}"
    tail = MetricsTail(run.metrics)
    tty = bool(getattr(stream, "isatty", lambda: False)())
    iterations = 0
    while True:
        state: RunState | None
        try:
            state = record.read()
        except RunFolderError:  # not written yet, or unreadable mid-replace on some filesystems: next round
            state = None
        lines = render(name, state, tail.poll())
        if tty:
            stream.write(_CLEAR + "\n".join(lines) + "\n")
        else:
            stream.write(" | ".join(lines) + "\n")
        stream.flush()
        iterations += 1
        if state is not None and state.status in ENDED:
            return ENDED[state.status]
        if max_iterations is not None and iterations >= max_iterations:
            return ExitCode.OK
        sleep(interval_s)
