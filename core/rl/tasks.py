"""Prompt sources of the built-in RL tasks, keyed by (seed, step, prompt): a resumed run asks
the same prompts at the same step, and no prompt is seen twice or skipped (the cursor is
the step).

``counting``: ``prompt_length`` consecutive ids from a random start, modulo the vocabulary
(``5 6 7 8``); its reward (core.rl.rewards.counting) is how far a response counts on.

``from_file``: the prompts of a file (core.data.prompts) in epochs: prompt ``i`` of step
``s`` is number ``g = s × count + i`` of the run; epoch ``g // n`` visits the ``n`` prompts
in its own order (a permutation keyed by (seed, epoch)), so every prompt is asked once per
epoch, and a resumed run asks exactly what the uninterrupted one did.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def counting(seed: int, step: int, count: int, length: int, vocab: int) -> list[tuple[tuple[int, ...], dict[str, Any]]]:
    """``count`` prompts of step ``step``, each with its metadata."""
    out = []
    for i in range(count):
        start = int(np.random.default_rng([seed, step, i]).integers(0, vocab))
        out.append((tuple((start + k) % vocab for k in range(length)), {"vocab_size": vocab, "index": i}))
    return out


def from_file(prompts: Sequence[Any], seed: int, step: int, count: int) -> list[tuple[tuple[int, ...], dict[str, Any]]]:
    """``count`` prompts of step ``step`` from ``prompts`` (each with ``tokens`` and ``meta``)."""
    n, out = len(prompts), []
    orders: dict[int, np.ndarray] = {}
    for i in range(count):
        g = step * count + i
        epoch = g // n
        if epoch not in orders:
            orders[epoch] = np.random.default_rng([seed, 7, epoch]).permutation(n)
        p = prompts[int(orders[epoch][g % n])]
        out.append((tuple(p.tokens), {**p.meta, "index": i, "epoch": epoch}))
    return out
