"""A distributed-optimizer save writes each data-parallel rank's own ranges: no rank holds more than its
shard (plus a bounded buffer) while it saves. Measured as the peak of the process's resident set
during the save (Linux: VmHWM after resetting it through /proc/self/clear_refs), not timed."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.checkpoint import manifest
from core.checkpoint.commit import commit, tmp_step_dir
from core.checkpoint.hdf5 import CheckpointReader
from tests.integration.gpt_harness import RankGroup, gpt_config

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))  # type: ignore[union-attr]


def save_measuring_peak(task: Any, tmp_dir: str) -> tuple[dict[str, Any], int, int]:
    """Rank side: one synchronous save as the checkpoint service makes it; (ack, peak extra bytes
    over the resident set before the save, this rank's optimizer shard bytes)."""
    import gc

    from core.checkpoint.calls import CKPT_SAVE, Save, ShardAttrs
    from core.checkpoint.service import CheckpointService
    from core.model.gpt.optimizer_state import MOMENTS

    inner = task._ready().optimizer.optimizer
    shard = sum(t.nbytes for state in inner.state.values() for k, t in state.items() if k in MOMENTS)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from here
    before = _kib("VmRSS")
    service = CheckpointService(task.ctx.rank, task.checkpoint_state, task.restore_state)  # the real, sync path
    attrs = ShardAttrs(step=1, layout="tp1pp1dp2", config_hash="distopt")
    saved = service.save(Save(step=1, tmp_dir=tmp_dir, attrs=attrs))
    extra = (_kib("VmHWM") - before) * 1024
    return CKPT_SAVE.encode_result(saved), extra, shard


def test_each_rank_writes_its_own_ranges_and_holds_no_more_than_its_shard(tmp_path: Path) -> None:
    model = {"num_layers": 8, "hidden_size": 512, "num_attention_heads": 8, "vocab_size": 128, "seq_length": 32}
    cfg = gpt_config(world_size=2, model=model, parallel={"tp": 1, "pp": 1, "distributed_optimizer": True},
                     training={"global_batch_size": 4, "micro_batch_size": 2,
                               "mixed_precision": {"param_dtype": "fp32"}})
    root = tmp_path / "checkpoints"
    with RankGroup(cfg, world_size=2, run_dir=tmp_path) as g:
        g.setup()
        g.train(range(1))
        tmp = tmp_step_dir(root, 1)
        answers = g.apply(save_measuring_peak, tmp_dir=str(tmp))
    from core.checkpoint.calls import CKPT_SAVE

    acks = [CKPT_SAVE.decode_result(a).ack for a, _, _ in answers]
    step_dir = commit(root, 1, tmp, acks, {"layout": "tp1pp1dp2"}, world_size=2)  # the ranges tile every tensor
    for rank, (_, extra, shard) in enumerate(answers):
        print(f"rank {rank}: peak extra {extra / 2**20:.1f} MiB during the save, optimizer shard {shard / 2**20:.1f} MiB")
        assert shard > 50 * 2**20, f"the shard ({shard} bytes) is too small to measure against"
        assert extra <= 1.2 * shard, f"rank {rank} held {extra / 2**20:.1f} MiB more during the save, " \
                                     f"its optimizer shard is {shard / 2**20:.1f} MiB"
    written = {f.rank: f.size_bytes for f in manifest.read_manifest(step_dir).files}
    assert min(written.values()) > 0.4 * max(written.values())  # both ranks write their half of the moments
    with CheckpointReader(step_dir) as reader:
        moments = [n for n in reader.names() if n.startswith("optim.exp_avg.")]
        assert moments and all(np.isfinite(reader.read(n)).all() for n in moments)


def hold_the_disk_until_the_fence(task: Any, nbytes: int) -> None:
    """Rank side: an async snapshot may hold at most ``nbytes`` of host memory, and the shard's
    writes wait until training has reached its fence (the optimizer step after the save): with
    a state larger than ``nbytes`` the copy cannot finish before the step asks to update, so
    the fence really has to wait for the rest of the copy. The checkpoint service is the one
    whose fence the task was given (CheckpointedTask binds it)."""
    import threading

    from core.checkpoint import pipeline

    service = task.rank.fence.__self__
    service.async_host_buffer_bytes = nbytes
    reached = threading.Event()

    def fence() -> None:
        pending = service._pending
        if pending is not None and not reached.is_set():
            task.__dict__["copy_done_at_fence"] = pending.snapshot_taken()
        reached.set()
        service.fence()

    def held(fd: int, piece: Any, offset: int, write: Any = pipeline.pwrite_all) -> None:
        assert reached.wait(120), "training never reached the fence"
        write(fd, piece, offset)

    task.rank.fence, pipeline.pwrite_all = fence, held


def copy_done_at_fence(task: Any) -> bool | None:
    """Rank side: whether the snapshot was complete when training first reached the fence."""
    return task.__dict__.get("copy_done_at_fence")


def test_a_bf16_distributed_optimizer_state_streamed_by_an_async_save_resumes_bit_for_bit(tmp_path: Path) -> None:
    """bf16 with the distributed optimizer on two DP ranks: the fp32 main weights and moments
    are streamed to the shard through 256 KiB of buffers (less than the state) while the next
    step runs, whose optimizer step waits at the fence for the rest of the copy; a resume in new processes holds exactly the saved state and gives the
    uninterrupted run's losses."""
    from core.checkpoint.calls import CKPT_WAIT
    from tests.integration.gpt_harness import assert_state_is_the_checkpoints

    steps, half = 6, 3
    cfg = gpt_config(world_size=2, steps=steps, parallel={"distributed_optimizer": True},
                     training={"global_batch_size": 16, "micro_batch_size": 2,
                               "mixed_precision": {"param_dtype": "bf16"}})
    root = tmp_path / "checkpoints"
    with RankGroup(cfg, world_size=2, run_dir=tmp_path) as g:
        g.setup()
        first = g.train(range(half))
        g.apply(hold_the_disk_until_the_fence, nbytes=256 << 10)
        tmp = tmp_step_dir(root, half)
        g.call("ckpt_save", step=half, tmp_dir=str(tmp), async_save=True,
               attrs={"step": half, "layout": "harness", "config_hash": "harness"})
        full = first + g.train(range(half, steps))  # its optimizer step waits at the fence for the copy
        assert g.apply(copy_done_at_fence) == [False, False]  # the fence did have to wait for the rest of it
        acks = [CKPT_WAIT.decode_result(a) for a in g.call("ckpt_wait", step=half)]
        step_dir = commit(root, half, tmp, acks, {"layout": "harness"}, world_size=2)
    assert sum(f.size_bytes for f in manifest.read_manifest(step_dir).files) > 4 * (256 << 10)  # more than the buffers
    with RankGroup(cfg, world_size=2, run_dir=tmp_path) as g:
        g.setup()
        g.load(step_dir)
        assert_state_is_the_checkpoints(g, step_dir, half)
        resumed = g.train(range(half, steps))
    assert resumed == full[half:]
