"""The RL losses the actor and critic compute on their workers, per token, masked.

The field's formulas (verl's ``core_algos``), so that the same settings train the same way:

- ``kl``: k1 ``logp - ref``, ``abs``, k2 ``mse`` ``0.5 (logp - ref)^2``, and k3
  ``low_var_kl`` ``exp(ref - logp) - (ref - logp) - 1`` clamped to [-10, 10].
- ``policy_loss``: the clipped ratio objective with separate low and high clip ranges
  (``1 - clip_low`` .. ``1 + clip_high``), and the dual clip ``clip_c`` for negative
  advantages, per token with where the clip bound; the log-ratio ``logp - old`` is clamped
  to ±20 before ``exp`` (verl: a token the policy moved far never overflows the ratio).
- ``value_loss``: the clipped value objective, ``0.5 max((v - R)^2, (v_clip - R)^2)``, per token.
- ``entropy``: of the full distribution, from logits (``logsumexp - sum p logit``).
- ``vocab_parallel_entropy``: the same from logits whose vocabulary is split over a
  tensor-parallel group (three all-reduces; no rank gathers the vocabulary; backward keeps
  the softmax alone), over the whole tensor at once. The RL passes take it, with the
  log-probs, in chunks of positions (core.model.gpt.logprobs: the same arithmetic per
  position, no fp32 tensor the size of the logits).
- ``aggregate``: a micro-batch's share of a loss aggregated over the whole RL mini-batch
  (``rl.loss_agg_mode``, verl's ``agg_loss`` with global counts): ``token-mean`` Σ terms /
  the mini-batch's response tokens; ``seq-mean-token-mean`` Σ over rows of each row's token
  mean / the mini-batch's rows; ``seq-mean-token-sum-norm`` (Dr. GRPO) Σ terms / (rows ×
  horizon, ``rl.max_response_length``). Summed over every micro-batch of every data replica
  it is the mini-batch's value, whatever the micro-batching, the replicas or the row order.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from core.wire import rl_calls

KL_ESTIMATORS = ("k1", "abs", "mse", "low_var_kl")
KL_CLAMP = 10.0
LOG_RATIO_CLAMP = 20.0  # verl's bound on logp - old before exp
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: rl_calls.LossAgg) -> torch.Tensor:
    """This micro-batch's share (``values``, ``mask``: rows x positions) of the per-token
    terms aggregated over the whole mini-batch ``agg`` counts (see the module's docstring)."""
    if min(agg.tokens, agg.rows, agg.horizon) < 1:
        raise ValueError(f"a loss aggregation over {agg.tokens} tokens, {agg.rows} rows, horizon {agg.horizon}: "
                         "each must be at least 1")
    masked = values * mask
    if agg.mode == "token-mean":
        return masked.sum() / agg.tokens
    if agg.mode == "seq-mean-token-mean":
        return (masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).sum() / agg.rows
    if agg.mode == "seq-mean-token-sum-norm":
        return masked.sum() / (agg.rows * agg.horizon)
    raise ValueError(f"unknown loss aggregation {agg.mode!r}; one of {', '.join(AGG_MODES)}")


def kl(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate."""
    diff = logp - ref_logp
    if estimator == "k1":
        return diff
    if estimator == "abs":
        return diff.abs()
    if estimator == "mse":
        return 0.5 * diff.square()
    if estimator == "low_var_kl":
        r = -diff
        return (torch.exp(r) - r - 1).clamp(-KL_CLAMP, KL_CLAMP)
    raise ValueError(f"unknown KL estimator {estimator!r}; one of {', '.join(KL_ESTIMATORS)}")


def log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """``logp - old_logp`` clamped to ±LOG_RATIO_CLAMP (the ratio is its exp)."""
    return (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
                clip_low: float, clip_high: float, clip_c: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: (the clipped policy loss, 1 where the clip bound and 0 elsewhere)."""
    ratio = torch.exp(log_ratio(logp, old_logp))
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    dual = torch.minimum(-advantages * clip_c, clipped)
    losses = torch.where(advantages < 0, dual, clipped)
    return losses, torch.gt(loss2, loss1).to(logp.dtype)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *,
               clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: (the clipped value loss, 1 where the clipped term was larger and 0 elsewhere)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    plain, other = (values - returns).square(), (clipped - returns).square()
    return 0.5 * torch.maximum(plain, other), torch.gt(other, plain).to(values.dtype)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits) over the last dimension."""
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


class _VocabParallelEntropy(torch.autograd.Function):
    """The entropy of softmax over a vocabulary split over ``group``'s ranks. Backward keeps
    one tensor the size of the logits, the softmax ``p`` (this rank's part, normalised over
    the whole vocabulary): dH/dz = -p (log p + H), this rank's part of the whole
    vocabulary's gradient (every rank computes the same loss of H)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, group: object) -> torch.Tensor:  # type: ignore[override]
        top = logits.max(dim=-1).values  # a shift the entropy does not depend on
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)
        e = shifted.exp()
        weighted = (e * shifted).sum(dim=-1)
        del shifted
        z = e.sum(dim=-1)
        dist.all_reduce(z, group=group)
        dist.all_reduce(weighted, group=group)
        entropy = z.log() - weighted / z
        p = e.div_(z.unsqueeze(-1))
        ctx.save_for_backward(p, entropy)
        return entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        p, entropy = ctx.saved_tensors
        out = torch.xlogy(p, p).add_(p * entropy.unsqueeze(-1))
        return out.mul_(-grad.unsqueeze(-1)), None


def vocab_parallel_entropy(logits: torch.Tensor, group: object) -> torch.Tensor:
    """Per-position entropy of softmax over a vocabulary split in order over ``group``'s
    ranks (``logits``: this rank's ``[..., vocab / tp]`` part); differentiable (the RL
    update's entropy bonus): each rank's gradient is that of its own part. Its backward
    keeps one fp32 tensor the size of the logits (the softmax)."""
    return _VocabParallelEntropy.apply(logits, group)
