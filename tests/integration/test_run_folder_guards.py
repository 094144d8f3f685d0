"""A run never silently starts over, and nothing the user may need is lost: damaged checkpoints,
torn metrics, two controllers, dry-run and model-changing resumes, storage faults (toy task: fast)."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from core.checkpoint import manifest
from core.record import steps
from tests.helpers import REPO, baton, history, submit_local, wait_for

pytestmark = pytest.mark.timeout(240)
FAST = ["timeouts.heartbeat_interval_s=0.1", "timeouts.heartbeat_timeout_s=1.5", "timeouts.controller_lost_s=3"]


def _toy_run(tmp_path: Path, *overrides: str) -> Path:
    return submit_local("experiments/toy.yaml", f"runs_root={tmp_path}", "trainer.steps=20", "checkpoint.interval_steps=10",
                   *FAST, *overrides)


def _snapshot(run: Path) -> dict[str, str]:
    """Every file of the run folder (logs aside) and its content hash: to prove nothing changed."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file() and "logs" not in p.parts}


def _refused(res: subprocess.CompletedProcess[str], *fragments: str) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert all(f in lines[0] for f in fragments), lines[0]
    return lines[0]


@pytest.mark.slow
def test_every_checkpoint_damaged_refuses_the_resume_unless_from_scratch_and_keeps_them(tmp_path: Path) -> None:
    run = _toy_run(tmp_path)
    for step in (10, 20):
        os.truncate(run / "checkpoints" / manifest.step_dir_name(step) / "rank_00001.h5", 100)
    before = _snapshot(run)
    _refused(baton("submit", "--resume", str(run), "trainer.steps=30", "--backend", "local"),
             "no checkpoint to resume from", "step_00000020", "rank_00001.h5", "--from-scratch")
    assert _snapshot(run) == before  # nothing written, nothing deleted
    submit_local("--resume", str(run), "trainer.steps=30", "--from-scratch")
    state = json.loads((run / "state.json").read_text())
    assert state["status"] == "completed" and state["step"] == 30 and not state["from_scratch"]
    assert [e["reason"] for e in history(run, "restart_from_scratch")] == ["--from-scratch"]
    kept = manifest.damaged(run / "checkpoints")
    assert sorted(p.name.split(".")[0] for p in kept) == ["step_00000010", "step_00000020"]  # set aside, kept
    assert all((p / "rank_00001.h5").stat().st_size == 100 for p in kept)


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_named_everywhere_and_the_previous_one_resumes(tmp_path: Path) -> None:
    run = _toy_run(tmp_path)
    newest = run / "checkpoints" / "step_00000020" / "rank_00002.h5"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    newest.write_bytes(bytes(data))
    res = baton("submit", "--resume", str(run), "trainer.steps=30", "--backend", "local")
    assert res.returncode == 0, res.stderr
    assert "note:" in res.stdout and "step_00000020" in res.stdout and "damaged" in res.stdout
    (damaged,) = history(run, "checkpoint_damaged")
    assert damaged["step"] == 20 and "rank_00002.h5" in damaged["problems"]
    assert any(e["step"] == 10 for e in history(run, "resumed"))
    status = baton("status", str(run))
    assert "step_00000020.damaged-" in status.stdout and "checkpoint_damaged" in status.stdout
    assert "note:" in status.stdout and "damaged, set aside and kept" in status.stdout, status.stdout
    listing = baton("ckpt", "ls", str(run))
    assert "damaged" in listing.stdout and listing.returncode == 0


@pytest.mark.slow
def test_a_bit_flip_in_the_only_checkpoint_fails_the_resume_with_exit_2_and_keeps_it(tmp_path: Path) -> None:
    run = _toy_run(tmp_path, "trainer.steps=10")
    shard = run / "checkpoints" / "step_00000010" / "rank_00000.h5"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    res = baton("submit", "--resume", str(run), "trainer.steps=20", "--backend", "local")
    _refused(res, "no checkpoint verifies", "step_00000010.damaged-", "--from-scratch")
    assert json.loads((run / "state.json").read_text())["status"] == "failed"
    assert [p.name.split(".")[0] for p in manifest.damaged(run / "checkpoints")] == ["step_00000010"]


@pytest.mark.slow
def test_a_torn_last_metrics_line_is_skipped_kept_and_the_resume_goes_on(tmp_path: Path) -> None:
    run = _toy_run(tmp_path)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 20, "loss": 0.1')  # a node crash mid-append
    before = (run / "metrics.jsonl").read_bytes()
    submit_local("--resume", str(run), "trainer.steps=30")
    assert (run / "metrics.jsonl").read_bytes().startswith(before + b"\n")  # never rewritten; the next line apart
    assert [r.step for r in steps.read(run / "metrics.jsonl")] == list(range(30))
    assert "torn last line" in (run / "logs" / "controller.log").read_text()


def test_a_dry_run_resume_writes_nothing(tmp_path: Path) -> None:
    run = _toy_run(tmp_path)
    before = _snapshot(run)
    res = baton("submit", "--resume", str(run), "trainer.steps=30", "--backend", "slurm", "--dry-run")
    assert res.returncode == 0 and "#SBATCH" in res.stdout, res.stderr
    assert _snapshot(run) == before


@pytest.mark.slow
def test_a_resume_that_changes_the_model_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    run = submit_local("experiments/tiny_gpt.yaml", f"runs_root={tmp_path}", "trainer.steps=2", *FAST,
                  "parallel.tp=1", "parallel.pp=1", "trainer.n_gpus_per_node=1", "checkpoint.interval_steps=0")
    before = _snapshot(run)
    _refused(baton("submit", "--resume", str(run), "model.hidden_size=128", "--backend", "local"),
             "step_00000002", "model.hidden_size=128", "another model")
    assert _snapshot(run) == before


@pytest.mark.slow
def test_a_second_controller_on_a_running_run_is_refused_naming_the_first(tmp_path: Path) -> None:
    args = [sys.executable, "-m", "launcher.cli", "submit", "experiments/toy.yaml", f"runs_root={tmp_path}", *FAST,
            "trainer.steps=100000000", "--backend", "local"]
    out = (tmp_path / "first.out").open("w")  # a file, not a pipe nobody reads: the CLI never blocks on it
    first = subprocess.Popen(args, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                             stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        run = wait_for(lambda: next(iter(tmp_path.glob("toy/*/controller.json")), None), 60, "controller.json").parent
        wait_for(lambda: json.loads((run / "state.json").read_text()).get("step", 0) > 3, 60, "the run to train")
        pid = json.loads((run / "controller.json").read_text())["pid"]
        _refused(baton("submit", "--resume", str(run), "--backend", "local"), "its controller still runs", f"pid {pid}")
        env = {**os.environ, "PYTHONPATH": str(REPO), "BATON_RUN_DIR": str(run), "BATON_EPOCH": "7"}
        second = subprocess.run([sys.executable, "-m", "core.entrypoint", "controller"], env=env, cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and f"another controller runs this run (pid {pid}" in second.stderr
        step = json.loads((run / "state.json").read_text())["step"]
        wait_for(lambda: json.loads((run / "state.json").read_text())["step"] > step + 5, 60, "the first to go on")
    finally:
        first.send_signal(signal.SIGINT)  # the CLI ends its own children
        try:
            assert first.wait(timeout=60) is not None
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
            out.close()


def test_a_storage_fault_in_a_checkpoint_write_is_retried_not_taken_for_a_user_error(tmp_path: Path) -> None:
    run = submit_local("experiments/toy.yaml", f"runs_root={tmp_path}", "trainer.steps=20", "checkpoint.interval_steps=10",
                  "recovery.backoff_s=0.1", *FAST, env={"BATON_TOY_SAVE_ENOSPC_ONCE": "1"})
    state = json.loads((run / "state.json").read_text())
    assert state["status"] == "completed" and state["step"] == 20, state.get("reason")
    (lost, *_) = history(run, "worker_lost")
    assert "No space left on device" in lost["why"] and lost["step"] == 10
    assert [e["generation"] for e in history(run, "restarting_workers")] == [1]
    assert manifest.committed_steps(run / "checkpoints") == [10, 20]
