"""Ending a vLLM engine's processes removes the shared memory they made, even when they are
killed before their own teardown (as Slurm's requeue kills them): real processes, no vLLM.

The engine's processes stand in for vLLM's: each makes a Python shared-memory segment (the
message queues between an engine's core and its workers are ``psm_*`` segments) and, like a
killed vLLM process, never removes it (nor does Python's resource tracker).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from core.model.gpt import vllm_engine

MAKER = """
import sys
from multiprocessing import resource_tracker, shared_memory
shm = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(shm._name, "shared_memory")  # a killed process's tracker cleans nothing either
print(shm.name, flush=True)
sys.stdin.read()  # until killed
"""


@pytest.fixture
def makers():
    """``start()``: a process holding a new shared-memory segment; (process, its /dev/shm path)."""
    started: list[tuple[subprocess.Popen, Path]] = []

    def start() -> tuple[psutil.Process, Path]:
        proc = subprocess.Popen([sys.executable, "-c", MAKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        path = Path("/dev/shm") / proc.stdout.readline().strip().lstrip("/")  # type: ignore[union-attr]
        started.append((proc, path))
        return psutil.Process(proc.pid), path

    yield start
    for proc, path in started:
        proc.kill()
        proc.wait()
        path.unlink(missing_ok=True)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_killed_engine_processes_leave_no_shared_memory(makers) -> None:
    (core, core_shm), (worker, worker_shm) = makers(), makers()
    assert core_shm.name.startswith("psm_") and core_shm.exists() and worker_shm.exists()
    assert vllm_engine.end_processes([core, worker]) == sorted([core_shm.name, worker_shm.name])
    assert not core_shm.exists() and not worker_shm.exists()
    assert not core.is_running() and not worker.is_running()


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_memory_noted_before_the_processes_died_is_removed_too(makers) -> None:
    """Slurm ends the engine's processes while the worker shuts it down: what they mapped when
    the shutdown began is removed once they are gone."""
    (core, core_shm), (worker, worker_shm) = makers(), makers()
    noted = vllm_engine.shared_memory([core])
    assert noted == {str(core_shm)}
    core.kill()
    core.wait(10)
    assert core_shm.exists()  # a killed process removes nothing: the leak this guards against
    assert vllm_engine.end_processes([core, worker], noted) == sorted([core_shm.name, worker_shm.name])
    assert not core_shm.exists()
