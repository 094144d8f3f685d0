"""HDF5 rank shards: layout on disk, checksums, resharded reads, blobs, async saves."""
from __future__ import annotations

import filecmp
import json
import math
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.checkpoint import manifest
from core.checkpoint.async_writer import AsyncWriter
from core.checkpoint.commit import commit, tmp_step_dir
from core.checkpoint.hdf5 import CheckpointReader, ShardReader, write_shard
from core.checkpoint.spec import TensorSlice, flat_range_boxes
from core.errors import CheckpointError


def _grid_save(root: Path, step: int, tensors: dict[str, np.ndarray], grid: tuple[int, int],
               blobs_of: dict[int, dict] | None = None) -> Path:
    """Commit ``tensors`` (2-D) split over a ``grid`` of ranks, rank r holding block (r // cols, r % cols)."""
    rows, cols = grid
    tmp = tmp_step_dir(root, step)
    acks = []
    for r in range(rows * cols):
        items = []
        for name, full in tensors.items():
            (h, w), (i, j) = full.shape, divmod(r, cols)
            bh, bw = h // rows, w // cols
            s = TensorSlice(name=name, global_shape=full.shape, offset=(i * bh, j * bw), shape=(bh, bw),
                            dtype=full.dtype.name)
            items.append((s, full[i * bh:(i + 1) * bh, j * bw:(j + 1) * bw]))
        blobs = (blobs_of or {}).get(r, {"rank": r})
        acks.append(write_shard(tmp / manifest.rank_file_name(r), items, blobs,
                                {"step": step, "rank": r, "layout": {"tp": cols, "pp": rows}, "config_hash": "c0"}))
    return commit(root, step, tmp, acks, {"layout": {"tp": cols, "pp": rows}, "config_hash": "c0"})


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8)


def test_2x2_save_reads_back_as_1x4_and_1x1_bit_identical(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    w[0, 0] = np.float32("nan")  # bit-identical includes NaN payloads and signed zeros
    w[7, 7] = np.float32(-0.0)
    b = rng.integers(-(2**62), 2**62, size=(8, 4), dtype=np.int64)
    step_dir = _grid_save(tmp_path, 1, {"w": w, "b": b}, grid=(2, 2))
    with CheckpointReader(step_dir) as reader:
        for name, full in (("w", w), ("b", b)):
            cols = full.shape[1] // 4
            parts = [reader.read(name, (0, c * cols), (full.shape[0], cols)) for c in range(4)]  # 1x4 layout
            assert np.array_equal(_bits(np.concatenate(parts, axis=1)), _bits(full))
            assert np.array_equal(_bits(reader.read(name)), _bits(full))  # 1x1 layout
        odd = reader.read("w", (3, 1), (3, 6))  # crosses all four stored blocks
        assert np.array_equal(_bits(odd), _bits(w[3:6, 1:7]))
        into = np.zeros((8, 8), np.float32)
        assert reader.read("w", out=into) is into and np.array_equal(_bits(into), _bits(w))


@settings(max_examples=20, deadline=None)
@given(rows=st.sampled_from([1, 2, 4]), cols=st.sampled_from([1, 2, 4]),
       box=st.tuples(st.integers(0, 7), st.integers(0, 7), st.integers(0, 8), st.integers(0, 8)))
def test_any_box_reads_the_same_whatever_the_saved_grid(tmp_path_factory: pytest.TempPathFactory, rows: int,
                                                        cols: int, box: tuple[int, int, int, int]) -> None:
    full = np.arange(64, dtype=np.float32).reshape(8, 8)
    i, j, h, w = box[0], box[1], min(box[2], 8 - box[0]), min(box[3], 8 - box[1])
    step_dir = _grid_save(tmp_path_factory.mktemp("grid"), 1, {"t": full}, grid=(rows, cols))
    with CheckpointReader(step_dir) as reader:
        assert np.array_equal(reader.read("t", (i, j), (h, w)), full[i:i + h, j:j + w])


def test_blobs_round_trip_per_rank(tmp_path: Path) -> None:
    blobs = {r: {"step": 12, "rng": {"numpy": [r, 2**40, 3], "torch": list(range(r, r + 5))},
                 "data": {"epoch": 1, "position": 4096 + r}, "lr": 1.5e-4, "name": "ünïcode",
                 "nested": [[1, 2], {"a": None, "b": True}]} for r in range(4)}
    step_dir = _grid_save(tmp_path, 12, {"w": np.ones((4, 4), np.float32)}, grid=(2, 2), blobs_of=blobs)
    with CheckpointReader(step_dir) as reader:
        assert [reader.blobs(r) for r in range(4)] == [blobs[r] for r in range(4)]
        with pytest.raises(CheckpointError, match="no shard of rank 9"):
            reader.blobs(9)


def test_shard_is_contiguous_datasets_with_global_attrs(tmp_path: Path) -> None:
    path = tmp_path / "rank_00002.h5"
    s = TensorSlice(name="layers.0/mlp.fc1.weight", global_shape=(6, 4), offset=(3, 0), shape=(3, 4), dtype="float32")
    ack = write_shard(path, [(s, np.full((3, 4), 2.0, np.float32))], {"k": 1},
                      {"step": 7, "rank": 2, "layout": {"tp": 2}, "config_hash": "h"})
    with h5py.File(path, "r") as f:
        ds = f[ack.slices[0].dataset]
        assert ds.chunks is None and ds.compression is None
        assert ds.id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS
        assert ds.attrs["name"].decode() == s.name and list(ds.attrs["global_shape"]) == [6, 4]
        assert list(ds.attrs["offset"]) == [3, 0] and np.all(ds[...] == 2.0)
        assert f.attrs["step"] == 7 and f.attrs["baton_format_version"] == manifest.FORMAT_VERSION
    with ShardReader(path) as shard:
        assert shard.slices() == {"tensor_00000": s}
        assert shard.attrs == {"step": 7, "rank": 2, "layout": {"tp": 2}, "config_hash": "h"}
    assert ack.rank == 2 and ack.file == "rank_00002.h5" and ack.size_bytes == path.stat().st_size


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int8", "int64", "uint16", "bool"])
def test_ack_checksum_is_the_checksum_of_the_file_bytes(tmp_path: Path, dtype: str) -> None:
    rng = np.random.default_rng(1)
    shapes = [(5, 3), (), (0, 4), (1000,), (2, 2, 2)]
    items = [(TensorSlice(name=f"t{i}", global_shape=shape, offset=(0,) * len(shape), shape=shape, dtype=dtype),
              (rng.standard_normal(shape) * 50).astype(dtype)) for i, shape in enumerate(shapes)]
    ack = write_shard(tmp_path / "rank_00000.h5", items, {}, {"step": 0})
    assert ack.checksum == manifest.file_checksum(tmp_path / "rank_00000.h5")
    with ShardReader(tmp_path / "rank_00000.h5") as shard:
        for (item, array), (dataset, stored) in zip(items, shard.slices().items(), strict=True):
            out = np.empty(item.shape, dtype)
            shard.read_into(dataset, tuple(slice(0, n) for n in item.shape), out, tuple(slice(0, n) for n in item.shape))
            assert stored == item and np.array_equal(out, array)


def test_write_shard_rejects_a_wrong_shape_and_an_existing_file(tmp_path: Path) -> None:
    s = TensorSlice(name="w", global_shape=(4,), offset=(0,), shape=(2,), dtype="float32")
    with pytest.raises(CheckpointError, match=r"w: array shape \(3,\)"):
        write_shard(tmp_path / "rank_00000.h5", [(s, np.zeros(3, np.float32))], {}, {"rank": 0})
    (tmp_path / "rank_00001.h5").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="exists already"):
        write_shard(tmp_path / "rank_00001.h5", [(s, np.zeros(2, np.float32))], {}, {"rank": 1})
    assert (tmp_path / "rank_00001.h5").read_bytes() == b"x"


def test_reading_an_unknown_tensor_or_a_box_outside_names_it(tmp_path: Path) -> None:
    step_dir = _grid_save(tmp_path, 1, {"decoder.w": np.ones((4, 4), np.float32)}, grid=(1, 2))
    with CheckpointReader(step_dir) as reader:
        assert reader.names() == ["decoder.w"]
        with pytest.raises(CheckpointError, match="no tensor 'encoder.w'.*decoder.w"):
            reader.read("encoder.w")
        with pytest.raises(ValueError, match="outside"):
            reader.read("decoder.w", (3, 0), (2, 4))


def _state(seed: int) -> list[tuple[TensorSlice, np.ndarray]]:
    rng = np.random.default_rng(seed)
    shapes = {"emb": (64, 32), "w1": (128, 64), "b1": (128,), "scale": ()}
    return [(TensorSlice(name=n, global_shape=s, offset=(0,) * len(s), shape=s, dtype="float32"),
             rng.standard_normal(s).astype(np.float32)) for n, s in shapes.items()]


def test_async_save_writes_the_same_file_as_a_sync_save(tmp_path: Path) -> None:
    items = _state(3)
    expected = [(s, a.copy()) for s, a in items]
    (tmp_path / "sync").mkdir()
    (tmp_path / "async").mkdir()
    attrs = {"step": 5, "rank": 0, "layout": {"dp": 1}, "config_hash": "x"}
    sync_ack = write_shard(tmp_path / "sync" / "rank_00000.h5", items, {"lr": 0.1}, attrs)
    writer = AsyncWriter()
    handle = writer.submit(tmp_path / "async" / "rank_00000.h5", items, {"lr": 0.1}, attrs)
    for _, array in items:  # training goes on: the snapshot must not see this
        array += 1.0
    async_ack = handle.result(timeout=30)
    assert handle.done()
    assert async_ack == sync_ack
    assert filecmp.cmp(tmp_path / "sync" / "rank_00000.h5", tmp_path / "async" / "rank_00000.h5", shallow=False)
    with ShardReader(tmp_path / "async" / "rank_00000.h5") as shard:
        assert shard.blobs() == {"lr": 0.1}
        for (dataset, stored), (item, array) in zip(shard.slices().items(), expected, strict=True):
            out = np.empty(item.shape, np.float32)
            shard.read_into(dataset, tuple(slice(0, n) for n in item.shape), out, tuple(slice(0, n) for n in item.shape))
            assert stored == item and np.array_equal(out, array)
    # a second save reuses the snapshot buffers and still writes the new values
    (tmp_path / "async2").mkdir()
    second = writer.submit(tmp_path / "async2" / "rank_00000.h5", items, {"lr": 0.2}, attrs).result(timeout=30)
    writer.close()
    with ShardReader(tmp_path / "async2" / "rank_00000.h5") as shard:
        out = np.empty((64, 32), np.float32)
        shard.read_into("tensor_00000", (slice(0, 64), slice(0, 32)), out, (slice(0, 64), slice(0, 32)))
        assert np.array_equal(out, expected[0][1] + 1.0) and second.checksum != async_ack.checksum


def test_async_save_of_private_copies_writes_them_without_another_copy(tmp_path: Path) -> None:
    """What CheckpointService does: a task's checkpoint_state returns private copies."""
    items = _state(4)
    (tmp_path / "sync").mkdir()
    (tmp_path / "async").mkdir()
    attrs = {"step": 6, "rank": 0, "layout": {"dp": 1}, "config_hash": "x"}
    sync_ack = write_shard(tmp_path / "sync" / "rank_00000.h5", items, {"lr": 0.1}, attrs)
    writer = AsyncWriter()
    handle = writer.submit(tmp_path / "async" / "rank_00000.h5", items, {"lr": 0.1}, attrs, snapshot="none")
    assert handle.result(timeout=30) == sync_ack
    assert writer._buffers == []  # nothing was copied into snapshot buffers
    assert filecmp.cmp(tmp_path / "sync" / "rank_00000.h5", tmp_path / "async" / "rank_00000.h5", shallow=False)
    bad = [(items[0][0], items[0][1].reshape(-1))]
    with pytest.raises(CheckpointError, match="emb: array shape"):
        writer.submit(tmp_path / "async" / "rank_00001.h5", bad, {}, attrs, snapshot="none")
    writer.close()


def test_async_background_failure_surfaces_from_result_and_never_acks(tmp_path: Path) -> None:
    target = tmp_path / "step_00000001.tmp-dead"
    target.mkdir()
    target.rmdir()  # the folder vanished (cleaned by someone else, filesystem gone)
    writer = AsyncWriter()
    handle = writer.submit(target / "rank_00000.h5", _state(4), {}, {"step": 1, "rank": 0})
    with pytest.raises(CheckpointError, match="cannot write the shard"):
        handle.result(timeout=30)
    assert handle.done() and not target.exists()
    with pytest.raises(CheckpointError):  # asked again, the error is still the answer, never an ack
        handle.result(timeout=0)
    ok = writer.submit(tmp_path / "rank_00000.h5", _state(4), {}, {"step": 1, "rank": 0}).result(timeout=30)
    writer.close()
    assert ok.size_bytes == (tmp_path / "rank_00000.h5").stat().st_size


def test_async_submit_rejects_blobs_that_are_not_json_on_the_callers_thread(tmp_path: Path) -> None:
    writer = AsyncWriter()
    with pytest.raises(TypeError):
        writer.submit(tmp_path / "rank_00000.h5", _state(5), {"bad": object()}, {"rank": 0})
    assert not (tmp_path / "rank_00000.h5").exists()


def test_manifest_lists_every_slice_with_its_file(tmp_path: Path) -> None:
    step_dir = _grid_save(tmp_path, 3, {"w": np.zeros((4, 8), np.float32)}, grid=(2, 2))
    doc = json.loads((step_dir / "manifest.json").read_text())
    slices = doc["tensors"]["w"]["slices"]
    assert doc["tensors"]["w"]["global_shape"] == [4, 8] and doc["tensors"]["w"]["dtype"] == "float32"
    assert sorted((s["file"], tuple(s["offset"])) for s in slices) == [
        ("rank_00000.h5", (0, 0)), ("rank_00001.h5", (0, 4)), ("rank_00002.h5", (2, 0)), ("rank_00003.h5", (2, 4))]
    assert sum(math.prod(s["shape"]) for s in slices) == 32
    assert doc["layout"] == {"tp": 2, "pp": 2} and doc["step"] == 3 and doc["config_hash"] == "c0"


@st.composite
def _flat_ranges(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int]:
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=4)))
    n = math.prod(shape)
    start = draw(st.integers(0, n))
    return shape, start, draw(st.integers(start, n))


@settings(max_examples=400, deadline=None)
@given(_flat_ranges())
def test_a_flat_range_is_cut_into_contiguous_boxes_that_cover_it_exactly(case: tuple[tuple[int, ...], int, int]) -> None:
    """What a distributed optimizer's shard of one parameter becomes in a checkpoint."""
    shape, start, end = case
    index = np.arange(math.prod(shape)).reshape(shape)
    covered, at = np.zeros(shape, dtype=int), start
    boxes = flat_range_boxes(shape, start, end)
    for offset, box, flat in boxes:
        cells = index[tuple(slice(o, o + s) for o, s in zip(offset, box, strict=True))]
        assert flat == at and np.array_equal(cells.reshape(-1), np.arange(flat, flat + cells.size))  # a view's run
        covered[tuple(slice(o, o + s) for o, s in zip(offset, box, strict=True))] += 1
        at += cells.size
    assert at == end or not boxes
    assert np.array_equal(covered.reshape(-1), (np.arange(covered.size) >= start) & (np.arange(covered.size) < end))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
