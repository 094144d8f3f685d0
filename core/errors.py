"""Baton's error hierarchy and its exit codes, in one place.

User errors are ``ValueError`` subclasses with one-line, actionable messages: the CLI
turns them into exit code 2 without a traceback. Runtime failures of a run (a lost
worker, a missed deadline, a remote exception) are ``BatonRuntimeError`` subclasses.
Every Baton process (the CLI, the controller, a worker, the supervisors) exits with an
``ExitCode``.
"""
from __future__ import annotations

import enum
import errno


class ExitCode(enum.IntEnum):
    """How a Baton process ends. The supervisors read the controller's, the CLI returns its own."""

    OK = 0  # done: the run completed (or stopped, checkpointed, as Slurm ends the job)
    FAILED = 1  # the run, or a check (`baton ckpt verify`, `baton doctor`), failed
    USER_ERROR = 2  # bad input: one line on stderr naming the key or file, the value and the fix
    CONTROLLER_LOST = 3  # a worker: the controller was silent for timeouts.controller_lost_s
    REFUSED = 4  # a worker: the controller refused it (stale epoch or generation, full group)
    ABORTED = 5  # a worker: the controller aborted the step
    REQUEUED = 85  # the controller checkpointed and asks for the next epoch (Slurm requeue)
    INTERRUPTED = 130  # Ctrl-C


class BatonError(Exception):
    """Base of every error Baton raises on purpose."""


class UserError(BatonError, ValueError):
    """Bad input from the user: config, CLI arguments, files. One line, with the fix."""


class ConfigError(UserError):
    """A config value is wrong; the message names the dotted path, the value and the fix."""


class LayoutError(ConfigError):
    """The parallel layout does not fit the model or the worker count."""


class CheckpointError(UserError):
    """A checkpoint file or folder is missing, incomplete or corrupt."""


class RunFolderError(UserError):
    """A file of the run folder (state, events, plan, metrics) is missing, damaged or of another version."""


class ProtocolError(BatonError, ValueError):
    """A message from the wire is malformed, of an unknown kind or of another version."""


class BatonRuntimeError(BatonError, RuntimeError):
    """A run failed while executing."""


class WorkerLostError(BatonRuntimeError):
    """One or more workers stopped heartbeating, exited or were declared hung."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class CallTimeoutError(BatonRuntimeError):
    """A call's deadline passed before every expected rank answered."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


class RemoteError(BatonRuntimeError):
    """A worker raised while executing a call; carries the remote traceback.

    ``same_on_all_ranks``: every rank of the call raised the same exception type, the
    mark of a deterministic error (a bug, a bad config) that a restart would only repeat.
    ``user_error``: the worker flagged its exception as bad input (a ``UserError``).
    """

    def __init__(self, message: str, rank: int, exc_type: str, remote_traceback: str, *,
                 method: str = "", same_on_all_ranks: bool = False, user_error: bool = False,
                 transient: bool = False) -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.method = method
        self.same_on_all_ranks = same_on_all_ranks
        self.user_error = user_error  # the worker said so: its exception was a UserError
        self.transient = transient  # ... or a storage fault that passes (core.errors.is_transient)


# Storage faults that pass (a full or flaky file system, a stale NFS handle): retried, never
# taken for the user's mistake.
TRANSIENT_ERRNOS = frozenset({errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN,
                              errno.EREMOTEIO, errno.ENOLCK})


def is_transient(exc: BaseException) -> bool:
    """An infrastructure fault a retry may get past (``TransientIOError`` or an OSError of those kinds)."""
    return isinstance(exc, TransientIOError) or (isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS)


class TransientIOError(BatonRuntimeError):
    """A write failed for a reason of the storage (no space, an I/O error): retried within the budget."""


class RegistrationError(BatonRuntimeError):
    """Workers did not register in time, or a worker was refused."""
