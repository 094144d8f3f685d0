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

Unset (the normal case), nothing sleeps. A malformed setting raises at the first step,
naming it.
"""
from __future__ import annotations

import errno
import functools
import os
import threading
import time

ENV = "BATON_FAULTS"
KEYS = ("data_delay_ms", "compute_delay_ms", "sync_delay_ms", "manifest_eio", "manifest_estale")


@functools.cache
def _settings() -> dict[str, str]:
    out = {}
    for item in filter(None, (s.strip() for s in os.environ.get(ENV, "").split(";"))):
        key, sep, value = item.partition("=")
        if not sep or key not in KEYS:
            raise ValueError(f"{ENV}: {item!r} is not one of data_delay_ms=N, compute_delay_ms=RANK:N, sync_delay_ms=N, "
                             "manifest_eio=N, manifest_estale=N")
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
