"""The generator group's plan: where it runs, its layout and its memory per rank.

Pure arithmetic beside ``core.config.plan`` (the trainer's), for ``baton plan``. Per generator
rank (bytes; ``P`` its parameters after tensor parallelism, ``r`` the rows of its replica's
largest generation, ``n`` their length, ``b`` the rows it continues at once):

- weights: ``P`` in the parameter dtype (2 bytes under bf16/fp16, else 4), nothing else;
- KV cache, per token: ``2 · layers · num_query_groups / tp · head size`` in the same dtype (a
  key and a value per key/value head: grouped-query attention holds ``num_query_groups``);
  Baton's Megatron engine holds ``b · n`` tokens (a static cache per chunk of rows), with
  ``b = min(r, generator.max_batch_tokens // n)`` (at least one row): a replica's rows are
  continued in chunks of at most that many tokens (core.model.gpt.generate);
- logits: Megatron's engine, each row's last prompt position (a static batch materialises
  only the last token's logits), vocab-parallel in fp32: ``b · vocab / tp · 4``;
- prefill: the attention probabilities of the prefill (Megatron's unfused local attention,
  scores and softmax at once) of at most ``b`` prompts (a chunk prefills each distinct prompt
  once: an upper bound): ``2 · b · heads / tp · prompt length²`` in the parameter dtype.

``r`` and ``n``: under ``grpo``/``ppo`` the rollout, every response of a step on the
generator's data replicas (``rl.prompts_per_step · rl.n / dp``) of ``rl.prompt_length +
rl.max_response_length`` tokens; otherwise the generator's own ``num_prompts / dp`` of
``prompt_length + max_new_tokens`` (its continuations at checkpoints). ``baton plan --check``
compares the KV cache with the largest one a replica allocated (``gen_kv_cache_mb`` in
metrics.jsonl).

A vLLM engine (``generator.engine: vllm``) takes ``generator.gpu_memory_utilization`` of the
GPU, its weights included: its KV cache is that share less the weights (and less the
activations vLLM measures when it starts: an upper bound here); ``generator.kv_cache_mb``
sizes the KV cache itself instead (vLLM then ignores the share), and the engine holds its
weights plus that. Its KV cache must hold at least one whole sequence (``model.seq_length + 1``
tokens: vLLM refuses to start otherwise); with less than a whole rollout it decodes in waves.

Colocated, these add to the trainer's worst rank (on a GPU the engine sleeps during the
trainer's updates, its KV cache freed and its weights offloaded, but the trainer's resident
memory stays while the engine generates: the plan counts both at once, an upper bound); split,
they are all its workers hold.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.config.dims import ParallelDims
from core.config.plan import DTYPE_BYTES, GIB, Plan, ceil_div, rank_params
from core.config.rl import RL_PROGRAMS
from core.config.roles import plan_roles
from core.config.run import RunConfig


@dataclass(frozen=True, kw_only=True)
class GeneratorPlan:
    placement: str
    engine: str  # megatron | vllm
    dims: ParallelDims
    first_rank: int  # the worker rank its rank 0 is
    weights_bytes: int
    kv_cache_bytes: int  # vllm by gpu_memory_utilization without a GPU size: 0 (unknown)
    kv_bytes_per_token: int
    kv_tokens: int  # the tokens the KV cache holds per replica (megatron: one chunk of rows)
    rollout_tokens: int  # the tokens of the largest generation per replica (rows × their length)
    rows: int  # the rows of that generation per replica
    chunk_rows: int  # megatron: the rows continued at once (generator.max_batch_tokens); vllm: rows
    logits_bytes: int  # vllm: 0 (its activations are inside its share, measured by vLLM at start)
    prefill_bytes: int  # megatron: the prefill's attention probabilities; vllm: 0
    total_bytes: int  # per generator rank
    with_trainer_bytes: int  # colocated: plus the trainer's worst rank; split: the same as total_bytes
    fits: bool | None  # None when no GPU memory was given
    fix: str  # what to change when it does not fit


def plan_generator(cfg: RunConfig, trainer: Plan) -> GeneratorPlan | None:
    """The generator's plan beside ``trainer``'s (None without a generator)."""
    g = cfg.generator
    role = next((r for r in plan_roles(cfg) if r.name == "generator"), None)
    if role is None:
        return None
    dims = role.dims
    param_dtype, _ = cfg.training.mixed_precision.resolved(on_cuda=True)  # a GPU plan, as the trainer's
    size = DTYPE_BYTES[param_dtype]
    m = cfg.model
    weights = size * rank_params(cfg, tp=dims.tp, first=True, last=True, n_layers=m.num_layers)
    rows, prompt, new = _rollout(cfg)
    batch, row = ceil_div(rows, dims.dp), prompt + new
    gpu = None if trainer.gpu_mem_gb is None else int(trainer.gpu_mem_gb * GIB)
    common: dict[str, Any] = dict(
        placement=g.placement, engine=g.engine, dims=dims, first_rank=role.first_rank, weights_bytes=weights,
        kv_bytes_per_token=kv_bytes_per_token(cfg, tp=dims.tp, dtype_bytes=size), rollout_tokens=batch * row,
        rows=batch)
    if g.engine == "vllm":
        return _vllm(cfg, trainer, gpu, common)
    chunk = chunk_rows(cfg, batch, row)
    kv = common["kv_bytes_per_token"] * chunk * row  # Megatron's static KV cache: a chunk's every position
    logits = chunk * ceil_div(m.vocab_size, dims.tp) * 4
    prefill = 2 * chunk * ceil_div(m.num_attention_heads, dims.tp) * prompt * prompt * size
    total = weights + kv + logits + prefill
    together = total if g.split else total + trainer.memory.total_bytes
    return GeneratorPlan(**common, kv_cache_bytes=kv, kv_tokens=chunk * row, chunk_rows=chunk, logits_bytes=logits,
                         prefill_bytes=prefill, total_bytes=total, with_trainer_bytes=together,
                         fits=None if gpu is None else together <= gpu,
                         fix=_megatron_fix(cfg, chunk, batch))


def _megatron_fix(cfg: RunConfig, chunk: int, rows: int) -> str:
    """What lowers a Megatron engine's memory: fewer rows at once, else shorter rows or more tp."""
    if chunk > 1 and chunk == rows:
        fewer = "rl.prompts_per_step × rl.n" if cfg.program in RL_PROGRAMS else "generator.num_prompts"
        return f"lower {fewer} or generator.max_batch_tokens (the tokens a replica continues at once), or raise generator.tp"
    if chunk > 1:
        return "lower generator.max_batch_tokens (the tokens a replica continues at once), or raise generator.tp"
    return "one row alone does not fit: lower the prompt and response lengths, or raise generator.tp"


def kv_bytes_per_token(cfg: RunConfig, *, tp: int, dtype_bytes: int) -> int:
    """A key and a value per layer of a rank's key/value heads (grouped-query attention:
    ``num_query_groups`` of them, split over ``tp``), each ``head_size`` wide."""
    m = cfg.model
    return 2 * m.num_layers * ceil_div(m.query_groups, tp) * m.head_size * dtype_bytes


def max_batch_tokens(cfg: RunConfig) -> int:
    """``generator.max_batch_tokens``: the most tokens (rows × their length) a replica holds in
    its KV cache at once."""
    return int(cfg.generator.max_batch_tokens)


def chunk_rows(cfg: RunConfig, rows: int, row_tokens: int) -> int:
    """The rows of ``row_tokens`` tokens a replica continues at once, of its ``rows``: as many
    as ``generator.max_batch_tokens`` holds, at least one (submit refuses a budget under one row)."""
    return max(1, min(rows, max_batch_tokens(cfg) // row_tokens))


def _vllm(cfg: RunConfig, trainer: Plan, gpu: int | None, common: dict[str, Any]) -> GeneratorPlan:
    """A vLLM engine's memory per rank: its share of the GPU (or its weights and
    ``kv_cache_mb``), the KV cache in it, on a GPU the staged copy of the whole policy the
    weight syncs fill, and whether it all fits beside the trainer."""
    g, weights, per_token = cfg.generator, common["weights_bytes"], common["kv_bytes_per_token"]
    trainer_bytes = 0 if g.split else trainer.memory.total_bytes
    if g.kv_cache_mb is not None:
        kv = int(g.kv_cache_mb * 2**20)
        total = weights + kv
    elif gpu is None:  # the share of an unknown GPU: nothing to size
        kv, total = 0, weights
    else:
        total = int(g.gpu_memory_utilization * gpu)
        kv = max(total - weights, 0)
    # on a GPU each replica's first rank also holds the whole policy the syncs fill (the staged
    # copy, core.model.gpt.vllm_rollout: NCCL receives into GPU memory only), in the same dtype
    staged = weights * g.tp if gpu is not None else 0
    total += staged
    together = total + trainer_bytes
    sequence = cfg.model.seq_length + 1  # the engine's max_model_len (core.model.gpt.vllm_rollout)
    key = "generator.kv_cache_mb" if g.kv_cache_mb is not None else "generator.gpu_memory_utilization"
    fits: bool | None = None
    fix = ""
    if g.kv_cache_mb is not None or gpu is not None:
        short = kv < sequence * per_token
        fits = not short and (gpu is None or together <= gpu)
        if short:
            fix = (f"{key}: its KV cache holds {kv // per_token} tokens, less than one sequence of "
                   f"model.seq_length + 1 = {sequence} ({_size(sequence * per_token)}); raise it")
        elif gpu is not None and together > gpu:
            fix = _over_gpu_fix(cfg, trainer_bytes + staged, weights, gpu)
    return GeneratorPlan(**common, kv_cache_bytes=kv, kv_tokens=kv // per_token, chunk_rows=common["rows"],
                         logits_bytes=0, prefill_bytes=0, total_bytes=total, with_trainer_bytes=together, fits=fits, fix=fix)


def _over_gpu_fix(cfg: RunConfig, trainer_bytes: int, weights: int, gpu: int) -> str:
    """The fix of an engine over its GPU; ``trainer_bytes``: what else the GPU holds (the
    trainer's worst rank, colocated, and the staged copy of the policy)."""
    g = cfg.generator
    left = gpu - trainer_bytes
    if g.kv_cache_mb is not None:
        return (f"lower generator.kv_cache_mb to at most {max(left - weights, 0) / 2**20:.0f} "
                + (f"(the trainer's worst rank plans {_size(trainer_bytes)} of the GPU's {_size(gpu)}), "
                   if trainer_bytes else "") + "or raise generator.tp")
    if left <= weights:
        return (f"the trainer's worst rank plans {_size(trainer_bytes)} of the GPU's {_size(gpu)}, which leaves "
                "no room for the engine's weights; use generator.placement=split")
    return (f"lower generator.gpu_memory_utilization to at most {left / gpu:.2f} (the trainer's worst rank and the "
            f"staged policy take {_size(trainer_bytes)} of the GPU's {_size(gpu)})"
            + ("" if g.split else ", or use generator.placement=split"))


def _rollout(cfg: RunConfig) -> tuple[int, int, int]:
    """(rows continued at once over all replicas, prompt tokens, new tokens) of the largest
    generation: an RL step's rollout under grpo/ppo, else the generator's own prompts."""
    if cfg.program in RL_PROGRAMS:
        rl = cfg.rl
        return rl.prompts_per_step * rl.n, rl.prompt_length, rl.max_response_length
    g = cfg.generator
    return g.num_prompts, g.prompt_length, g.max_new_tokens


def _size(n: int) -> str:
    if n >= GIB // 10:
        return f"{n / GIB:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 // 10 else f"{n / 2**10:.1f} KiB"  # the small models of tests


def format_generator(p: GeneratorPlan) -> str:
    ranks = f"ranks {p.first_rank}-{p.first_rank + p.dims.world_size - 1}"
    where = (f"split: {p.dims.world_size} workers of its own ({ranks})" if p.placement == "split"
             else f"colocated on the trainer's workers ({ranks})")
    if p.engine == "vllm":
        kv = (f"KV cache {_size(p.kv_cache_bytes)}: {p.kv_tokens:,} tokens of {p.kv_bytes_per_token:,} bytes, "
              f"a whole rollout {p.rollout_tokens:,}" if p.kv_cache_bytes or p.fits is not None
              else "KV cache: what gpu_memory_utilization of the GPU leaves after the weights")
        line = (f"generator: vLLM engine, {p.dims.describe()}, {where}; per rank {_size(p.total_bytes)} (weights "
                f"{_size(p.weights_bytes)}, {kv}; activations inside, measured by vLLM at start)")
    else:
        line = (f"generator: {p.dims.describe()}, {where}; per rank {_size(p.total_bytes)} (weights "
                f"{_size(p.weights_bytes)}, KV cache {_size(p.kv_cache_bytes)}: {p.chunk_rows} of {p.rows} rows at once, "
                f"{p.kv_tokens:,} tokens of {p.kv_bytes_per_token:,} bytes, logits {_size(p.logits_bytes)}, "
                f"prefill {_size(p.prefill_bytes)})")
    if p.placement != "split":
        line += f"; with the trainer's worst rank {_size(p.with_trainer_bytes)}"
        if p.engine == "vllm":
            line += " (counted beside the trainer's: both are resident while it generates)"
    if p.fits is not None:
        line += "; fits" if p.fits else f"; DOES NOT FIT: {p.fix}"
    return line
