"""The learning-rate schedule, which Baton computes itself (no torch here).

Why not Megatron's ``OptimizerParamScheduler``: its state is a few counters that must be
checkpointed and kept in sync with the step. ``lr_at(step, cfg)`` is a pure function of
the step number, so a resumed run (any layout) gets the same learning rate bit for bit,
the schedule can be printed without torch, and a checkpoint needs no scheduler state at
all. The DDP wrapper and the optimizer are built in ``core.model.gpt.build``.
"""
from __future__ import annotations

import math
from typing import Any

from core.config.run import RunConfig


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
