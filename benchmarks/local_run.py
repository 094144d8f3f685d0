"""One ``baton submit --backend local`` run for a benchmark: its run folder, or the run's
output when it failed (benchmarks/memory.py, benchmarks/gpu_size.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def submit_local(experiment: Path, overrides: list[str], root: Path, *, timeout_s: float = 3600) -> Path:
    """Run ``experiment`` with ``overrides`` under ``root`` in this process's Python; its folder."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "submit", str(experiment), f"runs_root={root}",
                          *overrides, "--backend", "local"], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=timeout_s)
    if out.returncode:
        raise SystemExit(f"{experiment.name} {' '.join(overrides)}: the run failed ({out.returncode}):\n"
                         f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return Path(next(line for line in out.stdout.splitlines() if line.startswith("run folder: ")).split(": ", 1)[1])
