"""GRPO on the real local Slurm cluster with the rollout one step ahead of the update
(``rl.max_staleness: 1``) in a component of its own: ONE het job of three components
(controller on node1; the actor's 2 workers on node2, partition low; the rollout's worker on
node3, partition multi). A job on ``high`` preempts node2 during the RL phase, whatever the
overlap is doing then: the controller waits for the rollout in flight and checkpoints it with
the step (``rollouts.npz``), the job is requeued as a whole, the actor, the reference and
that rollout are restored, the rollout's worker re-synced from the restored actor, and the
run ends with the numbers and the final actor weights of the same run uninterrupted on the
local backend (the session's ``async_demo``), bit for bit: prompts, sampling and each
step's policy version are functions of the step, so no prompt is repeated or skipped.

Before the preemption the rollout's worker is killed in the rollout of step 33 (BATON_FAULTS
kill_at_generate, reaching the job through sbatch's environment): the batch script's
supervisor of that component alone starts its step again, the trainer's step goes on, and the
new worker is synced from the trainer's kept copy of policy 32.
"""
from __future__ import annotations

import numpy as np
import pytest

from core.checkpoint import manifest
from tests.helpers import ASYNC_GRPO, GRPO_ASYNC_NUMBERS, checkpoint_weights, history, numbers, read_state
from tests.integration import slurm_helpers as sh

pytestmark = pytest.mark.slurm
SPLIT = ["checkpoint.interval_steps=0", *ASYNC_GRPO]
FAST_RECOVERY = ["recovery.backoff_s=0.2", "timeouts.heartbeat_interval_s=0.2", "timeouts.heartbeat_timeout_s=5"]
KILL_AT = 33
RUN_S = 240.0


@pytest.mark.timeout(900)
def test_grpo_overlapped_on_slurm_preempted_mid_rl_resumes_to_the_uninterrupted_numbers(
        slurm_cluster, slurm_jobs, shared_tmp, async_demo) -> None:
    problem = sh.cluster_problem(("node1", "node2", "node3"))
    if problem is not None:
        pytest.fail(f"the local cluster needs node3 for the rollout's component: {problem}")
    job, run = sh.submit(shared_tmp, slurm_jobs, "experiments/grpo_tiny.yaml", *SPLIT, *FAST_RECOVERY,
                         "slurm.controller.partition=cpu", "--partition", "low", "slurm.generator.partition=multi",
                         "slurm.generator.exclude=node2", env={"BATON_FAULTS": f"kill_at_generate={KILL_AT}"})
    sh.wait_until(lambda: read_state(run), lambda s: s.get("step", 0) > KILL_AT, 600,
                  awaited=f"job {job} past the generator's restart")
    sh.preempt_node2(shared_tmp, slurm_jobs)
    done = sh.finished(run, job, RUN_S)
    assert done["status"] == "completed", done.get("reason")
    # the killed rollout worker was restarted alone, in the job's first allocation, before the preemption
    assert [(e["rank"], e["step"], e["epoch"]) for e in history(run, "worker_lost")] == [(2, KILL_AT, 0)]
    assert [(e["generation"], e["ranks"]) for e in history(run, "restarting_workers")] == [(1, [2])]
    first = [e for e in history(run, "workers_ready") if e["epoch"] == 0]
    assert [e["generation"] for e in first] == [0, 1]
    pids = [{r["rank"]: (r["node"], r["pid"]) for r in e["ranks"]} for e in first]
    assert pids[0][0] == pids[1][0] and pids[0][1] == pids[1][1] and pids[0][2] != pids[1][2]
    (pre,) = history(run, "preempted") or [{"step": None}]
    assert pre["step"] is not None and KILL_AT < pre["step"] < 130, "the preemption did not land in the RL phase"
    assert done["restarts"] >= 1 and history(run, "resumed")[0]["step"] == pre["step"]
    roles = {r["rank"]: (r["role"], r["node"]) for r in done["ranks"]}
    assert roles == {0: ("trainer", "node2"), 1: ("trainer", "node2"), 2: ("generator", "node3")}, roles
    # the stop's checkpoint kept the rollout in flight (the next step's, from the policy before it), and the
    # resume trained on it
    step_dir = run / "checkpoints" / manifest.step_dir_name(pre["step"])
    assert manifest.verify(step_dir) == [] and manifest.read_attachment(step_dir, "rollouts.npz") is not None
    assert numbers(run, GRPO_ASYNC_NUMBERS) == numbers(async_demo, GRPO_ASYNC_NUMBERS)
    mine, theirs = checkpoint_weights(run, 130), checkpoint_weights(async_demo, 130)
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)
    log = (run / "logs" / "controller.log").read_text()
    assert f"generator synced to version {pre['step']}" in log  # the restored policy, before its first rollout
    assert f"{manifest.step_dir_name(pre['step'])}/rollouts.npz: steps [{pre['step']}]" in log
