"""This process on its host: when it started, resident memory (now and its peak), a free port."""
from __future__ import annotations

import os
import socket
import time


def started_at() -> float:
    """Unix time this process started (Linux's /proc; now where /proc is missing)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # starttime: field 22, in clock ticks since boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def rss_mb() -> float:
    """Resident memory of this process in MiB (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def reset_peak_rss() -> None:
    """Start this process's peak resident memory (VmHWM) again (Linux; nothing elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mb() -> float | None:
    """This process's peak resident memory since the last reset, in MiB (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def free_port() -> int:
    """A TCP port free on this host right now (offered to torch.distributed's rendezvous)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
