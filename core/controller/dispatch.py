"""How a call's request is split over ranks, and whose results come back.

Plain functions over ``ParallelDims``, chosen explicitly at each call site:

    group.call(TRAIN_STEP, Step(step=s), dispatch=one_to_all, collect=loss_owners)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from core.spec.dims import ParallelDims

Dispatch = Callable[[Any, ParallelDims], dict[int, Any]]
Collect = Callable[[dict[int, Any], ParallelDims], Any]


def one_to_all(request: Any, dims: ParallelDims) -> dict[int, Any]:
    """Every rank gets the same request."""
    return dict.fromkeys(range(dims.world_size), request)


def split_by_dp(request: Any, dims: ParallelDims) -> dict[int, Any]:
    """Sequence (and array) fields are cut into ``dp`` equal chunks along their first axis;
    a rank gets the chunk of its data-parallel coordinate. Other fields go to all."""
    chunks: dict[str, list[Any]] = {}
    for f in dataclasses.fields(request):
        value = getattr(request, f.name)
        if hasattr(value, "__len__") and not isinstance(value, (str, bytes, dict)) and value is not None:
            n = len(value)
            if n % dims.dp:
                raise ValueError(f"split_by_dp: {f.name!r} has {n} items, not divisible by dp = {dims.dp}")
            size = n // dims.dp
            chunks[f.name] = [value[i * size:(i + 1) * size] for i in range(dims.dp)]
    per_dp = [dataclasses.replace(request, **{k: v[d] for k, v in chunks.items()}) for d in range(dims.dp)]
    return {r: per_dp[dims.coords(r).dp] for r in range(dims.world_size)}


def collect_all(results: dict[int, Any], dims: ParallelDims) -> list[Any]:
    """Every rank's result, in rank order."""
    return [results[r] for r in range(dims.world_size)]


def rank_zero(results: dict[int, Any], dims: ParallelDims) -> Any:
    return results[0]


def loss_owners(results: dict[int, Any], dims: ParallelDims) -> list[Any]:
    """The last pipeline stage's tp-rank-0 result of each data replica, in dp order."""
    return [results[r] for r in dims.loss_owners()]
