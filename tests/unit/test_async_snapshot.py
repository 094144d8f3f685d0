"""Async saves that take their snapshot on the writer thread, and the fence training waits on."""
from __future__ import annotations

import filecmp
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.checkpoint.async_writer import AsyncWriter
from core.checkpoint.calls import CKPT_SAVE, CKPT_WAIT, Save, Saved, ShardAttrs
from core.checkpoint.hdf5 import write_shard
from core.checkpoint.service import CheckpointedTask
from core.checkpoint.spec import TensorSlice, current
from core.wire.calls import Step

ATTRS = {"step": 3, "rank": 0, "layout": "tp1pp1dp1", "config_hash": "x"}  # what the service writes for SAVE_3
SAVE_3 = ShardAttrs(step=3, layout="tp1pp1dp1", config_hash="x")


class Gated:
    """A LiveArray whose copy starts when the test says so (a slow device-to-host copy)."""

    def __init__(self, array: np.ndarray, *, fail: bool = False) -> None:
        self.array = array
        self.shape = array.shape
        self.fail = fail
        self.entered = threading.Event()
        self.release = threading.Event()

    def snapshot_into(self, out: np.ndarray) -> None:
        self.entered.set()
        assert self.release.wait(30), "the test never released the copy"
        if self.fail:
            raise RuntimeError("device-to-host copy failed")
        np.copyto(out, self.array)

    def current(self) -> np.ndarray:
        return self.array


def _items(seed: int) -> list[tuple[TensorSlice, np.ndarray]]:
    rng = np.random.default_rng(seed)
    shapes = {"emb": (64, 32), "w1": (128, 64), "b1": (128,)}
    return [(TensorSlice(name=n, global_shape=s, offset=(0,) * len(s), shape=s, dtype="float32"),
             rng.standard_normal(s).astype(np.float32)) for n, s in shapes.items()]


def test_a_background_snapshot_is_taken_off_the_callers_thread_and_written_as_a_sync_save(tmp_path: Path) -> None:
    items = _items(1)
    (tmp_path / "sync").mkdir()
    (tmp_path / "async").mkdir()
    sync_ack = write_shard(tmp_path / "sync" / "rank_00000.h5", items, {"lr": 0.1}, ATTRS)
    gated = Gated(items[0][1])
    live = [(items[0][0], gated), *items[1:]]  # a LiveArray beside plain live arrays
    writer = AsyncWriter()
    handle = writer.submit(tmp_path / "async" / "rank_00000.h5", live, {"lr": 0.1}, ATTRS, snapshot="background")
    assert gated.entered.wait(30), "the writer thread never started the snapshot"
    assert not handle.snapshot_taken()  # submit returned before the copy: the caller must wait to change state
    gated.release.set()
    assert handle.wait_snapshot(30)
    for _, array in items:  # the optimizer step after the fence: the file must not see it
        array += 1.0
    assert handle.result(timeout=30) == sync_ack
    writer.close()
    assert filecmp.cmp(tmp_path / "sync" / "rank_00000.h5", tmp_path / "async" / "rank_00000.h5", shallow=False)


def test_a_failed_background_snapshot_releases_the_caller_and_never_acks(tmp_path: Path) -> None:
    items = _items(2)
    gated = Gated(items[0][1], fail=True)
    writer = AsyncWriter()
    handle = writer.submit(tmp_path / "rank_00000.h5", [(items[0][0], gated)], {}, ATTRS, snapshot="background")
    gated.release.set()
    assert handle.wait_snapshot(30)  # training is not held forever by a copy that failed
    with pytest.raises(RuntimeError, match="device-to-host copy failed"):
        handle.result(timeout=30)
    assert not (tmp_path / "rank_00000.h5").exists()
    writer.close()


def test_an_unknown_snapshot_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="snapshot='later'"):
        AsyncWriter().submit(tmp_path / "rank_00000.h5", _items(3), {}, ATTRS, snapshot="later")  # type: ignore[arg-type]


class FencedTask:
    """A task exporting its live state, with the fence contract of core.checkpoint.service."""

    def __init__(self, items: list[tuple[TensorSlice, Any]]) -> None:
        self.items = items
        self.fence = None

    def handlers(self) -> dict[Any, Any]:
        return {}

    def close(self) -> None:
        pass

    def bind_checkpoint_fence(self, fence: Any) -> None:
        self.fence = fence

    def update(self) -> None:
        self.fence()
        for _, data in self.items:
            current(data)[...] += 1.0

    def checkpoint_state(self) -> tuple[list[tuple[TensorSlice, Any]], dict[str, Any]]:
        return self.items, {"step": 3}

    def restore_state(self, read: Any, blobs: dict[str, Any]) -> None:
        raise AssertionError("not used")


def test_the_update_after_an_async_save_waits_for_the_snapshot_and_the_file_has_the_old_values(tmp_path: Path) -> None:
    items = _items(4)
    expected = [a.copy() for _, a in items]
    gated = Gated(items[0][1])
    task = FencedTask([(items[0][0], gated), *items[1:]])
    served = CheckpointedTask(task, rank=0)
    table = served.handlers()
    (tmp_path / "sync").mkdir()
    (tmp_path / "async").mkdir()
    assert table[CKPT_SAVE](Save(step=3, tmp_dir=str(tmp_path / "async"), attrs=SAVE_3, async_save=True)) == Saved()
    updated = threading.Event()
    trainer = threading.Thread(target=lambda: (task.update(), updated.set()), daemon=True)
    trainer.start()
    assert gated.entered.wait(30)
    trainer.join(0.5)
    assert not updated.is_set(), "the update ran while the snapshot was still being copied"
    gated.release.set()
    trainer.join(30)
    assert updated.is_set(), "the update never ran after the snapshot was taken"
    ack = table[CKPT_WAIT](Step(step=3))
    write_shard(tmp_path / "sync" / "rank_00000.h5", list(zip([s for s, _ in items], expected, strict=True)),
                {"step": 3}, ATTRS)
    assert filecmp.cmp(tmp_path / "sync" / "rank_00000.h5", tmp_path / "async" / "rank_00000.h5", shallow=False)
    assert ack.file == "rank_00000.h5"
    assert np.array_equal(items[1][1], expected[1] + 1.0)  # and the update did happen, after the copy
    served.close()


def test_without_a_fence_live_items_are_copied_before_the_save_returns(tmp_path: Path) -> None:
    items = _items(5)
    expected = [a.copy() for _, a in items]

    class Unfenced(FencedTask):
        bind_checkpoint_fence = None  # type: ignore[assignment]

    gated = Gated(items[0][1])
    gated.release.set()
    task = Unfenced([(items[0][0], gated), *items[1:]])
    served = CheckpointedTask(task, rank=0)
    table = served.handlers()
    table[CKPT_SAVE](Save(step=3, tmp_dir=str(tmp_path), attrs=SAVE_3, async_save=True))
    assert gated.entered.is_set()  # the copy happened on the caller's thread, before ckpt_save returned
    items[0][1][...] = 0.0
    table[CKPT_WAIT](Step(step=3))
    (tmp_path / "ref").mkdir()
    write_shard(tmp_path / "ref" / "rank_00000.h5", list(zip([s for s, _ in items], expected, strict=True)),
                {"step": 3}, ATTRS)
    assert filecmp.cmp(tmp_path / "ref" / "rank_00000.h5", tmp_path / "rank_00000.h5", shallow=False)
    served.close()
