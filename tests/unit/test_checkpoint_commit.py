"""The commit protocol: manifest last, atomic latest pointer, verification, fallback, retention, crashes."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from core.checkpoint import manifest
from core.checkpoint.commit import commit, remove_uncommitted, retain, tmp_step_dir
from core.checkpoint.hdf5 import CheckpointReader, write_shard
from core.checkpoint.spec import ShardAck, TensorSlice
from core.errors import CheckpointError

REPO = Path(__file__).resolve().parents[2]


def _write_ranks(tmp: Path, step: int, value: float, world: int = 2, n: int = 64) -> list[ShardAck]:
    """Rank r writes rows [4r, 4r+4) of a (4*world, n) tensor 'w' filled with ``value``; return the acks."""
    acks = []
    for r in range(world):
        s = TensorSlice(name="w", global_shape=(world * 4, n), offset=(r * 4, 0), shape=(4, n), dtype="float32")
        acks.append(write_shard(tmp / manifest.rank_file_name(r), [(s, np.full((4, n), value, np.float32))],
                                {"step": step}, {"step": step, "rank": r}))
    return acks


def _save(root: Path, step: int, *, keep_last: int = 10, world: int = 2, pinned: frozenset[int] = frozenset()
          ) -> Path:
    tmp = tmp_step_dir(root, step)
    return commit(root, step, tmp, _write_ranks(tmp, step, float(step), world), {"layout": {"dp": world}},
                  keep_last=keep_last, pinned=pinned)


def _value(step_dir: Path) -> float:
    with CheckpointReader(step_dir) as reader:
        return float(reader.read("w")[0, 0])


def test_commit_renames_tmp_writes_manifest_and_moves_latest(tmp_path: Path) -> None:
    tmp = tmp_step_dir(tmp_path, 7)
    assert tmp.name.startswith("step_00000007.tmp-") and tmp.is_dir()
    acks = _write_ranks(tmp, 7, 1.0)
    assert manifest.committed_steps(tmp_path) == []  # files without a manifest are no checkpoint
    final = commit(tmp_path, 7, tmp, acks, {"layout": {"dp": 2}, "config_hash": "abc"})
    assert final == tmp_path / "step_00000007" and not tmp.exists()
    assert manifest.committed_steps(tmp_path) == [7] and manifest.read_latest(tmp_path) == 7
    m = manifest.read_manifest(final)
    assert m.step == 7 and m.layout == {"dp": 2} and m.config_hash == "abc"
    assert [(f.name, f.rank, f.size_bytes) for f in m.files] == [
        (a.file, a.rank, (final / a.file).stat().st_size) for a in acks]
    assert [s.file for s in m.tensors["w"].slices] == ["rank_00000.h5", "rank_00001.h5"]
    assert manifest.verify(final) == [] and manifest.latest_valid(tmp_path) == final


@pytest.mark.parametrize("damage", ["missing_rank", "size", "missing_file", "overlap", "gap", "wrong_name", "outside"])
def test_commit_refuses_bad_acks_and_commits_nothing(tmp_path: Path, damage: str) -> None:
    tmp = tmp_step_dir(tmp_path, 1)
    acks = _write_ranks(tmp, 1, 1.0)
    world = 2
    if damage == "missing_rank":
        acks, pattern = acks[:1], r"acks missing from ranks \[1\]"
    elif damage == "size":
        acks[1] = replace(acks[1], size_bytes=acks[1].size_bytes + 1)
        pattern = "rank_00001.h5: acked .* bytes but holds"
    elif damage == "missing_file":
        (tmp / "rank_00001.h5").unlink()
        pattern = "rank_00001.h5: acked by rank 1 but missing"
    elif damage == "overlap":
        acks[1] = replace(acks[1], slices=(replace(acks[1].slices[0], offset=(2, 0)),))
        pattern = "'w': slices overlap"
    elif damage == "gap":
        acks[1] = replace(acks[1], slices=(replace(acks[1].slices[0], shape=(2, 64)),))
        pattern = "'w': slices do not cover"
    elif damage == "outside":
        acks[1] = replace(acks[1], slices=(replace(acks[1].slices[0], offset=(6, 0)),))
        pattern = "rank 1 acked a bad slice .*outside"
    else:
        acks[1] = replace(acks[1], file="rank_00000.h5")
        pattern = "rank 1 acked file 'rank_00000.h5'"
    with pytest.raises(CheckpointError, match=pattern):
        commit(tmp_path, 1, tmp, acks, {}, world_size=world)
    assert manifest.committed_steps(tmp_path) == [] and manifest.read_latest(tmp_path) is None
    assert not (tmp / "manifest.json").exists()


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "delete"])
def test_damaged_newest_is_detected_and_latest_valid_falls_back(tmp_path: Path, damage: str,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    good = _save(tmp_path, 1)
    bad = _save(tmp_path, 2)
    victim = bad / "rank_00001.h5"
    if damage == "truncate":
        os.truncate(victim, victim.stat().st_size - 100)
    elif damage == "bitflip":
        data = bytearray(victim.read_bytes())
        data[len(data) - 200] ^= 0x10  # inside the tensor data, far from the HDF5 superblock
        victim.write_bytes(bytes(data))
    else:
        victim.unlink()
    problems = manifest.verify(bad)
    assert len(problems) == 1 and str(victim) in problems[0]
    assert {"truncate": "size", "bitflip": "checksum", "delete": "missing"}[damage] in problems[0]
    with caplog.at_level(logging.WARNING, logger="core.checkpoint.manifest"):
        assert manifest.latest_valid(tmp_path) == good
    assert str(victim) in caplog.text and "skipping checkpoint" in caplog.text
    assert _value(good) == 1.0


def test_bad_manifest_is_a_one_line_checkpoint_error_naming_the_file(tmp_path: Path) -> None:
    step_dir = _save(tmp_path, 3)
    (step_dir / "manifest.json").write_text('{"format": "baton-checkpoint", "format_vers')
    with pytest.raises(CheckpointError, match=r"step_00000003/manifest.json: unreadable .*delete") as info:
        manifest.read_manifest(step_dir)
    assert "\n" not in str(info.value)
    assert "manifest.json: unreadable" in manifest.verify(step_dir)[0]
    (step_dir / "manifest.json").write_text(json.dumps({"format": "baton-checkpoint", "format_version": 99}))
    with pytest.raises(CheckpointError, match="format version 99.*upgrade Baton"):
        CheckpointReader(step_dir)
    assert manifest.latest_valid(tmp_path) is None


def test_uncommitted_folders_are_never_loaded_and_are_cleaned(tmp_path: Path) -> None:
    good = _save(tmp_path, 1)
    stale = tmp_step_dir(tmp_path, 2)  # a save that crashed before its commit
    _write_ranks(stale, 2, 2.0)
    no_manifest = tmp_path / "step_00000003"  # a final name without a manifest
    no_manifest.mkdir()
    _write_ranks(no_manifest, 3, 3.0)
    in_flight = tmp_step_dir(tmp_path, 9)  # a newer save still being written
    assert manifest.committed_steps(tmp_path) == [1]
    assert manifest.latest_valid(tmp_path) == good
    listing = {(e.step, e.committed) for e in manifest.list_checkpoints(tmp_path)}
    assert listing == {(1, True), (2, False), (3, False), (9, False)}
    _save(tmp_path, 4)
    assert not stale.exists() and not no_manifest.exists() and in_flight.exists()
    assert remove_uncommitted(tmp_path) == [in_flight] and not in_flight.exists()
    assert manifest.committed_steps(tmp_path) == [1, 4]


def test_retention_keeps_keep_last_newest(tmp_path: Path) -> None:
    for step in range(1, 6):
        _save(tmp_path, step, keep_last=2)
        assert manifest.committed_steps(tmp_path) == list(range(max(1, step - 1), step + 1))
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["latest", "step_00000004", "step_00000005"]


def test_retention_keeps_a_pinned_step_for_good(tmp_path: Path) -> None:
    """An RL run's reference policy is a checkpoint: retention never deletes it."""
    for step in range(1, 6):
        _save(tmp_path, step, keep_last=2, pinned=frozenset({2}))
    assert manifest.committed_steps(tmp_path) == [2, 4, 5]


def test_retention_never_deletes_the_only_good_checkpoint(tmp_path: Path) -> None:
    good = _save(tmp_path, 1)
    for step in (2, 3):
        os.truncate(_save(tmp_path, step) / "rank_00000.h5", 10)
    assert retain(tmp_path, 2) == []  # both kept ones are bad: the older good one stays
    assert manifest.committed_steps(tmp_path) == [1, 2, 3] and manifest.latest_valid(tmp_path) == good
    _save(tmp_path, 4, keep_last=2)  # a good newer one exists again: now the old ones may go
    assert manifest.committed_steps(tmp_path) == [3, 4]
    with pytest.raises(ValueError):
        retain(tmp_path, 0)


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    _save(tmp_path, 5)
    tmp = tmp_step_dir(tmp_path, 5)
    final = commit(tmp_path, 5, tmp, _write_ranks(tmp, 5, 50.0), {})
    assert _value(final) == 50.0 and manifest.committed_steps(tmp_path) == [5]
    assert [p.name for p in tmp_path.iterdir() if p.name != "latest"] == ["step_00000005"]


@pytest.mark.timeout(60)
def test_latest_pointer_moves_atomically(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    seen: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            seen.append((tmp_path / "latest").read_text())  # never missing, never half-written

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for step in range(2, 12):
            with open(tmp_path / "latest") as before:  # the file that was the pointer until this commit
                _save(tmp_path, step, keep_last=3)
                assert before.read() == f"step_{step - 1:08d}\n"  # replaced by a rename, not rewritten in place
    finally:
        stop.set()
        thread.join(timeout=30)
    assert seen and set(seen) <= {f"step_{s:08d}\n" for s in range(1, 12)}
    assert manifest.read_latest(tmp_path) == 11 and not list(tmp_path.glob("latest.tmp-*"))


def test_list_and_describe_show_steps_layout_and_slices(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    step_dir = _save(tmp_path, 2)
    entries = manifest.list_checkpoints(tmp_path)
    assert [(e.step, e.committed, e.is_latest, e.layout) for e in entries] == [
        (1, True, False, {"dp": 2}), (2, True, True, {"dp": 2})]
    assert entries[1].size_bytes == sum(f.stat().st_size for f in step_dir.iterdir())
    text = manifest.describe(step_dir)
    assert "w  float32  [8, 64]" in text
    assert "rank_00001.h5:tensor_00000  offset [4, 0]  shape [4, 64]" in text


_CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    import numpy as np
    from core.checkpoint import manifest
    from core.checkpoint.commit import commit, tmp_step_dir
    from core.checkpoint.hdf5 import write_shard
    from core.checkpoint.spec import TensorSlice
    root = Path(sys.argv[1])
    tmp = tmp_step_dir(root, 2)
    big = np.ones(32 << 20, np.float32)  # 128 MiB per rank, 8 ranks: long enough to be caught mid-write
    acks = []
    for r in range(8):
        s = TensorSlice(name="big", global_shape=(8 * big.size,), offset=(r * big.size,), shape=big.shape,
                        dtype="float32")
        acks.append(write_shard(tmp / manifest.rank_file_name(r), [(s, big)], {}, {"step": 2, "rank": r}))
    commit(root, 2, tmp, acks, {})
""")


@pytest.mark.timeout(120)
def test_sigkill_mid_save_leaves_the_previous_checkpoint_committed(tmp_path: Path) -> None:
    good = _save(tmp_path, 1)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        seen: dict[Path, int] = {}
        growing = False
        while not growing:  # poll the file system until some shard of the save is growing
            assert child.poll() is None, "the writer finished before it could be killed mid-save"
            assert time.monotonic() < deadline, "no shard of the save was ever seen growing"
            for shard in tmp_path.glob("step_00000002.tmp-*/rank_*.h5"):
                try:
                    blocks = os.stat(shard).st_blocks  # allocated size: the file's length is set up front
                except FileNotFoundError:
                    continue
                growing = growing or blocks > seen.get(shard, blocks)
                seen[shard] = blocks
            time.sleep(0.002)  # a polling interval, not synchronisation: the loop exits on what it observes
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert manifest.committed_steps(tmp_path) == [1] and manifest.read_latest(tmp_path) == 1
    assert manifest.latest_valid(tmp_path) == good and _value(good) == 1.0
    debris = list(tmp_path.glob("step_00000002.tmp-*"))
    assert len(debris) == 1 and not (debris[0] / "manifest.json").exists()
    _save(tmp_path, 3)  # the next commit clears the crashed save away
    assert not debris[0].exists() and manifest.committed_steps(tmp_path) == [1, 3]
