"""Periodic synchronisation of data-parallel replicas (``parallel.sync``, local SGD).

Between synchronisations every replica steps on its own gradients: the step runs without
Megatron's gradient finalisation (no data-parallel all-reduce; with untied embeddings and
no sequence parallelism there is nothing else in it to do). ``average`` makes the replicas
equal again: every rank's fp32 main weights and both Adam moments, flattened into one
buffer, one all-reduce over its data-parallel group, divided by its size; then the model's
weights from the averaged main weights. Equal replicas at every checkpoint is what makes a
resume exact (a checkpoint holds one replica).

``BATON_FAULT_SYNC_DELAY_MS`` (a fault injection for tests of the adaptive period) sleeps
that long inside the timed averaging, as a slow link would.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from core.model.gpt.optimizer_state import OptimizerState
from core.model.gpt.state import param_parts
from core.model.gpt.step import StepContext

DELAY_ENV = "BATON_FAULT_SYNC_DELAY_MS"


def average(ctx: StepContext) -> float:
    """Average this rank's state over its data-parallel group; the seconds it took."""
    opt = OptimizerState(ctx.optimizer)
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    for part in param_parts(ctx.model_chunks):
        if id(part.param) in seen:
            continue
        seen.add(id(part.param))
        held = opt._tensors(part.param)
        if held is not None:
            tensors += [held[0][k] for k in ("main_param", "exp_avg", "exp_avg_sq")]
    t0 = time.perf_counter()
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    if delay > 0:
        time.sleep(delay / 1000.0)
    group = parallel_state.get_data_parallel_group()
    with torch.no_grad():
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        dist.all_reduce(flat, group=group)
        flat /= dist.get_world_size(group)
        offset = 0
        for t in tensors:
            t.view(-1).copy_(flat[offset:offset + t.numel()])
            offset += t.numel()
    if opt.separate_main:  # the model's bf16/fp16 weights from the averaged fp32 ones
        for leaf in opt.leaves:
            leaf._copy_main_params_to_model_params()
    return time.perf_counter() - t0
