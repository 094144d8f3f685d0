"""GRPO on the real local Slurm cluster, the rollout split into a component of its own:
ONE het job of three components (controller on node1; the actor's 2 workers on node2,
partition low; the rollout's worker on node3, partition multi). A job on ``high`` preempts
node2 during the RL phase: the controller checkpoints at the step boundary, the job is
requeued as a whole, the actor and the reference are restored, the rollout re-synced from
the restored actor, and the run ends with the numbers and the final actor weights of the
colocated demo on the local backend (the session's ``grpo_demo``), bit for bit: prompts and
sampling are keyed by seed and step, so no prompt is repeated or skipped.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import GRPO_NUMBERS, checkpoint_weights, history, numbers, read_state
from tests.integration import slurm_helpers as sh

pytestmark = pytest.mark.slurm
SPLIT = ["checkpoint.interval_steps=0", "generator.placement=split", "generator.workers=1"]
RUN_S = 240.0


@pytest.mark.timeout(900)
def test_grpo_split_on_slurm_preempted_mid_rl_resumes_to_the_demo_numbers(
        slurm_cluster, slurm_jobs, shared_tmp, grpo_demo) -> None:
    problem = sh.cluster_problem(("node1", "node2", "node3"))
    if problem is not None:
        pytest.fail(f"the local cluster needs node3 for the rollout's component: {problem}")
    job, run = sh.submit(shared_tmp, slurm_jobs, "experiments/grpo_tiny.yaml", *SPLIT,
                         "slurm.controller.partition=cpu", "--partition", "low", "slurm.generator.partition=multi",
                         "slurm.generator.exclude=node2")
    sh.wait_until(lambda: read_state(run), lambda s: s.get("step", 0) >= 31, 600, awaited=f"job {job} in its RL phase")
    sh.preempt_node2(shared_tmp, slurm_jobs)
    done = sh.finished(run, job, RUN_S)
    assert done["status"] == "completed", done.get("reason")
    (pre,) = history(run, "preempted") or [{"step": None}]
    assert pre["step"] is not None and 31 <= pre["step"] < 130, "the preemption did not land in the RL phase"
    assert done["restarts"] >= 1 and history(run, "resumed")[0]["step"] == pre["step"]
    roles = {r["rank"]: (r["role"], r["node"]) for r in done["ranks"]}
    assert roles == {0: ("trainer", "node2"), 1: ("trainer", "node2"), 2: ("generator", "node3")}, roles
    assert numbers(run, GRPO_NUMBERS) == numbers(grpo_demo, GRPO_NUMBERS)
    mine, theirs = checkpoint_weights(run, 130), checkpoint_weights(grpo_demo, 130)
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)
    log = (run / "logs" / "controller.log").read_text()
    assert f"generator synced to version {pre['step']}" in log  # the restored policy, before its first rollout
