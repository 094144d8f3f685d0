"""The stop policy: asked at every step boundary whether to checkpoint and stop now.

A preemption signal arrived (here, or at a worker, relayed in its heartbeat), or the
walltime is near: less time left than one step, one save and ``recovery.walltime_margin_s``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from core.job.signals import PreemptionFlag
from core.job.slurmctl import JobClock
from core.record.lock import check_fence

log = logging.getLogger(__name__)

PROACTIVE_MARGIN_S = 30.0  # slack on top of one step and one save before the walltime
# What a stopping controller needs after its last save, before Slurm's end time: record the
# requeue, release the workers, and the scontrol calls of a requeue (each up to a few seconds).
STOP_MARGIN_S = 10.0
# The least a stop waits for a save, whatever the clock says: at a preemption Slurm's EndTime
# can read "now" while its GraceTime still runs (seen on Slurm 22.05); a wait Slurm cuts short
# costs nothing more than giving up at once would (the newest committed checkpoint stands).
STOP_FLOOR_S = 15.0
UNKNOWN_SAVE_S = 60.0  # a save's duration before the first one was measured
RELAY_SETTLE_S = 5.0  # how long a worker's relayed signal of no known cause is re-read in the job record
RELAY_SETTLE_POLL_S = 0.5


@dataclass(frozen=True, kw_only=True)
class StopRequest:
    """Why the controller stops training at this step boundary to checkpoint and requeue."""

    cause: str  # "preemption" | "walltime" | "signal" | "requeued" | "ending" (see classify) | "time_running_out"
    signal: str  # "SIGUSR2", "SIGTERM" or "" for a proactive stop
    time_left_s: float | None
    detail: str
    signal_at: float | None = None  # time.time() the signal arrived (here or at a worker)


def should_save_now(time_left_s: float | None, *, step_s: float, save_s: float | None,
                    margin_s: float = PROACTIVE_MARGIN_S) -> bool:
    """True when another step might leave no time to save: time left < step + save + margin."""
    if time_left_s is None:
        return False
    return time_left_s < step_s + (UNKNOWN_SAVE_S if save_s is None else save_s) + margin_s


class StopPolicy:
    """Asked at every step boundary: stop now? (a signal arrived, or the walltime is near)."""

    def __init__(self, flag: PreemptionFlag | None, clock: JobClock | None,
                 *, margin_s: float = PROACTIVE_MARGIN_S) -> None:
        self.flag = flag
        self.clock = clock
        self.margin_s = margin_s  # recovery.walltime_margin_s
        self._decided: StopRequest | None = None

    def check(self, *, step_s: float, save_s: float | None) -> StopRequest | None:
        check_fence()  # a controller whose lock was taken over goes no further (ControllerLockLost)
        if self._decided is not None:
            return self._decided
        if self.flag is not None and self.flag.is_set:
            self.flag.report_once(log, "checkpointing at this step boundary, then requeueing")
            cause = self._classify()
            left = self.clock.time_left_s() if self.clock is not None else None
            self._decided = StopRequest(cause=cause, signal=self.flag.signal_name, time_left_s=left,
                                        detail=f"{self.flag.signal_name} received by {self.flag.source}",
                                        signal_at=self.flag.received_at)
        elif self.clock is not None:
            left = self.clock.time_left_s()
            if should_save_now(left, step_s=step_s, save_s=save_s, margin_s=self.margin_s):
                assert left is not None
                self._decided = StopRequest(
                    cause="time_running_out", signal="", time_left_s=left,
                    detail=f"{left:.0f} s left < step {step_s:.1f} s + save "
                           f"{UNKNOWN_SAVE_S if save_s is None else save_s:.1f} s + margin {self.margin_s:.0f} s "
                           "(recovery.walltime_margin_s)")
        return self._decided

    def _classify(self) -> str:
        """Why the signal came (core.job.slurmctl.classify). A SIGTERM a worker relayed can
        arrive before Slurm's job record says why it sent it (a node set down: the requeue's
        ``Restarts`` is counted a moment later), so a relayed signal that reads as no one's is
        read again for up to ``RELAY_SETTLE_S``."""
        assert self.flag is not None
        if self.clock is None:
            return "signal"
        cause = self.clock.classify_signal()
        deadline = time.monotonic() + (RELAY_SETTLE_S if self.flag.source != "this process" else 0.0)
        while cause == "signal" and time.monotonic() < deadline:
            time.sleep(RELAY_SETTLE_POLL_S)
            cause = self.clock.classify_signal()
        return cause

    def time_budget_s(self, default_s: float) -> float:
        """How long a wait of the stop path (an async save in flight, the last save) may take:
        the time Slurm's clock leaves, less STOP_MARGIN_S, at least STOP_FLOOR_S, at most
        ``default_s`` (the checkpoint timeout, also what it is without a clock or an end time)."""
        left = self.clock.time_left_s() if self.clock is not None else None
        return default_s if left is None else min(default_s, max(STOP_FLOOR_S, left - STOP_MARGIN_S))

    def stop_requested(self) -> bool:
        """A signal arrived (between steps, e.g. while waiting for workers)."""
        return self._decided is not None or (self.flag is not None and self.flag.is_set)
