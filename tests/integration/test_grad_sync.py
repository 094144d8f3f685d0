"""Gradient reduction overlapped with backward (``parallel.overlap_grad_reduce``, Megatron's
buckets, here small enough for several per model) gives the synchronous path's gradients
bit for bit: every step's loss and gradient norm and the final weights are equal, with the
plain optimizer and with the distributed one (dp2 on CPU, gloo)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integration.gpt_harness import RankGroup, gpt_config, record_reductions_on_rank, reductions_on_rank

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]
STEPS = 6


def _train_and_save(work: Path, tag: str, **parallel: object) -> tuple[list[tuple[float, float]], Path]:
    cfg = gpt_config(world_size=2, parallel={"tp": 1, "pp": 1, **parallel})
    weights = work / f"{tag}.npz"
    with RankGroup(cfg, world_size=2, run_dir=work) as g:
        g.setup()
        numbers = []
        for step in range(STEPS):
            (owner,) = g.loss_owner_results(g.call("train_step", step=step))[:1]
            numbers.append((owner["loss"], owner["grad_norm"]))
        g.call("save_global_weights", path=str(weights))
    return numbers, weights


# The plain optimizer with buckets of 20000 elements (several per model); the distributed
# optimizer with Megatron's default size (one bucket here): it shards its state by bucket, so
# a bucket size changes the order in which the gradient norm is summed (and, with clipping,
# the last bits of the update), not the gradients.
@pytest.mark.parametrize(("distributed_optimizer", "bucket_size"), [(False, 20000), (True, None)])
def test_overlapped_gradient_reduction_gives_the_same_gradients_bit_for_bit(
        tmp_path: Path, distributed_optimizer: bool, bucket_size: int | None) -> None:
    plain, plain_w = _train_and_save(tmp_path, "sync", distributed_optimizer=distributed_optimizer)
    over, over_w = _train_and_save(tmp_path, "overlap", distributed_optimizer=distributed_optimizer, overlap_grad_reduce=True,
                        bucket_size=bucket_size)
    assert over == plain
    with np.load(plain_w) as a, np.load(over_w) as b:
        assert sorted(a.files) == sorted(b.files)
        for name in a.files:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@pytest.mark.parametrize(("param_dtype", "reduce_dtype"), [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16"),
                                                           ("fp16", "fp32"), ("fp16", "fp16")])
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_gradients_cross_the_data_parallel_group_in_the_configured_reduce_dtype(
        tmp_path: Path, param_dtype: str, reduce_dtype: str, distributed_optimizer: bool) -> None:
    """Every accepted (param_dtype, reduce_dtype) pair: what each data-parallel gradient
    collective actually sends (all-reduce, or the distributed optimizer's reduce-scatter)."""
    seen = _reduced(tmp_path, {"distributed_optimizer": distributed_optimizer}, param_dtype, reduce_dtype,
                    record_reductions_on_rank)
    assert all(s and set(s) == {NAMES[reduce_dtype]} for s in seen), seen


def _reduced(work: Path, parallel: dict, param_dtype: str, reduce_dtype: str, recorder: Any) -> list[list[str]]:
    """The dtypes each rank's gradient collectives sent over two steps (dp2)."""
    cfg = gpt_config(world_size=2, parallel={"tp": 1, "pp": 1, **parallel},
                     training={"mixed_precision": {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype}})
    with RankGroup(cfg, world_size=2, run_dir=work) as g:
        g.setup()
        g.apply(recorder)
        g.train(range(2))
        return g.apply(reductions_on_rank)


def record_fsdp_reductions_on_rank(task: Any) -> None:
    """Wrap the reduce-scatter FSDP2 sends gradients with: note each big one's dtype."""
    import torch

    seen = task.__dict__.setdefault("_reduced", [])
    reduce_scatter = torch.distributed.reduce_scatter_single  # what FSDP2's default reduce-scatter calls

    def rs(*a: Any, **k: Any) -> Any:
        tensor = k.get("input", a[1] if len(a) > 1 else None)
        if tensor is not None and tensor.numel() >= 1000:
            seen.append(str(tensor.dtype).removeprefix("torch."))
        return reduce_scatter(*a, **k)

    torch.distributed.reduce_scatter_single = rs


@pytest.mark.parametrize(("param_dtype", "reduce_dtype"), [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")])
def test_zero3_reduce_scatters_gradients_in_the_configured_reduce_dtype(tmp_path: Path, param_dtype: str,
                                                                         reduce_dtype: str) -> None:
    """ZeRO-3 (FSDP2's mixed-precision policy): the gradients' reduce-scatter dtype."""
    seen = _reduced(tmp_path, {"sharding": "params"}, param_dtype, reduce_dtype, record_fsdp_reductions_on_rank)
    assert all(s and set(s) == {NAMES[reduce_dtype]} for s in seen), seen
