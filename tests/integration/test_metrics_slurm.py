"""Metrics of a run on the real local Slurm cluster: ``metrics.bind=node`` and
``metrics.sd_dir`` publish a file_sd target while the controller lives (scraped here, as a
login-node Prometheus would) and withdraw it at the end; goodput's allocated time counts from
the job's StartTime (scontrol), so the batch script's setup lines, run before the controller
starts, count as allocated."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from core.record.discovery import run_label
from tests.helpers import history, scrape
from tests.integration import slurm_helpers as sh

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]
SETUP_S = 2  # the batch script's setup (module loads, an environment) before the controller starts


def test_a_slurm_run_is_discoverable_while_live_and_goodput_counts_from_the_job_start(
        slurm_cluster, slurm_jobs, shared_tmp: Path) -> None:
    sd_dir = shared_tmp / "prometheus-targets"
    job, run = sh.submit(shared_tmp / "runs", slurm_jobs, "experiments/toy.yaml", "trainer.steps=40",
                         "trainer.n_gpus_per_node=2", "metrics.bind=node", f"metrics.sd_dir={sd_dir}",
                         f'slurm.setup=["sleep {SETUP_S}"]', "slurm.controller.partition=cpu", "--partition", "gpu",
                         env={"BATON_TOY_STEP_S": "0.1"})
    target_file = sd_dir / f"baton-toy-{run.name}.json"
    (group,) = json.loads(sh.wait_for_file(target_file, 120, f"job {job}'s file_sd target"))
    assert group["labels"] == {"job": "baton", "run": run_label(run), "node": "node1"}  # the controller's node
    published = json.loads((run / "metrics.json").read_text())
    assert group["targets"] == [f"{published['host']}:{published['port']}"]
    samples = scrape(f"http://{group['targets'][0]}/metrics")
    assert {s.labels["run"] for s in samples["baton_step"]} == {run_label(run)}
    done = sh.finished(run, job, 120)
    assert (done["status"], done["step"]) == ("completed", 40), done.get("reason")
    # withdrawn by the controller as it ends (just after it records the run completed)
    sh.wait_until(lambda: list(sd_dir.iterdir()), lambda left: left == [], 60, awaited=f"{target_file} withdrawn")
    start = datetime.strptime(sh.job_field(job, "StartTime") or "", "%Y-%m-%dT%H:%M:%S").timestamp()
    (began,) = history(run, "controller_started")
    assert began["started_at"] > start + SETUP_S - 1  # the setup ran before the controller's process
    # The last save of progress wrote `updated` and goodput together: allocated is from StartTime.
    assert done["goodput"]["allocated_s"] == pytest.approx(done["updated"] - start, abs=0.05)
    assert done["goodput"]["allocated_s"] > done["updated"] - began["started_at"] + SETUP_S - 1
