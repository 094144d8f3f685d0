"""Checkpoints the run's record says exist, gone from the disk (a scratch purge), and storage
errors reading them: refused in one line with nothing changed, or retried, never taken for
damage; metrics.jsonl never loses a record (toy task, real processes: fast)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.checkpoint import manifest
from core.config import run as config_mod
from core.record import steps
from core.record.runfolder import RunFolder
from tests.helpers import LocalRun, Submitted, baton, history, losses, submit_local

pytestmark = pytest.mark.timeout(240)
FAST = ["timeouts.heartbeat_interval_s=0.1", "timeouts.heartbeat_timeout_s=1.5", "timeouts.controller_lost_s=3",
        "recovery.backoff_s=0.1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The loss at each of 30 steps of an uninterrupted run."""
    run = submit_local("experiments/toy.yaml", f"runs_root={tmp_path_factory.mktemp('reference')}", "trainer.steps=30",
                       *FAST)
    return losses(run, every_step_once=True)


@pytest.fixture(scope="module")
def twenty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 20-step run with checkpoints at 10 and 20 (each test works on a copy)."""
    return submit_local("experiments/toy.yaml", f"runs_root={tmp_path_factory.mktemp('twenty')}", "trainer.steps=20",
                        "checkpoint.interval_steps=10", *FAST)


@pytest.fixture
def run(twenty: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "toy" / twenty.name
    shutil.copytree(twenty, copy)
    return copy


def _snapshot(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file() and "logs" not in p.parts}


def _one_line(res: subprocess.CompletedProcess[str], code: int, *fragments: str) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == code and len(lines) == 1 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert all(f in lines[0] for f in fragments), lines[0]
    return lines[0]


def test_checkpoints_moved_away_refuse_the_resume_in_one_line_and_change_nothing(run: Path, reference) -> None:
    state = json.loads((run / "state.json").read_text())
    assert state["checkpoints"] == [10, 20] and state["retired"] == []  # what the record remembers
    shutil.move(run / "checkpoints", run.parent / "purged")
    before, metrics = _snapshot(run), (run / "metrics.jsonl").read_bytes()
    _one_line(baton("submit", "--resume", str(run), "trainer.steps=30", "--backend", "local"), 2,
              f"{run / 'checkpoints'} (the folder itself is gone)", "step_00000020, step_00000010 missing",
              "restore them", "--from-scratch", "step 0")
    assert _snapshot(run) == before and (run / "metrics.jsonl").read_bytes() == metrics  # state, events too
    assert "note:     " + f"{run / 'checkpoints'} (the folder itself is gone)" in baton("status", str(run)).stdout
    submit_local("--resume", str(run), "trainer.steps=30", "--from-scratch")
    assert [e["reason"] for e in history(run, "restart_from_scratch")] == ["--from-scratch"]
    assert history(run, "resume_requested")[-1]["from_scratch"] is True
    assert (run / "metrics.jsonl").read_bytes().startswith(metrics)  # the first 20 records are kept
    every = steps.read(run / "metrics.jsonl", superseded=True)
    assert [r.step for r in every if r.superseded] == list(range(20))
    assert losses(run, every_step_once=True) == reference
    assert json.loads((run / "state.json").read_text())["checkpoints"] == manifest.committed_steps(run / "checkpoints")


def test_the_newest_one_deleted_is_refused_and_from_scratch_goes_on_from_the_one_left(run: Path, reference) -> None:
    shutil.rmtree(run / "checkpoints" / "step_00000020")
    before, metrics = _snapshot(run), (run / "metrics.jsonl").read_bytes()
    _one_line(baton("submit", "--resume", str(run), "trainer.steps=30", "--backend", "local"), 2,
              "step_00000020 missing", "--from-scratch", "step_00000010, the newest left")
    assert _snapshot(run) == before
    res = baton("submit", "--resume", str(run), "trainer.steps=30", "--from-scratch", "--backend", "local")
    assert res.returncode == 0 and "step_00000020 missing" in res.stdout and "going on without them" in res.stdout, \
        res.stdout + res.stderr
    assert [e["step"] for e in history(run, "resumed")] == [10] and not history(run, "restart_from_scratch")
    assert (run / "metrics.jsonl").read_bytes().startswith(metrics)
    every = steps.read(run / "metrics.jsonl", superseded=True)
    assert [r.step for r in every if r.superseded] == list(range(10, 20))
    assert [r.loss for r in every if r.superseded] == reference[10:20]  # the records kept are the originals
    assert losses(run, every_step_once=True) == reference


def test_an_older_one_deleted_is_a_note_and_the_resume_goes_on(run: Path, reference) -> None:
    shutil.rmtree(run / "checkpoints" / "step_00000010")
    res = baton("submit", "--resume", str(run), "trainer.steps=30", "--backend", "local")
    assert res.returncode == 0 and "step_00000010: missing" in res.stdout, res.stdout + res.stderr
    assert losses(run, every_step_once=True) == reference


def test_a_requeued_controller_that_never_passed_the_login_node_refuses_too(run: Path) -> None:
    """Slurm's requeue starts the next epoch's controller directly: the same check, as a user error."""
    shutil.rmtree(run / "checkpoints" / "step_00000020")
    metrics = (run / "metrics.jsonl").read_bytes()
    folder = RunFolder(run)
    job = LocalRun(run=folder, cfg=config_mod.load(folder.config, [])).start(epoch=1)
    try:
        assert job.controller is not None
        assert job.controller.wait(timeout=120) == 2
    finally:
        job.cleanup()
    state = json.loads((run / "state.json").read_text())
    assert state["status"] == "failed" and "step_00000020 missing" in state["reason"], state["reason"]
    assert "--from-scratch" in state["reason"] and "a user error" in state["reason"]
    assert (run / "metrics.jsonl").read_bytes() == metrics


def test_eio_at_every_manifest_open_of_the_resume_is_retried_and_nothing_is_set_aside(run: Path, reference) -> None:
    """Each process (the login node's check, the controller, every worker's load) meets 3 EIOs."""
    env = {"BATON_FAULTS": "manifest_eio=3"}
    res = baton("submit", "--resume", str(run), "trainer.steps=30", "--backend", "local", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert [e["step"] for e in history(run, "resumed")] == [20]
    assert not history(run, "checkpoint_damaged") and manifest.damaged(run / "checkpoints") == []
    assert "read after a storage error (Input/output error (BATON_FAULTS manifest_eio)), retried" in \
        (run / "logs" / "controller.log").read_text()
    assert losses(run, every_step_once=True) == reference


def test_a_filesystem_that_keeps_failing_at_the_login_node_is_one_line_exit_1_and_nothing_written(run: Path) -> None:
    before = _snapshot(run)
    _one_line(baton("submit", "--resume", str(run), "trainer.steps=30", "--backend", "local",
                    env={"BATON_FAULTS": "manifest_estale=cli:1000"}), 1,
              "step_00000020/manifest.json: Stale file handle", "the filesystem failed, not the checkpoint")
    assert _snapshot(run) == before


@pytest.fixture
def submitted(tmp_path: Path) -> Iterator[list[Submitted]]:
    runs: list[Submitted] = []
    yield runs
    for r in runs:
        r.cleanup()


def test_estale_past_the_retries_at_a_requeued_resume_is_recovered_with_the_good_checkpoint(
        tmp_path: Path, submitted: list[Submitted], reference) -> None:
    """The next epoch's controller meets 9 ESTALEs at the manifest: its reads give up after 7
    (TransientIOError), recovery restarts the workers and resumes again, from the same checkpoint."""
    r = Submitted(tmp_path, ["trainer.steps=30", "checkpoint.interval_steps=10", "checkpoint.keep_last=5", *FAST],
                  env={"BATON_FAULTS": "manifest_estale=controller:9;data_delay_ms=20"})
    submitted.append(r)
    pre = r.preempt_at(12)
    state = r.state()
    assert state["status"] == "completed" and state["step"] == 30, state.get("reason")
    assert [e["step"] for e in r.events("resumed")] == [pre["step"]]  # the failed try loaded nothing
    (lost,) = r.events("worker_lost")
    assert lost["failure"] == "storage" and "Stale file handle" in lost["why"]
    assert not r.events("checkpoint_damaged") and manifest.damaged(r.run_dir / "checkpoints") == []
    assert losses(r.run_dir, every_step_once=True) == reference


def test_a_worker_killed_mid_run_leaves_the_redone_steps_records_marked_superseded(
        tmp_path: Path, submitted: list[Submitted], reference) -> None:
    # state.json's step every step, and steps of at least 300 ms: the kill, sent once step 11 is
    # seen, lands between the checkpoints at 10 and 20 (nine steps, 2.7 s, of margin on a busy
    # machine), so the steps from 10 to the lost one are redone
    r = Submitted(tmp_path, ["trainer.steps=30", "checkpoint.interval_steps=10", "trainer.log_interval_steps=1", *FAST],
                  env={"BATON_FAULTS": "data_delay_ms=300"})
    submitted.append(r)
    r.wait_step(11)
    os.kill(r.worker_pid(1), signal.SIGKILL)
    assert r.finish() == 0, r.output
    resumed = r.events("resumed")[-1]["step"]
    lost = r.events("worker_lost")[0]["step"]
    path = r.run_dir / "metrics.jsonl"
    every = steps.read(path, superseded=True)
    old = [rec for rec in every if rec.superseded]
    assert [rec.step for rec in old] == list(range(resumed, lost)) and resumed < lost  # kept, marked
    assert [rec.loss for rec in old] == reference[resumed:lost]
    assert [json.loads(line).get("superseded_from") for line in path.read_text().splitlines()].count(resumed) == 1
    current = steps.read(path)
    assert [rec.step for rec in current] == list(range(30)) and [rec.loss for rec in current] == reference
    goodput = r.state()["goodput"]
    assert goodput["useful_s"] == pytest.approx(sum(rec.step_time_s for rec in current), rel=1e-6)
