"""Live progress of a run in the foreground (``baton submit --backend local``): step/total,
loss, tokens/s and the time left.

On a terminal it is a rich progress bar redrawn as steps land; elsewhere (a pipe, a log
file, CI) a plain line whenever the step moved and ``PLAIN_EVERY_S`` passed since the last
one, and a last line at the end. It follows the run's metrics.jsonl as ``baton watch``
does (cmd_watch.MetricsTail: from where it left off, from the start again when a resume
rewrote it shorter). Time left: the steps to go times the median of the last ``WINDOW`` step times.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from core.record.runfolder import RunFolder
from launcher.cmd_watch import MetricsTail

PLAIN_EVERY_S = 10.0
READ_EVERY_S = 0.5
WINDOW = 20


class LiveProgress:
    def __init__(self, run: RunFolder, total: int, *, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.run, self.total = run, total
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self._tail = MetricsTail(run.metrics, keep=WINDOW)
        self._read_at, self._printed_at = 0.0, time.monotonic()
        self._times: list[float] = []
        self.step, self._shown = 0, 0
        self.loss: float | None = None
        self.tokens_per_s = 0.0
        self._bar: Any = None
        if self.tty:
            self._bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                 TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s  left"),
                                 TimeRemainingColumn(), console=Console(file=self.stream), transient=False)
            self._task = self._bar.add_task("train", total=total, loss="-", tps="-")
            self._bar.start()

    def poll(self) -> None:
        """Read what landed since the last call (at most every READ_EVERY_S) and show it."""
        now = time.monotonic()
        if now - self._read_at < READ_EVERY_S:
            return
        self._read_at = now
        self._read()
        if self._bar is not None:
            self._bar.update(self._task, completed=self.step, loss=self._loss(), tps=f"{self.tokens_per_s:,.0f}")
        elif self.step != self._shown and now - self._printed_at >= PLAIN_EVERY_S:
            self._print_line(now)

    def close(self) -> None:
        """The final state: the bar completed to where the run got, or a last plain line."""
        self._read_at = 0.0
        self._read()
        if self._bar is not None:
            self._bar.update(self._task, completed=self.step, loss=self._loss(), tps=f"{self.tokens_per_s:,.0f}")
            self._bar.stop()
        elif self.step != self._shown:
            self._print_line(time.monotonic())

    def line(self) -> str:
        return (f"step {self.step}/{self.total}  loss {self._loss()}  {self.tokens_per_s:,.0f} tok/s  "
                f"left {self._eta()}")

    # --- internals ----------------------------------------------------------------------
    def _read(self) -> None:
        recent = self._tail.poll()
        if recent:
            last = recent[-1]
            self.step, self.loss, self.tokens_per_s = last.step + 1, last.loss, float(last.tokens_per_s or 0.0)
            self._times = [r.step_time_s for r in recent]

    def _print_line(self, now: float) -> None:
        print(self.line(), file=self.stream, flush=True)
        self._printed_at, self._shown = now, self.step

    def _loss(self) -> str:
        return "-" if self.loss is None else f"{self.loss:.4f}"

    def _eta(self) -> str:
        if not self._times:
            return "?"
        left = int(round(max(0, self.total - self.step) * statistics.median(self._times)))
        return f"{left // 3600}:{left % 3600 // 60:02d}:{left % 60:02d}"
