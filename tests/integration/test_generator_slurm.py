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

import json
import sys
from pathlib import Path
from typing import Any

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # works under any --import-mode
    sys.path.insert(0, _HERE)

import slurm_helpers as sh  # noqa: E402
from test_generator_local import same_samples  # noqa: E402
from test_recovery_slurm import _events, _finished, _losses, _preempt_node2, _state, _submit  # noqa: E402

from tests.integration.conftest import GENERATOR_RUN  # noqa: E402

pytestmark = pytest.mark.slurm
GEN = [*GENERATOR_RUN, "checkpoint.interval_steps=0", "generator.placement=split", "generator.workers=2"]
EXPERIMENT = "experiments/tiny_gpt_generate.yaml"


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(900)
def test_a_split_generator_job_of_three_components_is_preempted_and_resumes_the_same(
        slurm_cluster, slurm_jobs, shared_tmp, generator_reference) -> None:
    problem = sh.cluster_problem(("node1", "node2", "node3"))
    if problem is not None:
        pytest.fail(f"the local cluster needs node3 for the generator's component: {problem}")
    ref = generator_reference

    job, run = _submit(shared_tmp, slurm_jobs, "--partition", "low", "slurm.generator.partition=multi",
                       "slurm.generator.exclude=node2", experiment=EXPERIMENT, common=GEN)
    sh.wait_until(lambda: _state(run), lambda s: s.get("step", 0) >= 5, 600, awaited=f"job {job} at step 5")
    _preempt_node2(shared_tmp, slurm_jobs)
    done = _finished(run, job)
    assert done["status"] == "completed", done.get("reason")
    assert done["restarts"] >= 1 and _events(run, "preempted"), "the run finished before the preemption"
    roles = {r["rank"]: (r["role"], r["node"]) for r in done["ranks"]}
    assert roles == {**{r: ("trainer", "node2") for r in range(4)}, 4: ("generator", "node3"),
                     5: ("generator", "node3")}, roles
    assert sorted(s for s, _ in sh.sacct_states(job)) == [f"{job}+0", f"{job}+1", f"{job}+2"]
    resumed = _events(run, "resumed")
    assert resumed and resumed[0]["step"] == _events(run, "preempted")[0]["step"]
    assert _losses(run) == _losses(ref)
    same_samples(_lines(run / "samples.jsonl"), _lines(ref / "samples.jsonl"))
