"""An RL pass's micro-batches: which of a replica's rows go through the model together, each
micro-batch padded to its own longest row.

A row here is what the model reads of it: its length is its token count less one (the last
token is only a label). Without a token budget (``rl.max_tokens_per_micro_batch: 0``) a
micro-batch is ``training.micro_batch_size`` consecutive rows (``micro_size``: the largest
size at most that which splits the rows whole). With one it is verl's dynamic batch size,
for padded rows: the rows sorted longest first (ties by index), each micro-batch the longest
left and the next ones while rows × its longest stays within the budget (a row longer than
the budget alone); the fewest micro-batches under that bound, in order of their longest row,
each one's rows in their order in the request. Either way the grouping is a function of the
rows' lengths alone, so the old log-probs (score_rows, each update mini-batch's rows
grouped alone) are computed in the update's micro-batches on the same shapes.

``batches`` gives each micro-batch as tensors ``[rows, its width]`` (positions counted over a
left-padded prompt's real tokens, the pads masked: core.model.gpt.padding). Micro-batches of
different shapes through a pipeline (pp > 1) need Megatron's ``variable_seq_lengths`` (the
stages exchange each tensor's shape first): ``shapes_vary`` turns it on for one pass.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from core.model.gpt import padding


def micro_size(micro_batch_size: int, rows: int) -> int:
    """The largest micro-batch of at most ``micro_batch_size`` rows that splits ``rows`` into
    whole micro-batches (``micro_batch_size: auto`` may resolve to one that does not: no row
    is ever left out of a step)."""
    return next(m for m in range(min(micro_batch_size, rows), 0, -1) if rows % m == 0)


def by_tokens(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indices of each micro-batch whose rows × longest row stays within ``max_tokens``
    (see the module's docstring)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    while order:
        fits = max(1, max_tokens // max(1, lengths[order[0]]))
        groups.append(sorted(order[:fits]))
        order = order[fits:]
    return groups


def groups(lengths: Sequence[int], *, micro_batch_size: int, max_tokens: int) -> list[list[int]]:
    """Row indices of each micro-batch of one update's rows (``max_tokens`` 0: no budget)."""
    if max_tokens:
        return by_tokens(lengths, max_tokens)
    size = micro_size(micro_batch_size, len(lengths))
    return [list(range(start, start + size)) for start in range(0, len(lengths), size)]


def scoring_groups(lengths: Sequence[int], *, mini_batch: int, micro_batch_size: int,
                   max_tokens: int) -> list[list[int]]:
    """Row indices of each micro-batch of a scoring pass over several update mini-batches of
    ``mini_batch`` consecutive rows (0: one): each mini-batch's rows grouped as its update
    groups them."""
    mini = mini_batch or len(lengths)
    return [[start + i for i in group]
            for start in range(0, len(lengths), mini)
            for group in groups(lengths[start:start + mini], micro_batch_size=micro_batch_size,
                                max_tokens=max_tokens)]


def batches(arrays: dict[str, np.ndarray], groups: list[list[int]],
            device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """Each group's rows of ``arrays`` (rows × any width ≥ their lengths; ``lengths`` and
    ``pads`` per row) as tensors on ``device``, cut to the group's longest row."""
    for group in groups:
        index = np.asarray(group)
        width = max(1, int(arrays["lengths"][index].max()))
        mb = {k: torch.from_numpy(np.ascontiguousarray(v[index, :width])).to(device)
              for k, v in arrays.items() if v.ndim == 2}
        pads = torch.from_numpy(arrays["pads"][index]).to(device)
        mb["position_ids"] = padding.positions(pads, width)
        mask = padding.prefill_mask(pads, width)
        if mask is not None:  # else the model's own causal mask (no row of the micro-batch padded)
            mb["attention_mask"] = mask
        yield mb


def shape(arrays: dict[str, np.ndarray], groups: list[list[int]]) -> tuple[int, int]:
    """(the longest width, the most rows) of the micro-batches: the schedule's nominal shape."""
    lengths = arrays["lengths"]
    return max(max(1, int(lengths[g].max())) for g in groups), max(len(g) for g in groups)


@contextmanager
def shapes_vary(chunks: list[Any]) -> Iterator[None]:
    """Megatron's ``variable_seq_lengths`` on for one pass through a pipeline (pp > 1): its
    stages send each activation's shape before it. Off again after (a training step's
    micro-batches all have one shape)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        yield
        return
    configs = list({id(get_model_config(c)): get_model_config(c) for c in chunks}.values())  # the schedule's
    before = [c.variable_seq_lengths for c in configs]
    for c in configs:
        c.variable_seq_lengths = True
    try:
        yield
    finally:
        for c, was in zip(configs, before, strict=True):
            c.variable_seq_lengths = was
