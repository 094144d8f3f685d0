"""Generation and per-token log-probabilities with a Megatron-core GPT (one pipeline stage).

``generate`` continues a batch of prompts of one length, left-padded (``pads``: each
prompt's pad count; core.model.gpt.padding masks the pads out and counts positions over
real tokens, in the prefill and in every decode step): a prefill over the prompts fills a
KV cache (``megatron.core.inference.contexts.StaticInferenceContext``), then one token per
forward; the logits are gathered across the tensor-parallel group, so every TP rank of a
replica samples the same token from the same generators (one per prompt). Sampling is temperature, then
top-k, then top-p (nucleus) on the fp32 logits; temperature 0 is greedy. A sequence that
produced any of the stop ids ``eos`` stops (its later positions hold ``eos[0]`` with log-prob 0);
decoding ends when every sequence has stopped (what a row draws never depends on the steps
after it stopped, so the tokens are those of a full-length loop). The log-prob of
each new token is log_softmax(logits / T) at the sampling temperature T, before any top-k /
top-p truncation (greedy: T = 1), which is what the RL trainer's teacher-forced scoring
computes (core.model.gpt.policy.logprobs_at, at ``rl.temperature``).

``token_logprobs`` and ``label_logprobs`` are teacher-forced forwards at T = 1: the log-prob
of each token given the tokens before it, one full forward per batch (``label_logprobs`` is
the generator's side of the weight sync's probe, whose trainer side is at T = 1 too).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.inference.contexts import StaticInferenceContext

from core.model.gpt import padding


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How new tokens are chosen: ``temperature`` 0 is greedy."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    eos: tuple[int, ...] = ()  # stop ids: a sequence ends at the first of them it produces


def _causal(n: int, device: torch.device) -> torch.Tensor:
    return torch.triu(torch.ones(1, 1, n, n, dtype=torch.bool, device=device), diagonal=1)


def _logits(model: Any, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
            context: Any = None) -> torch.Tensor:
    out = model(tokens, positions, mask, inference_context=context, runtime_gather_output=True)
    return out.float()


def token_logprobs(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """``[b, s-1]``: log p(tokens[:, i+1] | tokens[:, :i+1]) under ``model`` (teacher forced)."""
    b, s = tokens.shape
    positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    with torch.no_grad():
        logp = torch.log_softmax(_logits(model, tokens, positions, _causal(s, tokens.device)), dim=-1)
    return logp[:, :-1].gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def label_logprobs(model: Any, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[b, s]``: log p(labels[:, i] | tokens[:, :i+1]) (a trainer's targets, teacher forced),
    computed on vocab-parallel logits: no rank gathers the whole vocabulary."""
    b, s = tokens.shape
    positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    with torch.no_grad():
        logits = model(tokens, positions, _causal(s, tokens.device), runtime_gather_output=False).float()
        return vocab_parallel_logprobs(logits, labels, model.pg_collection.tp)


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, group: Any) -> torch.Tensor:
    """log-softmax of ``labels`` over a vocabulary split in order over ``group``'s ranks
    (``logits``: this rank's ``[..., vocab / tp]`` part): a max, a sum of exponentials and
    the label's logit, each all-reduced."""
    part = logits.shape[-1]
    lo = dist.get_rank(group) * part
    top = logits.max(dim=-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top.unsqueeze(-1)
    total = shifted.exp().sum(dim=-1)
    dist.all_reduce(total, group=group)
    inside = (labels >= lo) & (labels < lo + part)
    picked = shifted.gather(-1, (labels - lo).clamp(0, part - 1).unsqueeze(-1)).squeeze(-1) * inside
    dist.all_reduce(picked, group=group)
    return picked - total.log()


def _at(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The logits of the distribution a new token's log-prob is taken from: those over the
    sampling temperature, untruncated; greedy (temperature 0): the logits as they are (T = 1)."""
    return logits / temperature if temperature > 0 else logits


def _choose(logits: torch.Tensor, how: Sampling, gens: Sequence[torch.Generator]) -> torch.Tensor:
    if how.temperature <= 0:
        return logits.argmax(dim=-1)
    scaled = logits / how.temperature
    if how.top_k > 0:
        kth = torch.topk(scaled, min(how.top_k, scaled.shape[-1]), dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if how.top_p < 1.0:
        ordered, order = torch.sort(scaled, dim=-1, descending=True)
        cum = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(ordered, dim=-1) >= how.top_p  # keep the smallest set reaching top_p
        scaled = scaled.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scaled, dim=-1)
    return torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, gens, strict=True)])


def generate(model: Any, prompts: Sequence[Sequence[int]], how: Sampling, *, seeds: Sequence[int],
             max_length: int, pads: Sequence[int] = ()) -> tuple[list[list[int]], list[list[float]]]:
    """Each prompt's new tokens and their log-probs; the prompts share one length, prompt i
    left-padded by ``pads[i]`` tokens (none: no pads) that it never sees. Prompt i samples
    from a generator of its own, seeded ``seeds[i]``: what it draws does not depend on the
    other prompts of the batch nor on its padding."""
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"one prompt length per batch, not {sorted(lengths)}")
    n = lengths.pop()
    if n + how.max_new_tokens > max_length:
        raise ValueError(f"prompt {n} + {how.max_new_tokens} new tokens exceed the model's {max_length} positions")
    device = next(model.parameters()).device
    tokens = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=device)
    b = tokens.shape[0]
    gens = [torch.Generator(device="cpu").manual_seed(s) for s in seeds]
    context = StaticInferenceContext(b, n + how.max_new_tokens)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    stop = torch.tensor(how.eos, dtype=torch.long, device=device) if how.eos else None
    out_tokens: list[torch.Tensor] = []
    out_logp: list[torch.Tensor] = []
    pad = padding.as_tensor(pads, b, device)
    mask = padding.prefill_mask(pad, n)
    step_in, positions = tokens, padding.positions(pad, n)
    if mask is None:  # no pads: the causal mask, as always
        mask = _causal(n, device)
    else:
        padding.require_mask_support(model)
    with torch.no_grad():
        for i in range(how.max_new_tokens):
            logits = _logits(model, step_in, positions, mask, context)[:, -1]
            context.increment_sequence_len_offset(step_in.shape[1])
            nxt = _choose(logits.cpu(), how, gens).to(device)
            logp = torch.log_softmax(_at(logits, how.temperature), dim=-1).gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
            if stop is not None:
                nxt = torch.where(done, torch.full_like(nxt, how.eos[0]), nxt)
                logp = torch.where(done, torch.zeros_like(logp), logp)
                done |= torch.isin(nxt, stop)
            out_tokens.append(nxt)
            out_logp.append(logp)
            if stop is not None and bool(done.all()):  # every row has ended: the rest is padding
                break
            context.enable_decode_mode()
            step_in, positions = nxt.unsqueeze(1), padding.positions(pad, 1, n + i)
            mask = padding.decode_mask(pad, n + i + 1)  # the cache's keys and the new one
    toks = torch.stack(out_tokens, dim=1).tolist()
    logps = torch.stack(out_logp, dim=1).tolist()
    rest = how.max_new_tokens - len(out_tokens)
    if rest:  # ended early (stop ids given): the first stop id, log-prob 0
        toks = [row + [how.eos[0]] * rest for row in toks]
        logps = [row + [0.0] * rest for row in logps]
    return toks, logps
