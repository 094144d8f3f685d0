"""core.model.gpt.padding against the definitions: verl's positions (cumsum of the real-token
mask, less one, clamped at 0) and attention that a plain-torch softmax over the real tokens
alone reproduces; no query left without a key (no NaN with a -inf fill)."""
from __future__ import annotations

import pytest
import torch

from core.model.gpt import padding

PADS = torch.tensor([0, 3, 5, 1])
S = 6


def _real(pads: torch.Tensor, s: int) -> torch.Tensor:
    return torch.arange(s).unsqueeze(0) >= pads.unsqueeze(1)


def test_positions_count_real_tokens_only() -> None:
    verl = (_real(PADS, S).long().cumsum(-1) - 1).clamp(min=0)
    assert torch.equal(padding.positions(PADS, S), verl)
    assert torch.equal(padding.positions(PADS, 1, start=S), verl[:, -1:] + 1)  # the next decode step's


def test_a_real_query_sees_exactly_the_real_keys_up_to_itself_and_a_pad_only_itself() -> None:
    mask = padding.prefill_mask(PADS, S)
    assert mask is not None and mask.shape == (4, 1, S, S) and mask.dtype == torch.bool
    real = _real(PADS, S)
    for b in range(4):
        for q in range(S):
            seen = {k for k in range(S) if not mask[b, 0, q, k]}
            want = {k for k in range(q + 1) if real[b, k]} if real[b, q] else {q}
            assert seen == want, (b, q)


def test_unpadded_batches_keep_the_models_own_causal_mask() -> None:
    zeros = torch.zeros(3, dtype=torch.int64)
    assert padding.prefill_mask(zeros, S) is None and padding.decode_mask(zeros, S) is None
    assert torch.equal(padding.positions(zeros, S), torch.arange(S).expand(3, S))
    assert torch.equal(padding.as_tensor((), 3, torch.device("cpu")), zeros)


def test_decode_hides_the_pad_keys_of_the_cache() -> None:
    mask = padding.decode_mask(PADS, S + 1)
    assert mask is not None and mask.shape == (4, 1, 1, S + 1)
    assert torch.equal(mask[:, 0, 0], ~_real(PADS, S + 1))


def test_masked_attention_is_attention_over_the_real_tokens_alone_and_never_nan() -> None:
    torch.manual_seed(0)
    scores, values = torch.randn(4, 2, S, S), torch.randn(4, 2, S, 8)
    mask = padding.prefill_mask(PADS, S)
    assert mask is not None
    out = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ values  # -inf: the strictest fill
    assert not out.isnan().any()
    for b, pad in enumerate(PADS.tolist()):
        n = S - pad
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        alone = torch.softmax(scores[b, :, pad:, pad:].masked_fill(causal, float("-inf")), dim=-1) @ values[b, :, pad:]
        torch.testing.assert_close(out[b, :, pad:], alone, rtol=0, atol=1e-6)


class TEDotProductAttention(torch.nn.Module):
    """Named as Transformer Engine's attention in Megatron (core.extensions.transformer_engine),
    which ignores a given mask under ``attn_mask_type=causal``."""


def test_padded_rows_are_refused_on_an_attention_that_ignores_the_mask() -> None:
    padding.require_mask_support(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(padding.PaddingError, match=r"^rl.prompt_length: .*TEDotProductAttention"):
        padding.require_mask_support(torch.nn.Sequential(torch.nn.Sequential(TEDotProductAttention())))
