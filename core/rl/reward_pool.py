"""The controller's reward processes: every response of a step scored in a pool of
``rl.reward_workers`` processes, each call bounded by ``rl.reward_timeout_s``.

``Scorer.score_all(samples)`` is the one entry point (an RL step's responses, a validation's):
the rewards in the samples' order, the same whatever the pool's size (each is the reward
function of one sample; which process ran it changes nothing). The processes are fresh
interpreters (``python -m core.rl.reward_pool``, never a fork: the controller has threads and
ZeroMQ sockets; nor multiprocessing's spawn, which would import the controller's main module
again), started once with the controller's ``sys.path`` and talking over a socket pair
(multiprocessing's ``Connection``: pickled messages). Each imports the reward when it starts,
so a module that cannot be imported fails the start as a ConfigError with its cause;
``close`` ends them. Their output goes where the controller's goes (its log).

The controller hands each process one call at a time, so a call's deadline runs from the
moment its process takes it: a call that outlives ``timeout_s`` fails the step with a
``RewardError`` naming the reward and the prompt, and its process is killed (a reward that
hangs never keeps the controller alive). A process that dies in a call (a crash in the
user's code, an ``os._exit``) fails the step the same way. After a failure the pool is
closed; the next ``score_all`` starts a new one.

Each reward process ignores SIGINT and SIGTERM (the controller decides when it ends: a
preemption's signal to the job's processes must not look like a failing reward) and ends
when the controller is gone: on Linux the kernel kills it (``PR_SET_PDEATHSIG``), even while
a reward is stuck in C code holding the GIL; elsewhere, and as a fallback, a thread watches
its parent. The kernel's signal follows the *thread* that started the process, so it is
asked for only when the pool is started from the controller's main thread (as the
controller does); a pool started from another thread relies on the watching thread alone.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from core.errors import BatonRuntimeError, RewardError
from core.rl import rewards
from core.rl.rewards import Sample

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # a reward process starts and imports the reward (a module may import torch) within this
CLOSE_TIMEOUT_S = 5.0  # an idle reward process exits within this when asked; else it is killed
_PARENT_POLL_S = 1.0  # how often a reward process looks whether the controller is still there
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds core
_SYS_PATH = "BATON_REWARD_SYS_PATH"  # the controller's sys.path, as JSON, for its reward processes


def _watch_parent(parent: int) -> None:
    """End this process when its parent is gone (re-parented), even while a reward hangs."""
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when the thread that started it ends; then, as the parent
    may be gone already (re-parented before the call), end now if it is."""
    try:
        import ctypes  # the C library's prctl: only here

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): the parent-watching thread alone",
                        ctypes.get_errno())
    except (OSError, AttributeError) as exc:
        log.warning("no prctl (%s): the parent-watching thread alone", exc)
    if os.getppid() != parent:
        os._exit(1)


def _serve(conn: Connection, spec: str, key: str, parent: int, *, pdeathsig: bool) -> None:
    """A reward process: load the reward, then score one sample per message until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if pdeathsig and sys.platform.startswith("linux"):
        _die_with_parent(parent)
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()
    try:
        fn = rewards.load(spec, key)
    except Exception as exc:  # noqa: BLE001 - a ConfigError, or whatever else: sent to the controller
        _send(conn, ("error", exc))
        return
    _send(conn, ("ready", None))
    while True:
        try:
            sample = conn.recv()
        except (EOFError, OSError):
            return  # the controller closed its end
        if sample is None:
            return
        try:
            _send(conn, ("ok", rewards.score(fn, sample.prompt, sample.response, sample.metadata,
                                             index=sample.index, name=spec)))
        except RewardError as exc:
            _send(conn, ("error", exc))


def _send(conn: Connection, message: tuple[str, Any]) -> None:
    """``message``; an exception that does not pickle goes as a RewardError of its text."""
    try:
        conn.send(message)
    except Exception as exc:  # noqa: BLE001 - a user's exception may not pickle
        conn.send(("error", RewardError(f"{message[1]} (its exception did not pickle: {exc})")))


@dataclass
class _Process:
    proc: subprocess.Popen[bytes]
    conn: Connection

    def ended(self) -> str:
        """How it ended (waited for up to CLOSE_TIMEOUT_S): its exit code or signal."""
        try:
            code = self.proc.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _launch(spec: str, key: str) -> _Process:
    """One reward process, its end of a socket pair passed by descriptor number."""
    mine, theirs = socket.socketpair()
    try:
        path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)  # this very core package
        env = {**os.environ, "PYTHONPATH": path, _SYS_PATH: json.dumps(sys.path)}
        # the kernel's parent-death signal fires when the starting *thread* ends: asked for
        # only from the main thread, which lives as long as the controller
        pdeathsig = threading.current_thread() is threading.main_thread()
        argv = [str(theirs.fileno()), str(os.getpid()), spec, key, str(int(pdeathsig))]
        proc = subprocess.Popen([sys.executable, "-m", "core.rl.reward_pool", *argv],
                                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()  # only the child holds its end now: its death reads as EOF here
    return _Process(proc, Connection(mine.detach()))


class Scorer:
    """The rewards of a run, scored in ``workers`` reward processes, ``timeout_s`` per call.

    ``spec``: ``rl.reward`` (a built-in name or ``module:function``), loaded in each process.
    """

    def __init__(self, spec: str, *, workers: int, timeout_s: float, key: str = "rl.reward") -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"a reward pool needs workers >= 1 and timeout_s > 0 (got {workers}, {timeout_s})")
        self.spec, self.workers, self.timeout_s, self.key = spec, workers, timeout_s, key
        self._procs: list[_Process] = []

    def __enter__(self) -> Scorer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """The reward processes' pids (empty when closed)."""
        return [p.proc.pid for p in self._procs]

    def start(self) -> None:
        """Start the reward processes (once) and wait until each has imported the reward."""
        if self._procs:
            return
        try:
            for _ in range(self.workers):
                self._procs.append(_launch(self.spec, self.key))
            deadline = time.monotonic() + START_TIMEOUT_S  # one bound for all: they start side by side
            for p in self._procs:
                self._await_ready(p, deadline)
        except BaseException:
            self.close()
            raise

    def _await_ready(self, p: _Process, deadline: float) -> None:
        if not p.conn.poll(max(0.0, deadline - time.monotonic())):
            raise BatonRuntimeError(f"{self.key}: a reward process did not load {self.spec!r} within "
                                    f"{START_TIMEOUT_S:.0f} s (pid {p.proc.pid}); see the controller's log")
        try:
            kind, value = p.conn.recv()
        except (EOFError, OSError):
            raise RewardError(f"{self.key}: the reward process ended ({p.ended()}) while it imported "
                              f"{self.spec!r}; fix the module (its output is in the controller's log)") from None
        if kind == "error":
            raise value
        if kind != "ready":
            raise AssertionError(f"a reward process sent {kind!r} before it was ready")

    def score_all(self, samples: Sequence[Sample]) -> list[float]:
        """The reward of every sample, in order; a failing, hanging or crashing call raises a
        RewardError (the pool is closed then)."""
        self.start()
        out: list[float | None] = [None] * len(samples)
        todo = deque(range(len(samples)))
        idle = list(reversed(self._procs))
        busy: dict[Connection, tuple[_Process, int, float]] = {}  # conn → (process, sample, deadline)
        try:
            while todo or busy:
                while todo and idle:
                    p, i = idle.pop(), todo.popleft()
                    self._send(p, samples[i])
                    busy[p.conn] = (p, i, time.monotonic() + self.timeout_s)
                first = min(deadline for _, _, deadline in busy.values())
                ready = wait(list(busy), timeout=max(0.0, first - time.monotonic()))
                for conn in ready:
                    p, i, _ = busy.pop(conn)  # type: ignore[index]
                    out[i] = self._result(p, samples[i])
                    idle.append(p)
                now = time.monotonic()
                late = [(p, i) for p, i, deadline in busy.values() if deadline <= now]
                if late:
                    p, i = min(late, key=lambda pi: pi[1])
                    self._kill(p)
                    raise RewardError(f"{self.key}: {self.spec} took more than rl.reward_timeout_s = "
                                      f"{self.timeout_s:g} s on {rewards.describe(samples[i])}; its process was "
                                      "killed; make the reward faster or raise rl.reward_timeout_s")
        except BaseException:
            self.close()
            raise
        return [float(v) for v in out]  # type: ignore[arg-type]

    def _send(self, p: _Process, sample: Sample) -> None:
        """``sample`` to an idle process; one that ended between calls (killed from outside: the
        kernel's out-of-memory killer, a ``kill``) fails the step naming it."""
        try:
            if p.proc.poll() is not None:  # gone already (its socket may still take a message)
                raise BrokenPipeError
            p.conn.send(sample)
        except OSError:
            raise RewardError(f"{self.key}: the reward process of {self.spec} (pid {p.proc.pid}) had ended "
                              f"({p.ended()}) while idle, before {rewards.describe(sample)} (killed from outside: out "
                              "of memory?); see the controller's log and the node's kernel log") from None

    def _result(self, p: _Process, sample: Sample) -> float:
        try:
            kind, value = p.conn.recv()
        except (EOFError, OSError):
            raise RewardError(f"{self.key}: {self.spec} ended its reward process ({p.ended()}) on "
                              f"{rewards.describe(sample)}; fix the reward function") from None
        if kind == "error":
            raise value
        return float(value)

    def _kill(self, p: _Process) -> None:
        p.proc.kill()
        if p.ended() == "still running":
            log.warning("reward process %s did not end after SIGKILL within %.0f s", p.proc.pid, CLOSE_TIMEOUT_S)

    def close(self) -> None:
        """End every reward process: asked first, killed after ``CLOSE_TIMEOUT_S``."""
        procs, self._procs = self._procs, []
        for p in procs:
            try:
                p.conn.send(None)
            except (OSError, ValueError):
                pass  # it is gone already, or busy forever: killed below
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for p in procs:
            try:
                p.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._kill(p)
            p.conn.close()


def main(argv: list[str]) -> None:
    """A reward process: ``FD PARENT_PID SPEC KEY PDEATHSIG``, with the controller's ``sys.path``
    (``_SYS_PATH``)."""
    fd, parent, spec, key, pdeathsig = argv
    sys.path[:] = json.loads(os.environ.pop(_SYS_PATH, "null")) or sys.path
    _serve(Connection(int(fd)), spec, key, int(parent), pdeathsig=pdeathsig == "1")


if __name__ == "__main__":
    main(sys.argv[1:])
