"""`baton submit --backend slurm` on the real local cluster, driven as a user would.

One heterogeneous job per run: the controller on partition cpu (node1), 4 toy workers on
partition gpu (node2). Other jobs on the cluster may preempt partition gpu (partition high
preempts it); Baton's job is then requeued as a whole, so these tests wait for outcomes,
never for a first attempt. Every job is scancelled at teardown.
"""
from __future__ import annotations

import json
import re
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import baton, history
from tests.integration import slurm_helpers as sh

pytestmark = pytest.mark.slurm
RUN_S = 180.0  # queue + start + 30 toy steps, with room for one requeue after a preemption
PLACE = ["slurm.controller.partition=cpu", "--partition", "gpu"]


def submit(runs_root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return baton("submit", "experiments/toy.yaml", f"runs_root={runs_root}", "model.kind=toy",
                 "trainer.n_gpus_per_node=4", "--backend", "slurm", *args, timeout=60)


def submitted(res: subprocess.CompletedProcess[str], jobs: list[int]) -> tuple[int, Path]:
    assert res.returncode == 0, res.stderr
    job = int(re.search(r"submitted job (\d+)", res.stdout).group(1))  # type: ignore[union-attr]
    jobs.append(job)
    run = Path(re.search(r"^run folder: (.+)$", res.stdout, re.M).group(1))  # type: ignore[union-attr]
    return job, run


def state(run: Path) -> dict[str, Any]:
    try:
        return json.loads((run / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def status(target: str | Path) -> str:
    res = baton("status", str(target), timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def queued(name: str) -> list[str]:
    """Jobs with this name in squeue or sacct (any user, any state)."""
    live = sh.run(["squeue", "-h", "-n", name, "-o", "%i"]).stdout.split()
    past = sh.run(["sacct", "-n", "-X", "-P", "--name", name, "-o", "JobID"], check=False).stdout.split()
    return live + past


@pytest.fixture
def runs_root(shared_tmp: Path) -> Path:
    root = shared_tmp / "runs with space" / "it's \"here\""
    root.mkdir(parents=True)
    return root


@pytest.mark.timeout(300)
def test_het_job_runs_the_toy_to_completion_and_status_shows_both_components(slurm_cluster, slurm_jobs, runs_root):
    job, run = submitted(submit(runs_root, "trainer.steps=30", *PLACE), slurm_jobs)
    assert (run / "job.sbatch").read_text().count("#SBATCH hetjob") == 1
    done = sh.wait_until(lambda: state(run), lambda s: s.get("status") in ("completed", "failed"), RUN_S,
                         awaited=f"job {job} to finish its run in {run}")
    assert (done["status"], done["step"]) == ("completed", 30), done.get("reason")
    for rank in range(4):
        assert (run / "logs" / f"worker_r{rank:05d}.log").stat().st_size > 0
        assert (run / "logs" / f"slurm-{job}-worker_{rank}.out").is_file()
    assert (run / "logs" / "controller.log").stat().st_size > 0
    final = sh.wait_until(lambda: status(run), lambda out: out.count(" COMPLETED (completed)") == 2, 60,
                          awaited=f"baton status to show both components of {job} completed")
    assert "status:   completed" in final and "step:     30/30" in final
    assert f"{job}+0 COMPLETED" in final and f"{job}+1 COMPLETED" in final
    assert status(str(job)) == final  # `baton status JOB_ID` finds the run folder from the job

    # What each component saw: one job id, its het group, ranks 0..3, no restart on a first run.
    ctl = done["slurm"]["controller_task"]
    restarts = done["restarts"]
    assert ctl["SLURM_JOB_ID"] == str(job) and ctl["het_group"] == 0 and ctl["SLURM_PROCID"] == "0"
    assert ctl["SLURMD_NODENAME"] == "node1" and ctl["SLURM_HET_SIZE"] == "2"
    assert ctl["SLURM_RESTART_COUNT"] == (None if restarts == 0 else str(restarts))
    seen = []
    for rank in range(4):  # each .out file is appended per attempt; its first line is the first attempt's
        first = (run / "logs" / f"slurm-{job}-worker_{rank}.out").read_text().splitlines()[0]
        seen.append(dict(kv.split("=", 1) for kv in first.removeprefix("baton-task: ").split()))
    assert {s["job_id"] for s in seen} == {str(job)}
    assert {s["het_group"] for s in seen} == {"1"} and {s["het_size"] for s in seen} == {"2"}
    assert sorted(s["procid"] for s in seen) == ["0", "1", "2", "3"] and {s["ntasks"] for s in seen} == {"4"}
    assert {s["node"] for s in seen} == {"node2"} and {s["restart_count"] for s in seen} == {"unset"}
    assert sorted(r["rank"] for r in done["ranks"]) == [0, 1, 2, 3] and {r["node"] for r in done["ranks"]} == {"node2"}


@pytest.mark.timeout(120)
def test_dry_run_prints_the_exact_script_and_submits_nothing(slurm_cluster, runs_root):
    name = f"dry-{uuid.uuid4().hex[:8]}"
    res = submit(runs_root, f"name={name}", *PLACE, "--dry-run")
    assert res.returncode == 0, res.stderr
    script = res.stdout
    assert script.startswith("#!/bin/bash\n") and "#SBATCH hetjob" in script
    assert f"#SBATCH --job-name=baton-{name}" in script and "baton_worker_step 1 0 worker &" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert list(runs_root.iterdir()) == []  # no run folder either
    assert queued(f"baton-{name}") == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, reason", [
    (("--partition", "nosuch"), "partition 'nosuch' does not exist"),
    (("trainer.n_gpus_per_node=16", "--partition", "gpu"), "at most 8 GPU(s) per node"),
])
def test_failed_preflight_exits_2_with_the_reason_and_submits_nothing(slurm_cluster, runs_root, args, reason):
    name = f"pre-{uuid.uuid4().hex[:8]}"
    res = submit(runs_root, f"name={name}", "slurm.controller.partition=cpu", *args)
    assert res.returncode == 2, res.stdout + res.stderr
    assert reason in res.stderr and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert list(runs_root.iterdir()) == []
    assert queued(f"baton-{name}") == []


@pytest.mark.timeout(300)
def test_cancel_ends_both_components_and_status_says_cancelled(slurm_cluster, slurm_jobs, runs_root):
    job, run = submitted(submit(runs_root, "trainer.steps=100000000", *PLACE), slurm_jobs)
    sh.wait_until(lambda: history(run, "workers_ready"), bool,
                  RUN_S, awaited=f"the workers of job {job} to be ready")
    res = baton("cancel", str(run), timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"{job}+0 CANCELLED" in res.stdout and f"{job}+1 CANCELLED" in res.stdout
    assert sh.squeue_states(job) in ({}, {f"{job}+0": "CANCELLED", f"{job}+1": "CANCELLED"})
    sh.wait_for_sacct(job, {f"{job}+0": "CANCELLED", f"{job}+1": "CANCELLED"}, 60)
    out = status(run)
    assert "status:   cancelled" in out
    assert f"{job}+0 CANCELLED (cancelled)" in out and f"{job}+1 CANCELLED (cancelled)" in out
