"""What the roles of one worker process share (``Rank``) and what a role declares (``Role``).

A role builds its model(s) at SETUP, in two phases over every role of the process: ``build``
in the plan's order of models (actor, reference, critic), while the RNG is still seeded
from the run's seed (Megatron's set-up seeds it: the initial weights are the run's in every
layout), then ``start`` (the actor seeds this rank's training streams, resolves the micro
batch and binds the data; the others bind to it, a colocated rollout builds its model). It lists the
calls it serves (``handlers``), answers SETUP when it is its process's first role
(``info``) and names its checkpoint items (``export`` / ``restore``).

The roles of a process share one ``Rank``: the run's config (its micro batch resolved at
SETUP), the device, the checkpoint fence, the actor's ``StepContext`` once built (data,
coordinates and layout the other roles follow) and the process's one end of weight syncs
(``WeightLink``: the actor's slices it sends, the rollout's it receives).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch

from core.config import run as config_mod
from core.config.roles import RolePlan, plan_roles
from core.errors import ConfigError, LayoutError
from core.flows import calls as gen_calls
from core.model.gpt.rollout import WeightLink
from core.model.gpt.step import StepContext
from core.parallel import cpu_shim
from core.parallel.megatron import destroy_megatron, init_megatron
from core.wire import calls
from core.wire.contract import Handlers
from core.worker.task import WorkerContext

log = logging.getLogger(__name__)

ReadFn = Callable[[str, tuple[int, ...], tuple[int, ...]], np.ndarray]
Items = list[tuple[Any, Any]]  # (TensorSlice, np.ndarray | LiveArray), core.checkpoint.service's


class Rank:
    """This worker process as its roles see it."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.config
        self.on_cuda = False
        self.fence: Callable[[], None] = lambda: None  # core.checkpoint.service's, once bound
        self.step: StepContext | None = None  # the actor's, once it has started
        self.link = WeightLink(ctx.rank, trainer_chunks=None, model=None)  # the roles fill its ends
        self.models: dict[str, Role] = {}  # model role → the process's role (core.model.gpt.roles.compose)
        self.set_up = False

    def join(self, req: calls.Setup) -> None:
        """Check the controller's config and the run's size; join the process's own group:
        torch.distributed and Megatron's parallel state in its layout, at its rank there."""
        cfg, ctx = self.cfg, self.ctx
        if req.config_hash and req.config_hash != config_mod.config_hash(cfg):
            raise ConfigError(f"{ctx.run_dir / 'config.yaml'}: changed since the controller read it "
                              f"(hash {config_mod.config_hash(cfg)}, controller {req.config_hash}); resume the run "
                              "again with `baton submit --resume`")
        if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"trainer.device: 'cuda' but rank {ctx.rank} on {ctx.host} sees no GPU; "
                              "use trainer.device=auto or cpu")
        groups = [g for g in plan_roles(cfg) if g.own_processes]
        if sum(g.world_size for g in groups) != ctx.world_size:
            raise LayoutError(f"config describes {sum(g.world_size for g in groups)} workers ("
                              f"{' and '.join(f'{g.name} {g.dims.describe()}' for g in groups)}) but this group has "
                              f"{ctx.world_size}")
        self.on_cuda = cfg.trainer.device != "cpu" and torch.cuda.is_available()
        if not self.on_cuda:
            cpu_shim.activate_if_needed()
        own = ctx.role
        init_megatron(own.dims, rank=own.local(ctx.rank), world_size=own.world_size, master_addr=req.master_addr,
                      master_port=req.master_port, backend=self.backend, seed=cfg.seed,
                      timeout_s=cfg.timeouts.setup_s)

    @property
    def backend(self) -> str:
        return "nccl" if self.on_cuda else "gloo"

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.on_cuda else torch.device("cpu")

    def ready(self) -> StepContext:
        """The actor's StepContext; a call before SETUP is refused."""
        if self.step is None:
            raise RuntimeError(f"rank {self.ctx.rank}: call setup before any other method")
        return self.step

    def linked(self) -> WeightLink:
        if not self.set_up:
            raise RuntimeError(f"rank {self.ctx.rank}: call setup before any other method")
        return self.link

    def link_handlers(self) -> Handlers:
        """The calls of the process's end of weight syncs (its actor's and its rollout's)."""
        table: Handlers = {
            gen_calls.GEN_SLICES: lambda _: self.linked().held(),
            gen_calls.SYNC_WEIGHTS: lambda req: self.linked().sync(req),
        }
        if self.cfg.generator.split:  # the trainer's and the generator's processes, bridged
            table[gen_calls.BRIDGE] = lambda req: self.linked().join(req, backend=self.backend,
                                                                     timeout_s=self.cfg.timeouts.setup_s)
        return table

    def close(self) -> None:
        """Tear down Megatron and the process group."""
        if self.set_up:
            destroy_megatron()
            self.set_up, self.step = False, None


class Role:
    """One model role of a worker process (``core.config.roles.ModelRole``); by default it
    serves nothing and holds nothing a checkpoint needs."""

    name: ClassVar[str]

    def __init__(self, rank: Rank, plan: RolePlan) -> None:
        self.rank, self.plan = rank, plan  # plan: the group this role's model is laid out in

    def build(self) -> None:
        """Its model(s), before the training streams are seeded."""

    def start(self, req: calls.Setup) -> None:
        """What follows every role's build: streams, micro batch, data, bindings to the actor."""

    def handlers(self) -> Handlers:
        return {}

    def info(self) -> calls.SetupInfo:
        """SETUP's answer, from the process's first role: where this rank sits, what it holds."""
        raise NotImplementedError(f"the {self.name} role is never a process's first")

    def scored(self) -> list[Any]:
        """The model chunks SCORE_ROWS runs for this role."""
        raise RuntimeError(f"rank {self.rank.ctx.rank}: the {self.name} model cannot be scored")

    def export(self) -> tuple[Items, dict[str, Any]]:
        """This rank's checkpoint items of this role and its blobs."""
        return [], {}

    def close(self) -> None:
        """What the role started (an engine's processes) ends with the process."""

    def restore(self, read: ReadFn, blobs: dict[str, Any]) -> None:
        """Its items of a checkpoint, in this rank's layout."""
