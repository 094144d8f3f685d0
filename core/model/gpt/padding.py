"""Left-padded rows: the attention mask and position ids that hide a row's pad tokens.

An RL prompt shorter than ``rl.prompt_length`` is left-padded (core.data.prompts); the
request carries each row's pad count. The model must not see the pads, so that a
prompt's log-probs and samples do not depend on its padding or its batch (verl's rule):

- positions count real tokens only: ``cumsum(real) - 1``, 0 on the pads (for a left-padded
  row: ``max(i - pad, 0)``). Learned position embeddings read them; Megatron's RoPE
  ignores ``position_ids`` and rotates by the index in the row, which is the same thing
  for attention (RoPE depends on the distance between query and key only).
- the attention mask (Megatron's: ``True`` = masked out, ``[b, 1, sq, sk]``) is causal and
  hides every pad key, except from the pad query at the same index: each query keeps at
  least one key (itself), so a pad's attention is finite on every backend (Megatron's
  local softmax fills masked scores with -10000, others with -inf) and no NaN can reach a
  loss through a masked product. A real token never sees a pad (its weight is exactly 0:
  ``exp(-10000 - max)`` underflows in fp32 and below).

A batch without pads gets ``None``: the model's own causal mask, bit for bit as before.
Megatron's local attention (``DotProductAttention``) applies a given mask in the prefill
and in every decode step with a ``StaticInferenceContext``; Transformer Engine's
attention with ``attn_mask_type=causal`` ignores a given mask (and Megatron turns decode
steps to ``no_mask``), so ``require_mask_support`` refuses padded rows on such a model
rather than let it see the pads.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from core.errors import UserError


class PaddingError(UserError):
    """Padded rows on a model whose attention would not hide the pads."""


def require_mask_support(model: Any) -> None:
    """Refuse a model whose attention ignores a given mask (Transformer Engine's)."""
    ignoring = {type(m).__name__ for m in model.modules() if type(m).__name__.startswith("TE")
                and type(m).__name__.endswith("DotProductAttention")}
    if ignoring:
        raise PaddingError(f"rl.prompt_length: left-padded prompts need an attention that applies a padding mask, "
                           f"and this model's ({', '.join(sorted(ignoring))}, Transformer Engine's causal "
                           "attention) ignores it; give prompts that fill rl.prompt_length, or run where "
                           "transformer_engine is not installed (Megatron's local layers)")


def as_tensor(pads: Sequence[int] | torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor:
    """``pads`` as a ``[rows]`` int64 tensor (None or empty: no row padded)."""
    if pads is None or len(pads) == 0:
        return torch.zeros(rows, dtype=torch.int64, device=device)
    out = torch.as_tensor(pads, dtype=torch.int64, device=device)
    if out.shape != (rows,):
        raise ValueError(f"{len(pads)} pad counts for {rows} rows")
    return out


def positions(pads: torch.Tensor, length: int, start: int = 0) -> torch.Tensor:
    """``[b, length]`` position ids of indices ``start`` .. ``start + length - 1`` of rows
    left-padded by ``pads``: the index less the pads, 0 on a pad."""
    index = torch.arange(start, start + length, device=pads.device).unsqueeze(0)
    return (index - pads.unsqueeze(1)).clamp(min=0)


def prefill_mask(pads: torch.Tensor, length: int) -> torch.Tensor | None:
    """``[b, 1, length, length]``: causal, pad keys hidden (but from themselves); None when
    no row is padded."""
    if not bool((pads > 0).any()):
        return None
    index = torch.arange(length, device=pads.device)
    causal = index.unsqueeze(1) < index.unsqueeze(0)  # [q, k]: key after query
    pad_key = index.view(1, 1, length) < pads.view(-1, 1, 1)  # [b, 1, k]
    self_key = (index.unsqueeze(1) == index.unsqueeze(0)).unsqueeze(0)  # [1, q, k]
    return (causal.unsqueeze(0) | (pad_key & ~self_key)).unsqueeze(1)


def decode_mask(pads: torch.Tensor, keys: int) -> torch.Tensor | None:
    """``[b, 1, 1, keys]``: one new query per row over ``keys`` cached keys (itself the
    last), the pad keys hidden; None when no row is padded."""
    if not bool((pads > 0).any()):
        return None
    index = torch.arange(keys, device=pads.device)
    return (index.unsqueeze(0) < pads.unsqueeze(1)).view(-1, 1, 1, keys)
