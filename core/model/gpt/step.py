"""One global training step (and one evaluation step) with Megatron's 1F1B schedule.

A global step is ``global_batch / (micro_batch × dp)`` micro-batches per data-parallel
replica through ``get_forward_backward_func()`` (1F1B when pp > 1), the DDP gradient
reduction in ``finalize_model_grads``, then one optimizer step. The loss is the mean over
micro-batches and over the DP replicas; every last-stage rank computes it (the
vocab-parallel cross entropy gives the full loss on each TP rank) and the TP-rank-0 one
reports it.

With a loss mask (``program: sft``) the loss is the mean over the counted labels of the whole
global batch, not of each micro-batch: a micro-batch returns its masked sum divided by
``loss_tokens / (micro-batches × dp)``, which the schedule's division by the micro-batch
count and DDP's average over dp turn into sum / loss_tokens, so neither dp, the micro batch
nor tp/pp changes it. Without a mask every label counts and the loss is each micro-batch's
plain mean, as it always was (the same arithmetic: pretraining's numbers do not change).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from core.config.dims import Coords, ParallelDims
from core.config.run import RunConfig
from core.job import faults, process
from core.model.gpt import activations
from core.model.gpt.data import BatchSource, MicroBatch, SFTSource
from core.model.gpt.optim import set_lr

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class StepContext:
    """What a step needs: this rank's model chunks, optimizer and batch source."""

    cfg: RunConfig
    model_chunks: list[Any]
    optimizer: Any
    source: BatchSource | SFTSource
    device: torch.device
    coords: Coords  # this rank's place in the layout
    dims: ParallelDims


def is_loss_owner() -> bool:
    """Last pipeline stage, tensor-parallel rank 0: one per data replica."""
    return parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0


def _to_torch(batches: list[MicroBatch], device: torch.device, *, dp: int = 1) -> Iterator[dict[str, Any]]:
    """Each micro-batch on ``device``; a masked one with its loss denominator (``loss_per``:
    the global batch's counted labels over micro-batches × ``dp``, see the module's docstring)."""
    for mb in batches:
        tokens = torch.from_numpy(mb.tokens).to(device)
        seq = tokens.shape[1]
        batch: dict[str, Any] = {
            "tokens": tokens,
            "labels": torch.from_numpy(mb.labels).to(device),
            "position_ids": torch.arange(seq, device=device).unsqueeze(0).expand_as(tokens),
        }
        if mb.loss_mask is not None:
            assert mb.loss_tokens is not None and mb.loss_tokens > 0  # core.data.sft refuses an empty one
            batch["loss_mask"] = torch.from_numpy(mb.loss_mask).to(device)
            batch["loss_per"] = mb.loss_tokens / (len(batches) * dp)
        yield batch


def _loss_func(per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = per_token_loss.float().mean()
    # The schedule divides the returned loss in place by the micro-batch count: report a copy.
    return loss, {"lm loss": loss.detach().clone()}


def _masked_loss_func(mask: torch.Tensor, loss_per: float,
                      per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The counted labels' loss sum over ``loss_per``; a masked label adds nothing (and gets no gradient)."""
    loss = torch.where(mask, per_token_loss.float(), 0.0).sum() / loss_per
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(storage: str) -> Any:
    def forward(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module) -> tuple[Any, Any]:
        batch = next(data_iterator)
        with activations.storing(storage):  # the model's forward only (core.model.gpt.activations)
            # attention_mask None: the local and TE specs build the causal mask themselves.
            output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        if "loss_mask" in batch:
            return output, partial(_masked_loss_func, batch["loss_mask"], batch["loss_per"])
        return output, _loss_func

    return forward


def _run_schedule(ctx: StepContext, batches: list[MicroBatch], *, forward_only: bool) -> float | None:
    """Run all micro-batches; the DP-averaged mean loss on last-stage ranks, else None."""
    micro = batches[0].tokens.shape[0]
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step(ctx.cfg.training.activation_storage),
        data_iterator=_to_torch(batches, ctx.device, dp=parallel_state.get_data_parallel_world_size()),
        model=ctx.model_chunks,
        num_microbatches=len(batches),
        seq_length=ctx.cfg.model.seq_length,
        micro_batch_size=micro,
        forward_only=forward_only,
    )
    if not parallel_state.is_pipeline_last_stage():
        return None
    mean = torch.stack([d["lm loss"] for d in losses]).mean()
    # Same group membership on every last-stage rank, so the collective is matched.
    dist.all_reduce(mean, group=parallel_state.get_data_parallel_group())
    return float(mean) / parallel_state.get_data_parallel_world_size()


@contextmanager
def reduction(ctx: StepContext, *, local: bool = False) -> Iterator[list[float]]:
    """The schedule's gradient reduction (Megatron's ``finalize_model_grads``) timed into the
    one-element list it yields; ``local``: no reduction at all (``parallel.sync``)."""
    config = ctx.model_chunks[0].config
    finalize, synced = config.finalize_model_grads_func, [0.0]

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return finalize(*args, **kwargs)
        finally:
            synced[0] += time.perf_counter() - t0

    config.finalize_model_grads_func = None if local else (timed if finalize is not None else None)
    try:
        yield synced
    finally:
        config.finalize_model_grads_func = finalize


def begin_measures(ctx: StepContext) -> None:
    """Before a step: the peak-memory counters start again."""
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    process.reset_peak_rss()


def measures(ctx: StepContext, t0: float, data_wait: float, synced: float | None) -> dict[str, Any]:
    """A step's times (wall, data wait, gradient reduction, the compute left) and CUDA peak."""
    wall = time.perf_counter() - t0
    return {"step_time_s": wall, "data_wait_s": data_wait, "grad_sync_s": synced,
            "compute_s": max(0.0, wall - data_wait - (synced or 0.0)),
            "cuda_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if ctx.device.type == "cuda" else None}


def train_step(ctx: StepContext, step: int, before_update: Callable[[], None] | None = None, *,
               local: bool = False) -> dict[str, Any]:
    """One optimizer step on the global batch of ``step``; metrics for this rank.

    ``before_update`` runs after forward and backward, right before the optimizer changes
    the weights (an async checkpoint's fence: its snapshot is read until then). ``local``:
    no gradient reduction over data parallelism (``parallel.sync``); else its time is
    ``grad_sync_s`` (waiting for the slowest replica included). ``data_wait_s``: fetching
    the step's micro-batches; ``compute_s``: the rest of the step (pipeline waits included,
    but not the gradient reduction: a slow rank shows here, its peers in ``grad_sync_s``);
    ``cuda_peak_mb``: the step's peak allocated CUDA memory.
    """
    t0 = time.perf_counter()
    begin_measures(ctx)
    lr = set_lr(ctx.optimizer, step, ctx.cfg)
    for chunk in ctx.model_chunks:
        chunk.zero_grad_buffer()
    ctx.optimizer.zero_grad()
    for chunk in ctx.model_chunks:
        chunk.train()
    faults.data_delay()
    batches = ctx.source.micro_batches(step, "train")
    data_wait = time.perf_counter() - t0
    faults.compute_delay(ctx.coords.rank)
    faults.raise_at_step(step, ctx.coords.rank)
    with reduction(ctx, local=local) as synced:
        loss = _run_schedule(ctx, batches, forward_only=False)
    if before_update is not None:
        before_update()
    update_ok, grad_norm, _ = ctx.optimizer.step()
    if not update_ok:
        log.warning("step %d: optimizer skipped the update (inf/nan gradients under loss scaling)", step)
    rss_peak = process.peak_rss_mb()
    out: dict[str, Any] = {**measures(ctx, t0, data_wait, None if local else synced[0]), "rss_peak_mb": rss_peak}
    if is_loss_owner():
        assert loss is not None
        out.update(
            loss=loss,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=float(lr),
            # This replica's tokens: the controller sums them over the replicas' loss owners.
            tokens=int(ctx.cfg.training.global_batch_size // ctx.dims.dp * ctx.cfg.model.seq_length),
        )
    return out


def eval_step(ctx: StepContext, step: int) -> dict[str, Any]:
    """Forward only on the held-out batch of ``step``; the loss on loss owners."""
    t0 = time.perf_counter()
    for chunk in ctx.model_chunks:
        chunk.eval()
    with torch.no_grad():
        loss = _run_schedule(ctx, ctx.source.micro_batches(step, "eval"), forward_only=True)
    out: dict[str, Any] = {"step_time_s": time.perf_counter() - t0}
    if is_loss_owner():
        assert loss is not None
        out["loss"] = loss
    return out


def _logp_func(per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return per_token_loss.float().sum() * 0, {"logp": -per_token_loss.detach().float()}


def _logp_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module) -> tuple[Any, Any]:
    batch = next(data_iterator)
    return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]), _logp_func


def label_logprobs(ctx: StepContext, batch: MicroBatch) -> torch.Tensor | None:
    """log p(label | tokens before it) of one micro-batch under the trainer, through its
    pipeline with dropout off; ``[b, s]`` on the last stage, None elsewhere."""
    for chunk in ctx.model_chunks:
        chunk.eval()
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=_logp_step, data_iterator=_to_torch([batch], ctx.device), model=ctx.model_chunks,
            num_microbatches=1, seq_length=ctx.cfg.model.seq_length, micro_batch_size=batch.tokens.shape[0],
            forward_only=True)
    return out[0]["logp"] if parallel_state.is_pipeline_last_stage() else None
