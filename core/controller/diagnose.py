"""What a silent worker is, when it runs on this host: exited, stopped or hung.

From the controller's side a worker that exited, one stopped by SIGSTOP and one hung on
its host all look alike (no heartbeats); /proc tells them apart for a local pid.
"""
from __future__ import annotations

import socket
import time


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
