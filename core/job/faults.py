"""Fault injection for tests and benchmarks: the one place Baton reads it.

``BATON_FAULTS`` holds ``;``-separated settings, read by each process when first asked:

    data_delay_ms=N        every rank sleeps N ms while it fetches a step's batches
    compute_delay_ms=R:N   rank R (global) sleeps N ms in each step's compute: a straggler
    sync_delay_ms=N        every average of ``parallel.sync`` sleeps N ms: a slow link
    manifest_eio=[ROLE:]N  the first N opens of a checkpoint's manifest.json in this process
                           fail with OSError(EIO) (core.checkpoint.manifest reads through
                           ``manifest_open``): a flaky storage at resume. ROLE (controller,
                           worker, cli) limits it to the processes of that role.
    manifest_estale=[ROLE:]N  the same with ESTALE (a stale NFS file handle)
    raise_at_step=S:KIND   every rank raises at training step S, once per run folder (a marker
                           file per rank, fault-raised-S-rNNNNN, so the retry goes past it):
                           conn_reset          a real ConnectionResetError (a TCP peer's RST)
                           collective_timeout  the RuntimeError gloo raises when a collective times out
                           runtime_error       a RuntimeError of unknown cause, the same on every rank
                           type_error          the same TypeError on every rank: a bug
                           user_error          the same UserError on every rank: a bad input
    generate_delay_ms=N    every generator rank sleeps N ms in each GENERATE of an RL step's rollout:
                           a generator whose time stands for an accelerator that does not compete
                           for this machine's cores (benchmarks/rl_async.py, the overlap's tests)
    kill_at_generate=S     the generator's first rank kills itself (SIGKILL) in the GENERATE of
                           step S's rollout, once per run folder (a marker file): a lost worker
    sigterm_at=S:POINT[,S:POINT...]  the controller sends SIGTERM to the process that started it
                           (the local launcher: a user's kill) at POINT of RL step S, once per run
                           folder each: ``generating`` (step S's rollout taken, the next one in
                           flight), ``updating`` (before step S's update), ``between`` (after step
                           S's record, before the next step)

Unset (the normal case), nothing sleeps or raises. A malformed setting raises at the first
step, naming it.
"""
from __future__ import annotations

import errno
import functools
import os
import signal
import socket
import struct
import threading
import time
from pathlib import Path

from core.errors import UserError

ENV = "BATON_FAULTS"
KEYS = ("data_delay_ms", "compute_delay_ms", "sync_delay_ms", "manifest_eio", "manifest_estale", "raise_at_step",
        "generate_delay_ms", "kill_at_generate", "sigterm_at")
POINTS = ("generating", "updating", "between")
KINDS = ("conn_reset", "collective_timeout", "runtime_error", "type_error", "user_error")


@functools.cache
def _settings() -> dict[str, str]:
    out = {}
    for item in filter(None, (s.strip() for s in os.environ.get(ENV, "").split(";"))):
        key, sep, value = item.partition("=")
        if not sep or key not in KEYS:
            raise ValueError(f"{ENV}: {item!r} is not one of data_delay_ms=N, compute_delay_ms=RANK:N, "
                             f"sync_delay_ms=N, manifest_eio=N, manifest_estale=N, raise_at_step=STEP:KIND "
                             f"(KIND: {', '.join(KINDS)}), generate_delay_ms=N, kill_at_generate=STEP, "
                             f"sigterm_at=STEP:POINT (POINT: {', '.join(POINTS)})")
        if key == "generate_delay_ms" and not value.replace(".", "", 1).isdigit():
            raise ValueError(f"{ENV}: {item!r}: give generate_delay_ms=N, N milliseconds")
        if key == "kill_at_generate" and not value.isdigit():
            raise ValueError(f"{ENV}: {item!r}: give kill_at_generate=STEP, an RL step")
        if key == "sigterm_at" and not all(p.partition(":")[0].isdigit() and p.partition(":")[2] in POINTS
                                           for p in value.split(",")):
            raise ValueError(f"{ENV}: {item!r}: give sigterm_at=STEP:POINT[,STEP:POINT] with POINT one of "
                             f"{', '.join(POINTS)}")
        if key == "raise_at_step" and (value.partition(":")[2] not in KINDS or not value.partition(":")[0].isdigit()):
            raise ValueError(f"{ENV}: {item!r}: give raise_at_step=STEP:KIND with KIND one of {', '.join(KINDS)}")
        out[key] = value
    return out


def _sleep_ms(value: str | None) -> None:
    if value:
        time.sleep(float(value) / 1000.0)


def data_delay() -> None:
    _sleep_ms(_settings().get("data_delay_ms"))


def compute_delay(rank: int) -> None:
    rank_s, _, ms = _settings().get("compute_delay_ms", "").partition(":")
    if rank_s and int(rank_s) == rank:
        _sleep_ms(ms)


def sync_delay() -> None:
    _sleep_ms(_settings().get("sync_delay_ms"))


_opens = {"manifest_eio": 0, "manifest_estale": 0}  # injected failures so far, in this process
_opens_lock = threading.Lock()
_role = ["cli"]  # core.entrypoint names the controller's and the workers' processes


def set_process(role: str) -> None:
    """This process's role, for the faults limited to one (``manifest_eio=controller:N``)."""
    _role[0] = role


def manifest_open(path: os.PathLike[str] | str) -> None:
    """Before an open of ``path`` (a manifest.json): raise the injected storage fault, if one is due."""
    settings = _settings()
    for key, code in (("manifest_eio", errno.EIO), ("manifest_estale", errno.ESTALE)):
        if key not in settings:
            continue
        role, _, count = settings[key].rpartition(":")
        if role and role != _role[0]:
            continue
        with _opens_lock:
            due = _opens[key] < int(count)
            _opens[key] += due
        if due:
            raise OSError(code, f"{os.strerror(code)} ({ENV} {key})", str(path))


def raise_at_step(step: int, rank: int) -> None:
    """``raise_at_step=S:KIND``: raise KIND at step S, the first time this rank of this run
    (``BATON_RUN_DIR``, the worker's run folder) gets there."""
    at, _, kind = _settings().get("raise_at_step", "").partition(":")
    if not at or int(at) != step:
        return
    marker = Path(os.environ["BATON_RUN_DIR"]) / f"fault-raised-{step}-r{rank:05d}"
    if marker.exists():
        return
    marker.touch()
    if kind == "conn_reset":
        _connection_reset()
    if kind == "collective_timeout":  # gloo's words (ProcessGroupGloo, a recv past the timeout)
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                           f"1800000ms for recv operation to complete (injected at step {step} by {ENV})")
    if kind == "runtime_error":
        raise RuntimeError(f"injected failure of unknown cause at step {step} ({ENV})")
    if kind == "user_error":
        raise UserError(f"injected bad input at step {step} ({ENV} raise_at_step); fix the input")
    raise TypeError(f"injected TypeError at step {step} ({ENV})")


def generate(step: int, first: bool) -> None:
    """In a generator rank's GENERATE of step ``step``'s rollout (``first``: the generator
    group's first rank): ``generate_delay_ms``, ``kill_at_generate``."""
    settings = _settings()
    if step < 0:
        return
    _sleep_ms(settings.get("generate_delay_ms"))
    at = settings.get("kill_at_generate")
    if first and at and int(at) == step and _once(f"fault-killed-generate-{step}"):
        os.kill(os.getpid(), signal.SIGKILL)


def at_point(step: int, point: str) -> None:
    """The controller at ``point`` of RL step ``step``: ``sigterm_at``'s SIGTERM to its parent."""
    value = _settings().get("sigterm_at")
    due = {(int(at), where) for at, _, where in (p.partition(":") for p in value.split(","))} if value else set()
    if (step, point) in due and _once(f"fault-sigterm-{step}-{point}"):
        os.kill(os.getppid(), signal.SIGTERM)


def _once(name: str) -> bool:
    """True the first time ``name`` is asked for in this run folder (a marker file there)."""
    marker = Path(os.environ["BATON_RUN_DIR"]) / name
    try:
        marker.touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


def _connection_reset() -> None:
    """Receive from a loopback TCP connection whose peer closed it with a reset: a real ECONNRESET."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        with client:
            peer, _ = server.accept()
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
            peer.close()
            client.settimeout(10)
            client.recv(1)  # raises ConnectionResetError
    raise ConnectionResetError("the peer closed without a reset")  # not reached on Linux
