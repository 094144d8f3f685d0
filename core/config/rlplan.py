"""The trainer's memory in an RL update (``program: grpo|ppo``): one actor optimizer step on
the rollout's rows (core.model.gpt.policy), beside ``core.config.plan``'s training step.

Pure arithmetic over a ``RunConfig``, for ``baton plan``. Per rank (bytes), on the worst
pipeline stage:

- static: the training plan's (weights, gradients, optimizer state, the reference's weights,
  ppo's critic: ``core.config.plan.stage_static_bytes``);
- a micro-batch: ``b`` rows of ``s = rl.prompt_length + rl.max_response_length - 1`` tokens
  (a row is read without its last token; a micro-batch is padded to its longest row, at
  most ``s``). ``b``: with ``rl.max_tokens_per_micro_batch`` (0: off) as many rows of ``s``
  as it holds, at least one; else ``training.micro_batch_size``, as ``microbatch.micro_size``
  splits a replica's rows of a mini-batch (``rl.mini_batch_size``, else the step's, over dp).
  With a budget the head is sized at the budget's positions (shorter rows pack up to it:
  ``head_rows``), the layers at ``b`` rows of ``s`` (the attention's worst);
- layers: the training plan's activations at ``s`` and ``b``, the attention keeping its
  softmax alone (``2·a·s²·b``: the update runs without dropout, so no mask nor its output),
  times the micro-batches in flight on the stage;
- head (last stage): the logits of ``T = b·s`` positions, ``vocab / tp`` wide, whose gradient
  core.model.gpt.logprobs writes into them (the compute dtype), and the log-prob / entropy
  temporaries of one chunk of ``LOGIT_CHUNK_TOKENS`` positions (core.config.rl), fp32
  ``[chunk, vocab / tp]``: in forward ``CHUNK_FORWARD`` (the chunk's shifted logits and their
  exp; the entropy adds their product), in backward ``CHUNK_BACKWARD`` (its softmax; the
  entropy adds ``ENTROPY_TEMPORARIES``); each loop frees a chunk's before the next. The
  output layer's backward is the other peak: the gradient copied, with ``b > 1``, from
  ``[b, s]`` into ``[s, b]`` order. ``head_bytes(chunk=None)`` sizes log-probs taken over a
  micro-batch at once (the fp32 softmax whole), for comparison.

Measured against the real update by ``benchmarks/rl_memory.py`` (2,560-token rows, a 32k
vocabulary: the head dominates): the plan is within 15 % of the peak (0.98-0.99 here).
"""
from __future__ import annotations

from dataclasses import dataclass

from core.config import rl as rl_config
from core.config.plan import DTYPE_BYTES, GIB, Plan, ceil_div, layer_activation_bytes, stage_static_bytes
from core.config.rl import RL_PROGRAMS
from core.config.run import RunConfig

ENTROPY_TEMPORARIES = 3  # fp32 [positions, vocab / tp] tensors the entropy adds at its peak
CHUNK_FORWARD = 2  # chunked forward: a chunk's shifted fp32 logits and their exp (the entropy adds one)
CHUNK_BACKWARD = 1  # chunked backward: a chunk's fp32 softmax (the entropy adds ENTROPY_TEMPORARIES)
NO_DROPOUT_ATTENTION = 2  # bytes per attention score an update keeps: the softmax (2-byte units)


@dataclass(frozen=True, kw_only=True)
class RLUpdatePlan:
    """The worst rank's bytes in one actor update of an RL step."""

    rank: int
    row_tokens: int  # ``s``: a row's positions (prompt + response - 1)
    micro_rows: int  # ``b``: rows a micro-batch holds
    chunk_tokens: int  # the positions the log-prob / entropy temporaries span at once
    static_bytes: int  # weights + gradients + optimizer state (+ reference, critic)
    activations_bytes: int  # the layers', micro-batches in flight
    logits_bytes: int  # the head: logits, their gradient and the log-prob / entropy temporaries
    total_bytes: int
    fits: bool | None  # None when no GPU memory was given


def logit_chunk_tokens() -> int:
    """``core.config.rl.LOGIT_CHUNK_TOKENS``: the positions the update's log-probs take at once
    (``head_bytes`` also sizes, with ``chunk=None``, log-probs over a micro-batch at once)."""
    return int(rl_config.LOGIT_CHUNK_TOKENS)


def micro_rows(cfg: RunConfig, row_tokens: int) -> int:
    """The rows of one update micro-batch (see the module's docstring)."""
    rl, dp = cfg.rl, cfg.dims.dp
    per_replica = max(1, (rl.mini_batch_size or rl.prompts_per_step * rl.n) // dp)
    budget = int(rl.max_tokens_per_micro_batch)
    if budget:
        return max(1, min(per_replica, budget // row_tokens))
    want = int(cfg.training.micro_batch_size) if cfg.training.micro_batch_size != "auto" else 1
    return next(m for m in range(min(want, per_replica), 0, -1) if per_replica % m == 0)


def head_rows(cfg: RunConfig, rows: int, row_tokens: int, per_replica: int) -> tuple[int, int]:
    """The (rows, width) whose logits the head holds at its worst: ``rows`` rows of
    ``row_tokens``, or with a token budget, shorter rows packed up to the budget (positions
    ``min(budget, every row of the replica)``, at least one whole row)."""
    budget = int(cfg.rl.max_tokens_per_micro_batch)
    positions = max(row_tokens, min(budget, per_replica * row_tokens))
    if not budget or positions <= rows * row_tokens:
        return rows, row_tokens
    many = max(rows + 1, 2)  # more, shorter rows than whole rows fit: the output layer's reordered copy too
    return many, -(-positions // many)


def head_bytes(cfg: RunConfig, *, rows: int, row_tokens: int, chunk: int | None) -> int:
    """The logits of a micro-batch and the log-prob / entropy temporaries at the larger of the
    update's two peaks: the loss's backward and the output layer's (module docstring)."""
    m, tp = cfg.model, cfg.dims.tp
    width = ceil_div(m.vocab_size, tp)
    dtype = DTYPE_BYTES[cfg.training.mixed_precision.resolved(on_cuda=True)[0]]
    positions = rows * row_tokens
    at_once = positions if chunk is None else min(chunk, positions)
    # the logits' gradient, whole: the fp32 softmax itself where the log-probs take every position
    # at once, else in the compute dtype beside a chunk's fp32 softmax
    gradient = positions * width * (4 if chunk is None else dtype)
    ent = bool(cfg.rl.entropy_coef)
    if chunk is None:
        in_loss = ENTROPY_TEMPORARIES * at_once * width * 4 if ent else 0
    else:  # the larger of a chunk's forward and backward temporaries
        in_loss = max(CHUNK_FORWARD + ent, CHUNK_BACKWARD + ENTROPY_TEMPORARIES * ent) * at_once * width * 4
    # the output layer's backward: a 16-bit copy of the fp32 gradient, and with rows > 1 the
    # gradient copied from [rows, positions] into [positions, rows] order
    in_output = positions * width * ((dtype if dtype < 4 and chunk is None else 0) + (dtype if rows > 1 else 0))
    return gradient + max(in_loss, in_output)


def plan_rl_update(cfg: RunConfig, trainer: Plan) -> RLUpdatePlan | None:
    """The RL update's memory on the worst rank (None for a program without one)."""
    if cfg.program not in RL_PROGRAMS:
        return None
    rl, dims = cfg.rl, cfg.dims
    s = rl.prompt_length + rl.max_response_length - 1
    b = micro_rows(cfg, s)
    per_replica = max(1, (rl.mini_batch_size or rl.prompts_per_step * rl.n) // dims.dp)
    num_micro = max(1, per_replica // b)
    hb, hs = head_rows(cfg, b, s, per_replica)
    chunk = logit_chunk_tokens()
    layer = layer_activation_bytes(cfg, cfg.training.recompute, b, seq=s, attention=NO_DROPOUT_ATTENTION)
    width = DTYPE_BYTES[cfg.training.mixed_precision.resolved(on_cuda=True)[0]]
    gpu = None if trainer.gpu_mem_gb is None else int(trainer.gpu_mem_gb * GIB)
    worst: RLUpdatePlan | None = None
    per_stage = cfg.model.num_layers // dims.pp
    for r in trainer.ranks:
        if r.tp or r.dp:  # every tp and dp replica of a stage needs the same memory
            continue
        static = sum(stage_static_bytes(cfg, r.params, dims.dp, cfg.parallel.distributed_optimizer))
        acts = per_stage * layer * min(dims.pp - r.pp, num_micro) * width // 2
        head = head_bytes(cfg, rows=hb, row_tokens=hs, chunk=chunk) if r.output_layer else 0
        total = static + acts + head
        if worst is None or total > worst.total_bytes:
            worst = RLUpdatePlan(rank=r.rank, row_tokens=s, micro_rows=b, chunk_tokens=min(chunk, hb * hs),
                                 static_bytes=static, activations_bytes=acts, logits_bytes=head, total_bytes=total,
                                 fits=None if gpu is None else total <= gpu)
    return worst


def format_rl_update(p: RLUpdatePlan) -> str:
    """One line for ``baton plan``."""
    line = (f"RL update, worst rank {p.rank}: {p.total_bytes / GIB:.3f} GiB (static {p.static_bytes / GIB:.3f}, "
            f"activations {p.activations_bytes / GIB:.3f}, logits and log-prob temporaries {p.logits_bytes / GIB:.3f}) "
            f"for micro-batches of {p.micro_rows} row(s) of {p.row_tokens:,} tokens, log-probs over "
            f"{p.chunk_tokens:,} positions at once")
    if p.fits is not None:
        line += "; fits" if p.fits else ("; DOES NOT FIT: lower rl.max_tokens_per_micro_batch or "
                                         "training.micro_batch_size, or raise parallel.tp")
    return line
