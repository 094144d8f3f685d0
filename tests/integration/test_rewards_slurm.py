"""Rewards on the real local Slurm cluster: the controller (submitit's task, in component 0,
working in the run folder) scores a user's reward in its reward processes, found on
the PYTHONPATH the job inherits, and ends them with the run."""
from __future__ import annotations

import json
import os

import pytest

from tests.helpers import REPO, history
from tests.integration import slurm_helpers as sh

pytestmark = pytest.mark.slurm

REWARD = '''
import json, os


def logged(prompt, response, meta):
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "prompt": list(prompt),
                            "response": list(response)}) + "\\n")
    return float(len(response) % 3)
'''


@pytest.mark.timeout(600)
def test_grpo_on_slurm_scores_in_the_controllers_reward_processes(slurm_cluster, slurm_jobs, shared_tmp) -> None:
    (shared_tmp / "slurm_rewards.py").write_text(REWARD)
    log = shared_tmp / "rewards.jsonl"
    job, run = sh.submit(shared_tmp, slurm_jobs, "experiments/grpo_tiny.yaml", "rl.warmup_steps=0", "trainer.steps=2",
                         "rl.reward=slurm_rewards:logged", "rl.reward_workers=2", "slurm.controller.partition=cpu",
                         env={"REWARD_LOG": str(log), "PYTHONPATH": os.pathsep.join((str(REPO), str(shared_tmp)))})
    done = sh.finished(run, job, 300)
    assert done["status"] == "completed", done.get("reason")
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2 * 4 * 8  # steps × prompts_per_step × n, each once
    (started,) = history(run, "controller_started")
    assert {c["ppid"] for c in calls} == {started["pid"]}  # the controller's own processes
    assert 1 <= len({c["pid"] for c in calls}) <= 2 and started["pid"] not in {c["pid"] for c in calls}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if "reward_mean" in r]
    by_step = [calls[s * 32:(s + 1) * 32] for s in range(2)]
    for r, step_calls in zip(rl, by_step, strict=True):  # the reference: the reward of each logged response
        assert r["reward_mean"] == pytest.approx(sum(len(c["response"]) % 3 for c in step_calls) / 32)
