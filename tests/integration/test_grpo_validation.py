"""Held-out validation of a GRPO run (rl.val_every), at the longest response the submit check
accepts.

experiments/grpo_tiny.yaml with 30 warm-start steps, then 40 GRPO steps with responses of
``rl.max_response_length = 12``: with 4 prompt tokens exactly ``model.seq_length`` (16), the
largest the generator holds (the submit check's bound; one more is refused at submit,
tests/unit/test_config.py). Validated every 10 RL steps: after steps 40, 50, 60 and 70 (the
last). The same run without validation gives the same training numbers bit for bit
(validation draws from no training stream), and a run preempted after step 40 resumes to
the same training and validation numbers and the same validation responses.
"""
from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from core.record import steps as step_records
from core.rl import rewards
from core.rl.tasks import counting_held_out
from tests.helpers import GRPO_NUMBERS, GRPO_TRAINING, Submitted, baton, json_lines, metrics, numbers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
EXPERIMENT = "experiments/grpo_tiny.yaml"
SHORT = ("trainer.steps=70", "rl.max_response_length=12", "checkpoint.interval_steps=0")
VALIDATED = ("rl.val_every=10",)


def _run(root: Path, *overrides: str) -> Path:
    res = baton("submit", EXPERIMENT, f"runs_root={root}", *SHORT, *overrides, "--backend", "local", timeout=500)
    assert res.returncode == 0, res.stdout + res.stderr
    return next((root / "grpo-tiny").glob("*"))


@pytest.fixture(scope="module")
def validated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(tmp_path_factory.mktemp("val"), *VALIDATED)


def test_validation_records_the_held_out_rewards_of_the_greedy_and_sampled_responses(validated: Path) -> None:
    """val_reward_mean(_sampled) on the records of the validated steps only, each the mean of
    the counting reward of that validation's responses in samples.jsonl, rescored here; the
    greedy responses are the held-out prompts' argmax continuations (the same for a rerun)."""
    rows = metrics(validated)
    assert [r["step"] for r in rows] == list(range(70))
    assert [r["step"] for r in rows if "val_reward_mean" in r] == [39, 49, 59, 69]  # policies 40, 50, 60, 70
    assert [r["step"] for r in rows if "val_reward_mean_sampled" in r] == [39, 49, 59, 69]
    assert all(r["response_length"] <= 12 for r in rows if "reward_mean" in r)
    samples = json_lines(validated / "samples.jsonl")
    assert {s["split"] for s in samples} == {"val"}  # an RL run's samples are its validation responses
    held = counting_held_out(1234, 4, 4, 32)
    for rec in (r for r in rows if "val_reward_mean" in r):
        done = rec["step"] + 1
        for kind, key in (("greedy", "val_reward_mean"), ("sampled", "val_reward_mean_sampled")):
            mine = [s for s in samples if s["step"] == done and s["kind"] == kind]
            assert [s["index"] for s in mine] == [0, 1, 2, 3] and all(s["version"] == done for s in mine)
            assert [tuple(s["prompt"]) for s in mine] == [a.tokens for a in held]
            assert all(len(s["tokens"]) == 12 == len(s["logprobs"]) for s in mine)  # the whole length generated
            scores = [rewards.counting(s["prompt"], s["tokens"], {"vocab_size": 32}) for s in mine]
            assert [s["reward"] for s in mine] == scores
            assert rec[key] == statistics.fmean(scores), (done, kind)
    greedy = [s for s in samples if s["kind"] == "greedy"]
    sampled = [s for s in samples if s["kind"] == "sampled"]
    assert [s["tokens"] for s in greedy] != [s["tokens"] for s in sampled]  # sampled at rl.temperature 1
    for s in greedy:  # every greedy token is its distribution's argmax: a probability of at least 1/32
        assert min(s["logprobs"]) >= -3.465736, s  # log(1/32) to the 6 decimals samples.jsonl keeps


def test_validation_changes_no_training_number(validated: Path, tmp_path: Path) -> None:
    plain = _run(tmp_path)
    assert not any("val_reward_mean" in r for r in metrics(plain))
    assert numbers(plain, GRPO_TRAINING) == numbers(validated, GRPO_TRAINING)
    assert any(r["reward_mean"] for r in metrics(plain) if "reward_mean" in r)  # numbers that could differ
    assert not (plain / "samples.jsonl").exists() or not (plain / "samples.jsonl").read_text()


def test_a_preempted_run_resumes_to_the_same_validation_numbers_and_responses(validated: Path,
                                                                                tmp_path: Path) -> None:
    r = Submitted(tmp_path, [*SHORT, *VALIDATED], experiment=EXPERIMENT)
    pre = r.preempt_at(40)
    assert pre["step"] < 70
    assert numbers(r.run_dir, GRPO_NUMBERS) == numbers(validated, GRPO_NUMBERS)
    assert json_lines(r.run_dir / "samples.jsonl") == json_lines(validated / "samples.jsonl")


def test_a_stop_skips_a_due_validation_that_the_resumed_run_does_first(tmp_path: Path) -> None:
    """Validated after every RL step: a preemption signal that arrives during a step stops the
    run at its end without validating it (the stop saves the step at once); the resumed run
    validates that step first. Training and validation numbers and the validation responses
    are those of the run never stopped."""
    every = ("trainer.steps=36", "rl.max_response_length=12", "checkpoint.interval_steps=0", "rl.val_every=1")
    whole = _run(tmp_path / "whole", *every)
    r = Submitted(tmp_path / "stopped", list(every), experiment=EXPERIMENT)
    pre = r.preempt_at(32)
    assert pre["step"] < 36
    assert numbers(r.run_dir, GRPO_NUMBERS) == numbers(whole, GRPO_NUMBERS)
    assert json_lines(r.run_dir / "samples.jsonl") == json_lines(whole / "samples.jsonl")
    redone = [rec for rec in step_records.read(r.run_dir / "metrics.jsonl", superseded=True)
              if rec.step == pre["step"] - 1]
    if len(redone) == 2:  # the signal came during the step: its validation ran after the resume
        assert redone[0].superseded and redone[0].val_reward_mean is None and "val" not in (redone[0].phase_s or {})
        assert redone[1].val_reward_mean is not None and "val" in (redone[1].phase_s or {})
