"""The actor's RL update: one optimizer step on one mini-batch of the clipped policy
objective, through the same Megatron schedule as a training step (1F1B when pp > 1, the DDP
reduction, the optimizer; tensor-parallel log-probs from the vocab-parallel cross entropy).

Every log-prob and entropy here is at the sampling temperature T = ``rl.temperature``: of
softmax(logits / T), the distribution the rollout drew from before top-k / top-p truncation
(as verl scores them). ``logprobs_at`` (core.model.gpt.logprobs: in chunks of positions) is
the one computation: the update and ``score_rows`` both take the model's logits and call it,
and ``score_rows`` micro-batches the rows as the update does (core.model.gpt.microbatch: each
mini-batch's rows in the same micro-batches, each padded to its own longest row), so the old
policy's log-probs and the update's first-epoch ones are the same arithmetic on the same
shapes (the first epoch's ratio is exactly 1).

A row is prompt + response. The model reads ``row[:-1]``, padded to its micro-batch's
longest row, and scores ``row[1:]``: the response's tokens are labels ``prompt_length - 1``
on. A prompt left-padded by ``pads[i]`` tokens is read with those keys masked out and positions counted
over its real tokens (core.model.gpt.padding): its numbers are those of the prompt alone.
Per response token the row carries its advantage and the old policy's log-prob. The loss
is ``core.model.gpt.rl_loss.policy_loss``, plus ``kl_coef`` × the KL estimate to the
reference's log-probs (computed only with them; reported as its token mean whatever the
mode), less ``rl.entropy_coef`` × the entropy (computed only when the coefficient is not
0), each aggregated over the whole mini-batch (``rl.loss_agg_mode``,
``rl_loss.aggregate``: the batch's ``LossAgg`` counts every replica's rows): a micro-batch
returns its share times micro-batches × dp, which Megatron's schedule divides by the
micro-batch count and DDP averages over dp. Summed, the gradient is that of the whole
mini-batch's loss whatever ``micro_batch_size``, ``rl.max_tokens_per_micro_batch``, dp or
the order of the rows (a replica's micro-batch count is its own).

The update's forward runs with dropout off: in eval mode when the model has dropout (then
the first epoch's new log-probs are the old ones exactly, as ``score_rows`` computes them;
gradients flow all the same), else in train mode, the same function, where Megatron's
activation recompute acts (``core.config.run`` refuses recompute with dropout in RL).

``score_rows`` is the forward-only pass that gives the old policy's log-probs (the actor
before its update, with the entropy of its distribution) and the reference's: the same
``logprobs_at`` the update computes, on the logits of the same forward.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from core.job import process
from core.model.gpt import activations, microbatch, padding, rl_loss
from core.model.gpt.logprobs import logprobs_at
from core.model.gpt.optim import set_lr
from core.model.gpt.step import StepContext, begin_measures, is_loss_owner, measures, reduction
from core.wire import rl_calls
from core.wire.ragged import FLOATS, Ragged


def _arrays(batch: rl_calls.PolicyBatch) -> dict[str, np.ndarray]:
    """Inputs, labels, mask, advantages and old log-probs, rows x the longest row (zero
    padded), with each row's pads and ``lengths`` (what the model reads of it)."""
    rows, p = len(batch.sequences), batch.prompt_length
    width = int(batch.sequences.lengths.max()) - 1
    out = {k: np.zeros((rows, width), dtype=np.int64) for k in ("tokens", "labels")}
    out.update({k: np.zeros((rows, width), dtype=np.float32) for k in ("mask", "adv", "old", "ref")})
    refs = batch.ref_logprobs.rows() if batch.ref_logprobs else [None] * rows
    out["pads"] = pad_counts(batch.pads, rows)
    out["lengths"] = np.zeros(rows, dtype=np.int64)
    for i, (row, adv, old, ref) in enumerate(zip(batch.sequences.rows(), batch.advantages.rows(),
                                                 batch.old_logprobs.rows(), refs, strict=True)):
        n = fill_row(out, i, row, p)
        out["adv"][i, p - 1:n], out["old"][i, p - 1:n] = adv, old
        if ref is not None:
            out["ref"][i, p - 1:n] = ref
    return out


def fill_row(out: dict[str, np.ndarray], i: int, row: np.ndarray, p: int) -> int:
    """Row ``i``'s inputs, labels, response mask (labels ``p - 1`` .. ``n - 1``) and length; ``n``."""
    n = len(row) - 1
    out["tokens"][i, :n], out["labels"][i, :n] = row[:-1], row[1:]
    out["mask"][i, p - 1:n] = 1.0
    out["lengths"][i] = n
    return n


def pad_counts(pads: tuple[int, ...], rows: int) -> np.ndarray:
    """Each row's leading pad tokens (``()``: none) as the ``pads`` array of a batch."""
    if pads and len(pads) != rows:
        raise ValueError(f"{len(pads)} pad counts for {rows} rows")
    return np.asarray(pads or (0,) * rows, dtype=np.int64)


def policy_step(ctx: StepContext, batch: rl_calls.PolicyBatch,
                before_update: Callable[[], None] | None = None) -> dict[str, Any]:
    """One optimizer step of the actor on this replica's share of a mini-batch; this rank's
    metrics (loss owners: the mini-batch's, every replica's together).
    ``before_update``: as for a training step (an async checkpoint's fence)."""
    rl, agg = ctx.cfg.rl, batch.agg
    arrays = _arrays(batch)

    def loss_of(_model: torch.nn.Module, logits: torch.Tensor,
                mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp, ent = logprobs_at(logits, mb["labels"], rl.temperature, entropy=bool(rl.entropy_coef))
        mask = mb["mask"]
        terms, clipped = rl_loss.policy_loss(logp, mb["old"], mb["adv"], clip_low=rl.clip_low,
                                             clip_high=rl.clip_high, clip_c=rl.clip_c)
        total = rl_loss.aggregate(terms, mask, agg)
        numbers = {"pg": total.detach(), "clipped": (clipped * mask).sum().detach(),
                   "max_ratio": (torch.exp(rl_loss.log_ratio(logp, mb["old"])) * mask).max().detach()}
        if batch.ref_logprobs:  # the KL term: in the loss by rl.loss_agg_mode, reported as its token sum
            kl = rl_loss.kl(logp, mb["ref"], rl.kl.estimator)
            if batch.kl_coef:
                total = total + batch.kl_coef * rl_loss.aggregate(kl, mask, agg)
            numbers["kl_sum"] = (kl * mask).sum().detach()
        if rl.entropy_coef:
            total = total - rl.entropy_coef * rl_loss.aggregate(ent, mask, agg)
        return total, numbers

    out, numbers = optimizer_step(ctx, arrays, batch.step, rl.lr, loss_of, before_update=before_update)
    if numbers is not None and is_loss_owner():
        out.update(loss=numbers["pg"], clip_frac=numbers["clipped"] / agg.tokens, ratio_max=numbers["max_ratio"],
                   kl=numbers["kl_sum"] / agg.tokens if batch.ref_logprobs else None)
    return out


LossOf = Callable[[torch.nn.Module, torch.Tensor, dict[str, torch.Tensor]],
                  tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _replicas_total(out_mb: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """The micro-batches' numbers over every data replica: summed, or the largest for names
    that begin with ``max_``. Collective over the data-parallel group (every last-stage rank)."""
    group = parallel_state.get_data_parallel_group()
    totals = {}
    for key in out_mb[0]:
        values = torch.stack([d[key].float() for d in out_mb])
        value = values.max() if key.startswith("max_") else values.sum()
        dist.all_reduce(value, op=dist.ReduceOp.MAX if key.startswith("max_") else dist.ReduceOp.SUM, group=group)
        totals[key] = float(value)
    return totals


def optimizer_step(ctx: StepContext, arrays: dict[str, np.ndarray], step: int, lr: float | None, loss_of: LossOf, *,
                   before_update: Callable[[], None] | None) -> tuple[dict[str, Any], dict[str, float] | None]:
    """One optimizer step of ``ctx``'s model on ``arrays`` (rows x width, with each row's
    ``lengths``) in its micro-batches (core.model.gpt.microbatch) through the pipeline schedule, dropout off (see the module's docstring). ``loss_of(model, output,
    micro-batch)`` gives a micro-batch's share of the mini-batch's loss (the output: the
    model's, logits or values) and its numbers; the share is scaled by micro-batches × dp
    here, which the schedule and DDP divide back. At ``lr`` (None: the schedule's); (this
    rank's metrics, on last-stage ranks the numbers summed over the micro-batches and the
    replicas (``_replicas_total``), else None)."""
    t0 = time.perf_counter()
    begin_measures(ctx)
    cfg = ctx.cfg
    rate = set_lr(ctx.optimizer, step, cfg)
    if lr is not None:  # the RL phase's own rate, with Megatron's per-group multipliers
        for group in ctx.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        rate = lr
    dropout = cfg.model.hidden_dropout > 0 or cfg.model.attention_dropout > 0
    for chunk in ctx.model_chunks:
        chunk.zero_grad_buffer()
        chunk.train(not dropout)
    ctx.optimizer.zero_grad()
    groups = microbatch.groups(arrays["lengths"].tolist(), micro_batch_size=int(cfg.training.micro_batch_size),
                               max_tokens=cfg.rl.max_tokens_per_micro_batch)
    scale = len(groups) * parallel_state.get_data_parallel_world_size()

    def forward(data: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module) -> tuple[Any, Any]:
        mb = next(data)
        if "attention_mask" in mb:
            padding.require_mask_support(model)
        with activations.storing(cfg.training.activation_storage):
            output = model(mb["tokens"], mb["position_ids"], mb.get("attention_mask"))

        def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            share, numbers = loss_of(model, out, mb)
            return share * scale, numbers

        return output, loss_func

    t_data = time.perf_counter()
    batches = list(microbatch.batches(arrays, groups, ctx.device))
    data_wait = time.perf_counter() - t_data
    width, most = microbatch.shape(arrays, groups)
    with reduction(ctx) as synced, microbatch.shapes_vary(ctx.model_chunks):
        out_mb = get_forward_backward_func()(
            forward_step_func=forward, data_iterator=iter(batches), model=ctx.model_chunks,
            num_microbatches=len(groups), seq_length=width, micro_batch_size=most, forward_only=False)
    if before_update is not None:
        before_update()
    update_ok, grad_norm, _ = ctx.optimizer.step()
    out: dict[str, Any] = {**measures(ctx, t0, data_wait, synced[0]), "rss_peak_mb": process.peak_rss_mb()}
    if not parallel_state.is_pipeline_last_stage():
        return out, None
    numbers = _replicas_total(out_mb)
    if is_loss_owner():
        out.update(grad_norm=float(grad_norm) if grad_norm is not None and update_ok else float("nan"),
                   lr=float(rate), tokens=int(arrays["mask"].sum()))
    return out, numbers


def score_rows(ctx: StepContext, req: rl_calls.ScoreRows, chunks: list[Any]) -> rl_calls.RowScores:
    """Log-probs of the response tokens of ``req``'s rows under ``chunks`` (the actor's or the
    reference's, this rank's pipeline stage) at ``rl.temperature``, dropout off (the actor:
    with the entropy at that temperature; the critic: its values); on loss owners. The rows
    are micro-batched as the update micro-batches each of ``req.mini_batch`` rows: the same
    rows share a micro-batch in both, each padded to the same width, so their numbers are the
    same arithmetic."""
    cfg = ctx.cfg
    rows, p, width = len(req.sequences), req.prompt_length, int(req.sequences.lengths.max()) - 1
    arrays = {k: np.zeros((rows, width), dtype=np.int64) for k in ("tokens", "labels")}
    arrays["mask"] = np.zeros((rows, width), dtype=np.float32)
    arrays["pads"], arrays["lengths"] = pad_counts(req.pads, rows), np.zeros(rows, dtype=np.int64)
    for i, row in enumerate(req.sequences.rows()):
        fill_row(arrays, i, row, p)
    groups = microbatch.scoring_groups(arrays["lengths"].tolist(), mini_batch=req.mini_batch,  # the update's
                                       micro_batch_size=int(cfg.training.micro_batch_size),
                                       max_tokens=cfg.rl.max_tokens_per_micro_batch)
    entropy = req.model == "actor"

    def forward(data: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module) -> tuple[Any, Any]:
        mb = next(data)
        if "attention_mask" in mb:
            padding.require_mask_support(model)
        output = model(mb["tokens"], mb["position_ids"], mb.get("attention_mask"))

        def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            if req.model == "critic":  # the value head's one output: [b, s, 1]
                return logits.sum() * 0, {"logp": logits[..., 0].float()}
            zero = logits.sum() * 0  # before logprobs_at spends the logits
            logp, ent = logprobs_at(logits, mb["labels"], cfg.rl.temperature, entropy=entropy)
            out = {"logp": logp}
            if ent is not None:
                out["entropy"] = (ent * mb["mask"]).sum()
            return zero, out

        return output, loss_func

    for chunk in chunks:
        chunk.eval()
    longest, most = microbatch.shape(arrays, groups)
    with torch.no_grad(), microbatch.shapes_vary(chunks):
        out_mb = get_forward_backward_func()(
            forward_step_func=forward, data_iterator=microbatch.batches(arrays, groups, ctx.device), model=chunks,
            num_microbatches=len(groups), seq_length=longest, micro_batch_size=most, forward_only=True)
    if not (is_loss_owner() and parallel_state.is_pipeline_last_stage()):
        return rl_calls.RowScores()
    logp: list[np.ndarray] = [np.empty(0, dtype=np.float32)] * rows
    for group, d in zip(groups, out_mb, strict=True):
        for i, scores in zip(group, d["logp"].cpu().numpy(), strict=True):
            logp[i] = scores[p - 1:arrays["lengths"][i]]
    per_row = Ragged.of(logp, FLOATS)  # float32, as computed
    if req.model == "critic":
        return rl_calls.RowScores(values=per_row, tokens=int(arrays["mask"].sum()))
    return rl_calls.RowScores(
        logprobs=per_row,
        entropy_sum=float(sum(float(d["entropy"]) for d in out_mb)) if entropy else 0.0,
        tokens=int(arrays["mask"].sum()))
