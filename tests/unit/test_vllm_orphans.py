"""A vLLM leader's weights folder in shared memory outlives a worker killed outright; the next
leader on the node removes such folders of workers that are gone, and only those."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from core.model.gpt import vllm_rollout


def test_a_new_leader_removes_the_weights_folders_of_dead_workers_only(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid runs no process
    dead = tmp_path / f"{vllm_rollout.SHM_PREFIX}{gone.pid}-abc"
    alive = tmp_path / f"{vllm_rollout.SHM_PREFIX}{os.getpid()}-def"
    other = tmp_path / "baton-vllm-notapid-x"
    for folder in (dead, alive, other):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"weights")
    vllm_rollout._sweep_orphans(str(tmp_path))
    assert not dead.exists() and alive.is_dir() and other.is_dir()
