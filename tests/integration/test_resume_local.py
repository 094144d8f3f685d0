"""Checkpoint commit and resume through the real controller and workers (toy task: fast)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.checkpoint import manifest
from tests.helpers import baton, history, losses, submit_local

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
def test_resume_continues_the_same_curve_exactly(tmp_path: Path) -> None:
    full = submit_local("experiments/toy.yaml", f"runs_root={tmp_path}/a", "trainer.steps=20")
    half = submit_local("experiments/toy.yaml", f"runs_root={tmp_path}/b", "trainer.steps=10")
    assert manifest.committed_steps(half / "checkpoints") == [10]
    res = baton("submit", "--resume", str(half), "trainer.steps=20", "--backend", "local")
    assert res.returncode == 0, res.stderr
    assert losses(half) == losses(full)  # bit-identical: same data, same state
    state = json.loads((half / "state.json").read_text())
    assert state["restarts"] == 1 and state["step"] == 20
    assert any(e["step"] == 10 for e in history(half, "resumed"))


@pytest.mark.slow
def test_a_run_folder_planned_before_worker_groups_resumes_on_the_same_curve(tmp_path: Path) -> None:
    """plan.json of version 1 (no ``roles``: written by a Baton before the plan carried the
    worker groups) is planned again by the resume, which continues the uninterrupted curve."""
    full = submit_local("experiments/toy.yaml", f"runs_root={tmp_path}/a", "trainer.steps=20")
    half = submit_local("experiments/toy.yaml", f"runs_root={tmp_path}/b", "trainer.steps=10")
    plan = json.loads((half / "plan.json").read_text())
    old = {k: v for k, v in plan.items() if k != "roles"} | {"version": 1, "generator_workers": 0}
    (half / "plan.json").write_text(json.dumps(old))
    res = baton("submit", "--resume", str(half), "trainer.steps=20", "--backend", "local")
    assert res.returncode == 0, res.stderr
    assert losses(half) == losses(full)
    replanned = json.loads((half / "plan.json").read_text())
    assert replanned["version"] == 2 and [r["name"] for r in replanned["roles"]] == ["trainer"]


def test_interval_checkpoints_keep_the_last_n_and_latest_points_to_the_newest(tmp_path: Path) -> None:
    run = submit_local("experiments/toy.yaml", f"runs_root={tmp_path}", "trainer.steps=20",
                  "checkpoint.interval_steps=4", "checkpoint.keep_last=3")
    assert manifest.committed_steps(run / "checkpoints") == [12, 16, 20]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000020"
    assert manifest.verify(run / "checkpoints" / "step_00000020") == []


def test_async_checkpoints_commit_and_resume(tmp_path: Path) -> None:
    run = submit_local("experiments/toy.yaml", f"runs_root={tmp_path}", "trainer.steps=12",
                  "checkpoint.interval_steps=4", "checkpoint.async=true")
    assert manifest.committed_steps(run / "checkpoints") == [8, 12]
    assert [e["step"] for e in history(run, "checkpoint_started")] == [4, 8]


@pytest.mark.slow
def test_a_corrupt_latest_checkpoint_is_skipped_for_the_previous_one(tmp_path: Path) -> None:
    run = submit_local("experiments/toy.yaml", f"runs_root={tmp_path}", "trainer.steps=10", "checkpoint.interval_steps=5")
    shard = run / "checkpoints" / "step_00000010" / "rank_00001.h5"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    res = baton("submit", "--resume", str(run), "--backend", "local")
    assert res.returncode == 0, res.stderr
    resumed = history(run, "resumed")
    assert resumed and resumed[-1]["step"] == 5
    assert "rank_00001.h5" in (run / "logs" / "controller.log").read_text()
