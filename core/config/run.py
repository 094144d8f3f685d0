"""The run configuration: frozen, keyword-only dataclasses, loaded from YAML.

``RunConfig`` composes the sections (``core.config.sections``, ``modelcfg``, ``generator``,
``rl``, ``slurmcfg``: each checks its own values) and checks them against each other here
(the layout, the generator's, RL's needs): the sections never see the whole config.
Loading order: the YAML file, then ``key=value`` overrides with dotted paths
(``parallel.tp=2``), then strict conversion (``core.config.schema.build``) and validation in
``__post_init__``. The resolved config is what the run folder records.
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from core.config import hfinit, inputs, modelcfg, schema
from core.config import rl as rl_spec
from core.config import sft as sft_spec
from core.config.dims import ParallelDims
from core.config.generator import GeneratorConfig
from core.config.modelcfg import ModelConfig
from core.config.schema import bounded, build, check_bounds, field_paths, set_dotted, show, to_data
from core.config.sections import (
    CheckpointConfig,
    DataConfig,
    MetricsConfig,
    MixedPrecisionConfig,
    OptimizerConfig,
    ParallelConfig,
    RecoveryConfig,
    SyncConfig,
    TimeoutsConfig,
    TrainerConfig,
    TrainingConfig,
)
from core.config.slurmcfg import SlurmConfig
from core.errors import ConfigError, LayoutError

__all__ = ["ConfigError", "LayoutError", "RunConfig", "load", "dump", "from_data", "to_dict", "config_hash",
           # the sections, where RunConfig's users have always found them
           "CheckpointConfig", "DataConfig", "GeneratorConfig", "MetricsConfig", "MixedPrecisionConfig", "ModelConfig",
           "OptimizerConfig", "ParallelConfig", "RecoveryConfig", "SlurmConfig", "SyncConfig", "TimeoutsConfig",
           "TrainerConfig", "TrainingConfig"]

@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One run. Cross-section checks (the layout) happen here, so bad configs fail at submit.

    ``name`` names the run's folder and Slurm job: 1 to 128 of ``A-Z a-z 0-9 . _ -``,
    starting with a letter or digit. ``seed``: 0 to 2**63 - 1. No string of the config may
    hold a control character (a newline would end a line of the batch script).
    """

    name: str = "run"
    program: str = "pretrain"  # or sft (core.config.sft), grpo, ppo (core.config.rl)
    init_from: str | None = None  # RUN_DIR[:STEP] or hf:PATH: start from a model's weights (core.config.rl, hfinit)
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
    sft: sft_spec.SFTConfig = field(default_factory=sft_spec.SFTConfig)

    def __post_init__(self) -> None:
        inputs.check_strings(self, "")
        check_bounds(self, "")
        inputs.check_name("name", self.name)
        if not self.runs_root.strip():
            raise ConfigError("runs_root: empty; give the folder that holds the run folders, e.g. runs")
        if self.model.kind == "gpt":
            _check_layout(self)
            _check_data(self)
        _check_generator(self)
        _check_rl(self)

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims.from_world(world_size=self.trainer.world_size, tp=self.parallel.tp, pp=self.parallel.pp)

    @property
    def lr(self) -> float:
        """The learning rate, with ``auto`` resolved (a heuristic: 3e-6 × sqrt(batch/1024))."""
        if self.optimizer.lr == "auto":
            return 3e-6 * math.sqrt(self.training.global_batch_size / 1024)
        return float(self.optimizer.lr)


# --- cross-section checks: one line naming the key and the numbers ---------------------------
def _check_zero3(cfg: RunConfig) -> None:
    """What ``parallel.sharding: params`` runs with so far; the rest refused in one line."""
    p, mp = cfg.parallel, cfg.training.mixed_precision
    why = ("tp and pp of 1" if p.tp != 1 or p.pp != 1 else "program: pretrain" if cfg.program != "pretrain" else
           "generator.enabled: false" if cfg.generator.enabled else "no fp16 (bf16 or fp32)" if
           mp.param_dtype == "fp16" else "overlap_grad_reduce: false (FSDP2 overlaps by itself)" if
           p.overlap_grad_reduce else None)
    if why:
        raise LayoutError(f"parallel.sharding: params (ZeRO-3) runs with {why} so far (now tp={p.tp} pp={p.pp}, "
                          f"program={cfg.program}); use parallel.sharding=optimizer for this run")


def _check_layout(cfg: RunConfig) -> None:
    """Reject layouts Megatron (and FSDP2) cannot run, with the numbers in the message."""
    p, m, t = cfg.parallel, cfg.model, cfg.training
    if p.sync.local and (p.sharding != "none" or p.overlap_grad_reduce or cfg.program != "pretrain"):
        raise LayoutError(f"parallel.sync: periodic synchronisation (every {p.sync.every}) keeps whole replicas "
                          f"apart: it runs with parallel.sharding: none, overlap_grad_reduce: false and program: "
                          f"pretrain (now {p.sharding}, {str(p.overlap_grad_reduce).lower()}, {cfg.program})")
    if p.sync.local and p.pp > 1 and m.tie_embeddings:  # the averaging skips Megatron's embedding all-reduce
        raise LayoutError(f"parallel.sync: periodic synchronisation (every {p.sync.every}) with parallel.pp: {p.pp} "
                          "and model.tie_embeddings: true would let the first and last stages' copies of the "
                          "embedding drift apart; set parallel.pp=1, model.tie_embeddings=false or "
                          "parallel.sync.every=1 (no adaptive_latency_ms)")
    if m.num_attention_heads % p.tp:
        raise LayoutError(f"parallel.tp: {p.tp} does not divide model.num_attention_heads = "
                          f"{m.num_attention_heads}; pick a tp that divides it")
    if p.bucket_size is not None and not p.overlap_grad_reduce:
        raise ConfigError(f"parallel.bucket_size: {p.bucket_size} is used only with parallel.overlap_grad_reduce: true "
                          "(without it the gradients are reduced in one piece); set both or drop bucket_size")
    if p.sharding == "params":
        _check_zero3(cfg)
    if m.query_groups % p.tp:
        raise LayoutError(f"parallel.tp: {p.tp} does not divide model.num_query_groups = {m.query_groups} "
                          "(each tensor-parallel rank holds whole key/value groups); pick a tp that divides it")
    if m.num_layers % p.pp:
        raise LayoutError(f"parallel.pp: {p.pp} does not divide model.num_layers = {m.num_layers}; "
                          "pick a pp that divides it")
    try:
        dims = cfg.dims
    except LayoutError as exc:
        raise LayoutError(f"trainer: {cfg.trainer.nodes} node(s) × {cfg.trainer.n_gpus_per_node} = "
                          f"{cfg.trainer.world_size} workers are not divisible by tp*pp = {p.tp * p.pp}") from exc
    if t.micro_batch_size != "auto" and t.global_batch_size % (t.micro_batch_size * dims.dp):
        raise LayoutError(f"training.global_batch_size: {t.global_batch_size} is not divisible by "
                          f"micro_batch_size × dp = {t.micro_batch_size} × {dims.dp} = {t.micro_batch_size * dims.dp}")


def _check_data(cfg: RunConfig) -> None:
    """``data.task: count_to``'s rows (core.model.gpt.data): a target, at least two numbers
    and the end-of-text token, the vocabulary's last id, in ``seq_length + 1`` tokens."""
    if cfg.data.kind != "synthetic" or cfg.data.task != "count_to":
        return
    for key, value in (("model.seq_length", cfg.model.seq_length), ("model.vocab_size", cfg.model.vocab_size)):
        if value < 3:
            raise ConfigError(f"{key}: {value} < 3: data.task: count_to writes a target, a count of at least two "
                              "numbers and the end-of-text token (model.vocab_size - 1); raise it or pick another "
                              "data.task")


def _check_generator(cfg: RunConfig) -> None:
    """The generator's layout and lengths against the model and the trainer's workers."""
    gen = cfg.generator
    if not gen.enabled:
        return
    world_size, heads, seq_length, kind = (cfg.trainer.world_size, cfg.model.num_attention_heads,
                                           cfg.model.seq_length, cfg.model.kind)
    if kind != "gpt":
        raise ConfigError(f"generator.enabled: the {kind} model cannot generate; use model.kind=gpt")
    if gen.split:
        world_size = gen.own_processes
        where = f"generator.workers = {world_size}"
    else:
        where = f"the {world_size} trainer workers it is colocated on"
        if gen.workers not in (0, world_size):
            raise ConfigError(f"generator.workers: {gen.workers}, but a colocated generator runs on the trainer's "
                              f"{world_size} workers; drop generator.workers or use generator.placement=split")
    if heads % gen.tp or world_size % gen.tp:
        raise ConfigError(f"generator.tp: {gen.tp} must divide model.num_attention_heads = {heads} and {where}; "
                          "pick a tp that divides both")
    if cfg.model.query_groups % gen.tp:
        raise ConfigError(f"generator.tp: {gen.tp} does not divide model.num_query_groups = {cfg.model.query_groups} "
                          "(each tensor-parallel rank holds whole key/value groups); pick a tp that divides it")
    if gen.prompt_length + gen.max_new_tokens > seq_length:
        raise ConfigError(f"generator.max_new_tokens: {gen.prompt_length} prompt + {gen.max_new_tokens} new tokens "
                          f"exceed model.seq_length = {seq_length}; generate fewer tokens or use shorter prompts")
    what, row = "generator.prompt_length + generator.max_new_tokens", gen.prompt_length + gen.max_new_tokens
    if cfg.program in rl_spec.RL_PROGRAMS:  # an RL run's rows: its prompts and responses
        what, row = "rl.prompt_length + rl.max_response_length", cfg.rl.prompt_length + cfg.rl.max_response_length
    if gen.engine == "megatron" and gen.max_batch_tokens < row:
        raise ConfigError(f"generator.max_batch_tokens: {gen.max_batch_tokens} holds no row of {what} = {row} tokens; "
                          f"raise it to at least {row}")
    if gen.engine == "vllm":
        _check_vllm(cfg)


VLLM_MIN_HEAD_DIM = 32  # vLLM's CPU attention refuses smaller heads (and no real model has them)


def _check_vllm(cfg: RunConfig) -> None:
    """vLLM loads the policy as a Hugging Face Llama, Qwen2 or Qwen3 model; a colocated engine
    leaves the trainer some of the GPU; its KV cache holds a whole sequence. (Against a GPU's
    size: ``baton plan``, core.config.genplan.)"""
    m = cfg.model
    want = {"normalization": "rmsnorm", "activation": "swiglu", "position_embedding": "rope", "bias": False}
    off = [f"model.{k}: {str(v).lower()} (now {str(getattr(m, k)).lower()})" for k, v in want.items()
           if getattr(m, k) != v]
    if m.qk_norm and m.qkv_has_bias:
        off.append("model.qk_norm and model.qkv_bias not both (Qwen3 has qk_norm, Qwen2 qkv_bias)")
    if off:
        raise ConfigError(f"generator.engine: vllm runs the policy as a Hugging Face Llama/Qwen2/Qwen3 model, which "
                          f"needs {', '.join(off)}; change the model section or use generator.engine=megatron")
    if m.rope_scaling_factor is not None and (m.qk_norm or m.qkv_has_bias):
        raise ConfigError(f"model.rope_scaling_factor: {m.rope_scaling_factor:g} is Llama 3's rope scaling, which a "
                          "Qwen2/Qwen3 model (qkv_bias / qk_norm) has none of in Hugging Face; drop it or use "
                          "generator.engine=megatron")
    if m.head_size < VLLM_MIN_HEAD_DIM:
        raise ConfigError(f"generator.engine: vllm needs a head dim of at least {VLLM_MIN_HEAD_DIM} (model.hidden_size "
                          f"{m.hidden_size} / model.num_attention_heads {m.num_attention_heads} = {m.head_size}); "
                          "use fewer, wider heads (or model.head_dim) or generator.engine=megatron")
    g = cfg.generator
    if not g.split and g.kv_cache_mb is None and g.gpu_memory_utilization >= 1:
        raise ConfigError(f"generator.gpu_memory_utilization: {g.gpu_memory_utilization:g} gives a colocated vLLM "
                          "engine the whole GPU and the trainer none while it generates; lower it to leave the trainer its share (baton plan shows both), set "
                          "generator.kv_cache_mb, or use generator.placement=split")
    # the KV cache must hold one whole sequence (the engine's max_model_len: seq_length + 1), or
    # vLLM refuses to start; counted at 2 bytes a value, the least any dtype takes (bf16 on a GPU)
    if g.kv_cache_mb is not None:
        per_token = 2 * m.num_layers * -(-m.query_groups // g.tp) * m.head_size * 2
        need = (m.seq_length + 1) * per_token
        if g.kv_cache_mb * 2**20 < need:
            raise ConfigError(f"generator.kv_cache_mb: {g.kv_cache_mb:g} holds fewer than one sequence of "
                              f"model.seq_length + 1 = {m.seq_length + 1} tokens ({need} bytes at {per_token} a "
                              f"token in bf16); raise it to at least {need / 2**20:.3g}")


def _check_rl(cfg: RunConfig) -> None:
    """``init_from``, ``program`` and what a GRPO or PPO run needs from the rest of the config."""
    if cfg.init_from is not None and not rl_spec.init_from(cfg.init_from)[0]:
        raise ConfigError(f"init_from: {cfg.init_from!r} names no run folder; give RUN_DIR, RUN_DIR:STEP or hf:PATH")
    tps = {"parallel.tp": cfg.parallel.tp, **({"generator.tp": cfg.generator.tp} if cfg.generator.enabled else {})}
    hfinit.check(cfg.init_from, cfg.model, tps)
    if cfg.init_from is not None and cfg.model.kind != "gpt":
        raise ConfigError(f"init_from: model.kind {cfg.model.kind!r} has no weights to start from; init_from needs "
                          "model.kind: gpt")
    if cfg.program not in rl_spec.PROGRAMS:
        raise ConfigError(f"program: {cfg.program!r} is not one of {', '.join(rl_spec.PROGRAMS)}")
    sft_spec.check(cfg.sft, program=cfg.program, init_from=cfg.init_from)
    if cfg.program == "sft" and (cfg.model.kind != "gpt" or cfg.generator.enabled):
        raise ConfigError(f"program: sft trains a GPT without a generator (now model.kind {cfg.model.kind!r}, "
                          f"generator.enabled {str(cfg.generator.enabled).lower()}); set model.kind=gpt and "
                          "generator.enabled=false")
    if cfg.program not in rl_spec.RL_PROGRAMS:
        return
    rl = cfg.rl
    if cfg.model.kind != "gpt" or not cfg.generator.enabled:
        raise ConfigError(f"program: {cfg.program} needs model.kind: gpt and generator.enabled: true "
                          "(the generator group is the rollout)")
    # The generator holds the prompt and every new token in its KV cache of model.seq_length
    # positions (core.model.gpt.generate); the trainer reads a row less its last token: the
    # generator's bound is the exact one.
    if rl.prompt_length + rl.max_response_length > cfg.model.seq_length:
        raise ConfigError(f"rl.max_response_length: prompt_length + max_response_length = {rl.prompt_length} + "
                          f"{rl.max_response_length} = {rl.prompt_length + rl.max_response_length} > model.seq_length "
                          f"= {cfg.model.seq_length} (the generator holds the prompt and every response token); "
                          f"use at most {cfg.model.seq_length - rl.prompt_length} or raise model.seq_length")
    if cfg.program == "grpo" and rl.n < 2:
        raise ConfigError(f"rl.n: {rl.n} under program: grpo leaves each prompt a group of one response, whose "
                          "advantage is always 0 (nothing to normalise by); set rl.n >= 2, or use program: ppo")
    rows, dp, micro = rl.prompts_per_step * rl.n, cfg.dims.dp, cfg.training.micro_batch_size
    if rl.max_tokens_per_micro_batch:  # the updates' micro-batches are by tokens: any row count splits
        micro = "auto"
    if rows % dp or (micro != "auto" and (rows // dp) % micro):
        raise ConfigError(f"rl.prompts_per_step: prompts_per_step × n = {rows} responses do not split into "
                          f"{dp} data-parallel replica(s) of whole micro-batches of {micro} "
                          "(training.micro_batch_size); pick sizes that divide")
    mini = rl.mini_batch_size
    if mini is not None and (rows % mini or mini % dp or (micro != "auto" and (mini // dp) % micro)):
        why = (f"does not divide prompts_per_step × n = {rows} responses" if rows % mini else
               f"does not split evenly over {dp} data-parallel replica(s)" if mini % dp else
               f"/ dp = {mini // dp} is not whole micro-batches of {micro} (training.micro_batch_size)")
        raise ConfigError(f"rl.mini_batch_size: {mini} {why}; pick a divisor of {rows} that is a multiple of "
                          f"dp × micro_batch_size")
    if cfg.training.recompute != "none" and (cfg.model.hidden_dropout or cfg.model.attention_dropout):
        raise ConfigError(f"training.recompute: {cfg.training.recompute!r} does not act in RL updates with dropout "
                          "(they run in eval mode so that dropout is off; Megatron recomputes in train mode only); "
                          "set model.hidden_dropout=0 and model.attention_dropout=0, or training.recompute=none")
    if rl.reward not in rl_spec.BUILTIN_REWARDS and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", rl.reward):
        raise ConfigError(f"rl.reward: {rl.reward!r} is neither a built-in reward ({', '.join(rl_spec.BUILTIN_REWARDS)}) "
                          "nor 'module:function' (imported on the controller)")
    if rl.reward in rl_spec.TEXT_REWARDS and rl.task != "file":
        raise ConfigError(f"rl.reward: {rl.reward} compares the response's text with each record's answer, but "
                          f"rl.task is {rl.task!r}; set rl.task=file with rl.prompts, or another reward")
    rl_spec.check_task(rl, vocab_size=cfg.model.vocab_size, init_from=cfg.init_from)
    if rl.max_staleness and cfg.generator.placement != "split":
        raise ConfigError(f"rl.max_staleness: {rl.max_staleness} overlaps the rollout with the update, which needs the "
                          f"rollout on workers of its own (generator.placement is {cfg.generator.placement!r}); set "
                          "generator.placement=split, or rl.max_staleness=0")
    ppo_only = [k for k, v, default in (("rl.gamma", rl.gamma, 1.0), ("rl.lam", rl.lam, 1.0),
                                        ("rl.critic", rl.critic, rl_spec.CriticConfig())) if v != default]
    if cfg.program != "ppo" and ppo_only:
        raise ConfigError(f"{ppo_only[0]}: read only with program: ppo (now {cfg.program}): GRPO has no critic; "
                          "set program=ppo or drop it")
    if rl.kl.target is not None and rl.kl.coef == 0:
        raise ConfigError(f"rl.kl.coef: 0 with rl.kl.target: {rl.kl.target:g} stays 0 (the adaptive coefficient "
                          "scales what it has); give rl.kl.coef a positive start")
    if rl.warmup_steps > cfg.trainer.steps:
        raise ConfigError(f"rl.warmup_steps: {rl.warmup_steps} > trainer.steps = {cfg.trainer.steps}")


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
    return build(RunConfig, hfinit.fill_model(data), finite=True)


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
