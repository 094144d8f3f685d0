"""A checkpoint's attachments: files of the controller's (an RL run's rollouts not yet trained on,
core.controller.rollouts) written into the step's folder by ``CheckpointCoordinator.save(...,
attachments=)``, their size and checksum in the manifest (``meta.attachments``), checked by
``manifest.verify`` and read back by ``manifest.read_attachment``.

The worker group is scripted at the function boundary (its two ranks write real shards); the
commit, the manifest, the files and the run record are real. Checksums are checked against
xxhash computed here from the bytes."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from core.checkpoint import calls, manifest
from core.checkpoint.coordinator import CheckpointCoordinator
from core.checkpoint.hdf5 import write_shard
from core.checkpoint.loop import LoopState
from core.checkpoint.spec import ShardAck, TensorSlice
from core.config.dims import ParallelDims
from core.errors import CheckpointError
from core.record import events as ev
from core.record.runfolder import RunFolder
from core.record.state import RunRecord, RunState, Status

WORLD = 2
NAME = "rollouts.npz"


class Ranks:
    """Two ranks that write their real shards; an async save is durable at the first poll.
    At each save they note what the step's folder already holds (the attachments come first)."""

    dims = ParallelDims(tp=1, pp=1, dp=WORLD)
    epoch = generation = 0

    def __init__(self) -> None:
        self.seen: dict[int, dict[str, bytes]] = {}  # step → the folder's files when the ranks were asked
        self._acks: list[ShardAck] = []

    def call(self, method: Any, request: Any = None, *, timeout_s: float | None = None) -> list[Any]:
        if method is calls.CKPT_SAVE:
            tmp = Path(request.tmp_dir)
            self.seen[request.step] = {p.name: p.read_bytes() for p in tmp.iterdir()}
            self._acks = [_shard(tmp, request.step, r) for r in range(WORLD)]
            return [calls.Saved(ack=None if request.async_save else a) for a in self._acks]
        if method in (calls.CKPT_POLL, calls.CKPT_WAIT):
            return list(self._acks)
        raise AssertionError(f"unexpected call {method.name}")


def _shard(tmp: Path, step: int, rank: int) -> ShardAck:
    s = TensorSlice(name="w", global_shape=(WORLD * 4, 8), offset=(rank * 4, 0), shape=(4, 8), dtype="float32")
    return write_shard(tmp / manifest.rank_file_name(rank), [(s, np.full((4, 8), float(step), np.float32))],
                       {}, {"step": step, "rank": rank})


def _coordinator(tmp_path: Path, *, async_save: bool = False) -> tuple[CheckpointCoordinator, Ranks]:
    run = RunFolder(tmp_path / "run")
    run.path.mkdir()
    record = RunRecord(run)
    record.create(RunState(status=Status.RUNNING, total_steps=100), ev.Created(backend="local"))
    ranks = Ranks()
    return CheckpointCoordinator(ranks, record, root=run.checkpoints, model_hash="h", keep_last=5,
                                 async_save=async_save, timeout_s=60.0, poll_timeout_s=5.0), ranks


def _bytes(seed: int, n: int = 3000) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8).tobytes()


def _expected(data: bytes) -> dict[str, Any]:
    return {"size_bytes": len(data), "checksum": f"xxh3_64:{xxhash.xxh3_64(data).hexdigest()}"}


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_writes_its_attachments_and_the_manifest_records_them(tmp_path: Path, async_save: bool) -> None:
    coord, ranks = _coordinator(tmp_path, async_save=async_save)
    data, other = _bytes(1), _bytes(2, 17)
    coord.save(LoopState(step=10), attachments={NAME: data, "notes.bin": other})
    assert ranks.seen[10] == {NAME: data, "notes.bin": other}  # in the folder before the ranks write
    coord.drain()  # an async save commits here; a sync one has already
    step_dir = coord.root / manifest.step_dir_name(10)
    assert manifest.committed_steps(coord.root) == [10]
    assert (step_dir / NAME).read_bytes() == data and (step_dir / "notes.bin").read_bytes() == other
    saved = manifest.read_manifest(step_dir)
    assert saved.meta["attachments"] == {NAME: _expected(data), "notes.bin": _expected(other)}
    on_disk = json.loads((step_dir / "manifest.json").read_text())  # what another reader of the file sees
    assert on_disk["meta"]["attachments"][NAME] == _expected(data)
    assert [f.name for f in saved.files] == ["rank_00000.h5", "rank_00001.h5"]  # not a rank's file
    assert manifest.verify(step_dir) == []
    assert manifest.read_attachment(step_dir, NAME) == data
    assert manifest.read_attachment(step_dir, "notes.bin") == other
    assert manifest.read_attachment(step_dir, "absent.npz") is None


def test_a_save_without_attachments_has_none(tmp_path: Path) -> None:
    coord, ranks = _coordinator(tmp_path)
    coord.save(LoopState(step=10))
    coord.save(LoopState(step=20), attachments={})
    for step in (10, 20):
        step_dir = coord.root / manifest.step_dir_name(step)
        assert ranks.seen[step] == {}
        assert "attachments" not in manifest.read_manifest(step_dir).meta
        assert manifest.attachments(manifest.read_manifest(step_dir)) == {}
        assert manifest.read_attachment(step_dir, NAME) is None and manifest.verify(step_dir) == []


def _damage(path: Path, how: str) -> str:
    """Damage ``path``; the word verify's report must hold."""
    if how == "missing":
        path.unlink()
        return "missing (the controller's attachment)"
    if how == "truncated":
        os.truncate(path, path.stat().st_size - 1)
        return "truncated"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # the same size, one bit different
    path.write_bytes(bytes(data))
    return "the bytes are corrupt"


@pytest.mark.parametrize("how", ["missing", "truncated", "corrupted"])
def test_a_damaged_attachment_fails_verification_naming_it_and_the_resume_falls_back(tmp_path: Path,
                                                                                     how: str) -> None:
    coord, _ = _coordinator(tmp_path)
    coord.save(LoopState(step=10), attachments={NAME: _bytes(10)})
    coord.save(LoopState(step=20), attachments={NAME: _bytes(20)})
    newest = coord.root / manifest.step_dir_name(20)
    victim = newest / NAME
    word = _damage(victim, how)
    problems = manifest.verify(newest)
    assert len(problems) == 1 and problems[0].startswith(f"{victim}: ") and word in problems[0], problems
    if how == "truncated":
        assert f"size {len(_bytes(20)) - 1} bytes, manifest says {len(_bytes(20))}" in problems[0]
    assert manifest.verify(newest, checksums=False) == ([] if how == "corrupted" else problems)  # sizes only
    older = coord.root / manifest.step_dir_name(10)
    assert manifest.latest_valid(coord.root) == older
    assert coord.resume_point() == older  # the damaged one set aside (kept), the one before it resumed
    assert manifest.read_attachment(older, NAME) == _bytes(10)
    (damaged,) = [e for e in coord.record.events() if isinstance(e, ev.CheckpointDamaged)]
    assert damaged.step == 20 and NAME in damaged.problems


@pytest.mark.parametrize("attachments", [
    {NAME: {"size_bytes": 3000}},  # no checksum
    {NAME: {"size_bytes": "3000", "checksum": "xxh3_64:0"}},
    {NAME: {"size_bytes": -1, "checksum": "xxh3_64:0"}},
    {"../rollouts.npz": {"size_bytes": 3000, "checksum": "xxh3_64:0"}},  # outside the step's folder
    {"manifest.json": {"size_bytes": 3000, "checksum": "xxh3_64:0"}},
    [NAME],
])
def test_a_malformed_attachment_entry_is_a_malformed_manifest_never_a_crash(tmp_path: Path, attachments: Any) -> None:
    coord, _ = _coordinator(tmp_path)
    coord.save(LoopState(step=10), attachments={NAME: _bytes(10)})
    step_dir = coord.root / manifest.step_dir_name(10)
    path = step_dir / "manifest.json"
    doc = json.loads(path.read_text())
    doc["meta"]["attachments"] = attachments
    path.write_text(json.dumps(doc))
    (problem,) = manifest.verify(step_dir)
    assert problem.startswith(f"{path}: malformed (") and "\n" not in problem, problem
    with pytest.raises(CheckpointError, match=f"^{path}: malformed"):
        manifest.read_attachment(step_dir, NAME)
