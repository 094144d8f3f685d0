"""Prompt sources of the built-in RL tasks, keyed by (seed, step, prompt): a resumed run asks
the same prompts at the same step, and no prompt is seen twice or skipped (the cursor is
the step).

``counting``: ``prompt_length`` consecutive ids from a random start, modulo the vocabulary
(``5 6 7 8``); its reward (core.rl.rewards.counting) is how far a response counts on.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def counting(seed: int, step: int, count: int, length: int, vocab: int) -> list[tuple[tuple[int, ...], dict[str, Any]]]:
    """``count`` prompts of step ``step``, each with its metadata."""
    out = []
    for i in range(count):
        start = int(np.random.default_rng([seed, step, i]).integers(0, vocab))
        out.append((tuple((start + k) % vocab for k in range(length)), {"vocab_size": vocab, "index": i}))
    return out
