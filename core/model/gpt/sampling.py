"""Choosing new tokens on the device, from vocab-parallel logits.

Each tensor-parallel rank holds its slice ``[lo, lo + part)`` of the vocabulary's logits
(``[rows, part]``, fp32); nothing of the vocabulary's size leaves the device and no Python
loop runs per row. What a row draws is a function of (its seed, the new token's index, the
logits) only: not of its batch, its chunk, its padding, the data-parallel layout, nor the
tensor-parallel split (up to the logits' own arithmetic).

- Greedy (temperature 0): the argmax over the group: each rank's local argmax and its
  value gathered (a ``[rows, 2]`` all-gather), the largest value wins, the lowest id on ties
  (``torch.argmax`` of the whole vocabulary, as before).
- Sampled: the Gumbel-max trick, ``argmax(logits / T + G)`` over the kept tokens, reduced
  over the group as greedy is. ``G = -log(-log(u))`` with counter-based noise: ``u`` from a
  32-bit hash (Wellons' lowbias32 finaliser, in int64 torch ops, every product exact below
  2**63) of (the row's key, the step, the global vocabulary id), so a rank computes the
  noise of its own slice and a row's noise is the same in any layout. (vLLM and SGLang draw
  the same race, ``argmax(p / Exp(1))``, from the device's random generator, whose stream
  depends on the batch; the counter keys it by row.) ``u`` has 24 bits: a token whose
  probability is below about 1e-7 of the largest is drawn slightly less often than it should.
- top-k: the global k-th largest value from each rank's local top k (a ``[rows, k]``
  all-gather); tokens below it dropped (ties at it kept).
- top-p (after top-k): exact, the smallest set of the most likely tokens whose mass reaches
  ``top_p`` (the mass before a token below ``top_p``), ties at the threshold kept. With
  top-k its threshold is found among the gathered top-k candidates (the mass of the kept set
  all-reduced); without top-k the vocabulary is all-gathered on the device (``[rows, vocab]``
  fp32, never to the host) and sorted there.

The chosen token's log-prob is log_softmax(logits / T) over the whole vocabulary, before
any truncation (greedy: T = 1): what the RL trainer's teacher-forced scoring computes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

MASK32 = 0xFFFFFFFF


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How new tokens are chosen: ``temperature`` 0 is greedy."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    eos: tuple[int, ...] = ()  # stop ids: a sequence ends at the first of them it produces


# --- the group: None (or one rank) is a whole vocabulary in this process --------------------
def group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _gather(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``[tp, *t.shape]``: every rank's ``t``, in rank order."""
    if group_size(group) == 1:
        return t.unsqueeze(0)
    parts = [torch.empty_like(t) for _ in range(group_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.stack(parts)


def _all_reduce(t: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


# --- counter-based noise ---------------------------------------------------------------------
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for 32-bit ``x`` and ``c`` in int64, each partial product below 2**48."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (a bijection of 32-bit integers with a near-ideal avalanche), int64 in and out."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[rows]`` int64: each row's 32-bit key from its (up to 64-bit) seed."""
    lo = torch.tensor([int(x) & MASK32 for x in seeds], dtype=torch.int64, device=device)
    hi = torch.tensor([(int(x) >> 32) & MASK32 for x in seeds], dtype=torch.int64, device=device)
    return hash32(lo ^ hash32(hi ^ 0x5BD1E995))


def vocab_keys(lo: int, part: int, device: torch.device) -> torch.Tensor:
    """``[part]`` int64: the hashes of global vocabulary ids ``lo .. lo + part - 1``."""
    return hash32(torch.arange(lo, lo + part, dtype=torch.int64, device=device) ^ 0x68E31DA4)


def gumbel(keys: torch.Tensor, step: int, vocab: torch.Tensor) -> torch.Tensor:
    """``[rows, part]`` fp32 standard Gumbel noise of (row key, new-token index ``step``, vocab id)."""
    per_step = hash32(keys ^ hash32(torch.full_like(keys, step) ^ 0x1B873593))
    return noise_of(hash32(per_step.unsqueeze(1) ^ vocab.unsqueeze(0)))


def noise_of(hashes: torch.Tensor) -> torch.Tensor:
    """fp32 standard Gumbel noise of 32-bit hashes: their top 23 bits b, u = (b + 0.5) / 2**23
    (exact in fp32, in [2**-24, 1 - 2**-24]: never 0 or 1, so the noise is always finite)."""
    u = ((hashes >> 9).float() + 0.5) * 2.0**-23
    return -torch.log(-torch.log(u))


# --- the choice ------------------------------------------------------------------------------
def group_argmax(values: torch.Tensor, lo: int, group: Any) -> torch.Tensor:
    """``[rows]`` global ids of the largest value over the group's slices, the lowest on ties."""
    best, where = values.max(dim=-1)  # the first of equal maxima
    both = _gather(torch.stack([best.double(), (where + lo).double()], dim=-1), group)  # [tp, rows, 2]
    top = both[..., 0].max(dim=0).values
    ids = torch.where(both[..., 0] == top, both[..., 1], torch.full_like(top, float("inf")))
    return ids.min(dim=0).values.long()


def logprobs(logits: torch.Tensor, chosen: torch.Tensor, lo: int, group: Any) -> torch.Tensor:
    """log-softmax of ``chosen`` (global ids) over the group's slices ``logits``."""
    part = logits.shape[-1]
    top = _all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX, group)
    shifted = logits - top.unsqueeze(-1)
    total = _all_reduce(shifted.exp().sum(dim=-1), dist.ReduceOp.SUM, group)
    inside = (chosen >= lo) & (chosen < lo + part)
    picked = shifted.gather(-1, (chosen - lo).clamp(0, part - 1).unsqueeze(-1)).squeeze(-1) * inside
    return _all_reduce(picked, dist.ReduceOp.SUM, group) - total.log()


def _kth(scaled: torch.Tensor, k: int, group: Any) -> torch.Tensor:
    """``[rows, 1]``: the k-th largest value over the group; ``[rows, c]``: the gathered local top
    k's, those below it -inf (every token top-k keeps is among them, but for ties at the k-th)."""
    local = torch.topk(scaled, min(k, scaled.shape[-1]), dim=-1).values
    cands = _gather(local, group).permute(1, 0, 2).reshape(scaled.shape[0], -1)
    kth = torch.topk(cands, min(k, cands.shape[-1]), dim=-1).values[..., -1:]
    return kth, cands.masked_fill(cands < kth, float("-inf"))


def _nucleus(kept: torch.Tensor, cands: torch.Tensor | None, top_p: float, group: Any) -> torch.Tensor:
    """``[rows, 1]``: the smallest value kept by top-p over ``kept`` (the group's slices, dropped
    ones -inf); ``cands``: values that hold every kept one (the gathered top-k), or None."""
    top = _all_reduce(kept.max(dim=-1).values, dist.ReduceOp.MAX, group).unsqueeze(-1)
    if cands is None:  # the whole vocabulary, gathered on the device
        cands = _gather(kept, group).permute(1, 0, 2).reshape(kept.shape[0], -1)
        mass = (cands - top).exp().sum(dim=-1, keepdim=True)
    else:
        mass = _all_reduce((kept - top).exp().sum(dim=-1), dist.ReduceOp.SUM, group).unsqueeze(-1)
    ordered = torch.sort(cands, dim=-1, descending=True).values
    p = (ordered - top).exp() / mass
    keep = (p.cumsum(dim=-1) - p) < top_p  # the mass before a token below top_p
    last = keep.sum(dim=-1, keepdim=True).clamp(min=1) - 1
    return ordered.gather(-1, last)


def choose(logits: torch.Tensor, how: Sampling, *, keys: torch.Tensor, step: int, lo: int, group: Any,
           vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows]`` chosen global ids and their log-probs, from this rank's ``[rows, part]`` slice
    ``logits`` (global ids ``lo ..``; ``vocab``: their hashes, ``vocab_keys``, computed here
    when None) of new token ``step``; ``keys``: the rows' ``row_keys``. Every rank of ``group``
    returns the same."""
    if how.temperature <= 0:
        chosen = group_argmax(logits, lo, group)
        return chosen, logprobs(logits, chosen, lo, group)
    scaled = logits / how.temperature
    kept, cands = scaled, None
    if how.top_k > 0:
        kth, cands = _kth(scaled, how.top_k, group)
        kept = kept.masked_fill(kept < kth, float("-inf"))
    if how.top_p < 1.0:
        kept = kept.masked_fill(kept < _nucleus(kept, cands, how.top_p, group), float("-inf"))
    if vocab is None:
        vocab = vocab_keys(lo, logits.shape[-1], logits.device)
    chosen = group_argmax(kept + gumbel(keys, step, vocab), lo, group)
    return chosen, logprobs(scaled, chosen, lo, group)
