"""PPO with a critic on the local backend: experiments/ppo_tiny.yaml learns to count while its
critic learns the rewards, and a run preempted mid-RL resumes to the same numbers.

The demo is the GRPO demo's task with a value model instead of group baselines: 30
supervised warm-start steps, then 100 PPO steps (4 prompts x 8 responses, the counting
reward on each response's last token, GAE over the critic's values, 2 critic and 2 actor
updates per step). The mean reward of the first 10 RL steps is at most 0.45 and of the last
10 at least 0.85; the critic's value loss over the last 10 is under half of the first 10's.
Every checkpoint holds the critic (``critic.`` names) and its optimizer beside the actor.

The preempted run gets SIGUSR2 at its controller after RL step 50; it resumes with the
actor, the critic and both optimizers restored, and writes the same numbers (value loss
and values included) bit for bit, ending with the same actor and critic weights.
"""
from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pytest

from core.checkpoint.hdf5 import CheckpointReader
from tests.helpers import Submitted, baton, checkpoint_weights, metrics, numbers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
EXPERIMENT = "experiments/ppo_tiny.yaml"
KEYS = ("step", "loss", "grad_norm", "reward_mean", "reward_std", "clip_frac", "policy_version", "kl", "entropy",
        "ratio_max", "sync_logprob_maxdiff", "value_loss", "values_mean")
PHASES = {"sync", "generate", "reward", "old", "ref", "values", "critic", "update"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ppo")
    res = baton("submit", EXPERIMENT, f"runs_root={root}", "--backend", "local", timeout=800)
    assert res.returncode == 0, res.stdout + res.stderr
    return next((root / "ppo-tiny").glob("*"))


def test_the_ppo_demo_learns_to_count_and_its_critic_learns_the_rewards(demo: Path) -> None:
    rl = [r for r in metrics(demo) if "reward_mean" in r]
    assert [r["step"] for r in rl] == list(range(30, 130)) and all(set(r["phase_s"]) == PHASES for r in rl)
    first, last = (statistics.fmean(r["reward_mean"] for r in part) for part in (rl[:10], rl[-10:]))
    assert first <= 0.45 and last >= 0.85, (first, last)
    v_first, v_last = (statistics.fmean(r["value_loss"] for r in part) for part in (rl[:10], rl[-10:]))
    assert v_last < 0.5 * v_first, (v_first, v_last)
    # the values follow the rewards up (the head starts near 0)
    assert abs(rl[0]["values_mean"]) < 0.2 and statistics.fmean(r["values_mean"] for r in rl[-10:]) > 0.6
    assert max(r["sync_logprob_maxdiff"] for r in rl) <= 1e-5
    weights = checkpoint_weights(demo, 130)
    actor_head, critic_head = weights["output_layer.weight"], weights["critic.output_layer.weight"]
    assert actor_head.shape == (32, 64) and critic_head.shape == (1, 64) and weights["critic.output_layer.bias"].shape == (1,)
    # the critic's transformer started as the actor's at step 30 and has trained apart from it since
    assert not np.array_equal(weights["critic.decoder.final_layernorm.weight"], weights["decoder.final_layernorm.weight"])
    with CheckpointReader(demo / "checkpoints" / "step_00000130") as reader:
        names = set(reader.manifest.tensors)
    assert {"optim.exp_avg.critic.output_layer.weight", "optim.exp_avg_sq.critic.decoder.final_layernorm.weight"} <= names
    res = baton("report", str(demo))
    assert res.returncode == 0, res.stderr
    drawn = {Path(line).name for line in res.stdout.split()}
    assert {"reward.png", "value.png", "phases.png"} <= drawn, drawn


def test_ppo_preempted_mid_rl_resumes_to_the_same_numbers(demo: Path, tmp_path: Path) -> None:
    r = Submitted(tmp_path, ["checkpoint.interval_steps=0"], experiment=EXPERIMENT, common=())
    assert r.preempt_at(50, timeout=800)["step"] < 130
    mine, theirs = numbers(r.run_dir, KEYS), numbers(demo, KEYS)
    assert mine == theirs
    a, b = checkpoint_weights(r.run_dir, 130), checkpoint_weights(demo, 130)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert any(k.startswith("critic.") for k in a)


def test_a_ppo_run_resumed_where_its_rl_phase_begins_gives_the_critic_the_actor_again(demo: Path,
                                                                                      tmp_path: Path) -> None:
    """The run ends at its warm start's last step (its checkpoint holds the critic as built),
    then is resumed for 10 RL steps: the first copies the restored actor into the critic
    again, and every number equals the uninterrupted demo's (the schedule is constant, so
    the shorter run's steps are the demo's)."""
    res = baton("submit", EXPERIMENT, f"runs_root={tmp_path}", "trainer.steps=30", "--backend", "local", timeout=800)
    assert res.returncode == 0, res.stdout + res.stderr
    run = next((tmp_path / "ppo-tiny").glob("*"))
    res = baton("submit", "--resume", str(run), "trainer.steps=40", "--backend", "local", timeout=800)
    assert res.returncode == 0, res.stdout + res.stderr
    mine, theirs = numbers(run, KEYS), numbers(demo, KEYS)
    assert len(mine) == 40 and mine == theirs[:40]


def test_a_critic_trained_in_tp2_resumes_in_tp1(tmp_path: Path) -> None:
    """The critic's transformer split over two tensor-parallel ranks (its value head whole on
    both); its checkpoint loads into a tp1 layout (dp2) by name, as the actor's does."""
    res = baton("submit", EXPERIMENT, f"runs_root={tmp_path}", "parallel.tp=2", "generator.tp=1",
                "trainer.steps=34", "generator.sync_interval_steps=34", "rl.ppo_epochs=1", "--backend", "local",
                timeout=800)
    assert res.returncode == 0, res.stdout + res.stderr
    run = next((tmp_path / "ppo-tiny").glob("*"))
    res = baton("submit", "--resume", str(run), "parallel.tp=1", "trainer.steps=36", "--backend", "local", timeout=800)
    assert res.returncode == 0, res.stdout + res.stderr
    rl = [r for r in metrics(run) if "reward_mean" in r]
    assert [r["step"] for r in rl] == list(range(30, 36))
    assert all(0 < r["value_loss"] < 1 and r["ratio_max"] == 1.0 for r in rl[:4]), rl
    assert all(0 < r["value_loss"] < 1 for r in rl)
    with CheckpointReader(run / "checkpoints" / "step_00000034") as reader:
        assert reader.manifest.layout == "tp2pp1dp1"
        head = reader.read("critic.output_layer.weight")
    # the critic at step 34 went on from that checkpoint: its head moved on from the tp2 one, by a little
    after = checkpoint_weights(run, 36)["critic.output_layer.weight"]
    assert after.shape == head.shape == (1, 64) and 0 < np.abs(after - head).max() < 0.1


def test_ppo_with_tied_embeddings_in_pp2_trains_its_own_value_head_on_mini_batches(tmp_path: Path) -> None:
    """``model.tie_embeddings`` with pp 2: the actor's last stage holds a copy of the word
    embedding as its output layer, which Megatron keeps in step with the first stage's; the
    critic's value head is its own [1, h] parameter, its model built untied (tied, CRITIC_INIT
    copied the embedding into the head and failed). Three RL steps from step 0, each epoch
    two mini-batches of 16 responses for the actor and the critic alike."""
    res = baton("submit", EXPERIMENT, f"runs_root={tmp_path}", "parallel.pp=2", "model.tie_embeddings=true",
                "rl.warmup_steps=0", "trainer.steps=3", "rl.mini_batch_size=16", "generator.sync_interval_steps=3",
                "--backend", "local", timeout=800)
    assert res.returncode == 0, res.stdout + res.stderr
    run = next((tmp_path / "ppo-tiny").glob("*"))
    rl = metrics(run)
    assert [r["step"] for r in rl] == [0, 1, 2] and all(r["optimizer_steps"] == 4 for r in rl), rl
    assert all(0 < r["value_loss"] < 10 and np.isfinite(r["loss"]) for r in rl), rl
    weights = checkpoint_weights(run, 3)
    assert weights["critic.output_layer.weight"].shape == (1, 64) and weights["critic.output_layer.bias"].shape == (1,)
    assert weights["critic.embedding.word_embeddings.weight"].shape == weights["embedding.word_embeddings.weight"].shape
    assert "output_layer.weight" not in weights  # the actor's output layer is its embedding
