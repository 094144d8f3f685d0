"""Recovery on the real local Slurm cluster: a preemption (a job on ``high`` takes node2 from
Baton's workers on ``low``) answered by a checkpoint at the step boundary, a requeue and a
resume with no lost step; a killed controller; a deterministic error. Lost workers restarted
inside the allocation are in test_multinode_slurm.py, where a whole node's workers die.

The toy model's losses do not depend on the backend, so the reference curve is a local,
uninterrupted run of the same config.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import textwrap

import pytest

from tests.helpers import REPO, baton, history, losses, make_run, read_state
from tests.integration import slurm_helpers as sh

pytestmark = pytest.mark.slurm
STEPS = 1000
COMMON = ["model.kind=toy", "trainer.n_gpus_per_node=4", f"trainer.steps={STEPS}", "optimizer.lr=0.002",
          "trainer.log_interval_steps=20", "recovery.backoff_s=0.2", "timeouts.heartbeat_interval_s=0.1",
          "timeouts.heartbeat_timeout_s=1.5", "timeouts.controller_lost_s=5"]
# Each test's job: the toy on 4 workers, its controller on partition cpu.
JOB = ("experiments/toy.yaml", *COMMON, "slurm.controller.partition=cpu")
RUN_S = 240.0


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    root = tmp_path_factory.mktemp("reference")
    res = baton("submit", "experiments/toy.yaml", f"runs_root={root}", *COMMON, "--backend", "local", timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    return losses(next((root / "toy").glob("*")), every_step_once=True)


@pytest.mark.timeout(480)
def test_a_preempted_run_checkpoints_requeues_and_resumes_with_no_lost_step(
        slurm_cluster, slurm_jobs, shared_tmp, reference) -> None:
    # 10 ms more per step: ~10 s of training after step 300, so the preemption lands mid-run.
    job, run = sh.submit(shared_tmp, slurm_jobs, *JOB, "checkpoint.interval_steps=0", "--partition", "low",
                         env={"BATON_TOY_STEP_S": "0.01"})
    sh.wait_until(lambda: read_state(run), lambda s: s.get("step", 0) >= 300, RUN_S, awaited=f"job {job} at step 300")
    sh.preempt_node2(shared_tmp, slurm_jobs)
    done = sh.finished(run, job, RUN_S)
    assert done["status"] == "completed", done.get("reason")
    assert done["restarts"] >= 1
    (pre, *_) = history(run, "preempted")
    assert (pre["cause"], pre["signal"]) == ("preemption", "SIGUSR2")
    assert pre["time_left_s"] is not None and pre["time_left_s"] <= 25  # GraceTime=20 on partition low
    assert any(e["step"] == pre["step"] for e in history(run, "checkpoint_committed"))
    (req, *_) = history(run, "requeued")
    assert req["step"] == pre["step"] and req["backend"] == "slurm"
    resumed = history(run, "resumed")
    assert resumed[0]["step"] == pre["step"], "steps were lost between the preemption and the resume"
    assert losses(run, every_step_once=True) == reference
    assert sh.job_field(job, "Restarts") == str(done["restarts"])


@pytest.mark.timeout(420)
def test_a_controller_killed_on_slurm_is_requeued_by_the_batch_script(
        slurm_cluster, slurm_jobs, shared_tmp, reference) -> None:
    job, run = sh.submit(shared_tmp, slurm_jobs, *JOB, "checkpoint.interval_steps=100", "--partition", "gpu",
                         env={"BATON_TOY_STEP_S": "0.005"})
    sh.wait_until(lambda: read_state(run), lambda s: s.get("step", 0) >= 300, RUN_S, awaited=f"job {job} at step 300")
    controller = json.loads((run / "controller.json").read_text())
    assert controller["node"] == "node1"
    os.kill(int(controller["pid"]), signal.SIGKILL)  # node1 is this host
    done = sh.finished(run, job, RUN_S)
    assert done["status"] == "completed", done.get("reason")
    (died,) = history(run, "controller_died")
    assert died["retry"] == 1 and died["epoch"] == 0
    assert [e["epoch"] for e in history(run, "controller_started")] == [0, 1]
    assert history(run, "resumed")[0]["step"] % 100 == 0
    assert losses(run, every_step_once=True) == reference
    assert sh.job_field(job, "Restarts") == "1"


@pytest.mark.timeout(420)
def test_a_deterministic_error_on_slurm_fails_the_job_once_with_the_reason_and_no_requeue(
        slurm_cluster, slurm_jobs, shared_tmp) -> None:
    job, run = sh.submit(shared_tmp, slurm_jobs, *JOB, "checkpoint.interval_steps=100", "--partition", "gpu",
                         env={"BATON_TOY_FAIL_AT_STEP": "250"})
    done = sh.finished(run, job, RUN_S)
    assert done["status"] == "failed" and done["step"] == 250, done.get("reason")
    assert "toy failure at step 250" in done["reason"] and "the same on all 4 ranks" in done["reason"]
    assert "not retried" in done["reason"]
    assert history(run, "requeued") == [] and history(run, "restarting_workers") == []
    # the controller component ends FAILED (its exit code), once: sacct -D lists no earlier run
    sh.wait_for_sacct(job, {f"{job}+0": "FAILED"}, 60)
    assert [jid for jid, _ in sh.sacct_states(job, duplicates=True)].count(f"{job}+0") == 1
    assert sh.job_field(job, "Restarts") in ("0", None)  # no requeue loop
    status = baton("status", str(run))
    assert "toy failure at step 250" in status.stdout, status.stdout + status.stderr


@pytest.mark.timeout(180)
def test_a_controller_that_dies_while_scancel_ends_the_job_is_not_requeued(
        slurm_cluster, slurm_jobs, shared_tmp) -> None:
    """The batch script's last word (``core.supervisor after-controller``) after a controller
    that exited without one, in a job that ``scancel`` is ending: the run stops, not requeued.
    The script stands in for a controller that scancel reached while it was starting."""
    local_run = make_run(shared_tmp, "toy.yaml", [])
    run = local_run.run.path
    started, out = shared_tmp / "started", shared_tmp / "after.out"
    script = shared_tmp / "ending.sbatch"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --partition=cpu --output={shared_tmp}/ending-%j.out
        trap '' TERM
        touch {started}
        while scontrol show job -o "$SLURM_JOB_ID" | grep -q JobState=RUNNING; do sleep 0.2; done
        cd {REPO} && PYTHONPATH={REPO} {sys.executable} -m core.supervisor after-controller {run} 1 > {out}
        """))
    job = sh.sbatch(script)
    slurm_jobs.append(job)
    sh.wait_until(lambda: started.exists(), bool, 60, awaited=f"job {job} to start")
    sh.scancel([job])
    assert sh.wait_for_file(out, 60, awaited="stop").strip() == "stop"
    done = read_state(run)
    assert done["status"] == "stopped" and "scancel" in done["reason"], done
    assert history(run, "controller_died") == [] and history(run, "requeued") == []
    sh.wait_for_sacct(job, "CANCELLED", 60)
    assert sh.job_field(job, "Restarts") in ("0", None)
