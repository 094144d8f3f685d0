"""Gradient reduction overlapped with backward (``parallel.overlap_grad_reduce``, Megatron's
buckets, here small enough for several per model) gives the synchronous path's gradients
bit for bit: every step's loss and gradient norm and the final weights are equal, with the
plain optimizer and with the distributed one (dp2 on CPU, gloo)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # works under any --import-mode
    sys.path.insert(0, _HERE)

from gpt_harness import RankGroup, gpt_config  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]
STEPS = 6


def _run(work: Path, tag: str, **parallel: object) -> tuple[list[tuple[float, float]], Path]:
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
    plain, plain_w = _run(tmp_path, "sync", distributed_optimizer=distributed_optimizer)
    over, over_w = _run(tmp_path, "overlap", distributed_optimizer=distributed_optimizer, overlap_grad_reduce=True,
                        bucket_size=bucket_size)
    assert over == plain
    with np.load(plain_w) as a, np.load(over_w) as b:
        assert sorted(a.files) == sorted(b.files)
        for name in a.files:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
