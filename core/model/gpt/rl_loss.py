"""The RL losses the actor and critic compute on their workers, per token, masked.

The field's formulas (verl's ``core_algos``), so that the same settings train the same way:

- ``kl``: k1 ``logp - ref``, ``abs``, k2 ``mse`` ``0.5 (logp - ref)^2``, and k3
  ``low_var_kl`` ``exp(ref - logp) - (ref - logp) - 1`` clamped to [-10, 10].
- ``policy_loss``: the clipped ratio objective with separate low and high clip ranges
  (``1 - clip_low`` .. ``1 + clip_high``), and the dual clip ``clip_c`` for negative
  advantages; returns the token-mean loss and the fraction of tokens clipped.
- ``value_loss``: the clipped value objective, ``0.5 max((v - R)^2, (v_clip - R)^2)``.
- ``entropy``: of the full distribution, from logits (``logsumexp - sum p logit``).
- ``vocab_parallel_entropy``: the same from logits whose vocabulary is split over a
  tensor-parallel group (three all-reduces; no rank gathers the vocabulary).
- ``token_mean``: every response token of the batch weighs the same.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

KL_ESTIMATORS = ("k1", "abs", "mse", "low_var_kl")
KL_CLAMP = 10.0


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


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


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                clip_low: float, clip_high: float, clip_c: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(token-mean clipped policy loss, fraction of tokens where the clip was active)."""
    ratio = torch.exp(logp - old_logp)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    dual = torch.minimum(-advantages * clip_c, clipped)
    losses = torch.where(advantages < 0, dual, clipped)
    clip_frac = token_mean(torch.gt(loss2, loss1).to(logp.dtype), mask)
    return token_mean(losses, mask), clip_frac


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(token-mean clipped value loss, fraction of tokens where the clipped term was larger)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    plain, other = (values - returns).square(), (clipped - returns).square()
    clip_frac = token_mean(torch.gt(other, plain).to(values.dtype), mask)
    return 0.5 * token_mean(torch.maximum(plain, other), mask), clip_frac


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits) over the last dimension."""
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


def vocab_parallel_entropy(logits: torch.Tensor, group: object) -> torch.Tensor:
    """Per-position entropy of softmax over a vocabulary split in order over ``group``'s
    ranks (``logits``: this rank's ``[..., vocab / tp]`` part)."""
    top = logits.max(dim=-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top.unsqueeze(-1)
    e = shifted.exp()
    z = e.sum(dim=-1)
    dist.all_reduce(z, group=group)
    weighted = (e * shifted).sum(dim=-1)
    dist.all_reduce(weighted, group=group)
    return z.log() - weighted / z
