"""The local Slurm cluster is real, and does what Baton relies on.

Needs the cluster from tests/cluster/slurm-cluster.sh (skipped without it, except in CI).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.integration import slurm_helpers as sh

pytestmark = pytest.mark.slurm

# What every task records about itself.
RECORDED = [
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURMD_NODENAME",
    "CUDA_VISIBLE_DEVICES",
    "SLURM_RESTART_COUNT",
    "SLURM_HET_SIZE",
    "SLURM_JOB_NODELIST_HET_GROUP_0",
]
UNSET = "<unset>"


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    path.chmod(0o755)
    return path


def record_task_script(out: Path) -> Path:
    """task.sh COMPONENT: writes the recorded variables to c<COMPONENT>.<PROCID>.env."""
    names = " ".join(RECORDED)
    return write(
        out / "task.sh",
        f"""
        #!/bin/bash
        set -eu
        f="{out}/c$1.$SLURM_PROCID.env"
        for v in {names}; do printf '%s=%s\\n' "$v" "${{!v-{UNSET}}}"; done > "$f.tmp"
        mv "$f.tmp" "$f"
        """,
    )


@pytest.mark.timeout(120)
def test_heterogeneous_job_components_land_on_their_nodes(slurm_cluster, slurm_jobs, shared_tmp):
    out = shared_tmp
    task = record_task_script(out)
    batch = write(
        out / "het.sbatch",
        f"""
        #!/bin/bash
        #SBATCH --job-name=baton-test-het
        #SBATCH --output={out}/batch-%j.out
        #SBATCH --time=5
        #SBATCH --partition=cpu
        #SBATCH --ntasks=1
        #SBATCH hetjob
        #SBATCH --partition=gpu
        #SBATCH --ntasks=4
        #SBATCH --gpus-per-node=4
        #SBATCH --time=5
        set -eu
        srun --het-group=0 bash {task} 0 &
        c0=$!
        srun --het-group=1 bash {task} 1 &
        c1=$!
        wait "$c0"
        wait "$c1"
        """,
    )
    job = sh.sbatch(batch)
    slurm_jobs.append(job)

    # squeue/sacct show the components as ID+0 and ID+1; both must complete.
    states = sh.wait_for_sacct(job, {f"{job}+0": "COMPLETED", f"{job}+1": "COMPLETED"}, timeout=90)
    assert set(states) == {f"{job}+0", f"{job}+1"}, states

    c0 = sh.read_env_file(out / "c0.0.env")
    assert c0["SLURMD_NODENAME"] == "node1", c0
    assert c0["SLURM_NTASKS"] == "1", c0
    assert c0["SLURM_JOB_ID"] == str(job), c0
    assert c0["SLURM_RESTART_COUNT"] == UNSET, c0

    workers = [sh.read_env_file(out / f"c1.{rank}.env") for rank in range(4)]
    assert not list(out.glob("c1.4.env"))
    for rank, env in enumerate(workers):
        assert env["SLURM_PROCID"] == str(rank), env
        assert env["SLURM_NTASKS"] == "4", env
        assert env["SLURMD_NODENAME"] == "node2", env
        # Every task of every component sees the leader's job id.
        assert env["SLURM_JOB_ID"] == str(job), env
        assert env["SLURM_HET_SIZE"] == "2", env
        assert env["SLURM_JOB_NODELIST_HET_GROUP_0"] == "node1", env
        assert len(env["CUDA_VISIBLE_DEVICES"].split(",")) == 4, env
        assert env["SLURM_RESTART_COUNT"] == UNSET, env


@pytest.mark.timeout(150)
def test_preemption_signals_usr2_and_requeues(slurm_cluster, slurm_jobs, shared_tmp):
    out = shared_tmp
    # The task traps USR2 (its default action is to terminate), records it, and requeues
    # its own job, as Baton's workers will.
    task = write(
        out / "low-task.sh",
        f"""
        #!/bin/bash
        on_usr2() {{
          echo "restart=${{SLURM_RESTART_COUNT:-0}}" >> "{out}/low.usr2"
          scontrol requeue "$SLURM_JOB_ID"
          exit 0
        }}
        trap on_usr2 USR2
        echo started > "{out}/low.started"
        while true; do sleep 1; done
        """,
    )
    low = write(
        out / "low.sbatch",
        f"""
        #!/bin/bash
        #SBATCH --job-name=baton-test-low
        #SBATCH --partition=low
        #SBATCH --ntasks=1
        #SBATCH --time=10
        #SBATCH --requeue
        #SBATCH --signal=USR2@60
        #SBATCH --open-mode=append
        #SBATCH --output={out}/low-%j.out
        trap 'echo batch-usr2 >> "{out}/low.batch-usr2"' USR2
        echo "${{SLURM_RESTART_COUNT:-{UNSET}}}" >> "{out}/low.runs"
        if [ -n "${{SLURM_RESTART_COUNT:-}}" ]; then
          exit 0
        fi
        srun --ntasks=1 bash {task}
        """,
    )
    high = write(
        out / "high.sbatch",
        f"""
        #!/bin/bash
        #SBATCH --job-name=baton-test-high
        #SBATCH --partition=high
        #SBATCH --nodes=1
        #SBATCH --ntasks=16
        #SBATCH --gpus-per-node=8
        #SBATCH --exclusive
        #SBATCH --time=5
        #SBATCH --output={out}/high-%j.out
        echo "$SLURM_JOB_ID" > "{out}/high.ran"
        """,
    )

    low_id = sh.sbatch(low)
    slurm_jobs.append(low_id)
    sh.wait_for_squeue(low_id, "RUNNING", timeout=30)
    sh.wait_for_file(out / "low.started", timeout=30, awaited="the low job's task to start")
    assert sh.job_field(low_id, "Restarts") == "0"

    high_id = sh.sbatch(high)
    slurm_jobs.append(high_id)

    usr2 = sh.wait_for_file(out / "low.usr2", timeout=30, awaited="SIGUSR2 in the low job's task")
    assert usr2.splitlines() == ["restart=0"]
    # The high job got all of node2 once the low job had left it.
    sh.wait_for_sacct(high_id, "COMPLETED", timeout=60)
    assert (out / "high.ran").read_text().strip() == str(high_id)

    # The low job came back under the same id, restarted once, and finished.
    sh.wait_for_sacct(low_id, "COMPLETED", timeout=60)
    assert sh.job_field(low_id, "Restarts") == "1"
    assert (out / "low.runs").read_text().split() == [UNSET, "1"]
    # Its first run is in accounting as requeued.
    history = [state for jid, state in sh.sacct_states(low_id, duplicates=True) if jid == str(low_id)]
    assert history == ["REQUEUED", "COMPLETED"], history
