"""Periodic synchronisation of data-parallel replicas (``parallel.sync``, local SGD).

Between synchronisations every replica steps on its own gradients: the step runs without
Megatron's gradient finalisation (no data-parallel all-reduce; with untied embeddings and
no sequence parallelism there is nothing else in it to do). ``average`` makes the replicas
equal again: every rank's fp32 main weights and both Adam moments, flattened into one
buffer, one all-reduce over its data-parallel group, divided by its size; then the model's
weights from the averaged main weights. Equal replicas at every checkpoint is what makes a
resume exact (a checkpoint holds one replica).

``outer: nesterov`` (DiLoCo, arXiv 2311.08105): the average of the main weights is not
taken as it is; with the weights of the last synchronisation ``anchor`` (the same on every
replica) the pseudo-gradient ``anchor - average`` feeds an SGD step with Nesterov momentum
(``outer_lr``, ``outer_momentum``) from the anchor, which becomes the new weights and anchor.
The momentum is in every checkpoint (``sync.momentum.<name>``, sliced as the weights); the
anchor is the weights themselves there (a checkpoint follows a synchronisation).

``BATON_FAULTS=sync_delay_ms=N`` (core.job.faults) sleeps that long inside the timed
averaging, as a slow link would.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from core.job import faults
from core.model.gpt.optimizer_state import OptimizerState
from core.model.gpt.state import LiveTensor, is_writer, param_parts, slice_of
from core.model.gpt.step import StepContext

MOMENTUM = "sync.momentum."


class Outer:
    """DiLoCo's outer optimizer on this rank: the anchor and the momentum of each main weight."""

    def __init__(self, ctx: StepContext, lr: float, momentum: float) -> None:
        self.ctx, self.lr, self.mu = ctx, lr, momentum
        self.mains = [t["main_param"] for t in _held(ctx).values()]
        self.anchor = [m.detach().clone() for m in self.mains]
        self.momentum = [torch.zeros_like(m) for m in self.mains]

    def reset(self) -> None:
        """After a load: the weights as they are now are the anchor."""
        for a, m in zip(self.anchor, self.mains, strict=True):
            a.copy_(m)

    def step(self) -> None:
        """The averaged main weights → the outer step from the anchor; the new anchor."""
        with torch.no_grad():
            for a, m, v in zip(self.anchor, self.mains, self.momentum, strict=True):
                delta = a - m
                v.mul_(self.mu).add_(delta)
                a.sub_(self.lr * (delta + self.mu * v))
                m.copy_(a)

    def export(self) -> list[tuple[Any, torch.Tensor]]:
        """The momentum's checkpoint slices (the weights' slicing, one writer per slice)."""
        by_param = dict(zip(_held(self.ctx), self.momentum, strict=True))
        out = []
        for sh, tensor, param, start in param_parts(self.ctx.model_chunks):
            if is_writer(sh):
                s = dataclasses.replace(slice_of(sh), name=f"{MOMENTUM}{sh.key}")
                out.append((s, LiveTensor(by_param[id(param)].view(-1)[start:start + tensor.numel()], s.shape)))
        return out

    def restore(self, read: Callable[[str, tuple[int, ...], tuple[int, ...]], Any]) -> None:
        by_param = dict(zip(_held(self.ctx), self.momentum, strict=True))
        with torch.no_grad():
            for sh, tensor, param, start in param_parts(self.ctx.model_chunks):
                s = slice_of(sh)
                data = torch.from_numpy(read(f"{MOMENTUM}{sh.key}", s.offset, s.shape).copy()).reshape(-1)
                by_param[id(param)].view(-1)[start:start + tensor.numel()].copy_(data)
        self.reset()


def _held(ctx: StepContext) -> dict[int, dict[str, torch.Tensor]]:
    """Per model parameter (by id, in order) the optimizer's main weight and moments of it."""
    opt = OptimizerState(ctx.optimizer)
    out: dict[int, dict[str, torch.Tensor]] = {}
    for part in param_parts(ctx.model_chunks):
        if id(part.param) not in out:
            held = opt._tensors(part.param)
            if held is not None:
                out[id(part.param)] = held[0]
    return out


def average(ctx: StepContext, outer: Outer | None = None) -> float:
    """Average this rank's state over its data-parallel group (then ``outer``'s step); the
    seconds it took."""
    opt = OptimizerState(ctx.optimizer)
    tensors = [t[k] for t in _held(ctx).values() for k in ("main_param", "exp_avg", "exp_avg_sq")]
    t0 = time.perf_counter()
    faults.sync_delay()
    group = parallel_state.get_data_parallel_group()
    with torch.no_grad():
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        dist.all_reduce(flat, group=group)
        flat /= dist.get_world_size(group)
        offset = 0
        for t in tensors:
            t.view(-1).copy_(flat[offset:offset + t.numel()])
            offset += t.numel()
    if outer is not None:
        outer.step()
    if opt.separate_main:  # the model's bf16/fp16 weights from the averaged fp32 ones
        for leaf in opt.leaves:
            leaf._copy_main_params_to_model_params()
    return time.perf_counter() - t0
