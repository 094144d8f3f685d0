"""Generation and per-token log-probabilities with a Megatron-core GPT (one pipeline stage).

``decode`` (and ``generate``, its tokens and log-probs) continues a batch of prompts of one
length, left-padded (``pads``: each prompt's pad count; core.model.gpt.padding masks the
pads out and counts positions over real tokens, in the prefill and in every decode step).
The rows go in chunks of at most ``max_batch_tokens`` (rows x (prompt + max_new_tokens),
at least one row), so the KV cache (``megatron.core.inference.contexts.
StaticInferenceContext``, one per chunk) is bounded; the samples of a prompt sit in one
chunk where they fit. In a chunk each distinct prompt (its tokens and pads) is prefilled
once, and its keys and values are copied to the cache slot of each of its rows before the
first decode step; then one token per forward for every row of the chunk still decoding,
until every row has ended or ``max_new_tokens`` (once at most half of those rows have not
ended, the ended ones leave the batch and the cache: a chunk's time follows its rows'
lengths, not its longest row's). The logits stay vocab-parallel (each tensor-parallel rank its
slice; Megatron asserts that an inference forward gathers them, so the output layer is told
not to, by a forward pre-hook, for the call) and the new tokens and their log-probs are
chosen on the device by core.model.gpt.sampling: what a row draws is keyed by (its seed, the
new token's index), so it does not depend on its batch, its chunk, its padding, whether its
prompt's prefill was shared, nor the layout (up to the rounding of the logits, which a batch
of another size or another tp may change in the last bit: a token can change at a near tie
only). A sequence that produced any of the stop ids
``eos`` stops (its later positions hold ``eos[0]`` with log-prob 0). The log-prob of each new
token is log_softmax(logits / T) at the sampling temperature T, before any top-k / top-p
truncation (greedy: T = 1), which is what the RL trainer's teacher-forced scoring computes
(core.model.gpt.policy.logprobs_at, at ``rl.temperature``).

``label_logprobs`` is a teacher-forced forward at T = 1: the log-prob of each label given the
tokens before it, one full forward per batch (the generator's side of the weight sync's
probe, whose trainer side is at T = 1 too).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.inference.contexts import StaticInferenceContext

from core.model.gpt import padding, sampling
from core.model.gpt.sampling import Sampling

__all__ = ["Decoded", "Sampling", "decode", "generate", "label_logprobs", "vocab_parallel_logprobs"]


def _causal(n: int, device: torch.device) -> torch.Tensor:
    return torch.triu(torch.ones(1, 1, n, n, dtype=torch.bool, device=device), diagonal=1)


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
    the label's logit, each all-reduced (core.model.gpt.sampling.logprobs)."""
    return sampling.logprobs(logits, labels, dist.get_rank(group) * logits.shape[-1], group)


# --- decoding ------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Decoded:
    tokens: list[list[int]]  # each row's max_new_tokens new tokens (after a stop: eos[0])
    logprobs: list[list[float]]  # at the sampling temperature, untruncated (after a stop: 0)
    kv_cache_bytes: int = 0  # the largest KV cache a chunk allocated (this rank's part)


@dataclass(frozen=True)
class _Vocab:
    """This rank's slice of the vocabulary: its group, first global id and the ids' hashes."""

    group: Any
    lo: int
    hashes: torch.Tensor | None  # None: a model without ``vocab_size`` (tests' small ones), hashed per step


@dataclass(frozen=True)
class _Chunk:
    rows: list[int]  # the request's rows decoded together
    firsts: list[int]  # the row whose prompt each prefill slot holds
    slots: list[int]  # each row's prefill slot


def _vocab(model: Any, device: torch.device) -> _Vocab:
    pgc = getattr(model, "pg_collection", None)  # a GPTModel's; a small test model has none: one rank
    group = None if pgc is None else pgc.tp
    vocab = getattr(model, "vocab_size", None)
    if vocab is None:
        return _Vocab(None, 0, None)
    part = vocab // sampling.group_size(group)
    lo = 0 if group is None else dist.get_rank(group) * part
    return _Vocab(group, lo, sampling.vocab_keys(lo, part, device))


def _local_logits(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    return args, {**kwargs, "runtime_gather_output": False}


@contextmanager
def _vocab_parallel(model: Any) -> Iterator[None]:
    """Megatron's GPTModel asserts that an inference forward (``inference_context`` given)
    gathers the logits; its output layer is told otherwise, for the duration."""
    layer = getattr(model, "output_layer", None)
    handle = None if layer is None else layer.register_forward_pre_hook(_local_logits, with_kwargs=True)
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def _last_logits(model: Any, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 context: Any, vocab: _Vocab) -> torch.Tensor:
    """``[b, part]`` fp32: this rank's slice of each row's last-position logits."""
    out = model(tokens, positions, mask, inference_context=context, runtime_gather_output=True)[:, -1].float()
    if vocab.hashes is not None and out.shape[-1] != vocab.hashes.numel():
        raise RuntimeError(f"the model returned {out.shape[-1]} logits a row, not this rank's {vocab.hashes.numel()}: "
                           "Megatron no longer lets the output layer's runtime_gather_output be turned off "
                           "(core.model.gpt.generate._vocab_parallel)")
    return out


def _chunks(prompts: Sequence[Sequence[int]], pads: Sequence[int], rows_per_chunk: int, share: bool) -> list[_Chunk]:
    """The rows in chunks of ``rows_per_chunk``, a prompt's rows side by side; with ``share``,
    rows of one prompt (tokens and pads) in a chunk share its prefill slot."""
    def key(i: int) -> tuple[tuple[int, ...], int]:
        return tuple(prompts[i]), (pads[i] if pads else 0)

    first: dict[tuple[tuple[int, ...], int], int] = {}
    for i in range(len(prompts)):
        first.setdefault(key(i), i)
    order = sorted(range(len(prompts)), key=lambda i: first[key(i)])  # stable: samples in their order
    out = []
    for start in range(0, len(order), rows_per_chunk):
        rows = order[start:start + rows_per_chunk]
        slot_of: dict[Any, int] = {}
        firsts: list[int] = []
        slots = []
        for i in rows:
            k = key(i) if share else i
            if k not in slot_of:
                slot_of[k] = len(firsts)
                firsts.append(i)
            slots.append(slot_of[k])
        out.append(_Chunk(rows, firsts, slots))
    return out


def _spread_prefill(context: Any, slots: torch.Tensor, n: int) -> None:
    """Each row's cache slot gets the prefilled keys and values of its prompt's slot."""
    for keys, values in context.key_value_memory_dict.values():  # [seq, batch, groups, head dim]
        keys[:n, :len(slots)] = keys[:n, slots]
        values[:n, :len(slots)] = values[:n, slots]


def _cache_bytes(context: Any) -> int:
    return sum(t.numel() * t.element_size() for kv in context.key_value_memory_dict.values() for t in kv)


def _prefill(model: Any, tokens: torch.Tensor, pad: torch.Tensor, chunk: _Chunk, how: Sampling,
             vocab: _Vocab) -> tuple[Any, torch.Tensor, int]:
    """A chunk's KV cache (each distinct prompt prefilled once, copied to its rows' slots), each
    row's first logits, and the cache's bytes."""
    device, n = tokens.device, tokens.shape[1]
    firsts = torch.tensor(chunk.firsts, dtype=torch.long, device=device)
    first_pad = pad[firsts]
    context = StaticInferenceContext(len(chunk.rows), n + how.max_new_tokens)
    mask = padding.prefill_mask(first_pad, n)
    if mask is None:  # no pads: the causal mask, as always
        mask = _causal(n, device)
    else:
        padding.require_mask_support(model)
    logits = _last_logits(model, tokens[firsts], padding.positions(first_pad, n), mask, context, vocab)
    size = _cache_bytes(context)
    slots = torch.tensor(chunk.slots, dtype=torch.long, device=device)
    if len(chunk.firsts) < len(chunk.rows):
        _spread_prefill(context, slots, n)
    context.increment_sequence_len_offset(n)
    context.enable_decode_mode()
    return context, logits[slots], size


def _keep_rows(context: Any, keep: torch.Tensor) -> None:
    """The cache of rows ``keep`` only (the others have ended): their filled positions copied
    into a smaller cache, the old one freed."""
    filled = context.sequence_len_offset
    for layer, pair in list(context.key_value_memory_dict.items()):
        smaller = []
        for t in pair:  # [seq, batch, groups, head dim]
            new = t.new_empty((t.shape[0], len(keep), *t.shape[2:]))
            new[:filled] = t[:filled, keep]
            smaller.append(new)
        context.key_value_memory_dict[layer] = tuple(smaller)
    context.max_batch_size = len(keep)


def _decode_chunk(model: Any, tokens: torch.Tensor, pad: torch.Tensor, chunk: _Chunk, keys: torch.Tensor,
                  how: Sampling, vocab: _Vocab, out: tuple[torch.Tensor, torch.Tensor], compact: bool) -> int:
    """One chunk's new tokens and log-probs into ``out`` (whose rows hold ``eos[0]`` and 0
    beforehand: a row's positions after its stop are left so); the bytes of its KV cache.
    With ``compact``, once at most half the rows still decoding have not ended, the ended ones
    leave the batch (and the cache): their tokens are settled, the others' do not depend on them."""
    n = tokens.shape[1]
    context, logits, size = _prefill(model, tokens, pad, chunk, how, vocab)
    live = torch.tensor(chunk.rows, dtype=torch.long, device=tokens.device)  # the request's rows still decoding
    pad, keys = pad[live], keys[live]
    done = torch.zeros(len(live), dtype=torch.bool, device=tokens.device)
    stop = torch.tensor(how.eos, dtype=torch.long, device=tokens.device) if how.eos else None
    nxt = live
    for i in range(how.max_new_tokens):
        if i:
            mask = padding.decode_mask(pad, n + i)  # the cache's keys and the new one
            logits = _last_logits(model, nxt.unsqueeze(1), padding.positions(pad, 1, n + i - 1), mask, context, vocab)
            context.increment_sequence_len_offset(1)
        nxt, logp = sampling.choose(logits, how, keys=keys, step=i, vocab=vocab.hashes, lo=vocab.lo, group=vocab.group)
        if stop is not None:
            nxt = torch.where(done, torch.full_like(nxt, how.eos[0]), nxt)
            logp = torch.where(done, torch.zeros_like(logp), logp)
            done |= torch.isin(nxt, stop)
        out[0][live, i] = nxt
        out[1][live, i] = logp
        if stop is None:
            continue
        left = int((~done).sum())
        if left == 0:  # every row has ended: the rest is padding
            break
        if compact and left <= len(live) // 2:
            keep = (~done).nonzero().squeeze(1)
            _keep_rows(context, keep)
            live, pad, keys, nxt, done = live[keep], pad[keep], keys[keep], nxt[keep], done[keep]
    return size


def decode(model: Any, prompts: Sequence[Sequence[int]], how: Sampling, *, seeds: Sequence[int], max_length: int,
           pads: Sequence[int] = (), max_batch_tokens: int | None = None, share_prefill: bool = True,
           compact: bool = True) -> Decoded:
    """Each prompt's new tokens and their log-probs; the prompts share one length, prompt i
    left-padded by ``pads[i]`` tokens (none: no pads) that it never sees. Row i's draws are
    keyed by ``seeds[i]`` and the new token's index: they do not depend on the other rows,
    on ``max_batch_tokens`` (None: one chunk), ``share_prefill`` nor ``compact`` (ended rows
    leave the batch)."""
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"one prompt length per batch, not {sorted(lengths)}")
    n = lengths.pop()
    if n + how.max_new_tokens > max_length:
        raise ValueError(f"prompt {n} + {how.max_new_tokens} new tokens exceed the model's {max_length} positions")
    device = next(model.parameters()).device
    b = len(prompts)
    row_tokens = n + how.max_new_tokens
    per_chunk = b if max_batch_tokens is None else max(1, max_batch_tokens // row_tokens)
    tokens = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=device)
    pad = padding.as_tensor(pads, b, device)
    keys = sampling.row_keys(seeds, device)
    vocab = _vocab(model, device)
    out_tokens = torch.full((b, how.max_new_tokens), how.eos[0] if how.eos else 0, dtype=torch.long, device=device)
    out_logp = torch.zeros((b, how.max_new_tokens), dtype=torch.float32, device=device)
    largest = 0
    with torch.no_grad(), _vocab_parallel(model):
        for chunk in _chunks(prompts, pads, per_chunk, share_prefill):
            size = _decode_chunk(model, tokens, pad, chunk, keys, how, vocab, (out_tokens, out_logp), compact)
            largest = max(largest, size)
    return Decoded(tokens=out_tokens.tolist(), logprobs=out_logp.tolist(), kv_cache_bytes=largest)


def generate(model: Any, prompts: Sequence[Sequence[int]], how: Sampling, *, seeds: Sequence[int],
             max_length: int, pads: Sequence[int] = (),
             max_batch_tokens: int | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """``decode``'s tokens and log-probs."""
    out = decode(model, prompts, how, seeds=seeds, max_length=max_length, pads=pads,
                 max_batch_tokens=max_batch_tokens)
    return out.tokens, out.logprobs
