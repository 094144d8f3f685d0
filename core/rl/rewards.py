"""Rewards: built-in rule rewards, or the user's ``module:function``, and how one is loaded and scored.

A reward function takes ``(prompt, response, metadata)``, where ``prompt`` and ``response``
are token-id tuples and ``metadata`` the prompt's own fields (its JSONL row, the task's
answer), and returns a number: a float, an int, or a bool (``return pred == truth``: 1.0 or
0.0; numpy's scalars too). It runs in the controller's reward processes
(core.rl.reward_pool), once per response. ``response``
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
- ``math``: for a file task: 1.0 when the response's answer (its last ``\\boxed{}``, else
  the last expression math-verify finds in it) equals the record's ground truth
  mathematically (``1/2``, ``0.5`` and ``\\frac{1}{2}`` are one answer), else 0.0
  (core.rl.math_reward, Hugging Face's math-verify).

A reward module that cannot be imported (not found, a syntax error, an exception while it
runs) or names no function is a ``ConfigError`` naming ``rl.reward`` and the cause. A reward
that raises is a user error (``RewardError``) naming the reward and the prompt (the step
fails, not retried, exit 2); one that returns a non-finite number or a non-number (None, a
string) is refused the same way.
"""
from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.errors import ConfigError, RewardError

RewardFn = Callable[[Sequence[int], Sequence[int], Mapping[str, Any]], float]


@dataclass(frozen=True)
class Sample:
    """One response to score: its prompt's ids, its ids, the prompt's metadata (with
    ``response_text`` for a file task), and the prompt's index in the step (for messages)."""

    prompt: tuple[int, ...]
    response: tuple[int, ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    index: int = 0


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


def math_answer(prompt: Sequence[int], response: Sequence[int], metadata: Mapping[str, Any]) -> float:
    """``rl.reward: math``: 1.0 when the response's answer equals the record's ground truth."""
    from core.rl import math_reward  # math-verify and sympy: loaded only where the math reward runs

    return math_reward.score(metadata)


BUILTIN: dict[str, RewardFn] = {"counting": counting, "count_to": count_to, "exact_match": exact_match,
                                "math": math_answer}


def load(spec: str, key: str = "reward") -> RewardFn:
    """A built-in name, or ``package.module:function`` importable here (the controller's
    reward processes, the submit's check); every failure a one-line ConfigError naming ``key``."""
    if spec == "math":
        from core.rl import math_reward  # math-verify: imported to check it is installed, only for this reward

        math_reward.check_installed(key)
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}: {spec!r} is neither a built-in reward ({', '.join(sorted(BUILTIN))}) nor "
                          "'module:function'; name one of those")
    module = _import(module_name, key)
    if not hasattr(module, attr):
        raise ConfigError(f"{key}: {module_name} ({getattr(module, '__file__', '?')}) has no function {attr!r}; "
                          "give module:function")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ConfigError(f"{key}: {module_name}:{attr} is a {type(fn).__name__}, not a function; "
                          "give module:function")
    return fn  # type: ignore[no-any-return]


def _import(module_name: str, key: str) -> Any:
    """The user's reward module; why it cannot be imported, as a one-line ConfigError."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigError(f"{key}: cannot find module {module_name!r}; put the folder that holds it on "
                              "PYTHONPATH (on Slurm the controller runs in the run folder, not where you submit)") from None
        raise ConfigError(f"{key}: importing {module_name!r} failed: {one_line(exc)}; install what it "
                          "imports or fix the module") from None
    except SyntaxError as exc:
        raise ConfigError(f"{key}: {module_name!r} does not compile: {exc.msg} ({exc.filename}, line {exc.lineno}); "
                          "fix the module") from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's module: whatever it raises is theirs
        raise ConfigError(f"{key}: importing {module_name!r} raised {one_line(exc)}; fix the module") from None


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (a message's newlines folded)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def describe(sample: Sample) -> str:
    """The prompt of a message: its index, its text (a file task's) or its first ids."""
    text = sample.metadata.get("prompt_text")
    if isinstance(text, str):
        return f"prompt {sample.index} ({text[:80]!r}{'...' if len(text) > 80 else ''})"
    return f"prompt {sample.index} ({list(sample.prompt)[:16]})"


def name_of(fn: RewardFn) -> str:
    """``module:function`` of a reward function."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def score(fn: RewardFn, prompt: Sequence[int], response: Sequence[int], metadata: Mapping[str, Any],
          *, index: int, name: str | None = None) -> float:
    """``fn`` on one response; anything but a finite number is a user error naming the prompt."""
    name = name or name_of(fn)
    where = describe(Sample(tuple(prompt), tuple(response), dict(metadata), index))
    try:
        value = fn(tuple(prompt), tuple(response), metadata)
    except Exception as exc:  # noqa: BLE001 - the user's code: any failure is theirs, reported as such
        raise RewardError(f"rl.reward: {name} raised {one_line(exc)} on {where}; fix the reward function") from exc
    if isinstance(value, (bool, np.bool_)):  # ``return pred == truth``
        return 1.0 if value else 0.0
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RewardError(f"rl.reward: {name} returned {value!r} on {where}: a reward must be a finite number "
                          "(or a bool)")
    return float(value)
