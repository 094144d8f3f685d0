"""``GPTTask``: one worker process of a Megatron-core GPT run, composed of its roles.

The plan gives each rank the model roles it holds (``WorkerContext.roles[*].models``,
core.config.roles): a trainer rank the actor, with the reference (an RL program with
``rl.kl``), the critic (PPO) and a colocated generator's rollout; a split generator's
process the rollout alone. The task is their composition (core.model.gpt.roles): SETUP
joins the process's own group and sets every role up, the handler table is the union of
the roles', a checkpoint is the roles' items in order. ``close`` runs at shutdown.
``checkpoint_state`` / ``restore_state``, ``restore_weights`` and ``restore_reference`` are
not calls: ``core.checkpoint.service`` wraps them into the checkpoint calls (trainer ranks).

This module loads without torch and Megatron: the roles are imported when a task is built.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from core.config.run import RunConfig
from core.job.process import rss_mb
from core.wire import calls
from core.wire.contract import Handlers, Method
from core.worker.task import WorkerContext

log = logging.getLogger(__name__)

ReadFn = Callable[[str, tuple[int, ...], tuple[int, ...]], np.ndarray]


class GPTTask:
    """A Megatron-core GPT worker process: the calls the controller may make."""

    def __init__(self, ctx: WorkerContext) -> None:
        from core.model.gpt import roles  # torch and megatron: this module loads without them

        self.ctx = ctx
        self.rank = roles.Rank(ctx)  # what the roles share
        self.roles = roles.compose(self.rank)  # the plan's order: its own group's models first

    @property
    def cfg(self) -> RunConfig:
        """The run's config (its micro batch resolved once set up)."""
        return self.rank.cfg

    def role(self, model: str) -> Any:
        """The role that holds ``model`` (core.config.roles.ModelRole), None if none does."""
        return self.rank.models.get(model)

    def handlers(self) -> Mapping[Method[Any, Any], Callable[[Any], Any]]:
        table: Handlers = {calls.SETUP: self.setup}
        for role in self.roles:
            table.update(role.handlers())
        return table

    def setup(self, req: calls.Setup) -> calls.SetupInfo:
        """Join the process's group, build and bind every role's model; where this rank sits
        and what it holds (as its own group's first role answers)."""
        self.rank.join(req)
        for role in self.roles:
            role.build()
        for role in self.roles:
            role.start(req)
        info = self.roles[0].info()
        self.rank.set_up = True
        log.info("rank %d (%s: %s) set up: %s, rss %.0f MB", self.ctx.rank, self.ctx.role.name,
                 ", ".join(r.name for r in self.roles), info, rss_mb())
        return info

    def close(self) -> None:
        """End what the roles started, then tear down Megatron and the process group."""
        for role in self.roles:
            role.close()
        self.rank.close()

    # --- checkpoint hooks (core.checkpoint.service) ------------------------------------------------
    def bind_checkpoint_fence(self, fence: Callable[[], None]) -> None:
        """``fence`` runs before every change of the exported state: an optimizer step, a
        weights load (a checkpoint load is fenced by CheckpointService.load itself)."""
        self.rank.fence = fence

    def checkpoint_state(self) -> tuple[list[tuple[Any, Any]], dict[str, Any]]:
        """Every role's slices (live: read until the next update) and blobs (collective over
        DP with the distributed optimizer)."""
        items: list[tuple[Any, Any]] = []
        blobs: dict[str, Any] = {}
        for role in self.roles:
            more, extra = role.export()
            items += more
            blobs.update(extra)
        return items, blobs

    def restore_state(self, read: ReadFn, blobs: dict[str, Any]) -> None:
        """Every role's slices of a checkpoint, in this rank's layout."""
        for role in self.roles:
            role.restore(read, blobs)

    def restore_weights(self, read: ReadFn) -> None:
        """Only the actor's model weights of a checkpoint (any layout), its optimizer's main
        weights from them: ``init_from``."""
        self.role("actor").load_weights(read)

    def restore_reference(self, read: ReadFn) -> None:
        """The reference policy from a checkpoint's model weights (any layout; CKPT_LOAD with
        ``into="reference"``)."""
        self.rank.ready()
        if self.role("reference") is None:
            raise RuntimeError(f"rank {self.ctx.rank}: this run has no reference policy (rl.kl is off)")
        self.role("reference").load(read)

    def _ready(self) -> Any:
        """The actor's StepContext (core.model.gpt.step) once set up."""
        return self.rank.ready()
