"""The worker runtime: register with the controller, serve its calls, heartbeat, never hang.

Two threads, each with its own socket, so a call never hops between threads. The main
thread's DEALER carries register/welcome, calls and results: it executes calls on the
task, one at a time, in order. The heartbeat thread's DEALER (same identity + b"/hb")
carries heartbeats both ways and aborts (core.worker.heartbeat).

SIGUSR2 and SIGTERM (Slurm's preemption and walltime notices) never end a worker: they are
recorded, logged once and passed on to the controller in the heartbeats, and the
controller decides (checkpoint, then shutdown or requeue).
"""
from __future__ import annotations

import logging
import os
import secrets
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.config.run import RunConfig
from core.config.runplan import RunPlan
from core.errors import ExitCode, RegistrationError, fault_class
from core.job.env import JobEnv
from core.job.process import free_port
from core.job.signals import PreemptionFlag
from core.record.runfolder import RunFolder, read_json
from core.wire import protocol
from core.wire.transport import WorkerSocket
from core.worker.heartbeat import HeartbeatThread
from core.worker.task import Task, WorkerContext

log = logging.getLogger(__name__)

# name → (request decoder, handler, result encoder or None when the result goes as it is)
Table = dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any], Callable[[Any], Any] | None]]


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


@dataclass(frozen=True, kw_only=True)
class Welcomed:
    rank: int
    world_size: int
    heartbeat_interval_s: float
    controller_lost_s: float


class WorkerRuntime:
    """One worker process: register, then serve calls until shutdown."""

    def __init__(self, env: JobEnv, cfg: RunConfig, plan: RunPlan, task_factory: Callable[[WorkerContext], Task], *,
                 signals: PreemptionFlag | None = None) -> None:
        self.env = env
        self.cfg = cfg
        self.plan = plan
        self.signals = signals
        self.run_folder = RunFolder(env.run_dir)
        self.task_factory = task_factory
        self.register_timeout_s = cfg.timeouts.register_s
        self.rank = env.rank_hint
        self.on_welcome: Callable[[int], None] = lambda rank: None

    def run(self) -> int:
        """Register, build the task, serve; the process's exit code."""
        info = wait_for_controller(self.run_folder, self.env.epoch, self.register_timeout_s)
        identity = f"{self.env.node}:{os.getpid()}:{secrets.token_hex(3)}".encode()
        self.address = info["address"]
        sock = WorkerSocket(self.address, self.run_folder.keys, identity=identity)
        hb_sock = WorkerSocket(self.address, self.run_folder.keys, identity=identity + b"/hb", share_context_with=sock)
        heartbeat: HeartbeatThread | None = None
        try:
            welcome = self.register(sock)
            if welcome is None:
                return ExitCode.REFUSED
            heartbeat = HeartbeatThread(hb_sock, self.env.epoch, interval_s=welcome.heartbeat_interval_s,
                                        controller_lost_s=welcome.controller_lost_s, signals=self.signals)
            heartbeat.start()
            task = self.task_factory(WorkerContext(
                rank=welcome.rank, world_size=welcome.world_size, epoch=self.env.epoch, run_dir=self.env.run_dir,
                host=self.env.host, log=logging.getLogger("baton.task"), config=self.cfg,
                roles=self.plan.roles_at(welcome.rank)))
            return self.serve(sock, task, heartbeat)
        finally:
            if heartbeat is not None:
                heartbeat.stopping.set()
                heartbeat.join(timeout=2)
            hb_sock.close()
            sock.close()

    def register(self, sock: WorkerSocket) -> Welcomed | None:
        """Say who we are; the controller's welcome, or None when it refused us (logged)."""
        port = free_port()  # a rendezvous, should the controller pick this rank to host one
        sock.send(protocol.encode(protocol.Register(
            rank_hint=self.env.rank_hint, host=self.env.host, node=self.env.node, pid=os.getpid(),
            rendezvous_port=port, generation=self.env.generation), epoch=self.env.epoch))
        env = self._next_message(sock, self.register_timeout_s)
        if env is None:
            raise RegistrationError(
                f"controller at {self.address} did not answer registration within {self.register_timeout_s:.0f} s")
        if isinstance(env.msg, protocol.Refuse):
            log.error("refused by the controller: %s", env.msg.reason)
            return None
        if not isinstance(env.msg, protocol.Welcome):
            raise RegistrationError(f"expected welcome from the controller, got {type(env.msg).__name__}")
        w = env.msg
        self.rank = w.rank
        self.on_welcome(w.rank)
        log.info("registered as rank %d of %d with %s (epoch %d, generation %d)", w.rank, w.world_size,
                 self.address, self.env.epoch, self.env.generation)
        return Welcomed(rank=w.rank, world_size=w.world_size, heartbeat_interval_s=w.heartbeat_interval_s,
                        controller_lost_s=w.controller_lost_s)

    @staticmethod
    def _next_message(sock: WorkerSocket, timeout_s: float) -> protocol.Envelope | None:
        """Next well-formed message on the call socket, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            frames = sock.recv_within(remaining)
            if frames is None:
                return None
            try:
                return protocol.decode(frames)
            except protocol.ProtocolError as exc:
                log.warning("dropped a malformed message from the controller: %s", exc)
        return None

    def serve(self, sock: WorkerSocket, task: Task, hb: HeartbeatThread) -> int:
        """Execute calls until the controller's shutdown; ExitCode.OK.

        The control plane's hot path on this side. Each message meets cold caches (the
        process slept since the last one), so what runs per call is kept small: the socket
        read as bound at construction, a Call decoded by protocol's lean path (anything
        else through the full decode), the request checked by its method's decoder, the
        result encoded by a Packer of our own.
        """
        table: Table = {m.name: (m.decode_request, fn, None if m.plain_result else m.encode_result)
                        for m, fn in task.handlers().items()}
        epoch = self.env.epoch  # answers carry this worker's epoch
        sock.set_timeout(1.0)
        recv, send = sock.recv, sock.send
        decode_call, encode_result = protocol.decode_call, protocol.result_encoder()
        while True:
            frames = recv()
            if frames is None:
                continue  # the heartbeat thread's watchdog ends us if the controller is gone
            call = decode_call(frames)
            if call is None:
                call = self._other_message(frames)
                if call is None:
                    continue
                if call == "shutdown":
                    _close(task)
                    return ExitCode.OK
            req_id, _, name, kwargs = call
            entry = table.get(name)
            if entry is None:
                err = protocol.Error(exc_type="AttributeError", traceback="",
                                     message=f"no method {name!r} on this worker; known: {sorted(table)}")
                send(protocol.encode(err, req_id=req_id, epoch=self.env.epoch))
                continue
            decode, fn, encode = entry
            hb.busy = name
            try:
                result = fn(decode(kwargs))
                out = encode_result(result if encode is None else encode(result), req_id, epoch)
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the controller
                out = self._failure(name, exc, req_id)
            finally:
                hb.busy = ""
            send(out)

    def _other_message(self, frames: list[Any]) -> Any:
        """A message the lean path did not take: a Call's tuple, "shutdown", or None (dropped)."""
        try:
            env = protocol.decode(frames)
        except protocol.ProtocolError as exc:
            log.warning("dropped a malformed message from the controller: %s", exc)
            return None
        msg = env.msg
        if isinstance(msg, protocol.Shutdown):
            log.info("shutdown: %s", msg.reason)
            return "shutdown"
        if isinstance(msg, protocol.Call):
            return env.req_id, env.epoch, msg.method, msg.kwargs  # e.g. a call with arrays
        log.warning("ignored a %s message from the controller", type(msg).__name__)
        return None

    def _failure(self, method: str, exc: Exception, req_id: int) -> list[Any]:
        """The frames of an Error for a call that raised (or whose request or result was malformed)."""
        if isinstance(exc, protocol.ProtocolError):
            log.error("call %s refused: %s", method, exc)
            err = protocol.Error(exc_type="ProtocolError", message=str(exc), traceback="")
        else:
            log.exception("call %s failed", method)
            err = error_of(exc)
        return protocol.encode(err, req_id=req_id, epoch=self.env.epoch)


def error_of(exc: BaseException) -> protocol.Error:
    """The Error a worker sends for ``exc``, flagged by its cause (core.errors.fault_class): the
    controller retries a transient fault and fails a user's at once."""
    fault = fault_class(exc)
    tb = "".join(traceback.format_exception(exc))
    return protocol.Error(exc_type=type(exc).__name__, message=str(exc), traceback=tb,
                          user_error=fault == "user", transient=fault == "transient")


def _close(task: Task) -> None:
    try:
        task.close()
    except Exception:  # noqa: BLE001 - logged; we are exiting anyway
        log.exception("task shutdown failed")
