"""Held-out validation of a GRPO or PPO run (``rl.val_every``, ``rl.val_prompts``).

After every ``rl.val_every`` RL steps, and after the last step, the policy of that moment
(the generator synced to it: the next RL step would sync it anyway) answers the held-out
prompts twice: greedily, and sampled at ``rl.temperature`` / ``top_k`` / ``top_p``. The
reward scores every response as it scores the training ones (``RLStep.rewards``); the
step's record gets the means, ``val_reward_mean`` (greedy) and ``val_reward_mean_sampled``,
and samples.jsonl one row per response (``split: "val"``): step and policy version, kind,
prompt, tokens, log-probs, reward, and a file task's ``text``.

The held-out prompts: every record of ``rl.val_prompts`` (a file task), else the built-in
task's own held-out set (core.rl.tasks.counting_held_out, count_to_held_out:
``rl.prompts_per_step`` prompts from a seed stream of their own, not guaranteed disjoint
from training's prompts). Nothing here draws from the training's streams: the
prompts are fixed for the run and each sampled response samples from a generator of its own,
keyed by (seed, step, prompt), so a validation changes no training number and a resumed run
validates to the same numbers.
"""
from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from core.config.run import RunConfig
from core.controller.generation import GeneratorFlow
from core.flows import calls as gen_calls
from core.rl import tasks
from core.wire.ragged import TOKENS, Ragged

Response = tuple[tuple[int, ...], tuple[float, ...]]  # a response's tokens (up to its stop token), log-probs
# the reward of every response: (the prompt each answers, the responses) -> scores
ScoreFn = Callable[[Sequence[tasks.Asked], Sequence[tuple[int, ...]]], list[float]]
Texter = Callable[[tuple[int, ...]], dict[str, str]]  # a response's text for samples.jsonl (a file task's)
KINDS = ("greedy", "sampled")


class Validation:
    def __init__(self, cfg: RunConfig, generator: GeneratorFlow, held_out: list[tasks.Asked], *, score: ScoreFn,
                 text: Texter, stop: tuple[int, ...]) -> None:
        self.cfg, self.generator, self.held_out = cfg, generator, held_out
        self.score, self.text, self.stop = score, text, stop  # a response ends after its first stop token

    def due(self, done: int) -> bool:
        """Whether the policy after ``done`` steps is validated."""
        return self.cfg.rl.validates(done, self.cfg.trainer.steps)

    def run(self, done: int) -> dict[str, float]:
        """The policy after ``done`` steps on the held-out prompts: the record's fields;
        every response appended to samples.jsonl."""
        if self.generator.version != done:
            self.generator.sync(done, probe=False)
        rows: list[dict[str, Any]] = []
        means: dict[str, float] = {}
        for kind in KINDS:
            responses = self._answer(done, greedy=kind == "greedy")
            scores = self.score(self.held_out, [r[0] for r in responses])
            means[kind] = statistics.fmean(scores)
            rows += [{"step": done, "version": self.generator.version, "split": "val", "kind": kind, "index": i,
                      "prompt": list(a.tokens), "tokens": list(r[0]), "logprobs": [round(x, 6) for x in r[1]],
                      "reward": s, **self.text(r[0])}
                     for i, (a, r, s) in enumerate(zip(self.held_out, responses, scores, strict=True))]
        with self.generator.run.samples.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        return {"val_reward_mean": means["greedy"], "val_reward_mean_sampled": means["sampled"]}

    def _answer(self, done: int, *, greedy: bool) -> list[Response]:
        """Every held-out prompt answered once, in chunks of a training rollout's size (what
        the generator already holds in memory); a chunk samples with a seed of its own."""
        cfg, rl = self.cfg, self.cfg.rl
        size = rl.prompts_per_step * rl.n
        out: list[Response] = []
        for chunk, first in enumerate(range(0, len(self.held_out), size)):
            part = self.held_out[first:first + size]
            seed = (((cfg.seed * 7919 + done) * 1009 + 503) * 65537 + chunk) % 2**62
            answered = self.generator.rollout(gen_calls.Generate(
                prompts=Ragged.of([a.tokens for a in part], TOKENS), max_new_tokens=rl.max_response_length,
                temperature=0.0 if greedy else rl.temperature, top_k=rl.top_k, top_p=rl.top_p, eos=self.stop,
                seed=seed, pads=tuple(a.pad for a in part))).until(self.stop)
            out += zip(answered.tokens.tolist(), answered.logprobs.tolist(), strict=True)
        return out
