"""Periodic synchronisation of data-parallel replicas (``parallel.sync``, local SGD).

Between synchronisations every replica steps on its own gradients: the step runs without
Megatron's gradient finalisation (no data-parallel all-reduce; with untied embeddings and
no sequence parallelism there is nothing else in it to do; tied embeddings with pp > 1, whose
stages' copies that finalisation keeps equal, are refused at submit: core.config.run). ``average`` makes the replicas
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
from core.model.gpt import spread
from core.model.gpt.optimizer_state import OptimizerState
from core.model.gpt.state import LiveTensor, param_parts, slice_of
from core.model.gpt.step import StepContext

MOMENTUM = "sync.momentum."


class Replicas:
    """This rank's part of the averaging: per model parameter (by id, in order) the
    optimizer's fp32 main weight and Adam moments, found once (they are updated in place),
    and DiLoCo's outer state when ``parallel.sync.outer`` is nesterov."""

    def __init__(self, ctx: StepContext, sync: Any) -> None:
        self.ctx = ctx
        self.opt = OptimizerState(ctx.optimizer)
        self.held: dict[int, dict[str, torch.Tensor]] = {}
        for part in param_parts(ctx.model_chunks):
            if id(part.param) not in self.held and (got := self.opt._tensors(part.param)) is not None:
                self.held[id(part.param)] = got[0]
        self.tensors = [t[k] for t in self.held.values() for k in ("main_param", "exp_avg", "exp_avg_sq")]
        mains = [t["main_param"] for t in self.held.values()]
        self.outer = Outer(mains, sync.outer_lr, sync.outer_momentum) if sync.outer == "nesterov" else None

    def average(self) -> float:
        """Average over the data-parallel group (then the outer step); the seconds it took."""
        t0 = time.perf_counter()
        faults.sync_delay()
        group = parallel_state.get_data_parallel_group()
        with torch.no_grad():
            flat = torch.cat([t.reshape(-1).float() for t in self.tensors])
            dist.all_reduce(flat, group=group)
            flat /= dist.get_world_size(group)
            offset = 0
            for t in self.tensors:
                t.view(-1).copy_(flat[offset:offset + t.numel()])
                offset += t.numel()
        if self.outer is not None:
            self.outer.step()
        if self.opt.separate_main:  # the model's bf16/fp16 weights from the averaged fp32 ones
            for leaf in self.opt.leaves:
                leaf._copy_main_params_to_model_params()
        return time.perf_counter() - t0

    def reset(self) -> None:
        """After a load of the weights: they are the anchor."""
        if self.outer is not None:
            self.outer.reset()

    def export(self) -> list[tuple[Any, Any]]:
        """The outer momentum's checkpoint slices (the weights' slicing, one writer per slice)."""
        if self.outer is None:
            return []
        by_param = dict(zip(self.held, self.outer.momentum, strict=True))
        out = []
        parts = list(param_parts(self.ctx.model_chunks))
        writes = spread.writers([p.sh for p in parts], follows=0 if self.opt.distributed else len(self.opt.kinds))
        for sh, tensor, param, start in parts:
            if writes(sh):  # the writer of the weight's box (core.model.gpt.spread)
                s = dataclasses.replace(slice_of(sh), name=f"{MOMENTUM}{sh.key}")
                out.append((s, LiveTensor(by_param[id(param)].view(-1)[start:start + tensor.numel()], s.shape)))
        return out

    def restore(self, read: Callable[[str, tuple[int, ...], tuple[int, ...]], Any]) -> None:
        """The outer momentum from a checkpoint; the restored weights are the anchor."""
        if self.outer is None:
            return
        by_param = dict(zip(self.held, self.outer.momentum, strict=True))
        with torch.no_grad():
            for sh, tensor, param, start in param_parts(self.ctx.model_chunks):
                s = slice_of(sh)
                data = torch.from_numpy(read(f"{MOMENTUM}{sh.key}", s.offset, s.shape).copy()).reshape(-1)
                by_param[id(param)].view(-1)[start:start + tensor.numel()].copy_(data)
        self.outer.reset()


class Outer:
    """DiLoCo's outer optimizer: the anchor and the momentum of each main weight."""

    def __init__(self, mains: list[torch.Tensor], lr: float, momentum: float) -> None:
        self.mains, self.lr, self.mu = mains, lr, momentum
        self.anchor = [m.detach().clone() for m in mains]
        self.momentum = [torch.zeros_like(m) for m in mains]

    def reset(self) -> None:
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
