"""A split generator on the real local Slurm cluster: ONE het job of three components.

Component 0 the controller (node1, partition cpu), component 1 the trainer's 4 workers
(node2, partition low), component 2 the generator's 2 workers (partition multi, node2
excluded). A job on ``high`` preempts node2 mid-run: the controller checkpoints at the step
boundary, the job is requeued as a whole and resumes, and the run ends with the losses and
the samples of an uninterrupted run of the same config on the local backend, its generator
colocated (the session's ``generator_reference``): the trainer's arithmetic depends on
neither the backend nor the generator's placement, and sampling is keyed by seed, step and
prompt (the samples' log-probs agree to 1e-5: another generator layout).
"""
from __future__ import annotations

import pytest

from tests.helpers import GENERATOR_RUN, history, json_lines, losses, read_state, same_samples
from tests.integration import slurm_helpers as sh

pytestmark = pytest.mark.slurm
GEN = [*GENERATOR_RUN, "checkpoint.interval_steps=0", "generator.placement=split", "generator.workers=2"]
EXPERIMENT = "experiments/tiny_gpt_generate.yaml"
RUN_S = 240.0


@pytest.mark.timeout(900)
def test_a_split_generator_job_of_three_components_is_preempted_and_resumes_the_same(
        slurm_cluster, slurm_jobs, shared_tmp, generator_reference) -> None:
    problem = sh.cluster_problem(("node1", "node2", "node3"))
    if problem is not None:
        pytest.fail(f"the local cluster needs node3 for the generator's component: {problem}")
    ref = generator_reference

    job, run = sh.submit(shared_tmp, slurm_jobs, EXPERIMENT, *GEN, "slurm.controller.partition=cpu",
                         "--partition", "low", "slurm.generator.partition=multi", "slurm.generator.exclude=node2")
    sh.wait_until(lambda: read_state(run), lambda s: s.get("step", 0) >= 5, 600, awaited=f"job {job} at step 5")
    sh.preempt_node2(shared_tmp, slurm_jobs)
    done = sh.finished(run, job, RUN_S)
    assert done["status"] == "completed", done.get("reason")
    assert done["restarts"] >= 1 and history(run, "preempted"), "the run finished before the preemption"
    roles = {r["rank"]: (r["role"], r["node"]) for r in done["ranks"]}
    assert roles == {**{r: ("trainer", "node2") for r in range(4)}, 4: ("generator", "node3"),
                     5: ("generator", "node3")}, roles
    assert sorted(s for s, _ in sh.sacct_states(job)) == [f"{job}+0", f"{job}+1", f"{job}+2"]
    resumed = history(run, "resumed")
    assert resumed and resumed[0]["step"] == history(run, "preempted")[0]["step"]
    assert losses(run, every_step_once=True) == losses(ref, every_step_once=True)
    same_samples(json_lines(run / "samples.jsonl"), json_lines(ref / "samples.jsonl"))
