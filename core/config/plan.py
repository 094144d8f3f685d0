"""The plan of a GPT run: who holds which layers, how many parameters, how much memory.

Pure arithmetic over a ``RunConfig``, so the login node can answer "does this fit?"
before a job costs a queue slot; ``core.config.planview`` writes the answer for ``baton plan``. The model it counts is Megatron-core's ``GPTModel``
as ``core.model.gpt.model`` builds it, in the shapes ``core.config.modelcfg`` offers; tied
embeddings (``model.tie_embeddings``) are counted once in the total, plus the last stage's
copy when pp > 1.

Memory, per GPU (bytes; ``P`` = parameters on that rank, after tensor parallelism):

- weights: ``2P`` bf16/fp16 compute copy + ``4P`` fp32 master under mixed precision,
  else ``4P``; the distributed optimizer shards the master copy over dp.
- gradients: Megatron DDP's ``main_grad`` buffer, ``4P`` when grads are reduced in fp32
  (``core.model.gpt.model``: fp32 training, or ``mixed_precision.reduce_dtype: fp32``), else
  ``2P`` in the bf16/fp16 parameter dtype.
- optimizer: Adam's two fp32 moments, ``8P``, sharded over dp by the distributed optimizer.
- activations (Korthikanti et al. 2022, no sequence parallelism), per layer and
  micro-batch: ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` without recompute,
  ``s·b·h·(10 + 24/t)`` with selective recompute, ``2·s·b·h`` (the layer input) with full
  recompute; times the micro-batches 1F1B keeps in flight on stage ``i``,
  ``min(pp - i, micro-batches)``; plus fp32 logits ``s·b·(vocab/t)·4`` on the last stage.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from core.config.dims import ParallelDims
from core.config.rl import RL_PROGRAMS
from core.config.run import RunConfig
from core.errors import ConfigError, LayoutError

logger = logging.getLogger(__name__)

GIB = 1024**3
RECOMPUTE_MODES = ("none", "selective", "full")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
AUTO_HEADROOM = 0.9  # micro_batch_size: auto uses 90 % of what is left for activations


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """One rank: its coordinates, its node slot, its layers and what else it holds."""

    rank: int
    node: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    layers: tuple[int, ...]  # global transformer layer indices of its pipeline stage
    embeddings: bool
    output_layer: bool
    loss_owner: bool
    params: int  # parameters on this rank (its tensor-parallel shard)


@dataclass(frozen=True, kw_only=True)
class ParamCount:
    """Parameters of the whole model; a tied output layer is counted once, in ``embeddings``."""

    total: int
    embeddings: int  # word (vocab × hidden) + position (seq × hidden)
    per_layer: int
    final_norm: int
    output_layer: int  # an untied output layer (vocab × hidden); 0 when tied
    tied: bool
    tied_copy: int  # tied with pp > 1: the last stage's copy of the word embeddings; else 0


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes on the worst rank under one choice of optimizer sharding and recompute."""

    rank: int
    distributed_optimizer: bool
    recompute: str
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    logits_bytes: int
    total_bytes: int
    fits: bool | None  # None when no GPU memory was given


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything ``baton plan`` shows; saved as ``plan.json`` in the run folder."""

    dims: ParallelDims
    nodes: int
    gpus_per_node: int
    global_batch_size: int
    micro_batch_size: int
    micro_batch_auto: bool
    num_micro_batches: int
    ranks: tuple[RankPlan, ...]
    params: ParamCount
    memory: MemoryEstimate  # the configured optimizer sharding and recompute
    variants: tuple[MemoryEstimate, ...]  # every optimizer sharding × recompute mode
    gpu_mem_gb: float | None
    fits: bool | None
    warnings: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, dicts, numbers), ready for JSON."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """The plan as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _layer_params(cfg: RunConfig, tp: int) -> int:
    """One transformer layer's parameters on one tensor-parallel rank: QKV (``query_width``
    wide queries, ``kv_channels`` wide keys and values), fc1 (gate and up under SwiGLU) and
    their biases, proj and fc2 split over tp; the row-parallel biases, the two norms and the
    q/k norms (one head wide) replicated."""
    m = cfg.model
    h, f, kv, bias = m.hidden_size, m.ffn * (2 if m.activation == "swiglu" else 1), m.kv_channels, int(m.bias)
    q, qkv_bias = m.query_width, int(m.qkv_has_bias)
    sharded = h * (q + 2 * kv) + qkv_bias * (q + 2 * kv) + q * h + h * f + bias * f + m.ffn * h
    qk_norm = 2 * m.head_size * (1 if m.normalization == "rmsnorm" else 2) if m.qk_norm else 0
    replicated = 2 * bias * h + 2 * _norm(cfg) + qk_norm  # proj and fc2 biases, 2 norms, q/k norms
    return ceil_div(sharded, tp) + replicated


def _norm(cfg: RunConfig) -> int:  # a norm's parameters: LayerNorm's weight and bias, RMSNorm's weight
    return cfg.model.hidden_size * (1 if cfg.model.normalization == "rmsnorm" else 2)


def _positions(cfg: RunConfig) -> int:  # the learned position-embedding table (none under rope)
    return 0 if cfg.model.position_embedding == "rope" else cfg.model.seq_length * cfg.model.hidden_size


def _tied(cfg: RunConfig) -> bool:
    return cfg.model.tie_embeddings


def count_params(cfg: RunConfig) -> ParamCount:
    """Parameters of the unsharded model (``tp = 1``)."""
    m, tied = cfg.model, _tied(cfg)
    embeddings = m.vocab_size * m.hidden_size + _positions(cfg)
    per_layer = _layer_params(cfg, 1)
    final_norm = _norm(cfg)
    output_layer = 0 if tied else m.vocab_size * m.hidden_size
    return ParamCount(
        total=embeddings + m.num_layers * per_layer + final_norm + output_layer, embeddings=embeddings,
        per_layer=per_layer, final_norm=final_norm, output_layer=output_layer, tied=tied,
        tied_copy=m.vocab_size * m.hidden_size if tied and cfg.parallel.pp > 1 else 0,
    )


def rank_params(cfg: RunConfig, *, tp: int, first: bool, last: bool, n_layers: int) -> int:
    m = cfg.model
    params = n_layers * _layer_params(cfg, tp)
    vocab_shard = ceil_div(m.vocab_size, tp) * m.hidden_size
    if first:
        params += vocab_shard + _positions(cfg)  # position embeddings are replicated
    if last:
        params += _norm(cfg)  # the final norm
        if not (_tied(cfg) and first):
            params += vocab_shard  # untied output layer, or the tied copy on a later stage
    return params


def _rank_table(cfg: RunConfig, dims: ParallelDims) -> tuple[RankPlan, ...]:
    per_stage = cfg.model.num_layers // dims.pp
    gpus = cfg.trainer.n_gpus_per_node
    rows = []
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        first, last = c.pp == 0, c.pp == dims.pp - 1
        rows.append(RankPlan(
            rank=rank, node=rank // gpus, local_rank=rank % gpus, tp=c.tp, pp=c.pp, dp=c.dp,
            layers=tuple(range(c.pp * per_stage, (c.pp + 1) * per_stage)),
            embeddings=first, output_layer=last, loss_owner=last and c.tp == 0,
            params=rank_params(cfg, tp=dims.tp, first=first, last=last, n_layers=per_stage),
        ))
    return tuple(rows)


def layer_activation_bytes(cfg: RunConfig, recompute: str, micro_batch: int, *, seq: int | None = None,
                           attention: int = 5) -> int:
    """One layer's activations of a micro-batch of ``seq`` tokens a row (None: the model's), in
    2-byte units; ``attention``: bytes per attention score kept (5: the softmax, the dropout mask
    and its output; 2 without dropout, the softmax alone)."""
    m, t = cfg.model, cfg.parallel.tp
    s, b, h = seq or m.seq_length, micro_batch, m.hidden_size
    if recompute == "full":
        return 2 * s * b * h
    # s·b·(10h + (8h + 4f)/t) + 5·a·s²·b/t (f = ffn: 24h/t for GELU's 4h; SwiGLU keeps 8f: gate, up, SiLU, product)
    selective = s * b * (10 * h + (8 * h + (8 if m.activation == "swiglu" else 4) * m.ffn) // t)
    return selective + (recompute != "selective") * attention * (m.num_attention_heads // t) * s * s * b


def _stage_activation_bytes(cfg: RunConfig, dims: ParallelDims, *, stage: int, recompute: str,
                            micro_batch: int, in_flight: int) -> tuple[int, int]:
    """(activations, head) bytes of one rank on ``stage``: its layers' (the formula counts 2-byte
    values: scaled to the compute dtype, 1 byte under int8 storage), and on the last stage the
    final norm's and output layer's inputs with the logits (fp32; 2 bytes under int8: the
    loss inside the model's forward keeps its softmax as int8 too, beside its scales))."""
    m, per_stage = cfg.model, cfg.model.num_layers // dims.pp
    width = 1 if cfg.training.activation_storage == "int8" else DTYPE_BYTES[
        cfg.training.mixed_precision.resolved(on_cuda=True)[0]]
    acts = per_stage * layer_activation_bytes(cfg, recompute, micro_batch) * in_flight * width // 2
    last = stage == dims.pp - 1
    return acts, last * m.seq_length * micro_batch * (ceil_div(m.vocab_size, dims.tp) * min(4, 2 * width)
                                                     + 2 * m.hidden_size * width)


def stage_static_bytes(cfg: RunConfig, params: int, dp: int, distributed_optimizer: bool) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes for ``params`` parameters on one rank; an RL
    program's other models on the trainer's ranks too: a critic like the actor (ppo), the
    reference's weights (rl.kl)."""
    param_dtype, reduce_dtype = cfg.training.mixed_precision.resolved(on_cuda=True)  # a GPU plan
    if cfg.parallel.sharding == "params":  # ZeRO-3: fp32 storage, gradients and Adam moments, all split over dp
        return ceil_div(4 * params, dp), ceil_div(4 * params, dp), ceil_div(8 * params, dp)
    shard = dp if distributed_optimizer else 1
    models = 2 if cfg.program == "ppo" else 1
    low = DTYPE_BYTES[param_dtype]
    if low < 4:
        weights = low * params + ceil_div(4 * params, shard)
        grads = (4 if reduce_dtype == "fp32" else low) * params  # as core.model.gpt.model's grad_reduce_in_fp32
    else:
        weights = grads = 4 * params
    reference = low * params if cfg.program in RL_PROGRAMS and cfg.rl.kl.enabled else 0
    return models * weights + reference, models * grads, models * ceil_div(8 * params, shard)


def _estimate(cfg: RunConfig, dims: ParallelDims, ranks: tuple[RankPlan, ...], *, micro_batch: int,
              num_micro: int, distributed_optimizer: bool, recompute: str,
              gpu_bytes: int | None) -> MemoryEstimate:
    worst: MemoryEstimate | None = None
    for r in ranks:
        if r.tp or r.dp:  # every tp and dp replica of a stage needs the same memory
            continue
        weights, grads, optim = stage_static_bytes(cfg, r.params, dims.dp, distributed_optimizer)
        acts, logits = _stage_activation_bytes(cfg, dims, stage=r.pp, recompute=recompute,
                                               micro_batch=micro_batch,
                                               in_flight=min(dims.pp - r.pp, num_micro))
        total = weights + grads + optim + acts + logits
        if worst is None or total > worst.total_bytes:
            worst = MemoryEstimate(
                rank=r.rank, distributed_optimizer=distributed_optimizer, recompute=recompute,
                weights_bytes=weights, grads_bytes=grads, optimizer_bytes=optim,
                activations_bytes=acts, logits_bytes=logits, total_bytes=total,
                fits=None if gpu_bytes is None else total <= gpu_bytes,
            )
    assert worst is not None
    return worst


def _samples_per_replica(cfg: RunConfig, dims: ParallelDims) -> int:
    gb = cfg.training.global_batch_size
    if gb % dims.dp:
        raise LayoutError(f"training.global_batch_size: {gb} is not divisible by dp = {dims.dp}; "
                          f"use a multiple of {dims.dp}")
    return gb // dims.dp


def memory_per_sample(cfg: RunConfig) -> int:
    """Activation + logits bytes one sample of a micro-batch adds on the worst stage.

    Counts the full 1F1B depth (``pp - stage`` micro-batches in flight), an upper bound
    that does not depend on the micro-batch size being resolved.
    """
    dims = cfg.dims
    return max(sum(_stage_activation_bytes(cfg, dims, stage=p, recompute=cfg.training.recompute,
                                           micro_batch=1, in_flight=dims.pp - p))
               for p in range(dims.pp))


def static_bytes(cfg: RunConfig) -> int:
    """Weights + gradients + optimizer bytes of the rank holding the most of them."""
    dims = cfg.dims
    return max(sum(stage_static_bytes(cfg, r.params, dims.dp, cfg.parallel.distributed_optimizer))
               for r in _rank_table(cfg, dims) if r.tp == 0 and r.dp == 0)


def resolve_micro_batch(cfg: RunConfig, available_bytes: float) -> int:
    """``micro_batch_size: auto``: the most samples that fit in ``available_bytes``.

    ``available_bytes`` is the GPU memory left for activations (after ``static_bytes``).
    Takes ``max(1, floor(available × 0.9 / memory_per_sample))``, then the largest value
    not above it that divides ``global_batch_size / dp``.
    """
    per_replica = _samples_per_replica(cfg, cfg.dims)
    limit = max(1, math.floor(max(available_bytes, 0) * AUTO_HEADROOM / memory_per_sample(cfg)))
    return max(b for b in range(1, min(limit, per_replica) + 1) if per_replica % b == 0)


def _layout_warnings(cfg: RunConfig, dims: ParallelDims, num_micro: int) -> list[str]:
    m, tp = cfg.model, dims.tp
    out = []
    if m.vocab_size % tp:
        out.append(f"model.vocab_size: {m.vocab_size} is not divisible by parallel.tp = {tp}; Megatron's "
                   f"vocab-parallel embedding needs it: pad it to {ceil_div(m.vocab_size, tp) * tp}")
    if m.ffn % tp:
        out.append(f"model.ffn_hidden_size: {m.ffn} is not divisible by parallel.tp = {tp}")
    if num_micro < dims.pp:
        out.append(f"only {num_micro} micro-batch(es) for {dims.pp} pipeline stages: most stages idle; "
                   "raise training.global_batch_size or lower training.micro_batch_size")
    if cfg.parallel.distributed_optimizer and dims.dp == 1:
        out.append("parallel.distributed_optimizer: has no effect with dp = 1")
    return out


def make_plan(cfg: RunConfig, *, gpu_mem_gb: float | None = None) -> Plan:
    """Compute the layout, parameter counts and memory estimate of a GPT run.

    ``gpu_mem_gb`` is the memory of one GPU in GiB; without it there is no fits
    verdict, and ``micro_batch_size: auto`` resolves to 1 (with a warning).
    """
    if cfg.model.kind != "gpt":
        raise ConfigError(f"model.kind: {cfg.model.kind!r} has no Megatron layout to plan; use model.kind: gpt")
    if gpu_mem_gb is not None and gpu_mem_gb <= 0:
        raise ConfigError(f"gpu_mem_gb: {gpu_mem_gb!r} must be > 0")
    dims = cfg.dims
    ranks = _rank_table(cfg, dims)
    gpu_bytes = None if gpu_mem_gb is None else int(gpu_mem_gb * GIB)
    warnings: list[str] = []

    per_replica = _samples_per_replica(cfg, dims)
    auto = cfg.training.micro_batch_size == "auto"
    if not auto:
        micro = int(cfg.training.micro_batch_size)
    elif gpu_bytes is None:
        micro = 1
        warnings.append("training.micro_batch_size: auto resolved to 1 because no GPU memory size was given")
    else:
        micro = resolve_micro_batch(cfg, gpu_bytes - static_bytes(cfg))
    num_micro = per_replica // micro
    warnings += _layout_warnings(cfg, dims, num_micro)

    variants = tuple(
        _estimate(cfg, dims, ranks, micro_batch=micro, num_micro=num_micro, distributed_optimizer=d,
                  recompute=rc, gpu_bytes=gpu_bytes)
        for d in (False, True) for rc in RECOMPUTE_MODES
    )
    memory = next(v for v in variants if v.distributed_optimizer == cfg.parallel.distributed_optimizer
                  and v.recompute == cfg.training.recompute)
    if memory.fits is False:
        fitting = [v for v in variants if v.fits]
        hint = ("; would fit with " + _fix(cfg, fitting)) if fitting else (
            "; no optimizer sharding or recompute setting fits: raise parallel.tp / parallel.pp, "
            "lower training.micro_batch_size or use a smaller model")
        warnings.append(f"does not fit: rank {memory.rank} needs about {memory.total_bytes / GIB:.2f} GiB "
                        f"of {gpu_mem_gb:g} GiB{hint}")
    logger.debug("plan %s: micro-batch %d, worst rank %d needs %d bytes", dims.describe(), micro,
                 memory.rank, memory.total_bytes)
    return Plan(
        dims=dims, nodes=cfg.trainer.nodes, gpus_per_node=cfg.trainer.n_gpus_per_node,
        global_batch_size=cfg.training.global_batch_size, micro_batch_size=micro, micro_batch_auto=auto,
        num_micro_batches=num_micro, ranks=ranks, params=count_params(cfg), memory=memory,
        variants=variants, gpu_mem_gb=gpu_mem_gb, fits=memory.fits, warnings=tuple(warnings),
    )


def _fix(cfg: RunConfig, fitting: list[MemoryEstimate]) -> str:
    """The overrides of the fitting variant with the fewest changes, the cheaper recompute first."""
    def changes(v: MemoryEstimate) -> list[str]:
        out = []
        if v.distributed_optimizer != cfg.parallel.distributed_optimizer:
            out.append(f"parallel.distributed_optimizer={str(v.distributed_optimizer).lower()}")
        if v.recompute != cfg.training.recompute:
            out.append(f"training.recompute={v.recompute}")
        return out

    best = min(fitting, key=lambda v: (len(changes(v)), RECOMPUTE_MODES.index(v.recompute)))
    return " ".join(changes(best))
