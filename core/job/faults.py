"""Fault injection for tests and benchmarks: the one place Baton reads it.

``BATON_FAULTS`` holds ``;``-separated settings, read by each process when first asked:

    data_delay_ms=N        every rank sleeps N ms while it fetches a step's batches
    compute_delay_ms=R:N   rank R (global) sleeps N ms in each step's compute: a straggler
    sync_delay_ms=N        every average of ``parallel.sync`` sleeps N ms: a slow link

Unset (the normal case), nothing sleeps. A malformed setting raises at the first step,
naming it.
"""
from __future__ import annotations

import functools
import os
import time

ENV = "BATON_FAULTS"


@functools.cache
def _settings() -> dict[str, str]:
    out = {}
    for item in filter(None, (s.strip() for s in os.environ.get(ENV, "").split(";"))):
        key, sep, value = item.partition("=")
        if not sep or key not in ("data_delay_ms", "compute_delay_ms", "sync_delay_ms"):
            raise ValueError(f"{ENV}: {item!r} is not one of data_delay_ms=N, compute_delay_ms=RANK:N, sync_delay_ms=N")
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
