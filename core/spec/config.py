"""The run configuration: frozen, keyword-only dataclasses, loaded from YAML.

Loading order: the YAML file, then ``key=value`` overrides with dotted paths
(``parallel.tp=2``), then strict conversion (``core.spec.schema.build``) and validation in
``__post_init__``. The resolved config is what the run folder records.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from core.errors import ConfigError, LayoutError

__all__ = ["ConfigError", "LayoutError", "RunConfig", "load", "dump", "from_data", "to_dict", "model_hash",
           "config_hash"]
from core.spec.dims import ParallelDims
from core.spec.schema import build, field_paths, to_data

Auto = Literal["auto"]


def _positive(path: str, value: float | int, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = "≥ 0" if allow_zero else "> 0"
        raise ConfigError(f"{path}: {value!r} must be {bound}")


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """How many workers and how long."""

    nodes: int = 1
    n_gpus_per_node: int = 1  # one worker process per GPU (per CPU slot on the local backend)
    steps: int = 20
    log_interval_steps: int = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"

    def __post_init__(self) -> None:
        _positive("trainer.nodes", self.nodes)
        _positive("trainer.n_gpus_per_node", self.n_gpus_per_node)
        _positive("trainer.steps", self.steps)
        _positive("trainer.log_interval_steps", self.log_interval_steps)

    @property
    def world_size(self) -> int:
        return self.nodes * self.n_gpus_per_node


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A GPT (Megatron-core), or ``toy``: a deterministic numpy model for control-plane tests."""

    kind: Literal["gpt", "toy"] = "gpt"
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    vocab_size: int = 128
    seq_length: int = 32
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0  # Megatron's names; masks are reproducible in every layout and resume
    attention_dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            _positive(f"model.{name}", getattr(self, name))
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"model.{name}: {getattr(self, name)!r} must be in [0, 1)")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size: {self.hidden_size} is not divisible by "
                f"model.num_attention_heads = {self.num_attention_heads}"
            )

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Tensor and pipeline parallel sizes; data parallel is derived from the worker count."""

    tp: int = 1
    pp: int = 1
    distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        _positive("parallel.tp", self.tp)
        _positive("parallel.pp", self.pp)


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
    initial_loss_scale: float = 65536.0
    buffer_dtype: str | None = None  # removed: refused with the reason

    def __post_init__(self) -> None:
        key = "training.mixed_precision"
        if self.buffer_dtype is not None:
            raise ConfigError(f"{key}.buffer_dtype: {self.buffer_dtype!r} is no longer a setting: Megatron keeps module "
                              f"buffers in the parameters' dtype, and the gradient reduction's dtype is "
                              f"{key}.reduce_dtype; remove it")
        _positive(f"{key}.initial_loss_scale", self.initial_loss_scale)
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
    global_batch_size: int = 16
    micro_batch_size: int | Auto = 4
    recompute: Literal["none", "full", "selective"] = "none"
    grad_clip: float = 1.0
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)

    def __post_init__(self) -> None:
        _positive("training.global_batch_size", self.global_batch_size)
        if self.micro_batch_size != "auto":
            _positive("training.micro_batch_size", self.micro_batch_size)
        _positive("training.grad_clip", self.grad_clip, allow_zero=True)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Adam with warmup and cosine decay. ``lr: auto`` = 3e-6 × sqrt(global_batch / 1024)."""

    lr: float | Auto = 3e-3
    min_lr: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: Literal["cosine", "constant"] = "cosine"

    def __post_init__(self) -> None:
        if self.lr != "auto":
            _positive("optimizer.lr", self.lr)
        _positive("optimizer.min_lr", self.min_lr, allow_zero=True)
        _positive("optimizer.warmup_steps", self.warmup_steps, allow_zero=True)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """``synthetic`` tasks for tests and demos, or an HDF5 token dataset (``baton data build``)."""

    kind: Literal["synthetic", "hdf5"] = "synthetic"
    task: Literal["increment", "copy", "random"] = "increment"
    path: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "hdf5" and not self.path:
            raise ConfigError("data.path: required when data.kind is 'hdf5' (build one with `baton data build`)")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    interval_steps: int = 0  # 0: only at the end of the run
    keep_last: int = 2
    async_save: bool = field(default=False, metadata={"key": "async"})
    at_end: bool = True

    def __post_init__(self) -> None:
        _positive("checkpoint.interval_steps", self.interval_steps, allow_zero=True)
        if self.keep_last < 2:
            raise ConfigError(
                f"checkpoint.keep_last: {self.keep_last} must be ≥ 2 (the previous good "
                "checkpoint is kept until the next one is committed)"
            )


@dataclass(frozen=True, kw_only=True)
class TimeoutsConfig:
    """Every wait has a deadline; heartbeats decide when a worker is lost."""

    register_s: float = 120.0
    setup_s: float = 600.0
    step_s: float = 600.0
    checkpoint_s: float = 600.0
    call_s: float = 60.0
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 2.0
    controller_lost_s: float = 10.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _positive(f"timeouts.{f.name}", getattr(self, f.name))
        for key in ("heartbeat_timeout_s", "controller_lost_s"):  # both sides' watchdogs
            if getattr(self, key) <= 2 * self.heartbeat_interval_s:
                raise ConfigError(
                    f"timeouts.{key}: {getattr(self, key)} must exceed twice "
                    f"timeouts.heartbeat_interval_s = {self.heartbeat_interval_s}"
                )


@dataclass(frozen=True, kw_only=True)
class RecoveryConfig:
    max_retries: int = 3
    backoff_s: float = 5.0
    node_failure_limit: int = 2  # failures on one node before a requeue excludes it (Slurm)
    walltime_margin_s: float = 30.0  # slack beyond one step and one save before the walltime

    def __post_init__(self) -> None:
        _positive("recovery.max_retries", self.max_retries, allow_zero=True)
        _positive("recovery.backoff_s", self.backoff_s, allow_zero=True)
        _positive("recovery.node_failure_limit", self.node_failure_limit)
        _positive("recovery.walltime_margin_s", self.walltime_margin_s, allow_zero=True)


@dataclass(frozen=True, kw_only=True)
class SlurmComponentConfig:
    """sbatch options of one het-job component, under sbatch's own names."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    reservation: str | None = None
    signal: str | None = None
    extra: list[str] = ()  # type: ignore[assignment]  # raw "--flag=value" pass-through


@dataclass(frozen=True, kw_only=True)
class SlurmConfig:
    controller: SlurmComponentConfig = field(default_factory=SlurmComponentConfig)
    workers: SlurmComponentConfig = field(default_factory=SlurmComponentConfig)
    setup: list[str] = ()  # type: ignore[assignment]  # module loads, env activation, exports


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    enabled: bool = True
    port: int = 0  # 0: any free port; the address is written to the run folder


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One run. Cross-section checks (the layout) happen here, so bad configs fail at submit."""

    name: str = "run"
    seed: int = 1234
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

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ConfigError(f"name: {self.name!r} must be a non-empty folder name without '/'")
        if self.model.kind == "gpt":
            validate_layout(self)

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims.from_world(
            world_size=self.trainer.world_size, tp=self.parallel.tp, pp=self.parallel.pp
        )

    @property
    def lr(self) -> float:
        """The learning rate, with ``auto`` resolved (a heuristic: 3e-6 × sqrt(batch/1024))."""
        if self.optimizer.lr == "auto":
            return 3e-6 * math.sqrt(self.training.global_batch_size / 1024)
        return float(self.optimizer.lr)


def validate_layout(cfg: RunConfig) -> None:
    """Reject layouts Megatron cannot run, with the numbers in the message."""
    p, m, t = cfg.parallel, cfg.model, cfg.training
    if m.num_attention_heads % p.tp:
        raise LayoutError(
            f"parallel.tp: {p.tp} does not divide model.num_attention_heads = "
            f"{m.num_attention_heads}; pick a tp that divides it"
        )
    if m.num_layers % p.pp:
        raise LayoutError(
            f"parallel.pp: {p.pp} does not divide model.num_layers = {m.num_layers}; "
            "pick a pp that divides it"
        )
    try:
        dims = cfg.dims
    except LayoutError as exc:
        raise LayoutError(
            f"trainer: {cfg.trainer.nodes} node(s) × {cfg.trainer.n_gpus_per_node} = "
            f"{cfg.trainer.world_size} workers are not divisible by tp*pp = {p.tp * p.pp}"
        ) from exc
    if t.micro_batch_size != "auto" and t.global_batch_size % (t.micro_batch_size * dims.dp):
        raise LayoutError(
            f"training.global_batch_size: {t.global_batch_size} is not divisible by "
            f"micro_batch_size × dp = {t.micro_batch_size} × {dims.dp} = "
            f"{t.micro_batch_size * dims.dp}"
        )


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` → (["a", "b", "c"], YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. parallel.tp=2")
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key; expected key=value, e.g. parallel.tp=2")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
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


def set_dotted(data: dict[str, Any], parts: list[str], value: Any, *, where: str) -> None:
    """Set ``data[a][b]...[z] = value``, creating sections; ``where`` names it in errors."""
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{where}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a missing or malformed file is a one-line ConfigError."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config ({exc.strerror}); check the path") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{p}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a YAML mapping at the top level, got {type(data).__name__}")
    return data


def from_data(data: dict[str, Any]) -> RunConfig:
    return build(RunConfig, data)


def load(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """YAML file + overrides → validated ``RunConfig``."""
    return from_data(apply_overrides(load_yaml(path), overrides or []))


def dump(cfg: RunConfig) -> str:
    """The resolved config as YAML (``load`` of it gives an equal config)."""
    return yaml.safe_dump(to_data(cfg), sort_keys=False)


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return to_data(cfg)  # type: ignore[no-any-return]


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def model_hash(cfg: RunConfig) -> str:
    """What a checkpoint must agree with to be loadable: the model's shape, not its layout."""
    return _digest(to_dict(cfg)["model"])


def config_hash(cfg: RunConfig) -> str:
    """The whole resolved config: the controller and its workers must have read the same one."""
    return _digest(to_dict(cfg))
