"""Liveness of a worker group: heartbeats both ways, workers declared lost, the pump thread.

The controller sends its heartbeat to every live worker's heartbeat socket (workers only
need it to notice a dead controller: a few per ``timeouts.controller_lost_s`` do) and
declares a worker lost when its own heartbeats stop for ``timeouts.heartbeat_timeout_s``
(``startup_heartbeat_timeout_s`` until it has answered a call), saying whether the process
exited, is stopped or hung (core.controller.diagnose). Between calls a pump thread, which
takes the group's socket only while nobody else holds it, does the same.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from core.controller.diagnose import diagnose
from core.errors import WorkerLostError
from core.wire import protocol

if TYPE_CHECKING:
    from core.config.run import TimeoutsConfig
    from core.controller.registration import Peer
    from core.record.runfolder import RunFolder
    from core.wire.transport import ControllerSocket

log = logging.getLogger("core.controller.group")


class Liveness:
    """The liveness half of ``core.controller.group.WorkerGroup`` (its state is the group's)."""

    sock: ControllerSocket
    peers: dict[int, Peer]
    timeouts: TimeoutsConfig
    run: RunFolder
    epoch: int
    _lock: threading.Lock
    _n_lost: int
    _next_check: float
    _next_beat: float
    _beat_seq: int
    _beat_interval_s: float
    restartable: frozenset[int]

    def _handle(self, identity: bytes, frames: list[Any]) -> None:
        raise NotImplementedError

    def _housekeeping(self) -> None:
        """When due: send our heartbeat, and check everyone's (O(N), so rate-limited)."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + min(self.timeouts.heartbeat_interval_s, 0.1)
        if now >= self._next_beat:
            self._beat_seq += 1
            frames = protocol.encode(protocol.Heartbeat(seq=self._beat_seq), epoch=self.epoch)
            for peer in self.peers.values():
                if not peer.lost:
                    self.sock.send(peer.hb_identity, frames)
            self._next_beat = now + self._beat_interval_s
        # A worker still starting (importing its libraries, setting up: its heartbeat thread may
        # starve on a busy host) has timeouts.startup_heartbeat_timeout_s; one that exited is
        # named at once all the same, when it ran on this host.
        limit, startup = self.timeouts.heartbeat_timeout_s, self.timeouts.startup_heartbeat_timeout_s
        for peer in self.peers.values():
            silent = now - peer.last_seen
            if peer.lost or silent <= limit:
                continue
            why = diagnose(peer.host, peer.pid)
            if peer.started or silent > startup or why == "process exited":
                self._declare_lost(peer, f"no heartbeat for {silent:.1f} s: {why}")

    def _declare_lost(self, peer: Peer, why: str) -> None:
        peer.lost = why
        self._n_lost += 1
        log.error("rank %d (%s pid %d on %s) lost: %s", peer.rank, peer.host, peer.pid, peer.node, why)

    def lost(self) -> list[Peer]:
        return [p for p in self.peers.values() if p.lost]

    def _raise_if_lost(self, ranks: Collection[int] | None = None) -> None:
        """Raise WorkerLostError naming the lost workers. With ``ranks`` (a call's), a worker
        that can restart alone (``restartable``: a split generator's, under an RL program)
        fails only the calls that wait for it; any other lost worker fails every call."""
        lost = self.lost() if self._n_lost else None
        if lost and ranks is not None:
            lost = [p for p in lost if p.rank in ranks or p.rank not in self.restartable]
        if lost:
            detail = "; ".join(
                f"rank {p.rank} (pid {p.pid} on {p.node}): {p.lost}; log {self.run.worker_log(p.rank)}" for p in lost
            )
            raise WorkerLostError(f"lost {len(lost)} worker(s): {detail}", ranks=[p.rank for p in lost])

    def check(self) -> None:
        """Between calls: raise WorkerLostError if a worker was lost meanwhile."""
        with self._lock:
            self._raise_if_lost()

    def _pump_loop(self, stop: threading.Event) -> None:
        interval = min(self.timeouts.heartbeat_interval_s, 0.1)
        while not stop.wait(interval):
            if not self._lock.acquire(blocking=False):
                continue  # a call is running and doing this itself
            try:
                while (item := self.sock.recv_nowait()) is not None:
                    self._handle(*item)
                self._housekeeping()
            except Exception:  # noqa: BLE001 - the pump must never die silently
                log.exception("controller pump failed")
            finally:
                self._lock.release()
