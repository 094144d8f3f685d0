"""An RL step's numbers for its record, from what the trainer and the generator answered.

``merged``: each rank's results of an epoch's optimizer steps as one; ``lengths``: the
responses' lengths and how many stopped; ``max_gap``: the largest difference between the
actor's and the rollout's log-prob of a response token.
"""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from core.wire import rl_calls
from core.wire.ragged import Ragged


def merged(calls: list[list[rl_calls.PolicyResult]]) -> list[rl_calls.PolicyResult]:
    """Each rank's results of an epoch's optimizer steps (one list per step) as one: the times
    summed, the peaks and ``ratio_max`` the largest, the loss numbers the mean over the steps."""
    def over(per_rank: tuple[rl_calls.PolicyResult, ...], key: str, how: Any) -> Any:
        values = [getattr(r, key) for r in per_rank]
        return None if any(v is None for v in values) else how(values)

    merged = []
    for per_rank in zip(*calls, strict=True):
        mean = {k: over(per_rank, k, statistics.fmean) for k in ("loss", "clip_frac", "kl")}
        total = {k: over(per_rank, k, sum) for k in ("step_time_s", "data_wait_s", "grad_sync_s", "compute_s",
                                                        "tokens")}
        peak = {k: over(per_rank, k, max) for k in ("cuda_peak_mb", "rss_peak_mb", "ratio_max")}
        merged.append(dataclasses.replace(per_rank[-1], **mean, **total, **peak))
    return merged


def max_gap(old: Ragged, rollout: Ragged) -> float:
    """The largest difference between the actor's and the rollout's log-prob of a response
    token (both float32; the difference in float64, exact)."""
    if not np.array_equal(old.lengths, rollout.lengths):
        raise ValueError("the actor scored other responses than the rollout's")
    return float(np.max(np.abs(old.values.astype(np.float64) - rollout.values.astype(np.float64))))


def lengths(responses: Sequence[tuple[int, ...]], stop: tuple[int, ...]) -> dict[str, float]:
    """The step's response lengths (mean, min, max) and the fraction that ended at a stop token
    (the rest ran to rl.max_response_length)."""
    lengths = [len(r) for r in responses]
    return dict(response_length=statistics.fmean(lengths), response_length_min=min(lengths),
                response_length_max=max(lengths),
                stopped_frac=statistics.fmean(1.0 if r and r[-1] in stop else 0.0 for r in responses))
