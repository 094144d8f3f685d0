"""A synchronous save streams its items through one bounded buffer (core.checkpoint.stream):
the file is the same as one written from whole host arrays, and the save holds about one
bucket of extra host memory, not a copy of the state."""
from __future__ import annotations

import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from core.checkpoint import manifest
from core.checkpoint.async_writer import AsyncWriter
from core.checkpoint.hdf5 import ShardReader, write_shard
from core.checkpoint.spec import TensorSlice
from core.checkpoint.stream import Slots

MIB = 1 << 20


class Chunked:
    """A LiveArray with piecewise copies (as core.model.gpt.state.LiveTensor of a bf16 or GPU
    tensor): records the largest piece it was asked for."""

    def __init__(self, array: np.ndarray) -> None:
        self.array, self.shape, self.largest = array, array.shape, 0

    def snapshot_into(self, out: np.ndarray) -> None:
        raise AssertionError("a streamed save copies pieces, never the whole tensor")

    def snapshot_flat_into(self, start: int, out: np.ndarray) -> None:
        self.largest = max(self.largest, out.nbytes)
        out[...] = self.array.reshape(-1)[start:start + out.size]

    def host_view(self) -> None:
        return None

    def current(self) -> np.ndarray:
        raise AssertionError("a streamed save never asks for the whole value")


def _slice(name: str, shape: tuple[int, ...], dtype: str = "float32") -> TensorSlice:
    return TensorSlice(name=name, global_shape=shape, offset=(0,) * len(shape), shape=shape, dtype=dtype)


def _state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"emb": (1000, 33), "w": (4, 257, 31), "b": (7,), "scalar": (), "empty": (0, 3)}
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def test_a_streamed_save_writes_the_file_a_whole_array_save_writes(tmp_path: Path) -> None:
    state = _state()
    for sub in "ab":
        (tmp_path / sub).mkdir()
    whole = write_shard(tmp_path / "a" / "rank_00000.h5", [(_slice(n, a.shape), a) for n, a in state.items()],
                        {"k": 1}, {"rank": 0})
    live = {n: Chunked(a) for n, a in state.items()}
    streamed = write_shard(tmp_path / "b" / "rank_00000.h5", [(_slice(n, a.shape), live[n]) for n, a in state.items()],
                           {"k": 1}, {"rank": 0}, slots=Slots(4096, 2))
    assert streamed.checksum == whole.checksum == manifest.file_checksum(tmp_path / "b" / "rank_00000.h5")
    assert (tmp_path / "a" / "rank_00000.h5").read_bytes() == (tmp_path / "b" / "rank_00000.h5").read_bytes()
    assert max(c.largest for c in live.values()) <= 4096  # no piece larger than the bucket
    with ShardReader(tmp_path / "b" / "rank_00000.h5") as shard:
        assert shard.blobs() == {"k": 1}


@pytest.mark.parametrize("source", ["float64 arrays", "chunked live arrays"])
def test_a_sync_save_holds_one_bucket_of_host_memory_not_the_state(tmp_path: Path, source: str) -> None:
    """32 MiB of float32 in the file from data that needs a copy (float64 arrays to convert,
    or live tensors): the save's peak of new allocations stays near its 1 MiB bucket."""
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((256, 2048)) for _ in range(8)]  # 8 x 4 MiB of float32 in the file
    data = arrays if source == "float64 arrays" else [Chunked(a.astype(np.float32)) for a in arrays]
    items = [(_slice(f"t{i}", a.shape), d) for i, (a, d) in enumerate(zip(arrays, data, strict=True))]
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        ack = write_shard(tmp_path / "rank_00000.h5", items, {}, {"rank": 0}, slots=Slots(MIB, 1))
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak <= MIB + MIB // 2, f"the save allocated {peak / MIB:.1f} MiB at its peak (bucket 1 MiB, state 32 MiB)"
    assert ack.checksum == manifest.file_checksum(tmp_path / "rank_00000.h5")
    with ShardReader(tmp_path / "rank_00000.h5") as shard:
        for (dataset, s), a in zip(shard.slices().items(), arrays, strict=True):
            out = np.empty(s.shape, np.float32)
            box = tuple(slice(0, n) for n in s.shape)
            shard.read_into(dataset, box, out, box)
            assert np.array_equal(out, a.astype(np.float32)), s.name



class Gated(Chunked):
    """A chunked LiveArray whose copy starts when the test says so (a slow device-to-host copy)."""

    def __init__(self, array: np.ndarray) -> None:
        super().__init__(array)
        self.entered, self.release = threading.Event(), threading.Event()

    def snapshot_flat_into(self, start: int, out: np.ndarray) -> None:
        self.entered.set()
        assert self.release.wait(30), "the test never released the copy"
        super().snapshot_flat_into(start, out)


def test_a_background_save_bigger_than_its_buffers_snapshots_every_item_before_the_update(tmp_path: Path) -> None:
    """An async writer with 64 KiB of buffers saves 1 MiB: the buffers are reused as the disk
    frees them, the snapshot is taken only once the last item is copied, and the file holds
    the values from before the update that follows, byte for byte a sync save's."""
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal((64, 1024)).astype(np.float32) for _ in range(4)]
    expected = [a.copy() for a in arrays]
    gated = Gated(arrays[-1])
    items = [(_slice(f"t{i}", a.shape), Chunked(a)) for i, a in enumerate(arrays[:-1])]
    items.append((_slice("t3", arrays[-1].shape), gated))
    writer = AsyncWriter(host_buffer_bytes=64 << 10)
    (tmp_path / "async").mkdir()
    (tmp_path / "sync").mkdir()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        handle = writer.submit(tmp_path / "async" / "rank_00000.h5", items, {"k": 1}, {"rank": 0},
                               snapshot="background")
        assert gated.entered.wait(30), "the writer never reached the last item: its buffers were never freed"
        assert not handle.snapshot_taken()
        gated.release.set()
        assert handle.wait_snapshot(30)
        for a in arrays:  # the optimizer step after the fence
            a += 1.0
        ack = handle.result(timeout=30)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        writer.close()
    assert peak <= 256 << 10, f"the background save allocated {peak >> 10} KiB at its peak (buffers: 64 KiB, state 1 MiB)"
    sync = write_shard(tmp_path / "sync" / "rank_00000.h5", [(s, e) for (s, _), e in zip(items, expected, strict=True)],
                       {"k": 1}, {"rank": 0})
    assert ack == sync
    assert (tmp_path / "sync" / "rank_00000.h5").read_bytes() == (tmp_path / "async" / "rank_00000.h5").read_bytes()


def test_a_failed_write_releases_the_training_and_its_buffers_serve_the_next_save(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fails (ENOSPC) while a background save bigger than its buffers is copied: the
    save raises a transient error, leaves no file, releases the fence; the next save reuses
    the buffers (none was lost with the failed one) and writes a sync save's file."""
    import errno

    from core.checkpoint import pipeline
    from core.errors import TransientIOError

    rng = np.random.default_rng(3)
    items = [(_slice(f"t{i}", (64, 1024)), Chunked(rng.standard_normal((64, 1024)).astype(np.float32)))
             for i in range(4)]
    writer = AsyncWriter(host_buffer_bytes=64 << 10)
    write = pipeline.pwrite_all

    def full(fd: int, piece: memoryview, offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pipeline, "pwrite_all", full)
    (tmp_path / "a").mkdir()
    handle = writer.submit(tmp_path / "a" / "rank_00000.h5", items, {}, {"rank": 0}, snapshot="background")
    assert handle.wait_snapshot(30)
    with pytest.raises(TransientIOError, match="No space left"):
        handle.result(timeout=30)
    assert not (tmp_path / "a" / "rank_00000.h5").exists()
    monkeypatch.setattr(pipeline, "pwrite_all", write)
    (tmp_path / "b").mkdir()
    (tmp_path / "sync").mkdir()
    ack = writer.submit(tmp_path / "b" / "rank_00000.h5", items, {}, {"rank": 0}, snapshot="background").result(30)
    writer.close()
    sync = write_shard(tmp_path / "sync" / "rank_00000.h5", [(s, c.array) for s, c in items], {}, {"rank": 0})
    assert ack == sync
