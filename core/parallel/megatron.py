"""torch.distributed and Megatron-core's parallel state, checked against ``ParallelDims``.

The controller never imports torch: it plans with ``ParallelDims`` alone. So after
Megatron has built its groups, every rank checks that its tensor-, pipeline- and
data-parallel groups are exactly the ones ``ParallelDims`` computes. A mismatch (a
Megatron upgrade that changes the default rank order) fails setup with both layouts in
the message, instead of silently sending metrics from the wrong ranks.
"""
from __future__ import annotations

import datetime
import logging
from typing import Literal

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from core.config.dims import ParallelDims
from core.errors import BatonRuntimeError, LayoutError
from core.parallel import rng

log = logging.getLogger(__name__)

Backend = Literal["gloo", "nccl"]


def init_megatron(
    dims: ParallelDims,
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: Backend,
    seed: int,
    timeout_s: float = 600.0,
) -> None:
    """Join the process group, build Megatron's groups, seed every RNG, check the layout.

    ``timeout_s`` bounds the rendezvous and every later collective: a lost peer turns
    into an error instead of a hang.
    """
    if dims.world_size != world_size:
        raise LayoutError(
            f"layout {dims.describe()} needs {dims.world_size} ranks, "
            f"but world_size is {world_size}"
        )
    if backend == "nccl":
        # Ranks are packed node by node (the worker launch guarantees it), so the
        # node-local index is the global rank modulo the GPUs per node.
        torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)),
    )
    check_groups(dims, rank)
    rng.seed_all(seed, parallel_state.get_tensor_model_parallel_rank(), on_cuda=backend == "nccl")
    log.info("megatron initialised: %s rank %d/%d backend %s", dims.describe(), rank, world_size, backend)


def _group_of(groups: list[list[int]], rank: int) -> list[int]:
    for group in groups:
        if rank in group:
            return group
    raise AssertionError(f"rank {rank} is in no group of {groups}")


def check_groups(dims: ParallelDims, rank: int) -> None:
    """Raise ``BatonRuntimeError`` unless Megatron's groups of ``rank`` equal those of ``dims``.

    Every rank checks its own three groups; together that covers every group.
    """
    actual = {
        "tp": dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group()),
        "pp": dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()),
        "dp": dist.get_process_group_ranks(parallel_state.get_data_parallel_group()),
    }
    expected = {
        "tp": _group_of(dims.tp_groups(), rank),
        "pp": _group_of(dims.pp_groups(), rank),
        "dp": _group_of(dims.dp_groups(), rank),
    }
    for axis in ("tp", "pp", "dp"):
        if list(actual[axis]) != expected[axis]:
            raise BatonRuntimeError(
                f"rank {rank}: Megatron's {axis} group is {list(actual[axis])} but "
                f"ParallelDims({dims.describe()}) computes {expected[axis]}; Megatron's rank "
                "order changed (expected 'tp-cp-ep-dp-pp'): fix core/parallel/dims.py"
            )


def destroy_megatron() -> None:
    """Tear down Megatron's groups and the process group; safe to call twice."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
