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
import re
from typing import Literal


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

    ``same_on_all_ranks``: every rank of the call raised the same exception type with the
    same message; with a type that names a bug (``PROGRAMMING_ERRORS``) the mark of a
    deterministic error that a restart would only repeat.
    ``user_error``: the worker's ``fault_class`` said "user" (a ``UserError``: bad input).
    ``transient``: ... said "transient" (the storage or the network: worth a retry).
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
        self.transient = transient  # ... or a storage or network fault that passes (fault_class)


# Faults of the storage or the network that pass (a full or flaky file system, a stale NFS
# handle, a peer that reset its connection): retried, never taken for the user's mistake.
TRANSIENT_ERRNOS = frozenset({
    errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN, errno.EREMOTEIO,
    errno.ENOLCK, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ENETDOWN, errno.ENETUNREACH,
    errno.ENETRESET, errno.EHOSTUNREACH, errno.EHOSTDOWN, errno.EPIPE, errno.ENOTCONN, errno.ENOBUFS,
    errno.ECOMM,
})
# torch.distributed's own errors of the transport and the store (matched by name and module:
# no torch import here), and the words gloo and NCCL put in the RuntimeErrors they raise.
_DIST_ERRORS = frozenset({"DistBackendError", "DistNetworkError", "DistStoreError"})
_DIST_WORDS = ("timed out", "connection reset by peer", "connection closed by peer", "connection refused",
               "broken pipe", "nccl error", "watchdog", "socket timeout")
_HDF5_ERRNO = re.compile(r"errno = (\d+)")  # h5py's message of a failed file driver call
# The exception types that name a bug or a bad input by themselves: the same one with the same
# message on every rank would come back on a retry (RuntimeError and OSError say nothing alone).
PROGRAMMING_ERRORS = frozenset({
    "TypeError", "ValueError", "KeyError", "IndexError", "LookupError", "AttributeError", "NameError",
    "UnboundLocalError", "AssertionError", "ZeroDivisionError", "ArithmeticError", "NotImplementedError",
    "ImportError", "ModuleNotFoundError", "SyntaxError", "RecursionError", "UnicodeDecodeError",
    "UnicodeEncodeError",
})
FaultClass = Literal["transient", "user", "unknown"]


def fault_class(exc: BaseException) -> FaultClass:
    """What caused ``exc``, by cause rather than type: "transient" (the storage or the network:
    a retry may get past it), "user" (bad input, a failing reward: no retry can) or "unknown".

    Walks ``exc`` and its ``__cause__``/``__context__`` chain, outermost first; the first link
    that says something decides, so a ``UserError`` raised over an I/O error stays the user's
    (code that turns a passing I/O error into its own error raises ``TransientIOError``).
    """
    for link in _chain(exc):
        if isinstance(link, UserError):
            return "user"
        if _transient_link(link):
            return "transient"
    return "unknown"


def is_transient(exc: BaseException) -> bool:
    """An infrastructure fault a retry may get past (``fault_class`` says "transient")."""
    return fault_class(exc) == "transient"


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc``, then what it was raised from or while handling, each once."""
    out: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and all(link is not seen for seen in out):
        out.append(link)
        link = link.__cause__ if link.__cause__ is not None else link.__context__
    return out


def _transient_link(exc: BaseException) -> bool:
    if isinstance(exc, TransientIOError | TimeoutError | ConnectionError):
        return True
    if isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS:
        return True
    names = {(c.__name__, c.__module__.split(".")[0]) for c in type(exc).__mro__}
    if any(name in _DIST_ERRORS and module == "torch" for name, module in names):
        return True
    message = str(exc)
    if isinstance(exc, OSError | RuntimeError) and (m := _HDF5_ERRNO.search(message)):
        return int(m.group(1)) in TRANSIENT_ERRNOS  # h5py: the errno is only in the message
    if isinstance(exc, RuntimeError) and _from_torch_distributed(exc):
        lowered = message.lower()
        return any(word in lowered for word in _DIST_WORDS)
    return False


def _from_torch_distributed(exc: BaseException) -> bool:
    """Raised in torch.distributed (a frame of its traceback is there), or gloo/NCCL's own words."""
    tb = exc.__traceback__
    while tb is not None:
        if "torch/distributed/" in tb.tb_frame.f_code.co_filename.replace("\\", "/"):
            return True
        tb = tb.tb_next
    lowered = str(exc).lower()
    return any(word in lowered for word in ("gloo", "nccl", "c10d", "processgroup"))


class TransientIOError(BatonRuntimeError):
    """A write failed for a reason of the storage (no space, an I/O error): retried within the budget."""


class RewardError(UserError):
    """The user's reward function raised on a sample, or returned no finite number: their bug."""


class RegistrationError(BatonRuntimeError):
    """Workers did not register in time, or a worker was refused."""
