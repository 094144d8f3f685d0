"""Preemption signals: the only module that installs signal handlers.

Slurm announces the end of a job with a signal: ``--signal=USR2@<lead>`` sends SIGUSR2
``lead`` seconds before the walltime limit, and at preemption (with
``preempt_send_user_signal``); SIGTERM follows at the end of the grace time. Handlers here
only record the signal; the controller acts on it at the next step boundary
(core.controller.stop), and a worker passes it on in its heartbeats.
"""
from __future__ import annotations

import logging
import signal
import time
from collections.abc import Sequence
from types import FrameType

SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class PreemptionFlag:
    """Records SIGUSR2 / SIGTERM; the handler does nothing else (no I/O, no locks)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None  # time.time() of the first signal
        self.count = 0
        self.source = "this process"
        self._reported = 0

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum, self.received_at = signum, time.time()
        self.count += 1

    @classmethod
    def install(cls, signals: Sequence[int] = SIGNALS) -> PreemptionFlag:
        """A flag receiving ``signals`` in this process (main thread only)."""
        flag = cls()
        for s in signals:
            signal.signal(s, flag._handler)
        return flag

    @property
    def is_set(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def report_once(self, logger: logging.Logger, what: str) -> None:
        """Log newly received signals (called from ordinary code, never from the handler)."""
        if self.count > self._reported:
            self._reported = self.count
            logger.warning("received %s (%d signal(s) so far): %s", self.signal_name, self.count, what)

    def relay(self, name: str, source: str) -> None:
        """A signal another process received (a worker's heartbeat says so), as if received here."""
        if self.signum is None and name in signal.Signals.__members__:
            self.signum, self.received_at, self.source = int(signal.Signals[name]), time.time(), source
            self.count += 1

    def set_for_test(self, signum: int = signal.SIGUSR2) -> None:
        """What a delivered signal does, without a signal (unit tests)."""
        self._handler(signum, None)
