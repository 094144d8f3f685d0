"""A trainer with a generator on the local backend: samples, checks, recovery, both placements.

experiments/tiny_gpt_generate.yaml for 30 steps (the generator synced and sampling every 10),
once uninterrupted with the generator colocated (tp1 over the trainer's 4 workers), and once
split (tp1 on 2 workers of its own, ranks 4-5) with a generator worker killed by SIGKILL
after step 12: the run recovers from the checkpoint of step 10, re-syncs the generator from
the restored trainer, and writes the same losses bit for bit and the same samples. Sampling
is keyed by (seed, step, prompt), so the samples do not depend on the generator's layout;
their log-probs agree to 1e-5, not bit for bit: the colocated generator continues one
prompt per replica and the split one two, and a batch of another size may take another
matrix kernel.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import GENERATOR_RUN, Submitted, json_lines, same_samples
from tests.helpers import metrics as current_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _start(root: Path, *overrides: str) -> Submitted:
    return Submitted(root, list(overrides), experiment="experiments/tiny_gpt_generate.yaml", common=GENERATOR_RUN)


def test_split_generator_matches_colocated_and_survives_a_killed_generator_worker(
        tmp_path: Path, generator_reference: Path) -> None:
    samples = json_lines(generator_reference / "samples.jsonl")
    assert [(s["version"], s["kind"]) for s in samples[::4]] == [
        (10, "greedy"), (10, "sampled"), (20, "greedy"), (20, "sampled"), (30, "greedy"), (30, "sampled")]
    assert all(len(s["tokens"]) == 8 and len(s["prompt"]) == 8 for s in samples)
    metrics = json_lines(generator_reference / "metrics.jsonl")
    gaps = {m["step"]: m["sync_logprob_maxdiff"] for m in metrics if "sync_logprob_maxdiff" in m}
    assert sorted(gaps) == [9, 19, 29] and max(gaps.values()) < 1e-5, gaps

    r = _start(tmp_path / "split", "generator.placement=split", "generator.workers=2")
    try:
        r.wait_step(12)
        os.kill(r.worker_pid(4), signal.SIGKILL)  # the generator's first worker
        assert r.finish(timeout=600) == 0, r.output
    finally:
        r.cleanup()
    assert [e["rank"] for e in r.events("worker_lost")] == [4]
    assert r.events("resumed")[-1]["step"] == 10
    # the current records (the steps redone after the restart supersede the first tries)
    assert [m["loss"] for m in current_metrics(r.run_dir)] == [m["loss"] for m in metrics]
    same_samples(json_lines(r.run_dir / "samples.jsonl"), samples)  # re-synced from the restored trainer
    manifests = {d.name: json.loads((d / "manifest.json").read_text()) for d in (r.run_dir / "checkpoints").glob("step_*")}
    assert {k: m["meta"]["loop"]["policy_version"] for k, m in manifests.items()} == {"step_00000020": 20, "step_00000030": 30}
    split_gaps = [m["sync_logprob_maxdiff"] for m in current_metrics(r.run_dir) if "sync_logprob_maxdiff" in m]
    assert len(split_gaps) == 3 and max(split_gaps) < 1e-5, split_gaps
    log = (r.run_dir / "logs" / "controller.log").read_text()
    assert log.count("generator synced to version 10") == 2, "the restarted workers were not re-synced at step 10"
    cli = [sys.executable, "-m", "launcher.cli"]
    status = subprocess.run([*cli, "status", str(r.run_dir)], capture_output=True, text=True, check=True).stdout
    assert "workers:  4 on 1 node: local (ranks 0-3)" in status and "generator: 2 on 1 node: local (ranks 4-5)" in status
    logs = subprocess.run([*cli, "logs", str(r.run_dir), "--group", "generator"], capture_output=True, text=True,
                          check=True).stdout
    assert "[generator r4@local]" in logs and "[generator r5@local]" in logs and "[worker r" not in logs
