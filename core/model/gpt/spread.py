"""Which data-parallel replica writes each replicated box of the model: the saving spread over DP.

Every data-parallel replica holds the same model boxes (Megatron's ``replica_id`` is
``(0, tp_replica, dp_rank)``), so one replica of each box suffices in a checkpoint. Writing
them all from DP rank 0 makes that rank's file the size of the model while the others write
only their optimizer shards; Megatron's fully parallel save
(``FullyParallelSaveStrategyWrapper``) instead gives each box to one replica, greedily, to
even out the bytes per rank. This does the same with Megatron's own assignment
(``dist_checkpointing.exchange_utils.distribute_shards_to_ranks``: lowest coverage first,
then largest first, ties broken by the box's id, each to the least loaded rank), without its
metadata exchange: the replicas of a DP group hold identical boxes, so every rank computes
the identical assignment from its own ``sharded_state_dict`` with no communication.

A box's weight is its bytes in the checkpoint: the fp32 weight, plus the optimizer state
that follows its writer when the optimizer is not distributed (main weight, moments). The
manifest maps every global tensor to (file, dataset, offset, shape) slices, so a checkpoint
whose weights are spread over several rank files loads into any layout unchanged.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.exchange_utils import distribute_shards_to_ranks
from megatron.core.dist_checkpointing.mapping import ShardedTensor

FP32 = 4
BoxId = tuple[str, tuple[int, ...]]  # (global name, global offset): one box of one global tensor


def box_id(sh: ShardedTensor) -> BoxId:
    return sh.key, tuple(int(o) for o in sh.global_offset)


def _replica(sh: ShardedTensor) -> tuple[int, ...]:
    rid = sh.replica_id
    return tuple(int(r) for r in (rid if isinstance(rid, tuple) else (rid,)))


def _candidate(sh: ShardedTensor) -> bool:
    """A box one of the DP replicas writes: the main replica in every other dimension
    (tensor-parallel copies of a norm, the last stage's tied embedding are never written)."""
    rid = _replica(sh)
    return len(rid) >= 2 and all(r == 0 for r in rid[:-1])


def assign(boxes: Iterable[tuple[BoxId, int]], dp_size: int) -> dict[BoxId, int]:
    """Box → the DP rank that writes it, balancing bytes: ``boxes`` gives (id, bytes) per box.

    Deterministic: a function of the boxes alone, so every replica computes the same one."""
    sizes = dict(boxes)
    if dp_size <= 1:
        return dict.fromkeys(sizes, 0)
    everyone = list(range(dp_size))
    return distribute_shards_to_ranks({b: everyone for b in sizes}, sizes, dp_size, set())


def dp_size() -> int:
    """The data-parallel group's size, as Megatron's replica ids count it (context parallel included)."""
    return parallel_state.get_data_parallel_world_size(with_context_parallel=True)


def writers(shardeds: Iterable[ShardedTensor], *, dp: int | None = None,
            follows: int = 0) -> Callable[[ShardedTensor], bool]:
    """The predicate "this rank writes box ``sh``" for the model's boxes ``shardeds``.

    ``follows``: how many fp32 tensors of the box's shape its writer writes beside the
    weight (the optimizer's main weight and moments when it is not distributed), so that
    they count in the balance. A rank outside a DP group (dp 1) writes what replica 0 writes.
    """
    dp = dp_size() if dp is None else dp
    boxes = [(box_id(sh), FP32 * (1 + follows) * int(np.prod(sh.local_shape, dtype=np.int64)))
             for sh in shardeds if _candidate(sh)]
    owner = assign(boxes, dp)

    def writes(sh: ShardedTensor) -> bool:
        if not _candidate(sh):
            return False
        rid = _replica(sh)
        return owner.get(box_id(sh), 0) == (rid[-1] if dp > 1 else 0)

    return writes

