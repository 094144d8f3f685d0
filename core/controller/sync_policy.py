"""``parallel.sync`` on the controller: which steps end with the replicas averaging, and the
adaptive period.

A replica steps on its own gradients until ``every`` steps have passed since the last
average, or a checkpoint is due after this step, or it is the run's last: then the step
ends with an average (``calls.Step(average=True)``; a stop between steps averages with
``calls.AVERAGE`` before its checkpoint), so every checkpoint holds equal replicas. With
``adaptive_latency_ms`` each average's time (the slowest rank's ``grad_sync_s``) goes into
a window of three: a median above the target doubles the period (up to ``max_every``), one
under half of it halves the period (down to ``every``); each change is an event and the
period is in every checkpoint's loop state.
"""
from __future__ import annotations

import statistics
from collections import deque

from core.config.run import SyncConfig
from core.record import events as ev
from core.record.steps import StepRecord
from core.wire import calls

WINDOW = 3


class SyncPolicy:
    def __init__(self, cfg: SyncConfig, every: int | None = None) -> None:
        self.cfg = cfg
        self.every = every or cfg.every  # the period now (restored from a checkpoint's loop state)
        self.since = 0  # steps since the replicas last averaged
        self._times: deque[float] = deque(maxlen=WINDOW)

    def request(self, step: int, *, checkpoint_due: bool, last: bool) -> calls.Step:
        self.since += 1
        average = self.since >= self.every or checkpoint_due or last
        if average:
            self.since = 0
        return calls.Step(step=step, local=True, average=average)

    @property
    def unsynced(self) -> bool:
        return self.since > 0

    def averaged(self) -> None:
        self.since = 0

    def observe(self, done: int, request: calls.Step, record: StepRecord) -> list[ev.Event]:
        """After a step: its average's time into the window; a change of period, if any."""
        if not request.average or not record.grad_sync_s or self.cfg.adaptive_latency_ms is None:
            return []
        self._times.append(max(record.grad_sync_s))
        if len(self._times) < WINDOW:
            return []
        median_ms = statistics.median(self._times) * 1000.0
        target, was = self.cfg.adaptive_latency_ms, self.every
        if median_ms > target and self.every < self.cfg.max_every:
            self.every = min(2 * self.every, self.cfg.max_every)
        elif median_ms < target / 2 and self.every > self.cfg.every:
            self.every = max(self.every // 2, self.cfg.every)
        if self.every == was:
            return []
        self._times.clear()
        return [ev.SyncPeriodChanged(step=done, every=self.every, was=was, median_ms=round(median_ms, 3))]
