"""The generator group's plan: where it runs, its layout and its memory per rank.

Pure arithmetic beside ``core.config.plan`` (the trainer's), for ``baton plan``. Per generator
rank (bytes; ``P`` its parameters after tensor parallelism, ``b`` the rows its replica
continues at once, ``n`` their length):

- weights: ``P`` in the parameter dtype (2 bytes under bf16/fp16, else 4), nothing else;
- KV cache: ``2 · layers · b · n · kv_channels / tp`` in the same dtype (a key and a value
  per key/value head: grouped-query attention holds ``num_query_groups`` of them);
- logits: the gathered fp32 logits of the prefill, ``b · prompt length · vocab · 4``.

``b`` and ``n``: under ``grpo``/``ppo`` the rollout, every response of a step on the
generator's data replicas (``rl.prompts_per_step · rl.n / dp``) of ``rl.prompt_length +
rl.max_response_length`` tokens; otherwise the generator's own ``num_prompts / dp`` of
``prompt_length + max_new_tokens`` (its continuations at checkpoints).

Colocated, these add to the trainer's worst rank; split, they are all its workers hold.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.config.dims import ParallelDims
from core.config.plan import DTYPE_BYTES, GIB, Plan, ceil_div, rank_params
from core.config.rl import RL_PROGRAMS
from core.config.roles import plan_roles
from core.config.run import RunConfig


@dataclass(frozen=True, kw_only=True)
class GeneratorPlan:
    placement: str
    dims: ParallelDims
    first_rank: int  # the worker rank its rank 0 is
    weights_bytes: int
    kv_cache_bytes: int
    logits_bytes: int
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
    batch = ceil_div(rows, dims.dp)
    # Megatron's static KV cache: per layer, a key and a value of the rank's query groups × head size
    kv = 2 * m.num_layers * batch * (prompt + new) * ceil_div(m.kv_channels, dims.tp) * size
    logits = batch * prompt * m.vocab_size * 4
    total = weights + kv + logits
    together = total if g.split else total + trainer.memory.total_bytes
    gpu = trainer.gpu_mem_gb
    return GeneratorPlan(placement=g.placement, dims=dims, first_rank=role.first_rank,
                         weights_bytes=weights, kv_cache_bytes=kv, logits_bytes=logits, total_bytes=total,
                         with_trainer_bytes=together, fits=None if gpu is None else together <= gpu * GIB,
                         fix=("lower rl.prompts_per_step × rl.n or the lengths, or raise generator.tp or its replicas"
                              if cfg.program in RL_PROGRAMS else "lower generator.num_prompts or raise generator.tp"))


def _rollout(cfg: RunConfig) -> tuple[int, int, int]:
    """(rows continued at once over all replicas, prompt tokens, new tokens) of the largest
    generation: an RL step's rollout under grpo/ppo, else the generator's own prompts."""
    if cfg.program in RL_PROGRAMS:
        rl = cfg.rl
        return rl.prompts_per_step * rl.n, rl.prompt_length, rl.max_response_length
    g = cfg.generator
    return g.num_prompts, g.prompt_length, g.max_new_tokens


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB // 10 else f"{n / 2**20:.1f} MiB"  # MiB: the small models of tests


def format_generator(p: GeneratorPlan) -> str:
    ranks = f"ranks {p.first_rank}-{p.first_rank + p.dims.world_size - 1}"
    where = (f"split: {p.dims.world_size} workers of its own ({ranks})" if p.placement == "split"
             else f"colocated on the trainer's workers ({ranks})")
    line = (f"generator: {p.dims.describe()}, {where}; per rank {_size(p.total_bytes)} (weights "
            f"{_size(p.weights_bytes)}, KV cache {_size(p.kv_cache_bytes)}, logits {_size(p.logits_bytes)})")
    if p.placement != "split":
        line += f"; with the trainer's worst rank {_size(p.with_trainer_bytes)}"
    if p.fits is not None:
        line += "; fits" if p.fits else f"; DOES NOT FIT: {p.fix}"
    return line
