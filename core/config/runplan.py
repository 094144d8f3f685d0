"""The plan a job runs: written at submit as ``plan.json``, read by the controller.

``plan_run(cfg)`` is what the login node computes before anything is submitted: the
parallel layout, the resources (nodes × tasks per node), the micro-batch size where it can
be resolved (``training.micro_batch_size: auto`` is resolved at run time by the workers
from their free memory, reported back and recorded in the run's state), and for a GPT the
model plan `baton plan` prints (core.config.plan), and the run's worker groups (``roles``,
core.config.roles): which ranks each group holds, in which layout, placement and Slurm
component. The controller, every worker, the local supervisor and the Slurm job spec take
ranks from here, and check that the plan was made for the config they read.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from core.config.dims import ParallelDims
from core.config.plan import Plan, make_plan
from core.config.roles import RoleName, RolePlan, plan_roles
from core.config.run import RunConfig, config_hash
from core.config.schema import build
from core.errors import RunFolderError

VERSION = 2  # 2: the worker groups (roles)


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    version: int = VERSION
    config_hash: str  # of the config this plan was made for
    kind: str  # model.kind
    dims: ParallelDims
    nodes: int
    tasks_per_node: int  # one worker per GPU (per CPU slot on the local backend)
    micro_batch_size: int | None  # None: ``auto``, resolved by the workers at setup
    roles: tuple[RolePlan, ...]  # the trainer's group first, then a generator's
    model: Plan | None = None  # the GPT's layers, parameters and memory; None for the toy model

    @property
    def world_size(self) -> int:
        """The trainer's workers."""
        return self.dims.world_size

    @property
    def workers(self) -> int:
        """Every worker process of the run: the groups' with processes of their own."""
        return sum(r.world_size for r in self.roles if r.own_processes)

    def role(self, name: RoleName) -> RolePlan | None:
        """The group called ``name``; None when the run has none."""
        return next((r for r in self.roles if r.name == name), None)

    @property
    def trainer(self) -> RolePlan:
        return self.roles[0]

    @property
    def generator(self) -> RolePlan | None:
        return self.role("generator")

    def role_of(self, rank: int) -> RolePlan:
        """The group whose process run rank ``rank`` is."""
        for r in self.roles:
            if r.own_processes and rank in r.ranks:
                return r
        raise IndexError(f"rank {rank} outside the run's {self.workers} workers")

    def roles_at(self, rank: int) -> tuple[RolePlan, ...]:
        """Every group run rank ``rank`` serves: its process's own first, then those colocated in it."""
        own = self.role_of(rank)
        return (own, *(r for r in self.roles if not r.own_processes and rank in r.ranks))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"


def plan_run(cfg: RunConfig) -> RunPlan:
    """The plan of ``cfg`` (pure: no GPU memory is known here)."""
    model = make_plan(cfg) if cfg.model.kind == "gpt" else None
    micro = cfg.training.micro_batch_size
    return RunPlan(
        config_hash=config_hash(cfg), kind=cfg.model.kind, dims=cfg.dims, nodes=cfg.trainer.nodes,
        tasks_per_node=cfg.trainer.n_gpus_per_node, micro_batch_size=None if micro == "auto" else int(micro),
        roles=plan_roles(cfg), model=model,
    )


def read_plan(path: Path, cfg: RunConfig) -> RunPlan:
    """plan.json, checked against the config it must have been made for."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise RunFolderError(f"{path}: missing; resume the run with `baton submit --resume` to plan it again") from None
    except (OSError, ValueError) as exc:
        raise RunFolderError(f"{path}: unreadable ({exc}); resume with `baton submit --resume` to plan it again") from None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise RunFolderError(f"{path}: not a plan of this Baton (version {VERSION}); "
                             "resume with `baton submit --resume` to plan it again")
    plan = build(RunPlan, data, str(path), error=RunFolderError)
    if plan.config_hash != config_hash(cfg):
        raise RunFolderError(f"{path}: made for another config.yaml (config hash {plan.config_hash}, "
                             f"config.yaml {config_hash(cfg)}); resume with `baton submit --resume` to plan it again")
    return plan
