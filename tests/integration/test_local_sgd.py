"""Periodic synchronisation of data-parallel replicas (``parallel.sync``) on a real Megatron-core
GPT at dp2 (CPU, gloo).

With ``every: 4`` the replicas step on their own gradients and average their weights and
Adam moments every fourth step: over 20 steps 4x fewer data-parallel all-reduces of more
than scalars than synchronous training (counted at the collective), the replicas equal after
each average, and a final loss within 10 % of synchronous training's on the increment task.
The steps' requests come from the controller's own policy (core.controller.sync_policy).

With ``adaptive_latency_ms: 50`` and a 60 ms delay injected into every average
(``BATON_FAULTS=sync_delay_ms=60``), a run through the controller doubles the period and
records each change as an event.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from core.config.run import SyncConfig
from core.controller.sync_policy import SyncPolicy
from tests.helpers import baton
from tests.integration.gpt_harness import RankGroup, gpt_config, record_reductions_on_rank, reductions_on_rank

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]
STEPS = 20


def weights_on_rank(task: Any) -> list[float]:
    """A fingerprint of this rank's weights: the sum of each parameter."""
    return [float(p.detach().double().sum()) for chunk in task._ready().model_chunks for p in chunk.parameters()]


def _train(work: Path, policy: SyncPolicy | None, outer: dict | None = None
           ) -> tuple[list[float], list[list[str]], list[bool]]:
    sync = {"sync": {"every": policy.cfg.every, **(outer or {})}} if policy else {}
    cfg = gpt_config(world_size=2, steps=STEPS, parallel={"tp": 1, "pp": 1, **sync})
    losses, equal = [], []
    with RankGroup(cfg, world_size=2, run_dir=work) as g:
        g.setup()
        g.apply(record_reductions_on_rank)
        for step in range(STEPS):
            request = {"step": step} if policy is None else vars(policy.request(step, checkpoint_due=False,
                                                                              last=step + 1 == STEPS))
            losses.append(g.loss(g.call("train_step", **request)))
            if request.get("average"):
                a, b = g.apply(weights_on_rank)
                equal.append(a == b)
        seen = g.apply(reductions_on_rank)
    return losses, seen, equal


def test_averaging_every_4_steps_all_reduces_4x_less_and_trains_like_synchronous(tmp_path: Path) -> None:
    sync, sync_seen, _ = _train(tmp_path, None)
    local, local_seen, equal = _train(tmp_path, SyncPolicy(SyncConfig(every=4)))
    assert [len(s) for s in sync_seen] == [STEPS, STEPS]  # one gradient bucket per step
    assert [len(s) for s in local_seen] == [STEPS // 4, STEPS // 4]
    assert equal == [True] * (STEPS // 4)  # every average leaves the replicas equal
    print(f"final loss: synchronous {sync[-1]:.4f}, every 4 steps {local[-1]:.4f}")
    assert local[-1] < 0.7 * local[0] and abs(local[-1] - sync[-1]) <= 0.1 * sync[-1], (local, sync)


def test_a_slow_average_doubles_the_period_and_is_an_event(tmp_path: Path) -> None:
    res = baton("submit", "experiments/tiny_gpt.yaml", f"runs_root={tmp_path}", "parallel.tp=1", "parallel.pp=1",
                "trainer.n_gpus_per_node=2", "trainer.steps=20", "parallel.sync.adaptive_latency_ms=50",
                "parallel.sync.max_every=4", "--backend", "local", timeout=600,
                env={"BATON_FAULTS": "sync_delay_ms=60"})
    assert res.returncode == 0, res.stdout + res.stderr
    run = next((tmp_path / "tiny-gpt").glob("*"))
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    changes = [(e["was"], e["every"]) for e in events if e["event"] == "sync_period_changed"]
    assert changes[:2] == [(1, 2), (2, 4)], changes
    assert all(e["median_ms"] >= 60 for e in events if e["event"] == "sync_period_changed")
    syncs = [r["grad_sync_s"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if r.get("grad_sync_s")]
    assert len(syncs) < 20 and all(min(s) >= 0.06 for s in syncs), syncs


def test_diloco_s_outer_nesterov_step_trains_and_keeps_the_replicas_equal(tmp_path: Path) -> None:
    """outer: nesterov: every average becomes DiLoCo's outer step from the last synced
    weights; still one all-reduce per average, equal replicas after it, and training on."""
    sync, _, _ = _train(tmp_path, None)
    outer, seen, equal = _train(tmp_path, SyncPolicy(SyncConfig(every=4, outer="nesterov")),
                                outer={"outer": "nesterov"})
    assert [len(s) for s in seen] == [STEPS // 4, STEPS // 4] and equal == [True] * (STEPS // 4)
    print(f"final loss: synchronous {sync[-1]:.4f}, DiLoCo every 4 steps {outer[-1]:.4f}")
    assert outer[-1] < 0.8 * outer[0] and outer[-1] <= 1.1 * sync[-1], (outer, sync)  # no worse than synchronous


def test_a_diloco_run_resumed_from_its_checkpoint_gives_the_uninterrupted_numbers(tmp_path: Path) -> None:
    """The outer momentum is in the checkpoint and the anchor is the restored weights: a run
    stopped at its step-8 checkpoint and resumed to 16 writes the uninterrupted run's losses."""
    common = ("parallel.tp=1", "parallel.pp=1", "trainer.n_gpus_per_node=2", "parallel.sync.every=4",
              "parallel.sync.outer=nesterov", "checkpoint.interval_steps=8", "optimizer.schedule=constant")
    whole = baton("submit", "experiments/tiny_gpt.yaml", f"runs_root={tmp_path / 'a'}", "trainer.steps=16", *common,
                  "--backend", "local", timeout=600)
    half = baton("submit", "experiments/tiny_gpt.yaml", f"runs_root={tmp_path / 'b'}", "trainer.steps=8", *common,
                 "--backend", "local", timeout=600)
    assert whole.returncode == 0 and half.returncode == 0, whole.stderr + half.stderr
    run = next((tmp_path / "b" / "tiny-gpt").glob("*"))
    res = baton("submit", "--resume", str(run), "trainer.steps=16", "--backend", "local", timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    losses = [[json.loads(line)["loss"] for line in (r / "metrics.jsonl").read_text().splitlines()]
              for r in (next((tmp_path / "a" / "tiny-gpt").glob("*")), run)]
    assert len(losses[0]) == 16 and losses[0] == losses[1]
