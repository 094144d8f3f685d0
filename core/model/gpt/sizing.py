"""The micro-batch a rank trains with: the plan's, or ``auto`` resolved from free memory."""
from __future__ import annotations

import dataclasses
import logging

import psutil
import torch
import torch.distributed as dist

from core.config.plan import resolve_micro_batch, static_bytes
from core.config.run import RunConfig


def with_micro_batch(cfg: RunConfig, micro: int) -> RunConfig:
    return dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, micro_batch_size=micro))


def auto_micro_batch(cfg: RunConfig, *, on_cuda: bool) -> int:
    """``micro_batch_size: auto``: max(1, floor(free memory × 0.9 / memory per sample)),
    with this rank's free memory less the static state ``core.config.plan`` estimates; the
    smallest answer over all ranks wins, so every stage runs the same schedule."""
    if on_cuda:
        free = float(torch.cuda.mem_get_info()[0])
    else:  # the workers of a node share its memory
        free = psutil.virtual_memory().available / cfg.trainer.n_gpus_per_node
    micro = resolve_micro_batch(cfg, free - static_bytes(cfg))
    if dist.is_initialized():
        t = torch.tensor([micro], dtype=torch.int64, device="cuda" if on_cuda else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        micro = int(t.item())
    logging.getLogger(__name__).info("micro_batch_size auto: %d", micro)
    return micro
