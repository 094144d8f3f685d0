"""A trainer with a colocated generator on the local backend: samples, checks, recovery.

experiments/tiny_gpt_generate.yaml for 30 steps (the generator synced and sampling every 10),
once uninterrupted and once with a worker killed by SIGKILL after step 12: the run recovers
from the checkpoint of step 10, re-syncs the generator from the restored trainer, and writes
the same losses and the same samples, bit for bit.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.integration.test_recovery_local import Submitted

pytestmark = pytest.mark.timeout(900)
RUN = ("trainer.steps=30", "generator.sync_interval_steps=10", "checkpoint.interval_steps=10", "recovery.backoff_s=0.2",
       "timeouts.heartbeat_interval_s=0.1", "timeouts.heartbeat_timeout_s=3", "timeouts.controller_lost_s=6")


def _start(root: Path) -> Submitted:
    return Submitted(root, [], experiment="experiments/tiny_gpt_generate.yaml", common=RUN)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_samples_and_losses_survive_a_killed_worker_bit_for_bit(tmp_path: Path) -> None:
    ref = _start(tmp_path / "ref")
    try:
        assert ref.finish(timeout=600) == 0, ref.output
    finally:
        ref.cleanup()
    samples = _lines(ref.run_dir / "samples.jsonl")
    assert [(s["version"], s["kind"]) for s in samples[::4]] == [
        (10, "greedy"), (10, "sampled"), (20, "greedy"), (20, "sampled"), (30, "greedy"), (30, "sampled")]
    assert all(len(s["tokens"]) == 8 and len(s["prompt"]) == 8 for s in samples)
    metrics = _lines(ref.run_dir / "metrics.jsonl")
    gaps = {m["step"]: m["sync_logprob_maxdiff"] for m in metrics if "sync_logprob_maxdiff" in m}
    assert sorted(gaps) == [9, 19, 29] and max(gaps.values()) < 1e-5, gaps

    r = _start(tmp_path / "killed")
    try:
        r.wait_step(12)
        victim = r.worker_pid(1)
        os.kill(victim, signal.SIGKILL)
        assert r.finish(timeout=600) == 0, r.output
    finally:
        r.cleanup()
    assert [e["rank"] for e in r.events("worker_lost")] == [1]
    assert r.events("resumed")[-1]["step"] == 10
    assert [m["loss"] for m in _lines(r.run_dir / "metrics.jsonl")] == [m["loss"] for m in metrics]
    assert _lines(r.run_dir / "samples.jsonl") == samples  # re-synced from the restored trainer, not stale memory
    log = (r.run_dir / "logs" / "controller.log").read_text()
    assert log.count("generator synced to version 10") == 2, "the restarted workers were not re-synced at step 10"
