"""The run configuration: frozen, keyword-only dataclasses, loaded from YAML.

Loading order: the YAML file, then ``key=value`` overrides with dotted paths
(``parallel.tp=2``), then strict conversion (``core.spec.schema.build``) and validation in
``__post_init__``. The resolved config is what the run folder records.
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from core.errors import ConfigError, LayoutError
from core.spec import inputs, modelcfg, schema
from core.spec import rl as rl_spec
from core.spec.dims import ParallelDims
from core.spec.generator import GeneratorConfig
from core.spec.generator import validate as validate_generator
from core.spec.jobspec import SlurmConfig
from core.spec.layout import validate_layout
from core.spec.modelcfg import ModelConfig
from core.spec.schema import bounded, build, check_bounds, field_paths, set_dotted, show, to_data

__all__ = ["ConfigError", "LayoutError", "RunConfig", "load", "dump", "from_data", "to_dict", "config_hash"]

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
    task: Literal["increment", "copy", "random"] = "increment"
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
    (default) this machine, ``0.0.0.0`` all interfaces, or one address of the node.
    """

    enabled: bool = True
    port: int = bounded(0, ge=0, le=65535, why=" (a TCP port; 0: any free one)")
    bind: str = "127.0.0.1"

    def __post_init__(self) -> None:
        check_bounds(self, "metrics")
        if not inputs.check_text("metrics.bind", self.bind).strip() or any(c.isspace() for c in self.bind):
            raise ConfigError(f"metrics.bind: {self.bind!r} is not an interface; use an address such as "
                              "127.0.0.1 (this machine) or 0.0.0.0 (all interfaces)")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One run. Cross-section checks (the layout) happen here, so bad configs fail at submit.

    ``name`` names the run's folder and Slurm job: 1 to 128 of ``A-Z a-z 0-9 . _ -``,
    starting with a letter or digit. ``seed``: 0 to 2**63 - 1. No string of the config may
    hold a control character (a newline would end a line of the batch script).
    """

    name: str = "run"
    program: str = "pretrain"  # or grpo, ppo (core.spec.rl)
    init_from: str | None = None  # RUN_DIR[:STEP]: start from another run's model weights (core.spec.rl)
    seed: int = bounded(1234, ge=0, le=2**63 - 1, why=" (seeds are 64-bit)")
    runs_root: str = "runs"
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    rl: rl_spec.RLConfig = field(default_factory=rl_spec.RLConfig)

    def __post_init__(self) -> None:
        inputs.check_strings(self, "")
        check_bounds(self, "")
        inputs.check_name("name", self.name)
        if not self.runs_root.strip():
            raise ConfigError("runs_root: empty; give the folder that holds the run folders, e.g. runs")
        if self.model.kind == "gpt":
            validate_layout(self)
        validate_generator(self.generator, self)
        rl_spec.validate(self)

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims.from_world(world_size=self.trainer.world_size, tp=self.parallel.tp, pp=self.parallel.pp)

    @property
    def lr(self) -> float:
        """The learning rate, with ``auto`` resolved (a heuristic: 3e-6 × sqrt(batch/1024))."""
        if self.optimizer.lr == "auto":
            return 3e-6 * math.sqrt(self.training.global_batch_size / 1024)
        return float(self.optimizer.lr)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` → (["a", "b", "c"], YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {show(text)}: expected key=value, e.g. parallel.tp=2")
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {show(text)}: empty key; expected key=value, e.g. parallel.tp=2")
    bad = schema.control_char(text)
    if bad is not None:
        raise ConfigError(f"override {show(key)}: {show(raw)} contains the control character {bad}; "
                          "give the value on one line, without control characters")
    try:
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else ""
    except (yaml.YAMLError, ValueError, RecursionError) as exc:  # ValueError: an integer beyond the digit limit
        if "duplicate key" in str(getattr(exc, "problem", "")):
            raise ConfigError(f"override {key}: {exc.problem}") from None  # type: ignore[attr-defined]
        value = raw  # not YAML: the text as it is
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each dotted override set; unknown paths are rejected."""
    out = copy.deepcopy(data)
    valid = field_paths(RunConfig)
    for text in overrides:
        parts, value = parse_override(text)
        dotted = ".".join(parts)
        if dotted not in valid and not any(v.startswith(dotted + ".") for v in valid):
            close = difflib.get_close_matches(dotted, valid, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"override {dotted}: unknown key{hint}")
        set_dotted(out, parts, value, where=f"override {dotted}")
    return out


class _Loader(yaml.SafeLoader):
    """yaml's safe loader, refusing a key given twice in one mapping (yaml lets the last one win)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` then a key over it is allowed
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {show(key)} (first at line {seen[key]}); give each key once",
                        key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
            except TypeError:  # an unhashable key: the base class refuses it
                continue
        return super().construct_mapping(node, deep=deep)


_NEEDS = {"experiment": "an experiment sets at least one key, e.g. name: and trainer: (see experiments/toy.yaml)",
          "sweep file": "a sweep file sets at least base: and grid: (see experiments/sweep_toy.yaml)"}
FileKind = Literal["experiment", "sweep file"]


def read_yaml(path: str | Path, *, kind: FileKind = "experiment") -> tuple[dict[str, Any], str]:
    """A file's non-empty YAML mapping and its text; anything else is a one-line ConfigError naming
    the file: unreadable, not UTF-8, bad syntax, a duplicate key, empty, not a mapping."""
    p = Path(path)
    text = inputs.read_text(p)
    try:
        data = yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except (yaml.YAMLError, ValueError, RecursionError) as exc:  # ValueError: an integer beyond the digit limit
        raise ConfigError(f"{p}: not valid YAML{inputs.parse_problem(exc)}") from None
    if inputs.too_many_values(data):  # first: the checks below walk it
        raise ConfigError(f"{p}: more than {inputs.MAX_VALUES} values once its aliases are expanded; check the file")
    if inputs.sets_nothing(data):
        raise ConfigError(f"{p}: empty; {_NEEDS[kind]}")
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a YAML mapping at the top level, got {type(data).__name__}")
    return data, text


def from_data(data: dict[str, Any]) -> RunConfig:
    """Plain data → validated ``RunConfig`` (NaN and the infinities are refused)."""
    return build(RunConfig, data, finite=True)


def load(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """YAML file + overrides → validated ``RunConfig``."""
    return from_data(apply_overrides(read_yaml(path)[0], overrides or []))


def dump(cfg: RunConfig) -> str:
    """The resolved config as YAML (``load`` of it gives an equal config)."""
    return yaml.safe_dump(to_data(cfg), sort_keys=False)


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return to_data(cfg)  # type: ignore[no-any-return]


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def model_hash(cfg: RunConfig) -> str:
    """What a checkpoint must agree with to be loadable: the model's shape, not its layout."""
    return _digest(modelcfg.hashed(to_dict(cfg)["model"]))


def config_hash(cfg: RunConfig) -> str:
    """The whole resolved config: the controller and its workers must have read the same one."""
    return _digest(to_dict(cfg))
