"""Megatron DDP and optimizer, with a learning-rate schedule that Baton computes itself.

Why not Megatron's ``OptimizerParamScheduler``: its state is a few counters that must be
checkpointed and kept in sync with the step. ``lr_at(step, cfg)`` is a pure function of
the step number, so a resumed run (any layout) gets the same learning rate bit for bit,
the controller can print the schedule without torch, and a checkpoint needs no scheduler
state at all. Megatron is imported inside the builders for the same reason: ``lr_at``
must stay importable without torch.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from core.spec.config import RunConfig

if TYPE_CHECKING:
    import torch


def lr_at(step: int, cfg: RunConfig) -> float:
    """Learning rate of step ``step`` (0-based: the number of steps done before it).

    Linear warmup over ``optimizer.warmup_steps`` (step 0 gets lr / warmup, never 0), then
    ``constant`` or ``cosine`` decay from ``lr`` to ``min_lr`` at ``trainer.steps``.
    """
    if step < 0:
        raise ValueError(f"step {step} must be ≥ 0")
    o = cfg.optimizer
    peak, warmup, total = cfg.lr, o.warmup_steps, cfg.trainer.steps
    if step < warmup:
        return peak * (step + 1) / warmup
    if o.schedule == "constant":
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return o.min_lr + 0.5 * (peak - o.min_lr) * (1.0 + math.cos(math.pi * progress))


def wrap_ddp(model: torch.nn.Module, cfg: RunConfig, *, grad_reduce_in_fp32: bool) -> Any:
    """Megatron's DistributedDataParallel: grads reduced (averaged) over DP in finalize, or
    bucket by bucket while backward runs (``parallel.overlap_grad_reduce``: the same sums in
    the same order, so the same gradients bit for bit)."""
    from megatron.core.distributed import (  # lr_at loads without torch
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
        bucket_size=cfg.parallel.bucket_size,
        use_distributed_optimizer=cfg.parallel.distributed_optimizer,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_optimizer(model_chunks: list[Any], cfg: RunConfig) -> Any:
    """Adam over fp32 main weights; ZeRO-1 sharding over DP when distributed_optimizer."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # lr_at loads without torch

    tc = model_chunks[0].config
    o = cfg.optimizer
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr_at(0, cfg),
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.beta1,
        adam_beta2=o.beta2,
        adam_eps=o.eps,
        clip_grad=cfg.training.grad_clip,
        bf16=tc.bf16,
        fp16=tc.fp16,
        params_dtype=tc.params_dtype,
        # fp16: dynamic loss scaling from here (Megatron's default 2**32 skips a dozen steps first)
        initial_loss_scale=cfg.training.mixed_precision.initial_loss_scale,
        use_distributed_optimizer=cfg.parallel.distributed_optimizer,
    )
    return get_megatron_optimizer(config, model_chunks)


def set_lr(optimizer: Any, step: int, cfg: RunConfig) -> float:
    """Write ``lr_at(step)`` (and weight decay) into every param group; returns the lr.

    Megatron's groups carry ``lr_mult`` / ``wd_mult`` (biases and norms get wd_mult 0);
    its own scheduler would apply them, so this does too.
    """
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = cfg.optimizer.weight_decay * group.get("wd_mult", 1.0)
    return lr
