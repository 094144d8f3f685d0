"""The run's worker groups ("roles") as the plan lays them out: which ranks, which layout.

A run's workers are one rank space. The trainer's group holds ranks ``0 .. trainer - 1``;
a generator placed ``split`` holds the ranks after them, in processes of its own (on Slurm
the job's third component); a generator placed ``colocated`` lives in the trainer's
processes, on the same ranks, with process groups of its own. Each group is one
``RolePlan``; ``core.config.runplan.RunPlan.roles`` carries them into plan.json, and every
reader (the controller's role groups, each worker, the local supervisor, the Slurm job
spec) takes ranks from there. This module is the only code that derives them.

``models``: what the group's ranks hold, the model roles the worker composes its task
from (``core.model.gpt.roles``): ``actor`` (the trained policy: the only model of a
pretraining or SFT run), ``reference`` (an RL program with a KL term), ``critic`` (PPO),
``rollout`` (a generator's model), ``toy`` (the numpy test model).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from core.config.dims import ParallelDims
from core.config.rl import RL_PROGRAMS
from core.config.run import RunConfig

RoleName = Literal["trainer", "generator"]
Placement = Literal["own", "colocated", "split"]  # own: the trainer's; colocated: in another's processes
ModelRole = Literal["actor", "reference", "critic", "rollout", "toy"]
WORKERS_COMPONENT = 1  # the het job's component of the trainer's workers (0 is the controller)
GENERATOR_COMPONENT = 2  # a split generator's


@dataclass(frozen=True, kw_only=True)
class RolePlan:
    """One worker group: its ranks ``first_rank .. first_rank + world_size - 1`` of the run."""

    name: RoleName
    first_rank: int
    dims: ParallelDims  # its layout over its own ranks (0-based within the group)
    placement: Placement
    component: int  # the Slurm het-job component its processes run in
    nodes: int  # nodes its processes span (colocated: its host's)
    models: tuple[ModelRole, ...]

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def ranks(self) -> range:
        """The run ranks of this group, in group order."""
        return range(self.first_rank, self.first_rank + self.dims.world_size)

    @property
    def own_processes(self) -> bool:
        """Its ranks are processes of its own (not hosted by another group's)."""
        return self.placement != "colocated"

    def local(self, rank: int) -> int:
        """``rank`` of the run as a rank of this group."""
        if rank not in self.ranks:
            raise IndexError(f"rank {rank} is not in the {self.name} group ({self.describe_ranks()})")
        return rank - self.first_rank

    def owners(self) -> tuple[int, ...]:
        """One run rank per data replica, in replica order: the replica's last pipeline
        stage's first tensor-parallel rank (where a loss, log-probs or a rollout end up)."""
        return tuple(self.first_rank + r for r in self.dims.loss_owners())

    def replica_of(self, rank: int) -> int:
        """The data-parallel replica run rank ``rank`` belongs to."""
        return self.dims.coords(self.local(rank)).dp

    def describe_ranks(self) -> str:
        last = self.first_rank + self.world_size - 1
        return f"rank {last}" if last == self.first_rank else f"ranks {self.first_rank}-{last}"


def plan_roles(cfg: RunConfig) -> tuple[RolePlan, ...]:
    """The trainer's group, then the generator's where the run has one."""
    trainer = RolePlan(name="trainer", first_rank=0, dims=cfg.dims, placement="own", component=WORKERS_COMPONENT,
                       nodes=cfg.trainer.nodes, models=_trainer_models(cfg))
    g = cfg.generator
    if not g.enabled:
        return (trainer,)
    n = g.own_processes
    dims = ParallelDims(tp=g.tp, pp=1, dp=(n or cfg.trainer.world_size) // g.tp)
    if n:
        gen_nodes = cfg.slurm.generator.nodes or 1
        generator = RolePlan(name="generator", first_rank=cfg.trainer.world_size, dims=dims, placement="split",
                             component=GENERATOR_COMPONENT, nodes=gen_nodes, models=("rollout",))
    else:
        generator = RolePlan(name="generator", first_rank=0, dims=dims, placement="colocated",
                             component=WORKERS_COMPONENT, nodes=cfg.trainer.nodes, models=("rollout",))
    return trainer, generator


def _trainer_models(cfg: RunConfig) -> tuple[ModelRole, ...]:
    if cfg.model.kind == "toy":
        return ("toy",)
    models: list[ModelRole] = ["actor"]
    if cfg.program in RL_PROGRAMS and cfg.rl.kl.enabled:
        models.append("reference")
    if cfg.program == "ppo":
        models.append("critic")
    return tuple(models)
