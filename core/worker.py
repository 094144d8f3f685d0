"""The worker runtime: register with the controller, serve its calls, heartbeat, never hang.

Two threads. The I/O thread owns the DEALER socket: it sends heartbeats on a timer (so a
long step never looks dead), forwards calls to the main thread, and ends the process
itself when the controller has been silent for ``controller_lost_s`` or orders an abort
(the main thread may be stuck inside a collective whose peer is gone; only exiting is
safe then). The main thread executes calls on the task, one at a time, in order.
"""
from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core import protocol
from core.errors import RegistrationError
from core.jobenv import JobEnv
from core.runfolder import RunFolder, read_json
from core.task import Task, WorkerContext
from core.transport import WorkerSocket

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_CONTROLLER_LOST = 3
EXIT_REFUSED = 4
EXIT_ABORTED = 5


def wait_for_controller(run: RunFolder, epoch: int, timeout_s: float) -> dict[str, Any]:
    """Poll the run folder until the controller of ``epoch`` has published its address."""
    deadline = time.monotonic() + timeout_s
    seen: Any = None
    while time.monotonic() < deadline:
        try:
            info = read_json(run.controller)
        except (FileNotFoundError, ValueError):
            info = None
        if isinstance(info, dict) and info.get("epoch") == epoch:
            return info
        seen = info
        time.sleep(0.05)  # polling a file with a deadline; nothing to wait on instead
    got = f"epoch {seen.get('epoch')}" if isinstance(seen, dict) else "no file"
    raise RegistrationError(
        f"no controller of epoch {epoch} published in {run.controller} after {timeout_s:.0f} s "
        f"(found: {got}); see {run.controller_log}"
    )


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class _IOThread(threading.Thread):
    """Owns the DEALER: heartbeats out, messages in, and the controller-lost watchdog."""

    def __init__(self, sock: WorkerSocket, epoch: int, inbox: queue.Queue[protocol.Envelope]) -> None:
        super().__init__(name="baton-io", daemon=True)
        self.sock = sock
        self.epoch = epoch
        self.inbox = inbox
        self.out_main, self.out_io = sock.pair(f"out-{secrets.token_hex(4)}")
        self.heartbeat_interval_s = 0.25
        self.controller_lost_s = 10.0
        self.busy = ""
        self.last_heard = time.monotonic()
        self.stopping = threading.Event()

    def send(self, frames: list[Any]) -> None:
        """Called from the main thread: hand frames to the I/O thread (inproc, no copy)."""
        WorkerSocket.send(self.out_main, frames)

    def run(self) -> None:
        poller = self.sock.poller(self.sock.sock, self.out_io)
        seq = 0
        next_beat = time.monotonic()
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= next_beat:
                seq += 1
                hb = protocol.Heartbeat(seq=seq, busy=self.busy, rss_mb=_rss_mb())
                WorkerSocket.send(self.sock.sock, protocol.encode(hb, epoch=self.epoch))
                next_beat = now + self.heartbeat_interval_s
            if now - self.last_heard > self.controller_lost_s:
                log.error("controller silent for %.1f s (limit %.1f s); exiting", now - self.last_heard, self.controller_lost_s)
                _hard_exit(EXIT_CONTROLLER_LOST)
            ready = dict(poller.poll(max(1, int((next_beat - time.monotonic()) * 1000))))
            if self.out_io in ready:
                while (frames := WorkerSocket.recv_nowait(self.out_io)) is not None:
                    WorkerSocket.send(self.sock.sock, frames)
            if self.sock.sock in ready:
                while (frames := WorkerSocket.recv_nowait(self.sock.sock)) is not None:
                    self._incoming(frames)

    def _incoming(self, frames: list[Any]) -> None:
        try:
            env = protocol.decode(frames)
        except protocol.ProtocolError as exc:
            log.warning("dropped a malformed message from the controller: %s", exc)
            return
        self.last_heard = time.monotonic()
        msg = env.msg
        if isinstance(msg, protocol.Heartbeat):
            return
        if isinstance(msg, protocol.Abort):
            log.error("aborted by the controller: %s", msg.reason)
            _hard_exit(EXIT_ABORTED)
        self.inbox.put(env)


def _hard_exit(code: int) -> None:
    """Exit now, from any thread, after flushing the logs."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(code)


class WorkerRuntime:
    """One worker process: register, then serve calls until shutdown."""

    def __init__(self, env: JobEnv, task_factory: Callable[[WorkerContext], Task], *, register_timeout_s: float) -> None:
        self.env = env
        self.run_folder = RunFolder(env.run_dir)
        self.task_factory = task_factory
        self.register_timeout_s = register_timeout_s
        self.rank = env.rank_hint
        self.on_welcome: Callable[[int], None] = lambda rank: None

    def run(self) -> int:
        info = wait_for_controller(self.run_folder, self.env.epoch, self.register_timeout_s)
        identity = f"{self.env.node}:{os.getpid()}:{secrets.token_hex(3)}".encode()
        sock = WorkerSocket(info["address"], self.run_folder.keys, identity=identity)
        inbox: queue.Queue[protocol.Envelope] = queue.Queue()
        io = _IOThread(sock, self.env.epoch, inbox)
        io.controller_lost_s = max(self.register_timeout_s, 10.0)  # until welcomed
        io.start()
        try:
            return self._serve(io, inbox, info["address"])
        finally:
            io.stopping.set()
            io.join(timeout=2)
            sock.close()

    def _send(self, io: _IOThread, msg: protocol.Message, req_id: int = 0) -> None:
        io.send(protocol.encode(msg, req_id=req_id, epoch=self.env.epoch))

    def _serve(self, io: _IOThread, inbox: queue.Queue[protocol.Envelope], address: str) -> int:
        port = _free_port() if self.env.rank_hint in (0, -1) else 0
        self._send(io, protocol.Register(
            rank_hint=self.env.rank_hint, host=self.env.host, node=self.env.node, pid=os.getpid(), rendezvous_port=port,
        ))
        try:
            env = inbox.get(timeout=self.register_timeout_s)
        except queue.Empty:
            raise RegistrationError(
                f"controller at {address} did not answer registration within {self.register_timeout_s:.0f} s"
            ) from None
        if isinstance(env.msg, protocol.Refuse):
            log.error("refused by the controller: %s", env.msg.reason)
            return EXIT_REFUSED
        if not isinstance(env.msg, protocol.Welcome):
            raise RegistrationError(f"expected welcome from the controller, got {type(env.msg).__name__}")
        welcome = env.msg
        self.rank = welcome.rank
        self.on_welcome(welcome.rank)
        io.heartbeat_interval_s = welcome.heartbeat_interval_s
        io.controller_lost_s = welcome.controller_lost_s
        log.info("registered as rank %d of %d with %s", welcome.rank, welcome.world_size, address)
        ctx = WorkerContext(
            rank=welcome.rank, world_size=welcome.world_size, epoch=self.env.epoch,
            run_dir=Path(self.env.run_dir), host=self.env.host, log=logging.getLogger("baton.task"),
        )
        task = self.task_factory(ctx)
        table = dict(task.rpc_table())
        while True:
            env = inbox.get()
            msg = env.msg
            if isinstance(msg, protocol.Shutdown):
                log.info("shutdown: %s", msg.reason)
                closer = table.get("shutdown")
                if closer is not None:
                    try:
                        closer()
                    except Exception:  # noqa: BLE001 - logged; we are exiting anyway
                        log.exception("task shutdown failed")
                return EXIT_OK
            if not isinstance(msg, protocol.Call):
                log.warning("ignored a %s message from the controller", type(msg).__name__)
                continue
            self._execute(io, table, msg, env.req_id)

    def _execute(self, io: _IOThread, table: dict[str, Callable[..., Any]], msg: protocol.Call, req_id: int) -> None:
        fn = table.get(msg.method)
        if fn is None:
            err = protocol.Error(
                exc_type="AttributeError",
                message=f"no method {msg.method!r} on this worker; known: {sorted(table)}",
                traceback="",
            )
            self._send(io, err, req_id)
            return
        io.busy = msg.method
        try:
            value = fn(**msg.kwargs)
            reply: protocol.Message = protocol.Result(value=value)
            frames = protocol.encode(reply, req_id=req_id, epoch=self.env.epoch)
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the controller
            log.exception("call %s failed", msg.method)
            reply = protocol.Error(exc_type=type(exc).__name__, message=str(exc), traceback=traceback.format_exc())
            frames = protocol.encode(reply, req_id=req_id, epoch=self.env.epoch)
        finally:
            io.busy = ""
        io.send(frames)
