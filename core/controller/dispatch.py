"""How a call's arguments are split over ranks, and whose results come back.

Plain functions over ``ParallelDims``, chosen explicitly at each call site:

    group.call("train_step", step=s, dispatch=one_to_all, collect=loss_owners)
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.spec.dims import ParallelDims

Dispatch = Callable[[dict[str, Any], ParallelDims], dict[int, dict[str, Any]]]
Collect = Callable[[dict[int, Any], ParallelDims], Any]


def one_to_all(kwargs: dict[str, Any], dims: ParallelDims) -> dict[int, dict[str, Any]]:
    """Every rank gets the same arguments."""
    return {r: kwargs for r in range(dims.world_size)}


def split_by_dp(kwargs: dict[str, Any], dims: ParallelDims) -> dict[int, dict[str, Any]]:
    """Sequence (and array) arguments are cut into ``dp`` equal chunks along their first
    axis; a rank gets the chunk of its data-parallel coordinate. Scalars go to all."""
    chunks: dict[str, list[Any]] = {}
    for key, value in kwargs.items():
        if hasattr(value, "__len__") and not isinstance(value, (str, bytes, dict)):
            n = len(value)
            if n % dims.dp:
                raise ValueError(f"split_by_dp: {key!r} has {n} items, not divisible by dp = {dims.dp}")
            size = n // dims.dp
            chunks[key] = [value[i * size:(i + 1) * size] for i in range(dims.dp)]
    out = {}
    for r in range(dims.world_size):
        dp = dims.coords(r).dp
        out[r] = {k: (chunks[k][dp] if k in chunks else v) for k, v in kwargs.items()}
    return out


def collect_all(results: dict[int, Any], dims: ParallelDims) -> list[Any]:
    """Every rank's result, in rank order."""
    return [results[r] for r in range(dims.world_size)]


def rank_zero(results: dict[int, Any], dims: ParallelDims) -> Any:
    return results[0]


def loss_owners(results: dict[int, Any], dims: ParallelDims) -> list[Any]:
    """The last pipeline stage's tp-rank-0 result of each data replica, in dp order."""
    return [results[r] for r in dims.loss_owners()]
