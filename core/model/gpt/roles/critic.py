"""PPO's critic: the value model (core.model.gpt.critic) on every trainer rank, in the actor's layout.

Built as the actor is (Megatron's DDP model and optimizer, its own) with its vocabulary
output layer replaced by the value head; at ``start`` it takes the actor's StepContext
with its own model and optimizer. Calls: CRITIC_STEP (one update on the clipped value
loss) and CRITIC_INIT (its transformer := the actor's, at the RL phase's first step);
SCORE_ROWS with ``model: critic`` scores it. Checkpoint items: its model and optimizer
under ``critic.`` names and the ``critic`` blob; a checkpoint without them is refused.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from core.config.roles import RolePlan
from core.errors import CheckpointError
from core.job.process import rss_mb
from core.model.gpt import build, critic
from core.model.gpt.roles.base import Items, Rank, ReadFn, Role
from core.wire import calls, rl_calls
from core.wire.contract import Handlers


class CriticRole(Role):
    name = "critic"

    def __init__(self, rank: Rank, plan: RolePlan) -> None:
        super().__init__(rank, plan)
        self.chunks: list[Any] = []
        self.optimizer: Any = None
        self.ctx: Any = None  # core.model.gpt.step.StepContext: the actor's, with this model and optimizer

    def build(self) -> None:
        # Never tied: the value head replaces the output layer, so there is no vocabulary
        # projection to share with the embedding (Megatron would tie the head to it).
        cfg = dataclasses.replace(self.rank.cfg, model=dataclasses.replace(self.rank.cfg.model, tie_embeddings=False))
        _, self.chunks, self.optimizer = build.trained(cfg, on_cuda=self.rank.on_cuda, rank=self.rank.ctx.rank,
                                                       head=lambda gpt: critic.attach_head(gpt, seed=cfg.seed))

    def start(self, req: calls.Setup) -> None:
        self.ctx = dataclasses.replace(self.rank.ready(), model_chunks=self.chunks, optimizer=self.optimizer)

    def handlers(self) -> Handlers:
        return {rl_calls.CRITIC_STEP: self.critic_step, rl_calls.CRITIC_INIT: self.critic_init}

    def scored(self) -> list[Any]:
        return self.chunks

    def critic_step(self, req: rl_calls.CriticBatch) -> rl_calls.CriticResult:
        """One critic update on this replica's share of a rollout."""
        self.rank.ready()
        return rl_calls.CriticResult(rss_mb=rss_mb(), **critic.critic_step(self.ctx, req, before_update=self.rank.fence))

    def critic_init(self, _req: Any) -> None:
        """The critic's transformer := the actor's (the first RL step)."""
        self.rank.fence()
        critic.copy_from_actor(self.rank.ready().model_chunks, self.chunks, self.optimizer)

    def export(self) -> tuple[Items, dict[str, Any]]:
        items, blob = critic.export(self.chunks, self.optimizer)
        return items, {"critic": blob}

    def restore(self, read: ReadFn, blobs: dict[str, Any]) -> None:
        if "critic" not in blobs:
            raise CheckpointError("the checkpoint holds no critic (it was not saved by a program: ppo run); "
                                  "start the PPO run from it with init_from instead")
        critic.restore(self.chunks, self.optimizer, read, blobs["critic"])
