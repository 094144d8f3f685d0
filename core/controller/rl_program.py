"""One GRPO iteration as the controller runs it (``program: grpo``, core.spec.rl).

    the generator holds the policy of this step (synced if not) → prompts of the step
    (core.rl.tasks) × n → rollout on the generator group → rewards on the controller
    (core.rl.rewards) → group-normalised advantages (core.rl.advantages) → ``ppo_epochs``
    actor updates (POLICY_STEP, each data replica its share of the responses; the rollout's
    log-probs are the old policy's) → the step's numbers for metrics.jsonl.

Everything a step draws is keyed by (seed, step): prompts, and the sampling of each
response (seed, step, response index). A run resumed at step k asks and samples exactly
what the uninterrupted run did at step k, from the restored policy (the generator is
re-synced after every load).
"""
from __future__ import annotations

import statistics
from typing import Any

from core.controller.generation import GeneratorFlow
from core.controller.group import WorkerGroup
from core.flows import calls as gen_calls
from core.rl import advantages, rewards, tasks
from core.spec.config import RunConfig


class GRPOStep:
    def __init__(self, cfg: RunConfig, group: WorkerGroup, generator: GeneratorFlow) -> None:
        self.cfg, self.group, self.generator = cfg, group, generator
        self.reward = rewards.load(cfg.rl.reward, "rl.reward")

    def run(self, step: int) -> tuple[list[gen_calls.PolicyResult], dict[str, Any]]:
        """One iteration at policy version ``step``: the last epoch's results by rank, and the
        step's RL numbers."""
        cfg, rl = self.cfg, self.cfg.rl
        extra: dict[str, Any] = {}
        if self.generator.version != step:
            extra["sync_logprob_maxdiff"] = self.generator.sync(step)
        asked = tasks.counting(cfg.seed, step, rl.prompts_per_step, rl.prompt_length, cfg.model.vocab_size)
        prompts = [p for p, _ in asked for _ in range(rl.n)]
        done = self.generator.rollout(gen_calls.Generate(
            prompts=tuple(prompts), max_new_tokens=rl.max_response_length, temperature=rl.temperature,
            top_k=rl.top_k, top_p=rl.top_p, seed=(cfg.seed * 7919 + step) * 1009 + 7))
        scores = [rewards.score(self.reward, prompts[i], done[i][0], asked[i // rl.n][1], index=i // rl.n)
                  for i in range(len(prompts))]
        adv = advantages.grpo(scores, [i // rl.n for i in range(len(prompts))], norm_by_std=rl.norm_adv_by_std)
        rows = [(prompts[i] + done[i][0], (float(adv[i]),) * len(done[i][0]), done[i][1]) for i in range(len(prompts))]
        results: list[gen_calls.PolicyResult] = []
        for _ in range(rl.ppo_epochs):
            answers = self.group.call(gen_calls.POLICY_STEP, None, timeout_s=cfg.timeouts.step_s,
                                      dispatch=lambda _req, _n: {r: self._share(step, rows, r)
                                                                 for r in range(self.group.dims.world_size)},
                                      collect=lambda res, _: res)
            results = [answers[r] for r in sorted(answers)]
        owners = [results[r] for r in self.group.dims.loss_owners()]
        extra.update(reward_mean=statistics.fmean(scores), reward_std=statistics.pstdev(scores),
                     response_length=statistics.fmean(len(d[0]) for d in done), policy_version=step,
                     clip_frac=statistics.fmean(o.clip_frac or 0.0 for o in owners))
        return results, extra

    def _share(self, step: int, rows: list[tuple[Any, Any, Any]], rank: int) -> gen_calls.PolicyBatch:
        """Rank ``rank``'s data replica's rows: every dp-th, from the replica's index on."""
        dp = self.group.dims.dp
        mine = rows[self.group.dims.coords(rank).dp::dp]
        return gen_calls.PolicyBatch(step=step, prompt_length=self.cfg.rl.prompt_length,
                                     sequences=tuple(tuple(r[0]) for r in mine),
                                     advantages=tuple(r[1] for r in mine), old_logprobs=tuple(r[2] for r in mine))
