"""GRPO on the local backend: experiments/grpo_tiny.yaml learns to count, and a run preempted
mid-RL resumes to the uninterrupted run's numbers.

The demo: 30 supervised warm-start steps, then 100 GRPO steps (4 prompts x 8 responses,
exact-match counting reward). The mean reward of the first 10 RL steps is at most 0.45 and
of the last 10 at least 0.85; the greedy continuations of the held-out prompts count on
exactly afterwards.

The preempted run gets SIGUSR2 at its controller after RL step 50: it checkpoints at the
step boundary, requeues, resumes, re-syncs the generator from the restored actor, and
writes the same losses, rewards and policy versions bit for bit (prompts and sampling are
keyed by seed and step, so no prompt repeats or is skipped). With the rollout on a worker
of its own (generator.placement=split) every number equals the colocated demo's too.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
from pathlib import Path

import pytest

from tests.helpers import baton
from tests.integration.test_recovery_local import Submitted

pytestmark = pytest.mark.timeout(900)
EXPERIMENT = "experiments/grpo_tiny.yaml"


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("grpo")
    res = baton("submit", EXPERIMENT, f"runs_root={root}", "--backend", "local", timeout=800)
    assert res.returncode == 0, res.stdout + res.stderr
    return next((root / "grpo-tiny").glob("*"))


def test_the_grpo_demo_learns_to_count(demo: Path) -> None:
    rows = _metrics(demo)
    assert [r["step"] for r in rows] == list(range(130))
    rl = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in rl] == list(range(30, 130)) and all(r["policy_version"] == r["step"] for r in rl)
    first, last = (statistics.fmean(r["reward_mean"] for r in part) for part in (rl[:10], rl[-10:]))
    assert first <= 0.45 and last >= 0.85, (first, last)
    assert all(r["response_length"] == 8 and 0 <= r["clip_frac"] <= 1 for r in rl)
    greedy = [json.loads(line) for line in (demo / "samples.jsonl").read_text().splitlines()]
    final = [s for s in greedy if s["version"] == 130 and s["kind"] == "greedy"]
    assert len(final) == 2
    for s in final:
        assert s["tokens"] == [(s["prompt"][-1] + k) % 32 for k in range(1, 9)], s


def test_grpo_preempted_mid_rl_resumes_to_the_same_numbers(demo: Path, tmp_path: Path) -> None:
    r = Submitted(tmp_path, ["checkpoint.interval_steps=0"], experiment=EXPERIMENT, common=())
    try:
        r.wait_step(50)
        os.kill(r.controller_pid(), signal.SIGUSR2)
        assert r.finish(timeout=800) == 0, r.output
    finally:
        r.cleanup()
    (pre,) = r.events("preempted")
    assert 50 <= pre["step"] < 130 and r.events("resumed")[0]["step"] == pre["step"]
    keys = ("step", "loss", "grad_norm", "reward_mean", "reward_std", "clip_frac", "policy_version")
    got = [{k: m.get(k) for k in keys} for m in _metrics(r.run_dir)]
    assert got == [{k: m.get(k) for k in keys} for m in _metrics(demo)]
    log = (r.run_dir / "logs" / "controller.log").read_text()
    assert f"generator synced to version {pre['step']}" in log  # the restored policy, before its first rollout


def test_grpo_with_the_rollout_on_workers_of_its_own_gives_the_same_numbers(demo: Path, tmp_path: Path) -> None:
    """generator.placement=split: the rollout on one worker of its own (rank 2), every weight
    sync over the bridge group; prompts, sampling and the actor's arithmetic are the same,
    so every step's numbers equal the colocated demo's."""
    res = baton("submit", EXPERIMENT, f"runs_root={tmp_path}", "generator.placement=split", "generator.workers=1",
                "--backend", "local", timeout=800)
    assert res.returncode == 0, res.stdout + res.stderr
    run = next((tmp_path / "grpo-tiny").glob("*"))
    keys = ("step", "loss", "grad_norm", "reward_mean", "reward_std", "clip_frac", "policy_version")
    assert [{k: m.get(k) for k in keys} for m in _metrics(run)] == [{k: m.get(k) for k in keys} for m in _metrics(demo)]
    status = baton("status", str(run)).stdout
    assert "generator: 1 on 1 node: local (rank 2)" in status, status
