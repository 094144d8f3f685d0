"""One controller per run folder: an ``flock`` on ``controller.lock`` held for the controller's life.

A second controller on the same run folder (a resume while the run still runs, a stray
requeue) would delete the first one's checkpoints; it is refused at start, naming the
holder from controller.json. The login node asks the same lock before a resume: a run
whose controller still holds it is not resumed.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator

from core.errors import UserError
from core.record.runfolder import RunFolder


def _path(run: RunFolder) -> str:
    return str(run.path / "controller.lock")


def holder(run: RunFolder) -> str:
    """Who the lock's holder is, from controller.json (best effort)."""
    try:
        info = json.loads(run.controller.read_bytes())
        return f"pid {info['pid']} on {info['node']} (epoch {info['epoch']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "a controller whose controller.json is unreadable"


def _try(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def controller_lock(run: RunFolder) -> Iterator[None]:
    """Hold the run's controller lock; a UserError naming the holder when another has it."""
    fd = os.open(_path(run), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if not _try(fd):
            raise UserError(f"{run.path}: another controller runs this run ({holder(run)}); a second one would "
                            "undo its checkpoints: wait for it, or end it (`baton cancel`) first")
        yield
    finally:
        os.close(fd)


def controller_alive(run: RunFolder) -> str | None:
    """The live controller's description when one holds the lock, else None (the lock is not kept)."""
    try:
        fd = os.open(_path(run), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return None if _try(fd) else holder(run)
    finally:
        os.close(fd)
