"""Log-probs and entropy from vocab-parallel logits, in chunks over the positions.

``logprobs_at`` is the one computation of every RL log-prob on the trainer (the update's,
the old policy's, the reference's) and of the actor's entropy: of softmax(logits / T) over
the whole vocabulary, from this rank's ``[b, s, vocab / tp]`` part, as Megatron's
vocab-parallel cross entropy and ``core.model.gpt.rl_loss.vocab_parallel_entropy`` compute
them. At real lengths the fp32 temporaries of those two are the largest tensors of an RL
update (three the size of the logits: about 9 GB at 5k tokens of a 150k vocabulary), so
here the positions (the micro-batch's rows × width, flattened) are taken
``LOGIT_CHUNK_TOKENS`` at a time (core.config.rl, which the plan reads too): forward keeps
per position only the max, the softmax's sum, the entropy and the label; backward recomputes
each chunk's softmax and writes its gradient into the logits themselves, chunk by chunk
(the logits are spent, as the cross entropy spent them before). No fp32 tensor the size of
the logits is ever held, in forward or backward; the model's own output is the one.

The arithmetic per position is the unchunked one's, step by step (shift by the max over the
whole vocabulary, exp, the sums, ``log z - predicted``, ``log z - Σ e·shifted / z``; the
gradient ``softmax - onehot`` times the upstream gradient plus the entropy's ``-p (log p + H)``,
divided by T): each position's numbers are those of the whole tensor's where the kernels are
row-wise, as on CPU. Two all-reduces per chunk over the tensor-parallel group: the max, and
the predicted logit, softmax sum (and entropy's weighted sum) stacked.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.utils import VocabUtility

from core.config.rl import LOGIT_CHUNK_TOKENS


def _vocab_range(part: int, group: Any) -> tuple[int, int]:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(part, rank, size)
    return start, end


def _scaled(piece: torch.Tensor, temperature: float) -> torch.Tensor:
    """A chunk of logits / T in fp32, a copy of its own (the logits stay as they were)."""
    out = piece.to(torch.float32, copy=True)
    return out.div_(temperature) if temperature != 1.0 else out


def _target(labels: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(1 where the label is outside this rank's vocabulary part, the label within it or 0)."""
    outside = (labels < start) | (labels >= end)
    return outside, (labels - start).masked_fill_(outside, 0)


class _ChunkedLogProbs(torch.autograd.Function):
    """(log-probs of ``labels``, entropy or None) per position of ``[n, vocab / tp]`` logits."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, temperature: float,  # type: ignore[override]
                entropy: bool, group: Any, chunk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, part = logits.shape
        start, end = _vocab_range(part, group)
        top, z, logp = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
        ent = torch.empty(n, dtype=torch.float32, device=logits.device) if entropy else None
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            shifted = _scaled(logits[lo:hi], temperature)
            m = shifted.max(dim=-1).values
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            shifted -= m.unsqueeze(-1)
            outside, target = _target(labels[lo:hi], start, end)
            predicted = shifted.gather(-1, target.unsqueeze(-1)).squeeze(-1).masked_fill_(outside, 0.0)
            e = shifted.exp()
            sums = [predicted, e.sum(dim=-1)]
            if entropy:
                sums.append((e * shifted).sum(dim=-1))
            del e, shifted
            stacked = torch.stack(sums)
            dist.all_reduce(stacked, group=group)
            top[lo:hi], z[lo:hi] = m, stacked[1]
            logp[lo:hi] = -(torch.log(stacked[1]) - stacked[0])  # the cross entropy's loss, negated
            if ent is not None:
                ent[lo:hi] = stacked[1].log() - stacked[2] / stacked[1]
        ctx.save_for_backward(logits, labels, top, z, ent)
        ctx.temperature, ctx.group, ctx.chunk = temperature, group, chunk
        return logp, ent

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor | None,  # type: ignore[override]
                 grad_ent: torch.Tensor | None) -> tuple[torch.Tensor, None, None, None, None, None]:
        logits, labels, top, z, ent = ctx.saved_tensors
        n, part = logits.shape
        start, end = _vocab_range(part, ctx.group)
        for lo in range(0, n, ctx.chunk):
            hi = min(lo + ctx.chunk, n)
            p = _scaled(logits[lo:hi], ctx.temperature).sub_(top[lo:hi].unsqueeze(-1)).exp_()
            p.div_(z[lo:hi].unsqueeze(-1))
            grad = None
            if grad_logp is not None:
                outside, target = _target(labels[lo:hi], start, end)
                grad = p.clone() if grad_ent is not None else p
                rows = torch.arange(hi - lo, device=p.device)
                grad[rows, target] -= 1.0 - outside.float()
                grad.mul_(-grad_logp[lo:hi].unsqueeze(-1))
            if grad_ent is not None:
                bonus = torch.xlogy(p, p).add_(p * ent[lo:hi].unsqueeze(-1)).mul_(-grad_ent[lo:hi].unsqueeze(-1))
                grad = bonus if grad is None else grad.add_(bonus)
            if grad is None:
                grad = torch.zeros_like(p)
            if ctx.temperature != 1.0:
                grad = grad.div_(ctx.temperature)
            logits[lo:hi] = grad  # this chunk's logits are read for the last time above
            p = grad = bonus = None  # freed before the next chunk's are made: one chunk's temporaries at a time
        return logits, None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float, *, entropy: bool,
                            group: Any, chunk: int = LOGIT_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[...]`` log-probs of ``labels`` under softmax(``logits`` / ``temperature``) over a
    vocabulary split in order over ``group``'s ranks (``logits``: this rank's ``[..., vocab /
    tp]`` part), and with ``entropy`` that distribution's entropy per position, ``chunk``
    positions at a time (see the module's docstring). Differentiable; its backward
    overwrites ``logits`` with their gradient, so the caller's logits are spent."""
    *lead, part = logits.shape
    flat = logits.reshape(-1, part)
    logp, ent = _ChunkedLogProbs.apply(flat, labels.reshape(-1), temperature, entropy, group, max(1, chunk))
    return logp.view(lead), None if ent is None else ent.view(lead)


def logprobs_at(logits: torch.Tensor, labels: torch.Tensor, temperature: float, *, entropy: bool = False,
                chunk: int = LOGIT_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[b, s]`` log-probs (and entropy) from this rank's ``[b, s, vocab / tp]`` logits over
    the tensor-parallel group: ``vocab_parallel_logprobs``. The caller's logits are spent."""
    return vocab_parallel_logprobs(logits, labels, temperature, entropy=entropy,
                                   group=parallel_state.get_tensor_model_parallel_group(), chunk=chunk)
