"""A requeue's node exclusions on the real local Slurm cluster (partition ``multi``: node2,
node3, node4): Baton's exclusion is added beside the user's, a node Slurm reports in service
is readmitted while the user's stays, and the list never takes the last node the job needs.
A plain batch job stands in for the workers' component (the same scontrol calls)."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from core.job import slurmctl
from tests.integration import slurm_helpers as sh

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]


def _excluded(job: int) -> set[str]:
    value = sh.job_field(job, "ExcNodeList") or ""
    return set(sh.run(["scontrol", "show", "hostnames", value]).stdout.split()) if value != "(null)" else set()


def test_requeue_exclusions_keep_the_users_readmit_nodes_back_in_service_and_leave_a_node(
        slurm_cluster: str, slurm_jobs: list[int], tmp_path: Path) -> None:
    script = tmp_path / "sleep.sh"
    script.write_text("#!/bin/bash\nsleep 300\n")
    job = sh.sbatch(script, "--requeue", "-p", "multi", "-N", "1", "--exclude=node4", "-o", str(tmp_path / "out"))
    slurm_jobs.append(job)
    sh.wait_for_squeue(job, "RUNNING", 60)
    handler = signal.getsignal(signal.SIGTERM)

    result = slurmctl.requeue(str(job), exclude=["node3"], floor=["node4"])
    assert result.ok and _excluded(job) == {"node3", "node4"}, result.detail

    assert slurmctl.in_service(["node3", "node4"]) >= {"node3"}  # idle: Slurm schedules on it
    result = slurmctl.requeue(str(job), readmit=["node3", "node4"], floor=["node4"])  # node4 is the user's
    assert result.ok and _excluded(job) == {"node4"}, result.detail

    result = slurmctl.requeue(str(job), exclude=["node2", "node3"], floor=["node4"])  # would leave no node
    assert result.ok and _excluded(job) == {"node3", "node4"}, result.detail
    assert "not excluding node2: partition multi would keep fewer than the 1 node(s)" in result.detail
    assert signal.getsignal(signal.SIGTERM) == handler
