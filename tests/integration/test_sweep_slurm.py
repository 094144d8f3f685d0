"""`baton sweep` on the real local Slurm cluster: every point its own het job (toy model).

Each point: the controller on partition cpu, 2 workers on partition gpu. Every job id a
test submits is scancelled at teardown (the slurm_jobs fixture).
"""
from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, baton, sweep_ledger
from tests.integration import slurm_helpers as sh

pytestmark = pytest.mark.slurm
DONE_S = 240.0  # generous: the cluster is shared with other tests


def _overrides(root: Path, *, workers_partition: bool = True) -> list[str]:
    return [f"runs_root={root}", "trainer.n_gpus_per_node=2", "slurm.controller.partition=cpu",
            'slurm.workers.time="10"', *(["slurm.workers.partition=gpu"] if workers_partition else [])]


def _sweep_file(root: Path, name: str, **body: object) -> Path:
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "base": str(REPO / "experiments" / "toy.yaml"), **body}))
    return path


def _jobs(sweep_dir: Path) -> list[str]:
    return [p["job_id"] for p in sweep_ledger(sweep_dir)["points"]]


def _track(sweep_dir: Path, slurm_jobs: list[int]) -> None:
    """Hand every job id the ledger knows to the fixture that scancels them."""
    if (sweep_dir / "sweep.json").exists():
        slurm_jobs.extend(int(j) for j in _jobs(sweep_dir) if j and int(j) not in slurm_jobs)


def _submit_sweep(path: Path, root: Path, slurm_jobs: list[int], *extra: str) -> Path:
    sweep_dir = root / path.stem
    try:
        res = baton("sweep", "submit", str(path), "--backend", "slurm", *_overrides(root), *extra, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
    finally:
        _track(sweep_dir, slurm_jobs)
    return sweep_dir


def _wait_completed(job_ids: list[str]) -> None:
    for job in job_ids:
        sh.wait_for_sacct(int(job), {f"{job}+0": "COMPLETED", f"{job}+1": "COMPLETED"}, DONE_S)


def _intervals(job_ids: list[str]) -> list[tuple[datetime.datetime, datetime.datetime]]:
    """(earliest Start, latest End) over both components of each job, from sacct."""
    out = []
    for job in job_ids:
        rows = sh.run(["sacct", "-n", "-P", "-X", "-j", job, "-o", "JobID,Start,End"]).stdout.split()
        parsed = [r.split("|") for r in rows if r.startswith(f"{job}+")]
        assert len(parsed) == 2, f"job {job}: expected two het components in sacct, got {rows}"
        out.append((min(datetime.datetime.fromisoformat(r[1]) for r in parsed),
                    max(datetime.datetime.fromisoformat(r[2]) for r in parsed)))
    return out


@pytest.mark.timeout(420)
def test_2x2_grid_runs_as_four_het_jobs_with_status_and_results(slurm_cluster, slurm_jobs, shared_tmp) -> None:
    sweep_dir = _submit_sweep(REPO / "experiments" / "sweep_toy.yaml", shared_tmp, slurm_jobs, "trainer.steps=20")
    ledger = sweep_ledger(sweep_dir)
    jobs = _jobs(sweep_dir)
    assert len(set(jobs)) == 4 and len({p["run_dir"] for p in ledger["points"]}) == 4
    for p in ledger["points"]:
        assert "#SBATCH hetjob" in (Path(p["run_dir"]) / "job.sbatch").read_text()
    _wait_completed(jobs)

    status = baton("sweep", "status", str(sweep_dir))
    assert status.returncode == 0, status.stderr
    assert "states: 4 completed (of 4)" in status.stdout, status.stdout
    rows = [line.split() for line in status.stdout.splitlines()[2:6]]
    for p, row in zip(ledger["points"], rows, strict=True):
        loss = json.loads((Path(p["run_dir"]) / "state.json").read_text())["last_loss"]
        assert row[3] == "completed" and row[4] == "20/20" and float(row[5]) == pytest.approx(loss, rel=1e-5)
        assert row[7] == p["job_id"]

    results = baton("sweep", "results", str(sweep_dir))
    assert results.returncode == 0, results.stderr
    body = [line.split() for line in results.stdout.splitlines()[2:6]]
    losses = [float(r[6]) for r in body]
    assert len(body) == 4 and losses == sorted(losses)
    assert f"best: point {body[0][1]} " in results.stdout


@pytest.mark.timeout(420)
def test_cancelled_point_is_the_only_one_resume_submits_and_it_completes(slurm_cluster, slurm_jobs, shared_tmp) -> None:
    path = _sweep_file(shared_tmp, "cancel_resume", grid={"seed": [1, 2]})
    sweep_dir = _submit_sweep(path, shared_tmp, slurm_jobs, "trainer.steps=4000", "trainer.log_interval_steps=100")
    first, second = _jobs(sweep_dir)
    sh.wait_for_squeue(int(first), "RUNNING", DONE_S)
    sh.scancel([int(first)])
    sh.wait_for_sacct(int(first), "CANCELLED", 60)
    _wait_completed([second])
    status = baton("sweep", "status", str(sweep_dir))
    assert "1 completed, 1 cancelled (of 2)" in status.stdout, status.stdout

    try:
        res = baton("sweep", "resume", str(sweep_dir), timeout=120)
    finally:
        _track(sweep_dir, slurm_jobs)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "resuming 1 point(s)" in res.stdout and ": 0" in res.stdout
    ledger = sweep_ledger(sweep_dir)
    resubmitted, kept = ledger["points"][0]["job_id"], ledger["points"][1]["job_id"]
    assert resubmitted not in (first, second) and kept == second
    assert [p["submissions"] for p in ledger["points"]] == [2, 1]
    _wait_completed([resubmitted])
    status = baton("sweep", "status", str(sweep_dir))
    assert "states: 2 completed (of 2)" in status.stdout, status.stdout
    again = baton("sweep", "resume", str(sweep_dir))
    assert "nothing to resume" in again.stdout


@pytest.mark.timeout(420)
def test_max_running_1_never_runs_two_points_at_once(slurm_cluster, slurm_jobs, shared_tmp) -> None:
    path = _sweep_file(shared_tmp, "one_at_a_time", grid={"seed": [1, 2, 3]}, max_running=1)
    sweep_dir = _submit_sweep(path, shared_tmp, slurm_jobs, "trainer.steps=300")
    ledger = sweep_ledger(sweep_dir)
    jobs = _jobs(sweep_dir)
    assert [p["after"] for p in ledger["points"]] == [None, jobs[0], jobs[1]]
    most = 0
    deadline = time.monotonic() + DONE_S
    while time.monotonic() < deadline:  # watch the queue while the chain runs
        running = {jid.split("+")[0] for j in jobs for jid, s in sh.squeue_states(int(j)).items() if s == "RUNNING"}
        most = max(most, len(running))
        if all(dict(sh.sacct_states(int(j))).get(f"{j}+0") == "COMPLETED" for j in jobs):
            break
        time.sleep(sh.POLL_INTERVAL_S)
    _wait_completed(jobs)
    assert most <= 1
    spans = _intervals(jobs)
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert start >= end, f"a point started at {start} before the previous one ended at {end}: {spans}"


@pytest.mark.timeout(120)
def test_sweep_with_one_invalid_point_submits_nothing(slurm_cluster, slurm_jobs, shared_tmp) -> None:
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 2))
    bad_value = _sweep_file(shared_tmp, "bad_value", grid={"trainer.steps": [5, 0]})
    bad_partition = _sweep_file(shared_tmp, "bad_partition", grid={"slurm.workers.partition": ["gpu", "nope"]})
    for path, key in ((bad_value, "trainer.steps: 0 must be > 0"), (bad_partition, "partition 'nope' does not exist")):
        res = baton("sweep", "submit", str(path), "--backend", "slurm",
                    *_overrides(shared_tmp, workers_partition=path is bad_value))
        assert res.returncode == 2, res.stdout + res.stderr
        assert "point 1 (" in res.stderr and key in res.stderr and "nothing was submitted" in res.stderr
        assert not (shared_tmp / path.stem).exists()
    comments = sh.run(["sacct", "-n", "-P", "-X", "-S", since, "-o", "Comment"]).stdout
    assert str(shared_tmp) not in comments
