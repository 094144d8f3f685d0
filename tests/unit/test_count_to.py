"""The ``count_to`` task (core.rl.tasks), its reward (core.rl.rewards) and its warm-start rows
(core.model.gpt.data, ``data.task: count_to``), against the rule written out by hand: a
prompt ``T a a+1 ..`` is answered by the numbers after its last one up to ``T``, then the
end-of-text id ``vocab - 1``."""
from __future__ import annotations

import numpy as np
import pytest

from core.config import run as config_mod
from core.errors import ConfigError
from core.model.gpt.data import BatchSource
from core.rl import rewards, tasks

DEMO = "experiments/grpo_varlen_tiny.yaml"


def _answer(prompt: tuple[int, ...], vocab: int) -> list[int]:
    return [*range(prompt[-1] + 1, prompt[0] + 1), vocab - 1]


def test_count_to_prompts_are_a_target_and_a_count_whose_answers_differ_in_length() -> None:
    vocab, length, most = 32, 4, 8
    held_out = tasks.count_to_held_out(7, 64, length, most, vocab)
    asked = [a for step in range(50) for a in tasks.count_to(7, step, 8, length, most, vocab)] + held_out
    lengths = set()
    for a in asked:
        target, count = a.tokens[0], a.tokens[1:]
        assert len(a.tokens) == length and a.pad == 0 and a.meta["target"] == target and a.meta["eot"] == vocab - 1
        assert list(count) == list(range(count[0], count[0] + length - 1)) and 0 <= count[0]
        assert count[-1] < target <= vocab - 2  # at least one more number, every number below the end of text
        answer = _answer(a.tokens, vocab)
        assert 2 <= len(answer) <= most
        lengths.add(len(answer))
    assert lengths == set(range(2, most + 1))  # every answer length from 1 number + <eot> to max_response_length
    assert tasks.count_to(7, 3, 8, length, most, vocab) == tasks.count_to(7, 3, 8, length, most, vocab)
    assert held_out[:8] == tasks.count_to_held_out(7, 8, length, most, vocab)  # the same set at every validation
    assert tasks.count_to(7, 3, 8, length, most, vocab) != tasks.count_to(7, 4, 8, length, most, vocab)


def test_the_count_to_reward_wants_the_whole_count_and_its_end_of_text() -> None:
    meta = {"target": 12, "eot": 31}
    prompt = (12, 7, 8, 9)
    assert rewards.count_to(prompt, (10, 11, 12, 31), meta) == 1.0
    assert rewards.count_to((10, 7, 8, 9), (10, 31), {"target": 10, "eot": 31}) == 1.0
    for wrong in ((10, 11, 12), (10, 11, 31), (10, 11, 12, 13), (10, 11, 12, 31, 31), (31,), (10, 12, 11, 31), ()):
        assert rewards.count_to(prompt, wrong, meta) == 0.0, wrong
    with pytest.raises(KeyError, match="rl.task: count_to"):
        rewards.count_to(prompt, (10,), {"vocab_size": 32})


def test_count_to_warm_start_rows_are_the_task_format_with_the_loss_on_the_answer_only() -> None:
    vocab, seq, batch = 32, 16, 16
    src = BatchSource(kind="synthetic", task="count_to", path=None, seed=3, vocab_size=vocab, seq_length=seq,
                      global_batch=batch, micro_batch=4, dp=1, dp_rank=0)
    for step in range(20):
        mbs = src.micro_batches(step)
        counted = 0
        for mb in mbs:
            assert mb.loss_mask is not None and mb.loss_mask.shape == mb.tokens.shape
            for tokens, labels, mask in zip(mb.tokens, mb.labels, mb.loss_mask, strict=True):
                row = [int(tokens[0]), *map(int, labels)]  # T a a+1 .. T <eot> <eot> ..
                end = row.index(vocab - 1)
                assert end >= 3 and row[1:end] == list(range(row[1], row[0] + 1))
                assert all(t == vocab - 1 for t in row[end:])
                assert row[3:end + 1] == _answer(tuple(row[:3]), vocab)  # what the task's reward wants
                assert mask.tolist() == [1 <= j < end for j in range(seq)]  # labels a+1 .. <eot>
                counted += int(mask.sum())
        assert all(mb.loss_tokens == counted for mb in mbs)  # the global batch's count, on every micro-batch
        halves = [BatchSource(kind="synthetic", task="count_to", path=None, seed=3, vocab_size=vocab, seq_length=seq,
                              global_batch=batch, micro_batch=8, dp=2, dp_rank=r).micro_batches(step)[0]
                  for r in (0, 1)]
        assert np.array_equal(np.concatenate([h.tokens for h in halves]), np.concatenate([m.tokens for m in mbs]))
        assert all(h.loss_tokens == counted for h in halves)


@pytest.mark.parametrize(("override", "key"), [
    ("rl.prompt_length=1", "rl.prompt_length"),
    ("rl.max_response_length=1", "rl.max_response_length"),
    ("rl.stop=[5]", "rl.stop"),
])
def test_count_to_settings_that_cannot_work_are_refused_naming_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as info:
        config_mod.load(DEMO, [override])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("key", ["model.seq_length", "model.vocab_size"])
def test_count_to_warm_start_rows_that_cannot_fit_are_refused_at_submit(key: str) -> None:
    """data.task: count_to writes ``T a a+1 <eot>`` at least: below 3 positions or ids the
    rows cannot be drawn (numpy's ValueError in the worker before this check)."""
    base = ["program=pretrain", "generator.enabled=false", "rl.task=counting", "rl.reward=counting"]
    with pytest.raises(ConfigError, match=rf"^{key.replace('.', '[.]')}: 2 < 3: data.task: count_to writes ") as info:
        config_mod.load(DEMO, [*base, f"{key}=2", "model.num_attention_heads=1", "model.num_query_groups=1",
                               "model.hidden_size=8"])
    assert "\n" not in str(info.value)
    src = BatchSource(kind="synthetic", task="count_to", path=None, seed=3, vocab_size=3, seq_length=3,
                      global_batch=2, micro_batch=2, dp=1, dp_rank=0)  # the least it takes: rows drawn
    assert src.micro_batches(0)[0].tokens.shape == (2, 3)


def test_the_count_to_reward_needs_the_count_to_task() -> None:
    with pytest.raises(ConfigError, match=r"rl\.reward: count_to .*rl\.task=count_to"):
        config_mod.load(DEMO, ["rl.task=counting"])
    assert config_mod.load(DEMO).rl.task == "count_to"
