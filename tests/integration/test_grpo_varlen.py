"""GRPO with answers of different lengths: experiments/grpo_varlen_tiny.yaml (rl.task: count_to,
sampled at temperature 0.8) learns, resumes bit for bit, and its RL objective does not
depend on the micro-batch size or the number of data-parallel replicas.

The demo: 50 supervised warm-start steps on data.task: count_to, then 120 GRPO steps of 8
prompts x 8 responses; a response ends at its first end-of-text token (id 31), and the
exact-match reward wants the whole count up to the prompt's target and that token. The
mean reward of the last 10 RL steps exceeds the first 10's by at least 0.3, responses of a
step differ in length, and at the end nearly all of them stop at the end-of-text token.

A run preempted mid-RL (SIGUSR2 to its controller) resumes to the same numbers and weights.

The first three RL steps' losses at training.micro_batch_size 1 and 4 (the same global
batch) and at dp 1 and 2 are equal within 1e-6 (and equal the demo's, at micro-batch 8):
the loss is aggregated over the whole RL batch, not per micro-batch or replica.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import GRPO_NUMBERS, Submitted, baton, checkpoint_weights, metrics, numbers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
EXPERIMENT = "experiments/grpo_varlen_tiny.yaml"
WARMUP, STEPS, MOST = 50, 170, 8  # the YAML's rl.warmup_steps, trainer.steps, rl.max_response_length
EOT = 31  # model.vocab_size - 1
VARLEN_NUMBERS = (*GRPO_NUMBERS, "response_length", "response_length_min", "response_length_max", "stopped_frac")


def _answer(prompt: list[int]) -> list[int]:
    """The right response to ``T a a+1 ..``: the numbers after the prompt's last up to ``T``, then <eot>."""
    return [*range(prompt[-1] + 1, prompt[0] + 1), EOT]


def _rl(run: Path) -> list[dict]:
    return [r for r in metrics(run) if "reward_mean" in r]


def test_the_variable_length_demo_learns_to_count_to_the_target_and_stop(grpo_varlen_demo: Path) -> None:
    rl = _rl(grpo_varlen_demo)
    assert [r["step"] for r in rl] == list(range(WARMUP, STEPS))
    first, last = (statistics.fmean(r["reward_mean"] for r in part) for part in (rl[:10], rl[-10:]))
    assert last - first >= 0.3, (first, last)
    # Lengths vary within a step (answers are 2 to 8 tokens), and the policy learns to stop at <eot>:
    # a response that never stops runs to max_response_length and scores 0.
    assert all(1 <= r["response_length_min"] <= r["response_length"] <= r["response_length_max"] <= MOST for r in rl)
    assert sum(r["response_length_min"] < r["response_length_max"] for r in rl) >= 0.9 * len(rl)
    assert len({r["response_length"] for r in rl}) > len(rl) // 2
    assert statistics.fmean(r["stopped_frac"] for r in rl[-10:]) >= 0.9
    assert all(r["stopped_frac"] >= r["reward_mean"] for r in rl)  # every right answer ends at <eot>
    # The held-out prompts' responses (rl.val_every: 40) scored by the rule written out here.
    val = [json.loads(line) for line in (grpo_varlen_demo / "samples.jsonl").read_text().splitlines()]
    assert {(v["step"], v["kind"]) for v in val} == {(s, k) for s in (90, 130, 170) for k in ("greedy", "sampled")}
    for v in val:
        assert len(v["tokens"]) <= MOST and EOT not in v["tokens"][:-1]  # cut at the first <eot>
        assert v["reward"] == float(v["tokens"] == _answer(v["prompt"])), v
    final = [v for v in val if v["step"] == STEPS and v["kind"] == "greedy"]
    assert len({len(_answer(v["prompt"])) for v in final}) > 1  # answers of different lengths ...
    assert statistics.fmean(v["reward"] for v in final) >= 0.75  # ... mostly right, each ending at <eot>
    assert all(v["tokens"][-1] == EOT for v in final if v["reward"] == 1.0)
    records = {r["step"]: r for r in rl}
    res = baton("report", str(grpo_varlen_demo))  # response_length.png: mean, min and max
    assert res.returncode == 0 and (grpo_varlen_demo / "report" / "response_length.png").stat().st_size > 1000, res
    assert all(records[s - 1]["val_reward_mean"] == statistics.fmean(v["reward"] for v in val
                                                                       if v["step"] == s and v["kind"] == "greedy")
               for s in (90, 130, 170))  # the record of the step after which it validated


def test_the_variable_length_demo_preempted_mid_rl_resumes_to_the_same_numbers(grpo_varlen_demo: Path,
                                                                               tmp_path: Path) -> None:
    r = Submitted(tmp_path, ["checkpoint.interval_steps=0"], experiment=EXPERIMENT)
    pre = r.preempt_at(WARMUP + 40, timeout=800)
    assert WARMUP < pre["step"] < STEPS
    assert numbers(r.run_dir, VARLEN_NUMBERS) == numbers(grpo_varlen_demo, VARLEN_NUMBERS)
    assert (r.run_dir / "samples.jsonl").read_text() == (grpo_varlen_demo / "samples.jsonl").read_text()
    mine, theirs = checkpoint_weights(r.run_dir, STEPS), checkpoint_weights(grpo_varlen_demo, STEPS)
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)


def _first_rl_losses(root: Path, *overrides: str) -> list[float]:
    res = baton("submit", EXPERIMENT, f"runs_root={root}", f"trainer.steps={WARMUP + 3}",
                f"generator.sync_interval_steps={WARMUP + 3}", *overrides, "--backend", "local", timeout=800)
    assert res.returncode == 0, res.stdout + res.stderr
    return [r["loss"] for r in _rl(next((root / "grpo-varlen-tiny").glob("*")))]


def test_the_first_rl_losses_do_not_depend_on_the_micro_batch_or_dp(grpo_varlen_demo: Path, tmp_path: Path) -> None:
    """The same global batches (the warm start's 16 rows, each RL step's 64 responses) split
    into micro-batches of 1 and of 4, over 2 data-parallel replicas and over 1."""
    demo = [r["loss"] for r in _rl(grpo_varlen_demo)[:3]]  # micro-batches of 8, dp 2
    runs = {"micro 1, dp 2": ("training.micro_batch_size=1",),
            "micro 4, dp 2": ("training.micro_batch_size=4",),
            "micro 4, dp 1": ("training.micro_batch_size=4", "trainer.n_gpus_per_node=1",
                              "slurm.workers.gpus_per_node=1")}
    got = {name: _first_rl_losses(tmp_path / name.replace(", ", "-").replace(" ", ""), *o) for name, o in runs.items()}
    assert all(len(losses) == 3 for losses in got.values()), got
    assert any(abs(x) > 1e-3 for x in demo), demo  # losses that can differ (not all zero)
    for name, losses in got.items():
        assert losses == pytest.approx(demo, abs=1e-6), (name, losses, demo)
