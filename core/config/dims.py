"""The parallel layout as one validated value.

Ranks are laid out in Megatron-core's default order ``tp-cp-ep-dp-pp`` (with cp = ep = 1):
tensor-parallel rank varies fastest, then data-parallel, then pipeline. So

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

``core.parallel.megatron`` checks after initialisation that Megatron's groups equal the
groups computed here, so the controller (which never imports torch) can reason about
who owns what.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.errors import LayoutError


@dataclass(frozen=True, kw_only=True)
class Coords:
    """Where one rank sits in the layout."""

    rank: int
    tp: int
    pp: int
    dp: int


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Tensor, pipeline and data parallel sizes over ``world_size`` ranks."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"parallel.{name}: {value!r} is not a positive integer")

    @classmethod
    def from_world(cls, *, world_size: int, tp: int, pp: int) -> ParallelDims:
        """Derive dp from the worker count; reject counts that tp*pp does not divide."""
        if world_size < 1:
            raise LayoutError(f"worker count {world_size} must be at least 1")
        if world_size % (tp * pp):
            raise LayoutError(
                f"{world_size} workers are not divisible by tp*pp = {tp}*{pp} = {tp * pp}; "
                f"use a worker count that is a multiple of {tp * pp}"
            )
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> Coords:
        """Rank → (tp, pp, dp) coordinates."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside world of {self.world_size}")
        return Coords(
            rank=rank,
            tp=rank % self.tp,
            dp=(rank // self.tp) % self.dp,
            pp=rank // (self.tp * self.dp),
        )

    def rank(self, *, tp: int, pp: int, dp: int) -> int:
        """(tp, pp, dp) coordinates → rank."""
        return tp + self.tp * (dp + self.dp * pp)

    def tp_groups(self) -> list[list[int]]:
        """Ranks that share pp and dp, in Megatron's order."""
        return [
            [self.rank(tp=t, pp=p, dp=d) for t in range(self.tp)]
            for p in range(self.pp)
            for d in range(self.dp)
        ]

    def pp_groups(self) -> list[list[int]]:
        """Ranks that share tp and dp, first stage first."""
        return [
            [self.rank(tp=t, pp=p, dp=d) for p in range(self.pp)]
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def dp_groups(self) -> list[list[int]]:
        """Ranks that share tp and pp (replicas of the same shard)."""
        return [
            [self.rank(tp=t, pp=p, dp=d) for d in range(self.dp)]
            for p in range(self.pp)
            for t in range(self.tp)
        ]

    def loss_owners(self) -> list[int]:
        """One rank per data replica that holds the loss: last stage, tp rank 0."""
        return [self.rank(tp=0, pp=self.pp - 1, dp=d) for d in range(self.dp)]

    def describe(self) -> str:
        return f"tp{self.tp}pp{self.pp}dp{self.dp}"
