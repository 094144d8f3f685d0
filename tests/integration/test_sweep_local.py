"""`baton sweep` with the local backend, end to end: real controller and worker processes (toy model)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, baton, sweep_ledger, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
SWEEP = "experiments/sweep_toy.yaml"
SMALL = ["trainer.n_gpus_per_node=2", "trainer.steps=8"]


def _state(run_dir: str | Path) -> dict:
    return json.loads((Path(run_dir) / "state.json").read_text())


def test_local_2x2_grid_completes_with_status_and_results(tmp_path: Path) -> None:
    res = baton("sweep", "submit", SWEEP, "--backend", "local", f"runs_root={tmp_path}", *SMALL)
    assert res.returncode == 0, res.stdout + res.stderr
    sweep_dir = tmp_path / "sweep_toy"
    ledger = sweep_ledger(sweep_dir)
    dirs = {p["run_dir"] for p in ledger["points"]}
    assert len(dirs) == 4 and all(Path(d).parent == sweep_dir for d in dirs)
    assert [p["state"] for p in ledger["points"]] == ["completed"] * 4
    assert (sweep_dir / "sweep.yaml").read_text() == (REPO / SWEEP).read_text()
    losses = {p["index"]: _state(p["run_dir"])["last_loss"] for p in ledger["points"]}

    status = baton("sweep", "status", str(sweep_dir))
    assert status.returncode == 0, status.stderr
    assert "states: 4 completed (of 4)" in status.stdout
    rows = [line.split() for line in status.stdout.splitlines()[2:6]]
    assert [(int(r[0]), r[3], r[4]) for r in rows] == [(i, "completed", "8/8") for i in range(4)]
    assert [float(r[5]) for r in rows] == pytest.approx([losses[i] for i in range(4)], rel=1e-5)

    best = min(losses, key=losses.__getitem__)
    csv_path = tmp_path / "results.csv"
    results = baton("sweep", "results", str(sweep_dir), "--csv", str(csv_path))
    assert results.returncode == 0, results.stderr
    body = [line.split() for line in results.stdout.splitlines()[2:6]]
    assert [int(r[1]) for r in body] == sorted(losses, key=losses.__getitem__)
    assert f"best: point {best} " in results.stdout
    assert len(csv_path.read_text().splitlines()) == 5

    again = baton("sweep", "submit", SWEEP, "--backend", "local", f"runs_root={tmp_path}", *SMALL)
    assert again.returncode == 2 and "submitted already" in again.stderr
    nothing = baton("sweep", "resume", str(sweep_dir))
    assert nothing.returncode == 0 and "nothing to resume: 4 completed" in nothing.stdout


def test_interrupted_local_sweep_resumes_only_the_unfinished_points(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep_toy"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "sweep", "submit", SWEEP, "--backend", "local",
         f"runs_root={tmp_path}", "trainer.n_gpus_per_node=2", "trainer.steps=3000", "trainer.log_interval_steps=50"],
        cwd=REPO, env={**env, "BATON_TOY_STEP_S": "0.002"},  # a point lasts seconds: long enough to be caught
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def point1_running() -> bool:
            try:
                p1 = sweep_ledger(sweep_dir)["points"][1]
                return p1["state"] == "running" and _state(p1["run_dir"]).get("status") == "running"
            except (FileNotFoundError, ValueError, KeyError):
                return False

        wait_for(point1_running, 120, "point 1 of the local sweep to be running")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out
    ledger = sweep_ledger(sweep_dir)
    assert [p["state"] for p in ledger["points"]] == ["completed", "cancelled", "unsubmitted", "unsubmitted"]
    done = _state(ledger["points"][0]["run_dir"])

    res = baton("sweep", "resume", str(sweep_dir), "trainer.steps=1")
    assert res.returncode == 2  # resume takes no overrides: the points are as submitted
    res = baton("sweep", "resume", str(sweep_dir))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "resuming 3 point(s)" in res.stdout and ": 1, 2, 3" in res.stdout
    ledger = sweep_ledger(sweep_dir)
    assert [p["state"] for p in ledger["points"]] == ["completed"] * 4
    assert [p["submissions"] for p in ledger["points"]] == [1, 2, 1, 1]
    assert _state(ledger["points"][0]["run_dir"]) == done  # the completed point was left alone
    resumed = _state(ledger["points"][1]["run_dir"])
    assert resumed["restarts"] == 1 and resumed["step"] == 3000
