"""Reading a checkpoint's files through storage faults (no h5py, numpy or torch).

A storage fault is not damage: an OSError that passes (EIO, ESTALE, ... ``core.errors.is_transient``)
is retried with a doubling wait for ``IO_DEADLINE_S``, then raised as TransientIOError (the
controller's recovery retries it; the CLI says the filesystem failed, exit 1); another one
(EACCES) becomes a RunFolderError (``unreadable``). Neither ever sets a checkpoint aside: only
what the bytes say (a format, size or checksum mismatch, a missing file) does
(core.checkpoint.manifest.verify). Every read of a ``manifest.json`` goes through
``manifest_bytes``, where the tests inject their faults (core.job.faults: BATON_FAULTS).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from core.errors import RunFolderError, TransientIOError, is_transient
from core.job import faults

logger = logging.getLogger(__name__)

T = TypeVar("T")
IO_DEADLINE_S = 5.0  # how long a read of a checkpoint is retried through transient storage errors
IO_FIRST_WAIT_S = 0.05  # then doubled


def storage_io(path: Path, read: Callable[[], T]) -> T:
    """``read()``, retried while it raises a transient storage error, for up to ``IO_DEADLINE_S``;
    then a TransientIOError naming ``path``. Other errors pass through."""
    deadline_s = IO_DEADLINE_S
    deadline = time.monotonic() + deadline_s
    wait = IO_FIRST_WAIT_S
    failed: OSError | None = None
    while True:
        try:
            value = read()
            if failed is not None:
                logger.warning("%s: read after a storage error (%s), retried", path, failed.strerror or failed)
            return value
        except OSError as exc:
            if not is_transient(exc):
                raise
            if time.monotonic() + wait > deadline:
                raise TransientIOError(
                    f"{path}: {exc.strerror or exc} (errno {exc.errno}), still after {deadline_s:.0f} s of retries; "
                    "the filesystem failed, not the checkpoint (nothing was set aside): check the mount "
                    "and try again") from exc
            logger.debug("%s: %s; reading it again in %.2f s", path, exc.strerror or exc, wait)
            failed = exc
            time.sleep(wait)
            wait *= 2


def manifest_bytes(path: Path) -> bytes:
    """The bytes of a ``manifest.json``: every read of a manifest goes through here (and
    through ``core.job.faults.manifest_open``, the tests' storage faults)."""

    def read() -> bytes:
        faults.manifest_open(path)
        return Path(path).read_bytes()

    return storage_io(path, read)


def unreadable(path: Path, exc: OSError) -> RunFolderError:
    """A storage error that no retry mends (EACCES, EPERM, ...): the user's, the checkpoint is fine."""
    return RunFolderError(f"{path}: unreadable ({exc.strerror or exc}); the checkpoint is not damaged and was not set "
                          "aside: fix the file's permissions or the mount, then resume")
