"""The worker's heartbeat thread: heartbeats out, the controller's beats and aborts in.

It owns the worker's second DEALER (identity + b"/hb"). The controller sends its own
heartbeats and any abort to this socket, so both are acted on even while the main thread
is deep inside a step (possibly stuck in a collective whose peer is gone: only exiting is
safe then). A preemption signal this worker received travels to the controller in the
heartbeats (Slurm signals only the preempted component).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from core.errors import ExitCode
from core.job.process import rss_mb
from core.job.signals import PreemptionFlag
from core.wire import protocol
from core.wire.transport import WorkerSocket
from core.worker.task import ON_HARD_EXIT

log = logging.getLogger(__name__)


def hard_exit(code: int) -> None:
    """Exit now, from any thread, after ending what ``ON_HARD_EXIT`` names and flushing the logs."""
    for end in ON_HARD_EXIT:  # what must not outlive the worker (core.worker.task)
        try:
            end()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(code)


class HeartbeatThread(threading.Thread):
    """Beats every ``interval_s``; exits the process when the controller has been silent for
    ``controller_lost_s`` or orders an abort. ``busy`` names the call being executed."""

    def __init__(self, sock: WorkerSocket, epoch: int, *, interval_s: float, controller_lost_s: float,
                 signals: PreemptionFlag | None = None) -> None:
        super().__init__(name="baton-heartbeat", daemon=True)
        self.signals = signals
        self.sock = sock
        self.epoch = epoch
        self.interval_s = interval_s
        self.controller_lost_s = controller_lost_s
        self.busy = ""
        self.last_heard = time.monotonic()
        self.stopping = threading.Event()

    def run(self) -> None:
        seq = 0
        next_beat = time.monotonic()
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= next_beat:
                seq += 1
                hb = protocol.Heartbeat(seq=seq, busy=self.busy, rss_mb=rss_mb(),
                                        signal=self.signals.signal_name if self.signals is not None else "")
                self.sock.send(protocol.encode(hb, epoch=self.epoch))
                next_beat = now + self.interval_s
            if self.signals is not None:
                self.signals.report_once(log, "ignored by the worker; the controller decides")
            frames = self.sock.recv_within(max(0.001, next_beat - time.monotonic()))
            if frames is None:  # a receive that slept through a stop can time out with messages queued
                frames = self.sock.recv_nowait()
            while frames is not None:
                self._incoming(frames)
                frames = self.sock.recv_nowait()
            # Checked after reading what arrived: a thread starved of CPU for a while must
            # not mistake heartbeats waiting in its queue for silence.
            silent = time.monotonic() - self.last_heard
            if silent > self.controller_lost_s and not self._heard_within(max(self.interval_s, 1.0)):
                log.error("controller silent for %.1f s (limit %.1f s); exiting", silent, self.controller_lost_s)
                hard_exit(ExitCode.CONTROLLER_LOST)

    def _heard_within(self, grace_s: float) -> bool:
        """A last wait before declaring the controller lost: a process that was stopped (or
        starved) resumes with its socket's I/O thread still moving what arrived meanwhile."""
        frames = self.sock.recv_within(grace_s)
        if frames is None:
            return False
        while frames is not None:
            self._incoming(frames)
            frames = self.sock.recv_nowait()
        return True

    def _incoming(self, frames: list[Any]) -> None:
        try:
            env = protocol.decode(frames)
        except protocol.ProtocolError as exc:
            log.warning("dropped a malformed message from the controller: %s", exc)
            return
        self.last_heard = time.monotonic()
        if isinstance(env.msg, protocol.Abort):
            log.error("aborted by the controller: %s", env.msg.reason)
            hard_exit(ExitCode.ABORTED)
