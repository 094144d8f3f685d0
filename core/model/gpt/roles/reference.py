"""The reference policy (an RL program with ``rl.kl``): a frozen copy of the actor's model.

Built in the actor's layout and precision with no gradients and no optimizer
(core.model.gpt.build.frozen). Its weights are a checkpoint's model weights, loaded by
CKPT_LOAD into reference (``load``) at the RL phase's first step of every allocation; it
is not part of the run's state, so it declares no checkpoint items. It serves no call of
its own: SCORE_ROWS with ``model: reference`` (the actor's handler) scores it.
"""
from __future__ import annotations

from typing import Any

from core.config.roles import RolePlan
from core.model.gpt import build
from core.model.gpt.roles.base import Rank, ReadFn, Role
from core.model.gpt.state import load_model_slices


class ReferenceRole(Role):
    name = "reference"

    def __init__(self, rank: Rank, plan: RolePlan) -> None:
        super().__init__(rank, plan)
        self.chunks: list[Any] = []
        self.loaded = False

    def build(self) -> None:
        self.chunks = [build.frozen(self.rank.cfg, on_cuda=self.rank.on_cuda)]

    def scored(self) -> list[Any]:
        if not self.loaded:
            raise RuntimeError(f"rank {self.rank.ctx.rank}: the reference policy was asked for before it was loaded")
        return self.chunks

    def load(self, read: ReadFn) -> None:
        """A checkpoint's model weights (any layout); its optimizer state is not read."""
        self.rank.ready()
        load_model_slices(self.chunks, read)
        self.loaded = True
