"""``rl.reward: math``: a response's answer checked against the record's ground truth with
Hugging Face's math-verify (its only home; imported only when the math reward is used).

The ground truth is the record's ``answer`` field, else ``ground_truth``, else verl's
``reward_model.ground_truth``; an expression (``0.5``, ``\\frac{1}{2}``, ``x^2+1``), read as
if boxed, or text that marks its answer itself (``$...$``, ``\\boxed{}``). The response's answer
is what math-verify extracts from ``response_text`` (its last ``\\boxed{}`` first, else LaTeX
between ``$``, else a plain expression). 1.0 when they are equal as math-verify compares them
(numbers, fractions and decimals, symbolic expressions, intervals, sets), else 0.0; a
response with no answer it can read scores 0.0.

math-verify bounds each parse and comparison with ``signal.alarm``, which works only in a
process's main thread: the reward processes (core.rl.reward_pool) call rewards in their main
thread, so its bounds hold there (a pathological expression scores 0.0 rather than failing
the step); called from another thread its bounds are off (a signal there would raise, and
math-verify would turn that into a silent 0.0), and ``rl.reward_timeout_s`` alone bounds it.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from core.errors import ConfigError

try:
    from math_verify import parse, verify
except ImportError:  # the check below names the fix
    parse = verify = None  # type: ignore[assignment]

PARSE_TIMEOUT_S = 5  # math-verify's own bound on one parse or comparison (its default)


def check_installed(key: str = "rl.reward") -> None:
    """A ConfigError naming ``key`` when math-verify is not installed."""
    if parse is None:
        raise ConfigError(f"{key}: math needs Hugging Face's math-verify, which is not installed; "
                          "pip install math-verify")


def ground_truth(metadata: Mapping[str, Any]) -> str:
    """The record's ground truth: ``answer``, ``ground_truth`` or ``reward_model.ground_truth``."""
    for key in ("answer", "ground_truth"):
        if metadata.get(key) is not None:
            return str(metadata[key])
    model = metadata.get("reward_model")
    if isinstance(model, Mapping) and model.get("ground_truth") is not None:
        return str(model["ground_truth"])
    raise KeyError("math needs records with an 'answer' field (or 'ground_truth', or verl's "
                   "reward_model.ground_truth)")


def score(metadata: Mapping[str, Any]) -> float:
    """1.0 when ``metadata``'s ``response_text`` answers its ground truth, else 0.0."""
    check_installed()
    if "response_text" not in metadata:
        raise KeyError("math needs a file task (rl.task: file): it reads the response's text")
    truth = ground_truth(metadata).strip()
    bound = PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    marked = "$" in truth or "\\boxed" in truth
    gold = parse(truth if marked else f"\\boxed{{{truth}}}", parsing_timeout=bound)
    if not gold and not marked:
        gold = parse(truth, parsing_timeout=bound)
    if not gold:
        raise ValueError(f"math-verify reads no answer in the ground truth {truth!r}; fix the record")
    answer = parse(str(metadata["response_text"]), parsing_timeout=bound)
    return 1.0 if answer and verify(gold, answer, timeout_seconds=bound) else 0.0
