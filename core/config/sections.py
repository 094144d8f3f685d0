"""The run configuration's sections that stand alone: each a frozen, keyword-only dataclass
checking its own values (bounds, and what one section alone can refuse). ``core.config.run``
composes them, with the model's (modelcfg), the generator's, RL's and Slurm's sections, into
``RunConfig`` and checks them against each other.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Literal

from core.config import inputs
from core.config.schema import bounded, check_bounds
from core.errors import ConfigError

Auto = Literal["auto"]

MAX_STEPS = 10**12
MAX_WORLD = 2**20  # workers in one run
MAX_TIMEOUT_S = 1e7  # about 116 days: any wait longer than that is a typo
MAX_COUNT = 10**6  # retries, retained checkpoints, failures per node


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """How many workers and how long."""

    nodes: int = bounded(1, gt=0, le=100_000, why=" (more nodes than any cluster has)")
    n_gpus_per_node: int = bounded(1, gt=0, le=1024, why=" (more GPUs than any node has)")  # one worker per GPU
    steps: int = bounded(20, gt=0, le=MAX_STEPS)
    log_interval_steps: int = bounded(1, gt=0, le=MAX_STEPS)
    device: Literal["auto", "cpu", "cuda"] = "auto"

    def __post_init__(self) -> None:
        check_bounds(self, "trainer")
        if self.world_size > MAX_WORLD:
            raise ConfigError(f"trainer: {self.nodes} node(s) × {self.n_gpus_per_node} = {self.world_size} workers "
                              f"exceed {MAX_WORLD} (2**20); lower trainer.nodes or trainer.n_gpus_per_node")

    @property
    def world_size(self) -> int:
        return self.nodes * self.n_gpus_per_node


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Periodic synchronisation of data-parallel replicas (local SGD): with ``every`` > 1 or
    ``adaptive_latency_ms``, each replica steps on its own gradients and every ``every``-th
    step (and before every checkpoint) the replicas average their weights and Adam moments;
    with ``adaptive_latency_ms`` the controller doubles the period (up to ``max_every``)
    while the median of the last 3 averaging all-reduces takes longer, and halves it (down
    to ``every``) once it takes under half of that."""

    every: int = bounded(1, gt=0, le=2**20)
    adaptive_latency_ms: float | None = bounded(None, gt=0, le=1e7)
    max_every: int = bounded(64, gt=0, le=2**20)
    outer: Literal["average", "nesterov"] = "average"  # nesterov: DiLoCo's outer step on the pseudo-gradient
    outer_lr: float = bounded(0.7, gt=0, le=1e3)
    outer_momentum: float = bounded(0.9, ge=0, lt=1)

    def __post_init__(self) -> None:
        check_bounds(self, "parallel.sync")
        if self.max_every < self.every:
            raise ConfigError(f"parallel.sync.max_every: {self.max_every} < parallel.sync.every = {self.every}; "
                              "raise max_every")

    @property
    def local(self) -> bool:
        """Replicas step on their own gradients (no all-reduce of gradients)."""
        return self.every > 1 or self.adaptive_latency_ms is not None


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Tensor and pipeline parallel sizes; data parallel is derived from the worker count.
    ``sharding`` over data parallelism: ``optimizer`` (ZeRO-1, Megatron's distributed
    optimizer; the same as ``distributed_optimizer: true``) or ``params`` (ZeRO-3, torch
    FSDP2: core.model.gpt.fsdp)."""

    tp: int = bounded(1, gt=0, le=MAX_WORLD)
    pp: int = bounded(1, gt=0, le=MAX_WORLD)
    sharding: Literal["none", "optimizer", "params"] = "none"
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False  # Megatron's bucketed all-reduce of gradients during backward
    bucket_size: int | None = bounded(None, gt=0, le=2**40)  # elements per gradient bucket; null: Megatron's
    sync: SyncConfig = field(default_factory=SyncConfig)

    def __post_init__(self) -> None:
        check_bounds(self, "parallel")
        if self.distributed_optimizer and self.sharding == "params":
            raise ConfigError("parallel.distributed_optimizer: true with parallel.sharding: params; ZeRO-3 shards the "
                              "optimizer state already: drop distributed_optimizer")
        if self.distributed_optimizer or self.sharding == "optimizer":  # the two spellings of ZeRO-1 agree
            object.__setattr__(self, "sharding", "optimizer")
            object.__setattr__(self, "distributed_optimizer", True)


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionConfig:
    """The three precision levels: parameters (and compute) in ``param_dtype`` over fp32 master
    weights and Adam moments in the optimizer; the data-parallel gradient reduction in
    ``reduce_dtype``. ``auto``: bf16 on a GPU, fp32 on a CPU (an explicit dtype wins on both);
    ``reduce_dtype: auto`` is the parameters' dtype. fp16 trains with dynamic loss scaling
    from ``initial_loss_scale``. ``enabled: false`` is fp32 throughout.

    Megatron reduces gradients in fp32 or in the parameters' dtype, nothing else: any other
    pairing is refused at submit. ``buffer_dtype`` was removed (module buffers stay in the
    parameters' dtype; the communication dtype is ``reduce_dtype``).
    """

    enabled: bool = True
    param_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    reduce_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    initial_loss_scale: float = bounded(65536.0, gt=0, le=1e12, why=" (beyond it every gradient overflows)")
    buffer_dtype: str | None = None  # removed: refused with the reason

    def __post_init__(self) -> None:
        key = "training.mixed_precision"
        if self.buffer_dtype is not None:
            raise ConfigError(f"{key}.buffer_dtype: {self.buffer_dtype!r} is no longer a setting: Megatron keeps module "
                              f"buffers in the parameters' dtype, and the gradient reduction's dtype is "
                              f"{key}.reduce_dtype; remove it")
        check_bounds(self, key)
        if not self.enabled:
            for name in ("param_dtype", "reduce_dtype"):
                if getattr(self, name) not in ("auto", "fp32"):
                    raise ConfigError(f"{key}.{name}: {getattr(self, name)!r} with {key}.enabled: false (fp32 "
                                      f"throughout); set {key}.enabled=true or {key}.{name}=fp32")
            return
        param, reduce = self.param_dtype, self.reduce_dtype
        if reduce in ("auto", "fp32") or reduce == param:
            return
        if param == "auto":
            raise ConfigError(f"{key}.reduce_dtype: {reduce!r} needs {key}.param_dtype={reduce} (auto is fp32 on a "
                              f"CPU); Megatron reduces gradients in fp32 or in the parameters' dtype")
        raise ConfigError(f"{key}.reduce_dtype: {reduce!r} with {key}.param_dtype {param!r}: Megatron reduces "
                          f"gradients in fp32 or in the parameters' dtype; use {key}.reduce_dtype=fp32 or "
                          f"{key}.reduce_dtype={param}")

    def resolved(self, *, on_cuda: bool) -> tuple[str, str]:
        """(parameter dtype, reduction dtype) as they run on a GPU (``on_cuda``) or a CPU."""
        if not self.enabled:
            return "fp32", "fp32"
        param = ("bf16" if on_cuda else "fp32") if self.param_dtype == "auto" else self.param_dtype
        return param, param if self.reduce_dtype == "auto" else self.reduce_dtype


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    global_batch_size: int = bounded(16, gt=0, le=2**31)
    micro_batch_size: int | Auto = bounded(4, gt=0, le=2**31)
    recompute: Literal["none", "full", "selective"] = "none"
    activation_storage: Literal["plain", "int8"] = "plain"  # int8: saved for backward as int8 (model.gpt.activations)
    grad_clip: float = bounded(1.0, ge=0)
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)

    def __post_init__(self) -> None:
        check_bounds(self, "training")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Adam with warmup and cosine decay. ``lr: auto`` = 3e-6 × sqrt(global_batch / 1024)."""

    lr: float | Auto = bounded(3e-3, gt=0)
    min_lr: float = bounded(0.0, ge=0)
    weight_decay: float = bounded(0.0, ge=0)
    beta1: float = bounded(0.9, ge=0, lt=1)
    beta2: float = bounded(0.95, ge=0, lt=1)
    eps: float = bounded(1e-8, gt=0)
    warmup_steps: int = bounded(0, ge=0, le=MAX_STEPS)
    schedule: Literal["cosine", "constant"] = "cosine"

    def __post_init__(self) -> None:
        check_bounds(self, "optimizer")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """``synthetic`` tasks for tests and demos, or an HDF5 token dataset (``baton data build``).

    ``path`` (hdf5) must name an existing file when the config is validated; a relative path
    is relative to the folder ``baton submit`` runs in, and the run folder stores it resolved.
    """

    kind: Literal["synthetic", "hdf5"] = "synthetic"
    task: Literal["increment", "copy", "random", "count_to"] = "increment"
    path: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "hdf5" and not self.path:
            raise ConfigError("data.path: required when data.kind is 'hdf5' (build one with `baton data build`)")
        if self.kind == "hdf5":
            inputs.check_file("data.path", str(self.path), "give an HDF5 token file (build one with `baton data build`)")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    interval_steps: int = bounded(0, ge=0, le=MAX_STEPS)  # 0: only at the end of the run
    keep_last: int = bounded(2, le=MAX_COUNT)
    async_save: bool = field(default=False, metadata={"key": "async"})
    # An async save's host buffers per rank; null: as large as the rank's state, so the copy
    # never waits for the disk (core.checkpoint.async_writer).
    async_buffer_mb: int | None = bounded(None, ge=1, le=2**30)
    at_end: bool = True

    def __post_init__(self) -> None:
        check_bounds(self, "checkpoint")
        if self.keep_last < 2:
            raise ConfigError(f"checkpoint.keep_last: {self.keep_last} must be ≥ 2 (the previous good "
                              "checkpoint is kept until the next one is committed)")


@dataclass(frozen=True, kw_only=True)
class TimeoutsConfig:
    """Every wait has a deadline (each > 0 and ≤ 1e7 s); heartbeats decide when a worker is lost.

    ``heartbeat_timeout_s``: how long a running worker may be silent before it is declared
    lost. ``startup_heartbeat_timeout_s``: how long a worker may be silent while it starts
    and sets up (it imports its libraries: torch, Megatron); at least ``heartbeat_timeout_s``.
    """

    register_s: float = bounded(120.0, gt=0, le=MAX_TIMEOUT_S)
    setup_s: float = bounded(600.0, gt=0, le=MAX_TIMEOUT_S)
    step_s: float = bounded(600.0, gt=0, le=MAX_TIMEOUT_S)
    checkpoint_s: float = bounded(600.0, gt=0, le=MAX_TIMEOUT_S)
    call_s: float = bounded(60.0, gt=0, le=MAX_TIMEOUT_S)
    heartbeat_interval_s: float = bounded(0.25, gt=0, le=MAX_TIMEOUT_S)
    heartbeat_timeout_s: float = bounded(2.0, gt=0, le=MAX_TIMEOUT_S)
    startup_heartbeat_timeout_s: float = bounded(120.0, gt=0, le=MAX_TIMEOUT_S)
    controller_lost_s: float = bounded(10.0, gt=0, le=MAX_TIMEOUT_S)

    def __post_init__(self) -> None:
        check_bounds(self, "timeouts")
        for key in ("heartbeat_timeout_s", "controller_lost_s"):  # both sides' watchdogs
            if getattr(self, key) <= 2 * self.heartbeat_interval_s:
                raise ConfigError(f"timeouts.{key}: {getattr(self, key)} must exceed twice "
                                  f"timeouts.heartbeat_interval_s = {self.heartbeat_interval_s}")
        if self.startup_heartbeat_timeout_s < self.heartbeat_timeout_s:
            raise ConfigError(f"timeouts.startup_heartbeat_timeout_s: {self.startup_heartbeat_timeout_s} must be ≥ "
                              f"timeouts.heartbeat_timeout_s = {self.heartbeat_timeout_s} (a starting worker may be "
                              "silent at least as long as a running one); raise it")


@dataclass(frozen=True, kw_only=True)
class RecoveryConfig:
    max_retries: int = bounded(3, ge=0, le=MAX_COUNT)
    backoff_s: float = bounded(5.0, ge=0, le=MAX_TIMEOUT_S)
    node_failure_limit: int = bounded(2, gt=0, le=MAX_COUNT)  # failures on one node before a requeue excludes it
    walltime_margin_s: float = bounded(30.0, ge=0, le=MAX_TIMEOUT_S)  # beyond one step and one save

    def __post_init__(self) -> None:
        check_bounds(self, "recovery")


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """The controller's Prometheus endpoint.

    ``port``: 0 (any free port) to 65535, written to the run folder. ``bind``: ``127.0.0.1``
    (default) this machine, ``0.0.0.0`` all interfaces, ``node`` the controller node's address
    as other hosts reach it (core.job.netaddr), or one IP address of the node. ``sd_dir``: a
    folder every node mounts, where the controller publishes a Prometheus file_sd target
    (core.record.discovery); checked at submit.
    """

    enabled: bool = True
    port: int = bounded(0, ge=0, le=65535, why=" (a TCP port; 0: any free one)")
    bind: str = "127.0.0.1"
    sd_dir: str | None = None

    def __post_init__(self) -> None:
        check_bounds(self, "metrics")
        if inputs.check_text("metrics.bind", self.bind) != NODE and not _is_ip(self.bind):
            raise ConfigError(f"metrics.bind: {self.bind!r} is not an address; use node (the controller node's "
                              "address), 127.0.0.1 (this machine only), 0.0.0.0 (all interfaces) or one IP address "
                              "of the node")
        if self.sd_dir is not None and not inputs.check_text("metrics.sd_dir", self.sd_dir).strip():
            raise ConfigError("metrics.sd_dir: empty; give the folder where Prometheus reads its file_sd targets, "
                              "or leave it unset")


NODE = "node"  # metrics.bind: the controller node's routable address


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
