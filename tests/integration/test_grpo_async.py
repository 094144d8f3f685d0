"""GRPO with the rollout one step ahead of the update (``rl.max_staleness: 1``, the rollout on
a worker of its own): experiments/grpo_tiny.yaml learns to count, and a run stopped or
broken anywhere in the overlap ends with the uninterrupted run's numbers.

The schedule (core/controller/rollouts.py): at the RL phase's first step (30) the generator is
synced to policy 30 and starts rollouts 30 and 31; at every later step s it waits for the
rollouts in flight, is synced to policy s and starts rollout s + 1, while the trainer updates
policy s on rollout s, which policy s - 1 generated. Every step's policy version is thus a
function of the step alone, and so are its prompts and sampling keys: a run preempted at
any point (SIGTERM to the local ``baton submit`` while the next rollout is being generated,
before the update, between two steps) resumes from the stop's checkpoint, which holds the
rollout in flight (``rollouts.npz``), to the same losses, rewards, KL, entropy and policy
versions bit for bit, and the same actor weights; so does a run whose generator worker is
killed mid-rollout (the controller restarts the generator's worker alone and syncs it to the
policy the lost rollout came from, which the trainer's ranks kept).
The reference is the session's ``async_demo`` (tests/integration/conftest.py); the Slurm
variant is tests/integration/test_grpo_slurm.py.
"""
from __future__ import annotations

import io
import statistics
from pathlib import Path

import numpy as np
import pytest

from core.checkpoint import manifest
from core.record import steps
from tests.helpers import (
    ASYNC_GRPO,
    GRPO_ASYNC_NUMBERS,
    GRPO_TRAINING,
    baton,
    checkpoint_weights,
    history,
    metrics,
    numbers,
    run_folder,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
EXPERIMENT = "experiments/grpo_tiny.yaml"
PHASES = {"wait", "sync", "generate", "reward", "old", "ref", "update"}
# the same recovery settings as the other killed-worker tests (tests.helpers.GENERATOR_RUN)
FAST_RECOVERY = ("recovery.backoff_s=0.2", "timeouts.heartbeat_interval_s=0.1", "timeouts.heartbeat_timeout_s=3",
                 "timeouts.controller_lost_s=6")


def _same_weights(run: Path, reference: Path) -> None:
    mine, theirs = checkpoint_weights(run, 130), checkpoint_weights(reference, 130)
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)


def _kept_rollouts(step_dir: Path) -> dict[int, int]:
    """The rollouts a checkpoint kept (rollouts.npz, verified against its manifest): step → version."""
    assert manifest.verify(step_dir) == []  # rollouts.npz's size and checksum among the rest
    data = manifest.read_attachment(step_dir, "rollouts.npz")
    assert data is not None, f"{step_dir} holds no rollouts"
    with np.load(io.BytesIO(data)) as z:
        return dict(zip(z["steps"].tolist(), z["versions"].tolist(), strict=True))


def test_staleness_one_on_the_counting_demo_learns_from_rollouts_one_version_old(
        async_demo: Path, grpo_demo: Path) -> None:
    rows = metrics(async_demo)
    assert [r["step"] for r in rows] == list(range(130))
    rl = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in rl] == list(range(30, 130))
    # the schedule: step 30 trains on its own policy's rollout, every later step s on policy s - 1's
    assert [r["policy_version"] for r in rl] == [30, *range(30, 129)]
    assert all(r["staleness"] == r["step"] - r["policy_version"] for r in rl)
    assert [r["staleness"] for r in rl] == [0] + [1] * 99
    first, last = (statistics.fmean(r["reward_mean"] for r in part) for part in (rl[:10], rl[-10:]))
    assert first <= 0.45 and last >= 0.85, (first, last)
    assert all(set(r["phase_s"]) == PHASES and r["optimizer_steps"] == 2 for r in rl)
    assert statistics.fmean(r["entropy"] for r in rl[-10:]) < statistics.fmean(r["entropy"] for r in rl[:10])
    assert rl[0]["kl"] == 0.0 and max(r["kl"] for r in rl) > 0
    # The actor's old log-probs are its own (policy s); the rollout's are those of the policy it
    # came from: equal at step 30, apart at every later step (the rows really are one version old).
    assert rl[0]["sync_logprob_maxdiff"] <= 1e-5 and min(r["sync_logprob_maxdiff"] for r in rl[1:]) > 1e-5
    # Against the synchronous demo: the same warm start and the same first RL step (its rollout is
    # policy 30's in both); from step 31 on another algorithm (rollout 31 is policy 30's here).
    sync = {r["step"]: r for r in metrics(grpo_demo)}
    assert all({k: r.get(k) for k in GRPO_TRAINING} == {k: sync[r["step"]].get(k) for k in GRPO_TRAINING}
               for r in rows[:31])
    assert [r["reward_mean"] for r in rl[1:]] != [sync[r["step"]]["reward_mean"] for r in rl[1:]]
    status = baton("status", str(async_demo)).stdout
    assert "generator: 1 on 1 node: local (rank 2)" in status, status


STOPS = ((45, "generating"), (70, "updating"), (100, "between"))  # (RL step, point of the overlap)


def test_stops_at_three_points_of_the_overlap_resume_to_the_uninterrupted_numbers(
        async_demo: Path, tmp_path: Path) -> None:
    """SIGTERM to the local ``baton submit`` (BATON_FAULTS sigterm_at: the controller signals its
    parent) during step 45's next rollout, before step 70's update and after step 100's record;
    each stop checkpoints at the step boundary (the only checkpoints: interval_steps=0) with the
    rollout in flight, and ``baton submit --resume`` goes on from there."""
    env = {"BATON_FAULTS": "sigterm_at=" + ",".join(f"{s}:{point}" for s, point in STOPS)}
    res = baton("submit", EXPERIMENT, f"runs_root={tmp_path}", *ASYNC_GRPO, "checkpoint.interval_steps=0",
                "--backend", "local", env=env, timeout=800)
    run = run_folder(res)
    stopped: list[int] = []
    for _ in STOPS:
        out = res.stdout + res.stderr
        assert res.returncode == 143 and "continue with `baton submit --resume" in out, out
        stop = history(run, "stopped")[-1]["step"]
        assert f"run stopped at step {stop}/130" in out, out
        stopped.append(stop)
        # the stop's checkpoint holds the rollout in flight: the next step's, from the policy before it
        assert _kept_rollouts(run / "checkpoints" / manifest.step_dir_name(stop)) == {stop: stop - 1}
        res = baton("submit", "--resume", str(run), "--backend", "local", env=env, timeout=800)
    assert res.returncode == 0, res.stdout + res.stderr
    # each stop landed after the step it was sent at, before the next one was sent
    ends = [s for s, _ in STOPS[1:]] + [130]
    assert all(s < stop <= end for (s, _), stop, end in zip(STOPS, stopped, ends, strict=True)), stopped
    assert [e["step"] for e in history(run, "preempted")] == stopped
    assert [e["step"] for e in history(run, "resumed")] == stopped  # from the stops' own checkpoints
    assert not any(superseded for _, superseded in steps.entries(run / "metrics.jsonl"))  # no step redone
    assert numbers(run, GRPO_ASYNC_NUMBERS) == numbers(async_demo, GRPO_ASYNC_NUMBERS)
    _same_weights(run, async_demo)
    log = (run / "logs" / "controller.log").read_text()  # each resume trained on the rollout its stop kept
    unused = [stop for stop in stopped if f"step_{stop:08d}/rollouts.npz: steps [{stop}]" not in log]
    assert not unused, f"the rollouts kept at steps {unused} were not restored"


# The generator's rank dies in the GENERATE of this step's rollout, started at step 64 from policy 64.
# The loss is found where the end of step 64 waits for that rollout before the generator's interval
# sync (generator.sync_interval_steps: 65): inside a step, after the trainer's update of it.
KILL_AT = 65


def test_a_generator_worker_killed_mid_rollout_is_restarted_alone_and_the_trainer_loses_nothing(
        async_demo: Path, tmp_path: Path) -> None:
    """BATON_FAULTS kill_at_generate (reaching the workers through ``baton submit``'s environment):
    the generator's only rank SIGKILLs itself in the rollout of step 65 (started at step 64, from
    policy 64, while the trainer updates policy 64). The controller restarts the generator's
    worker alone, inside step 64: the trainer's processes go on holding policy 65, the new
    generator is synced to policy 64 from the trainer's kept copy and generates rollout 65 again
    with the same keys, then the interval sync goes on. No step is redone, nothing is resumed
    from a checkpoint, and the run ends with the uninterrupted run's numbers and weights."""
    res = baton("submit", EXPERIMENT, f"runs_root={tmp_path}", *ASYNC_GRPO, "checkpoint.interval_steps=20",
                *FAST_RECOVERY, "--backend", "local", env={"BATON_FAULTS": f"kill_at_generate={KILL_AT}"}, timeout=800)
    assert res.returncode == 0, res.stdout + res.stderr
    run = run_folder(res)
    lost_at = KILL_AT - 1  # steps done when the loss was found: step 64's own tail
    assert [(e["rank"], e["failure"], e["step"]) for e in history(run, "worker_lost")] == [(2, "worker_lost", lost_at)]
    assert [(e["generation"], e["ranks"], e["step"]) for e in history(run, "restarting_workers")] == [(1, [2], lost_at)]
    ready = history(run, "workers_ready")
    assert [e["generation"] for e in ready] == [0, 1]
    pids = [{r["rank"]: r["pid"] for r in e["ranks"]} for e in ready]
    assert pids[0][0] == pids[1][0] and pids[0][1] == pids[1][1] and pids[0][2] != pids[1][2]  # only rank 2 is new
    assert history(run, "resumed") == []  # no checkpoint was loaded: the trainer kept its state
    # no step was redone: every step has one record, none superseded
    entries = steps.entries(run / "metrics.jsonl")
    assert [d["step"] for d, superseded in entries] == list(range(130)) and not any(s for _, s in entries)
    assert numbers(run, GRPO_ASYNC_NUMBERS) == numbers(async_demo, GRPO_ASYNC_NUMBERS)
    _same_weights(run, async_demo)


def test_staleness_two_with_validation_and_interval_syncs_inside_blocks_resumes_to_the_same_numbers(
        tmp_path: Path) -> None:
    """rl.max_staleness=2: the generator is synced every two steps (30, 32, ...) and rolls out
    the next two; a validation (every 3 RL steps) and the generator's interval sync (every 5
    steps) fall inside blocks and wait for the rollouts in flight first. Two stops (in a block
    and at its end) resume to the uninterrupted run's numbers, the validations' included."""
    common = (*ASYNC_GRPO[:2], "rl.max_staleness=2", "trainer.steps=42", "rl.val_every=3",
              "generator.sync_interval_steps=5", "checkpoint.interval_steps=0")
    whole = run_folder(baton("submit", EXPERIMENT, f"runs_root={tmp_path / 'whole'}", *common, "--backend", "local",
                             timeout=800))
    rl = [r for r in metrics(whole) if "reward_mean" in r]
    assert [r["staleness"] for r in rl] == [0] + [1, 2] * 5 + [1]  # steps 30 .. 41
    assert [r["policy_version"] for r in rl] == [30, 30, 30, 32, 32, 34, 34, 36, 36, 38, 38, 40]
    assert [r["step"] for r in rl if "val_reward_mean" in r] == [32, 35, 38, 41]  # after 3, 6, 9 and the last
    env = {"BATON_FAULTS": "sigterm_at=33:updating,37:generating"}
    res = baton("submit", EXPERIMENT, f"runs_root={tmp_path / 'stopped'}", *common, "--backend", "local", env=env,
                timeout=800)
    run = run_folder(res)
    for _ in range(2):
        assert res.returncode == 143, res.stdout + res.stderr
        res = baton("submit", "--resume", str(run), "--backend", "local", env=env, timeout=800)
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(history(run, "preempted")) == 2
    assert numbers(run, GRPO_ASYNC_NUMBERS) == numbers(whole, GRPO_ASYNC_NUMBERS)
    mine, theirs = checkpoint_weights(run, 42), checkpoint_weights(whole, 42)
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)
