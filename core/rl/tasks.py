"""Prompt sources of the built-in RL tasks, keyed by (seed, step, prompt): a resumed run asks
the same prompts at the same step, and no prompt is seen twice or skipped (the cursor is
the step).

``counting``: ``prompt_length`` consecutive ids from a random start, modulo the vocabulary
(``5 6 7 8``); its reward (core.rl.rewards.counting) is how far a response counts on.

``count_to``: answers of different lengths that end at an end-of-text token. A prompt is a
target ``T`` and the start of a count, ``T a a+1 .. a+L-2`` (``L = prompt_length``); the right
response counts on up to the target and stops: ``a+L-1 .. T <eot>``, 1 to
``max_response_length - 1`` numbers. The end-of-text token is the vocabulary's last id
(``count_to_eot``; the numbers are the ids below it, never wrapped), as the byte tokenizer's
is. Its reward is core.rl.rewards.count_to; ``data.task: count_to`` (core.model.gpt.data) is
the supervised warm start in the same format.

``counting_held_out``: the validation set of the counting task (no ``rl.val_prompts`` file):
``count`` prompts keyed by (seed, a tag of their own, prompt), a stream of four words where
training's are three, so no training step draws from its stream. ``count_to_held_out``:
count_to's, keyed by (seed, that tag, prompt, 13) where its training prompts' are (seed, 13,
step, prompt). A seed stream of their own, not a set apart: over a small vocabulary (the
demos' 32 ids) the same prompts also come up in training; they are not guaranteed disjoint
from training's (a file task's ``rl.val_prompts`` are whatever the file holds).

``from_file``: the prompts of a file (core.data.prompts) in epochs: prompt ``i`` of step
``s`` is number ``g = s × count + i`` of the run; epoch ``g // n`` visits the ``n`` prompts
in its own order (a permutation keyed by (seed, epoch)), so every prompt is asked once per
epoch, and a resumed run asks exactly what the uninterrupted one did.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np


class Asked(NamedTuple):
    """One prompt of a step: its tokens (left-padded to the prompt length by ``pad`` tokens),
    its metadata for the reward."""

    tokens: tuple[int, ...]
    meta: dict[str, Any]
    pad: int = 0


def counting(seed: int, step: int, count: int, length: int, vocab: int) -> list[Asked]:
    """``count`` prompts of step ``step``, each with its metadata."""
    out = []
    for i in range(count):
        start = int(np.random.default_rng([seed, step, i]).integers(0, vocab))
        out.append(Asked(tuple((start + k) % vocab for k in range(length)), {"vocab_size": vocab, "index": i}))
    return out


def count_to_eot(vocab: int) -> int:
    """The ``count_to`` task's end-of-text id: the vocabulary's last."""
    return vocab - 1


def count_to(seed: int, step: int, count: int, length: int, max_response: int, vocab: int) -> list[Asked]:
    """``count`` prompts of step ``step``: ``T a a+1 ..`` (``length`` tokens), whose right
    answer is ``1 .. max_response - 1`` more numbers up to ``T`` and the end-of-text token
    (core.config.rl.check_task: ``length ≥ 2``, ``max_response ≥ 2``, ``vocab ≥ length + 1``)."""
    return [_count_to(np.random.default_rng([seed, 13, step, i]), i, length, max_response, vocab) for i in range(count)]


def count_to_held_out(seed: int, count: int, length: int, max_response: int, vocab: int) -> list[Asked]:
    """The ``count_to`` task's ``count`` validation prompts, from a seed stream of their own
    (not guaranteed disjoint from training's prompts)."""
    return [_count_to(np.random.default_rng([seed, HELD_OUT, i, 13]), i, length, max_response, vocab)
            for i in range(count)]


def _count_to(rng: np.random.Generator, index: int, length: int, max_response: int, vocab: int) -> Asked:
    eot = count_to_eot(vocab)
    most = min(max_response - 1, eot - length + 1)  # the target stays below the end-of-text id
    more = int(rng.integers(1, most + 1))  # numbers the answer adds before its end-of-text
    start = int(rng.integers(0, eot - length - more + 2))
    target = start + length - 2 + more
    return Asked((target, *range(start, start + length - 1)), {"target": target, "eot": eot, "index": index})


HELD_OUT = 0x76616C  # "val": the held-out prompts' key, never a training key (three words, or count_to's (seed, 13, ..))


def counting_held_out(seed: int, count: int, length: int, vocab: int) -> list[Asked]:
    """The counting task's ``count`` validation prompts: the same for every step of a run, from
    a seed stream of their own (not guaranteed disjoint from training's prompts)."""
    out = []
    for i in range(count):
        start = int(np.random.default_rng([seed, HELD_OUT, i, 1]).integers(0, vocab))
        out.append(Asked(tuple((start + k) % vocab for k in range(length)), {"vocab_size": vocab, "index": i}))
    return out


def held_out(prompts: Sequence[Any]) -> list[Asked]:
    """A validation file's prompts, each once, in the file's order; their metadata has the
    training prompts' keys (``index`` in the file, ``epoch`` 0), so one reward reads both."""
    return [Asked(tuple(p.tokens), {**p.meta, "index": i, "epoch": 0}, p.pad) for i, p in enumerate(prompts)]


def from_file(prompts: Sequence[Any], seed: int, step: int, count: int) -> list[Asked]:
    """``count`` prompts of step ``step`` from ``prompts`` (each with ``tokens``, ``meta``, ``pad``)."""
    n, out = len(prompts), []
    orders: dict[int, np.ndarray] = {}
    for i in range(count):
        g = step * count + i
        epoch = g // n
        if epoch not in orders:
            orders[epoch] = np.random.default_rng([seed, 7, epoch]).permutation(n)
        p = prompts[int(orders[epoch][g % n])]
        out.append(Asked(tuple(p.tokens), {**p.meta, "index": i, "epoch": epoch}, p.pad))
    return out
