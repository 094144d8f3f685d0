"""What went wrong with a worker: what a silent one is (exited, stopped or hung), and the one
error a call's failed ranks make.

From the controller's side a worker that exited, one stopped by SIGSTOP and one hung on
its host all look alike (no heartbeats); /proc tells them apart for a local pid.
"""
from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

from core.errors import RemoteError
from core.wire import protocol


def remote_error(method: str, errors: dict[int, protocol.Error], n: int, log_of: Callable[[int], Path]) -> RemoteError:
    """The ranks' errors of one call as one RemoteError: the first rank's, with its traceback and
    whether every rank raised the same (type and message: one cause), transient when every
    failed rank's was (a rank that raised a bug makes it no passing fault), a user error when
    any rank's was."""
    rank = min(errors)
    err = errors[rank]
    same = len(errors) == n and len({(e.exc_type, e.message) for e in errors.values()}) == 1
    scope = (f"the same on all {n} ranks" if same else
             f"{len(errors)} of {n} ranks raised: " + ", ".join(f"r{r} {e.exc_type}" for r, e in sorted(errors.items())[:8]))
    return RemoteError(
        f"rank {rank} raised {err.exc_type} in {method}: {err.message} ({scope})\n"
        f"--- remote traceback (rank {rank}, log {log_of(rank)}) ---\n{err.traceback}",
        rank=rank, exc_type=err.exc_type, remote_traceback=err.traceback, method=method, same_on_all_ranks=same,
        user_error=any(e.user_error for e in errors.values()),
        transient=all(e.transient for e in errors.values()),
    )


def _proc_state(pid: int) -> str:
    """The kernel's one-letter state of a local pid; "" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def diagnose(host: str, pid: int, *, settle_s: float = 0.0) -> str:
    """Say more than 'silent' when the worker runs on this host.

    ``settle_s``: a dying process closes its sockets before the kernel marks it a
    zombie, so a closed connection is seen while /proc still says running. When the
    connection is known closed, wait up to ``settle_s`` for the pid to finish exiting
    before calling it hung.
    """
    if host != socket.gethostname():
        return "exited or hung"
    deadline = time.monotonic() + settle_s
    while True:
        state = _proc_state(pid)
        if state in ("", "Z", "X"):
            return "process exited"
        if state in ("T", "t") or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    return {"T": "process stopped (SIGSTOP)", "t": "process stopped (traced)"}.get(
        state, "process alive but unresponsive (hung)"
    )
