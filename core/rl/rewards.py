"""Rewards, scored on the controller: built-in rule rewards, or the user's ``module:function``.

A reward function takes ``(prompt, response, metadata)``, where ``prompt`` and ``response``
are token-id tuples and ``metadata`` the prompt's own fields (its JSONL row, the task's
answer), and returns a float. It runs on the controller, once per response. ``response``
ends with the stop token that ended it (``rl.stop``; none when it ran to
``rl.max_response_length``); a file task's metadata adds ``prompt_text`` and
``response_text``, the response's text *before* its stop token (special tokens skipped):
text after a stop token never reaches the reward.

Built in:

- ``counting``: the prompt counts up by one (``5 6 7 8``, modulo the vocabulary); 1.0 when
  the whole response counts on (``9 10 11 ...``), else 0.0. Exact match: partial credit
  would also reward the wrong tokens after a response's first miss, and teach them. A
  supervised warm start on ``data.task: increment`` learns the same rule.
- ``count_to``: for ``rl.task: count_to`` (prompt ``T a a+1 ..``): 1.0 when the response
  counts on from the prompt's last number up to the target ``T`` and then ends with the
  end-of-text token (the whole response, its end included), else 0.0. Exact for the same
  reason as ``counting``; a response that stops early, overshoots or never stops scores 0.
- ``exact_match``: for a file task whose records carry an ``answer``: 1.0 when the
  response's text (before its stop token), stripped of surrounding whitespace, is the
  answer's text, else 0.0.

A user reward that raises is a user error (``RewardError``) naming the reward and the prompt
(the step fails, not retried, exit 2);
one that returns a non-finite number or a non-number is refused the same way.
"""
from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from core.errors import ConfigError, RewardError

RewardFn = Callable[[Sequence[int], Sequence[int], Mapping[str, Any]], float]


def counting(prompt: Sequence[int], response: Sequence[int], metadata: Mapping[str, Any]) -> float:
    """1.0 when every response token continues the prompt's count, else 0.0."""
    vocab = int(metadata.get("vocab_size", 0)) or None
    if not prompt or not response:
        return 0.0
    start = int(prompt[-1])
    want = [(start + k) if vocab is None else (start + k) % vocab for k in range(1, len(response) + 1)]
    return 1.0 if [int(t) for t in response] == want else 0.0


def count_to(prompt: Sequence[int], response: Sequence[int], metadata: Mapping[str, Any]) -> float:
    """1.0 when the response is the count from the prompt's last number up to ``target``, then
    ``eot`` (core.rl.tasks.count_to's metadata), else 0.0."""
    if "target" not in metadata or "eot" not in metadata:
        raise KeyError("count_to needs rl.task: count_to (its prompts carry the target and the end-of-text id)")
    if not prompt:
        return 0.0
    want = [*range(int(prompt[-1]) + 1, int(metadata["target"]) + 1), int(metadata["eot"])]
    return 1.0 if [int(t) for t in response] == want else 0.0


def exact_match(prompt: Sequence[int], response: Sequence[int], metadata: Mapping[str, Any]) -> float:
    """1.0 when the response's text, stripped, is the record's ``answer``, else 0.0."""
    if "answer" not in metadata or "response_text" not in metadata:
        raise KeyError("exact_match needs a file task (rl.task: file) whose records have an 'answer' field")
    return 1.0 if str(metadata["response_text"]).strip() == str(metadata["answer"]).strip() else 0.0


BUILTIN: dict[str, RewardFn] = {"counting": counting, "count_to": count_to, "exact_match": exact_match}


def load(spec: str, key: str = "reward") -> RewardFn:
    """A built-in name, or ``package.module:function`` importable on the controller."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}: {spec!r} is neither a built-in reward ({', '.join(sorted(BUILTIN))}) nor "
                          "'module:function'; name one of those")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import {module_name!r} ({exc}); put it on PYTHONPATH "
                          "or in the folder you submit from") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}: {module_name} has no function {attr!r}; give module:function")
    return fn


def score(fn: RewardFn, prompt: Sequence[int], response: Sequence[int], metadata: Mapping[str, Any],
          *, index: int) -> float:
    """``fn`` on one response; anything but a finite number is a user error naming the prompt."""
    name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    try:
        value = fn(tuple(prompt), tuple(response), metadata)
    except Exception as exc:  # noqa: BLE001 - the user's code: any failure is theirs, reported as such
        raise RewardError(f"rl.reward: {name} raised {type(exc).__name__}: {exc} on prompt {index} "
                          f"({list(prompt)[:16]}); fix the reward function") from exc
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardError(f"rl.reward: {name} returned {value!r} on prompt {index}: a reward must be a finite number")
    return float(value)
