"""The worker runtime: register with the controller, serve its calls, heartbeat, never hang.

Two threads, each with its own socket. The main thread executes calls on the task, one
at a time, in order. The heartbeat thread sends heartbeats on a timer (so a long step
never looks dead) and ends the process itself when the controller has been silent for
``controller_lost_s`` or orders an abort (the main thread may be stuck inside a
collective whose peer is gone; only exiting is safe then).

SIGUSR2 and SIGTERM (Slurm's preemption and walltime notices) never end a worker: they are
recorded, logged once and passed on to the controller in the heartbeats (Slurm signals
only the preempted component: the controller's may not get one), and the controller
decides (checkpoint, then shutdown or requeue).
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.errors import RegistrationError
from core.job.env import JobEnv
from core.job.signals import PreemptionFlag
from core.record.runfolder import RunFolder, read_json
from core.wire import protocol, transport
from core.wire.transport import WorkerSocket
from core.worker.task import Task, WorkerContext

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


def rss_mb() -> float:
    """Resident memory of this process in MiB (Linux; 0 where /proc is missing)."""
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


class _HeartbeatThread(threading.Thread):
    """Owns the worker's second DEALER (identity + b"/hb"): heartbeats out, and the watchdog.

    The controller sends its own heartbeats and any abort to this socket, so both are
    acted on even while the main thread is deep inside a step.
    """

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
                WorkerSocket.send(self.sock.sock, protocol.encode(hb, epoch=self.epoch))
                next_beat = now + self.interval_s
            if self.signals is not None:
                self.signals.report_once(log, "ignored by the worker; the controller decides")
            frames = self.sock.recv_within(max(0.001, next_beat - time.monotonic()))
            while frames is not None:
                self._incoming(frames)
                frames = WorkerSocket.recv_nowait(self.sock.sock)
            # Checked after reading what arrived: a thread starved of CPU for a while must
            # not mistake heartbeats waiting in its queue for silence.
            silent = time.monotonic() - self.last_heard
            if silent > self.controller_lost_s:
                log.error("controller silent for %.1f s (limit %.1f s); exiting", silent, self.controller_lost_s)
                _hard_exit(EXIT_CONTROLLER_LOST)

    def _incoming(self, frames: list[Any]) -> None:
        try:
            env = protocol.decode(frames)
        except protocol.ProtocolError as exc:
            log.warning("dropped a malformed message from the controller: %s", exc)
            return
        self.last_heard = time.monotonic()
        if isinstance(env.msg, protocol.Abort):
            log.error("aborted by the controller: %s", env.msg.reason)
            _hard_exit(EXIT_ABORTED)


def _hard_exit(code: int) -> None:
    """Exit now, from any thread, after flushing the logs."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(code)


class WorkerRuntime:
    """One worker process: register, then serve calls until shutdown.

    Two sockets, one per thread, so a call never hops between threads: the main thread's
    DEALER carries register/welcome, calls and results; the heartbeat thread's DEALER
    (same identity + b"/hb") carries heartbeats both ways and aborts.
    """

    def __init__(self, env: JobEnv, task_factory: Callable[[WorkerContext], Task], *, register_timeout_s: float,
                 signals: PreemptionFlag | None = None) -> None:
        self.env = env
        self.signals = signals
        self.run_folder = RunFolder(env.run_dir)
        self.task_factory = task_factory
        self.register_timeout_s = register_timeout_s
        self.rank = env.rank_hint
        self.on_welcome: Callable[[int], None] = lambda rank: None

    def run(self) -> int:
        info = wait_for_controller(self.run_folder, self.env.epoch, self.register_timeout_s)
        identity = f"{self.env.node}:{os.getpid()}:{secrets.token_hex(3)}".encode()
        self.address = info["address"]
        self.sock = WorkerSocket(self.address, self.run_folder.keys, identity=identity)
        self.hb_sock = WorkerSocket(self.address, self.run_folder.keys, identity=identity + b"/hb",
                                    share_context_with=self.sock)
        self.heartbeat: _HeartbeatThread | None = None
        try:
            return self._serve()
        finally:
            if self.heartbeat is not None:
                self.heartbeat.stopping.set()
                self.heartbeat.join(timeout=2)
            self.hb_sock.close()
            self.sock.close()

    def _send(self, msg: protocol.Message, req_id: int = 0) -> None:
        WorkerSocket.send(self.sock.sock, protocol.encode(msg, req_id=req_id, epoch=self.env.epoch))

    def _recv(self, timeout_s: float) -> protocol.Envelope | None:
        """Next well-formed message on the call socket, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            frames = self.sock.recv_within(remaining) if remaining > 0 else None
            if frames is None:
                return None
            try:
                return protocol.decode(frames)
            except protocol.ProtocolError as exc:
                log.warning("dropped a malformed message from the controller: %s", exc)

    def _serve(self) -> int:
        port = _free_port() if self.env.rank_hint in (0, -1) else 0
        self._send(protocol.Register(
            rank_hint=self.env.rank_hint, host=self.env.host, node=self.env.node, pid=os.getpid(), rendezvous_port=port,
            generation=self.env.generation,
        ))
        env = self._recv(self.register_timeout_s)
        if env is None:
            raise RegistrationError(
                f"controller at {self.address} did not answer registration within {self.register_timeout_s:.0f} s"
            )
        if isinstance(env.msg, protocol.Refuse):
            log.error("refused by the controller: %s", env.msg.reason)
            return EXIT_REFUSED
        if not isinstance(env.msg, protocol.Welcome):
            raise RegistrationError(f"expected welcome from the controller, got {type(env.msg).__name__}")
        welcome = env.msg
        self.rank = welcome.rank
        self.on_welcome(welcome.rank)
        hb = self.heartbeat = _HeartbeatThread(
            self.hb_sock, self.env.epoch,
            interval_s=welcome.heartbeat_interval_s, controller_lost_s=welcome.controller_lost_s, signals=self.signals,
        )
        hb.start()
        log.info("registered as rank %d of %d with %s (epoch %d, generation %d)", welcome.rank, welcome.world_size,
                 self.address, self.env.epoch, self.env.generation)
        ctx = WorkerContext(
            rank=welcome.rank, world_size=welcome.world_size, epoch=self.env.epoch,
            run_dir=Path(self.env.run_dir), host=self.env.host, log=logging.getLogger("baton.task"),
        )
        table = dict(self.task_factory(ctx).rpc_table())
        # The serving loop is the control plane's hot path on this side. Each message meets
        # cold caches (the process slept since the last one), so what runs per call is kept
        # small: the socket read directly, a Call decoded by protocol's lean path (anything
        # else goes through the full decode), the result encoded by a Packer of our own.
        sock, epoch = self.sock.sock, self.env.epoch  # answers carry this worker's epoch
        self.sock.set_timeout(1.0)
        recv, send = transport.recv_or_none, transport.send_frames
        decode_call, encode_result = protocol.decode_call, protocol.result_encoder()
        while True:
            frames = recv(sock)
            if frames is None:
                continue  # the heartbeat thread's watchdog ends us if the controller is gone
            call = decode_call(frames)
            if call is None:
                try:
                    env = protocol.decode(frames)
                except protocol.ProtocolError as exc:
                    log.warning("dropped a malformed message from the controller: %s", exc)
                    continue
                msg = env.msg
                if isinstance(msg, protocol.Shutdown):
                    log.info("shutdown: %s", msg.reason)
                    self._close(table)
                    return EXIT_OK
                if not isinstance(msg, protocol.Call):
                    log.warning("ignored a %s message from the controller", type(msg).__name__)
                    continue
                call = env.req_id, env.epoch, msg.method, msg.kwargs  # e.g. a call with arrays
            req_id, _, method, kwargs = call
            fn = table.get(method)
            if fn is None:
                send(sock, self._unknown_method(method, table, req_id))
                continue
            hb.busy = method
            try:
                out = encode_result(fn(**kwargs), req_id, epoch)
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the controller
                out = self._failure(method, exc, req_id)
            finally:
                hb.busy = ""
            send(sock, out)

    @staticmethod
    def _close(table: dict[str, Callable[..., Any]]) -> None:
        closer = table.get("shutdown")
        if closer is not None:
            try:
                closer()
            except Exception:  # noqa: BLE001 - logged; we are exiting anyway
                log.exception("task shutdown failed")

    def _unknown_method(self, method: str, table: dict[str, Callable[..., Any]], req_id: int) -> list[Any]:
        err = protocol.Error(exc_type="AttributeError", traceback="",
                             message=f"no method {method!r} on this worker; known: {sorted(table)}")
        return protocol.encode(err, req_id=req_id, epoch=self.env.epoch)

    def _failure(self, method: str, exc: Exception, req_id: int) -> list[Any]:
        """The frames of an Error for a call that raised (or whose result cannot be sent)."""
        log.exception("call %s failed", method)
        err = protocol.Error(exc_type=type(exc).__name__, message=str(exc), traceback=traceback.format_exc())
        return protocol.encode(err, req_id=req_id, epoch=self.env.epoch)
