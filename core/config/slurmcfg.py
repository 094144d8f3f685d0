"""The ``slurm:`` section of a run's config: every het-job component's sbatch options and
the batch script's setup lines, as the YAML gives them. ``core.config.jobspec`` merges them
with the command line's flags into the job (``HetJobSpec``) and checks what reaches sbatch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from core.config.inputs import check_strings
from core.config.schema import bounded, check_bounds


@dataclass(frozen=True, kw_only=True)
class SlurmComponentConfig:
    """sbatch options of one het-job component, under sbatch's own names."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    nodes: int | None = bounded(None, gt=0, le=100_000, why=" (more nodes than any cluster has)")
    gpus_per_node: int | None = bounded(None, ge=0, le=1024, why=" (more GPUs than any node has)")
    cpus_per_task: int | None = bounded(None, gt=0, le=2**16, why=" (more CPUs than any node has)")
    mem: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    reservation: str | None = None
    signal: str | None = None
    extra: list[str] = ()  # type: ignore[assignment]  # raw "--flag=value" pass-through


@dataclass(frozen=True, kw_only=True)
class SlurmConfig:
    """Every component's sbatch options and the batch script's setup lines (module loads,
    environment activation, exports), each one line without control characters.
    ``generator``: the generator's component (``generator.placement: split``); what it
    leaves unset, it takes from ``workers``, except ``nodes`` (1) and ``gpus_per_node``
    (one per task); with ``generator.engine: vllm``, ``cpus_per_task`` and ``mem`` still unset
    are what its engines need (core.config.jobspec)."""

    controller: SlurmComponentConfig = field(default_factory=SlurmComponentConfig)
    workers: SlurmComponentConfig = field(default_factory=SlurmComponentConfig)
    generator: SlurmComponentConfig = field(default_factory=SlurmComponentConfig)
    setup: list[str] = ()  # type: ignore[assignment]

    def __post_init__(self) -> None:
        check_bounds(self.controller, "slurm.controller")
        check_bounds(self.workers, "slurm.workers")
        check_bounds(self.generator, "slurm.generator")
        check_strings(self, "slurm")
