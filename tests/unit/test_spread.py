"""Which data-parallel replica writes each model box (core.model.gpt.spread), on Megatron's own
ShardedTensors as a model's ``sharded_state_dict`` gives them, one set per replica."""
from __future__ import annotations

import random

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from core.model.gpt import spread

SHAPES = [(128, 64), (32, 64), *[(64, 64), (192, 64), (256, 64), (64, 256), (64,), (256,)] * 4, (64,)]


def _boxes(dp_rank: int, tp_replica: int = 0) -> list[ShardedTensor]:
    """The boxes one replica holds: the same names and offsets on every replica, its replica id."""
    out = []
    for i, shape in enumerate(SHAPES):
        t = torch.empty(shape)
        out.append(ShardedTensor.from_rank_offsets(f"t{i}", t, replica_id=(0, tp_replica, dp_rank)))
    return out


def _written(dp: int, order_seed: int | None = None) -> dict[str, list[int]]:
    """Box name → the replicas that write it, each replica deciding on its own boxes."""
    seen: dict[str, list[int]] = {}
    for rank in range(dp):
        boxes = _boxes(rank)
        if order_seed is not None:
            random.Random(order_seed + rank).shuffle(boxes)  # another model traversal order
        writes = spread.writers(boxes, dp=dp)
        for sh in boxes:
            if writes(sh):
                seen.setdefault(sh.key, []).append(rank)
    return seen


def test_every_box_is_written_by_exactly_one_replica_and_the_bytes_are_balanced() -> None:
    for dp in (2, 3, 4):
        seen = _written(dp)
        assert sorted(seen) == sorted(f"t{i}" for i in range(len(SHAPES)))
        assert all(len(ranks) == 1 for ranks in seen.values()), seen
        load = [0] * dp
        for i, shape in enumerate(SHAPES):
            load[seen[f"t{i}"][0]] += 4 * int(torch.Size(shape).numel())
        largest = max(4 * int(torch.Size(s).numel()) for s in SHAPES)
        assert max(load) - min(load) <= largest, (dp, load)  # greedy by size: within one box


def test_the_assignment_is_the_same_whatever_order_each_replica_lists_its_boxes() -> None:
    assert _written(4, order_seed=1) == _written(4) == _written(4, order_seed=7)


def test_tensor_parallel_copies_are_never_written_and_one_replica_writes_everything() -> None:
    copies = _boxes(0, tp_replica=1)
    assert not any(spread.writers(copies, dp=2)(sh) for sh in copies)
    alone = _boxes(0)
    assert all(spread.writers(alone, dp=1)(sh) for sh in alone)
