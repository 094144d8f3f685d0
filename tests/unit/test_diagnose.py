"""How the controller names a lost local worker's state, on real processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from core.controller.diagnose import diagnose


def _here(pid: int, settle_s: float = 0.0) -> str:
    return diagnose(socket.gethostname(), pid, settle_s=settle_s)


@pytest.fixture
def child():
    procs: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"])
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def test_a_living_process_is_called_hung(child) -> None:
    p = child()
    assert _here(p.pid) == "process alive but unresponsive (hung)"


def test_a_stopped_process_is_called_stopped(child) -> None:
    p = child()
    os.kill(p.pid, signal.SIGSTOP)
    try:
        # SIGSTOP is delivered asynchronously; settle_s waits for the state to show it
        assert _here(p.pid, settle_s=5.0) == "process stopped (SIGSTOP)"
    finally:
        os.kill(p.pid, signal.SIGCONT)


def test_a_killed_process_is_called_exited_also_before_it_is_reaped(child) -> None:
    p = child()
    os.kill(p.pid, signal.SIGKILL)
    # not waited for: a zombie (or a process still tearing down) must read as exited
    assert _here(p.pid, settle_s=5.0) == "process exited"


def test_a_pid_that_is_gone_is_called_exited(child) -> None:
    p = child()
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=10)
    assert _here(p.pid) == "process exited"


def test_a_worker_on_another_host_is_not_guessed_at() -> None:
    assert diagnose("elsewhere.invalid", 1) == "exited or hung"
