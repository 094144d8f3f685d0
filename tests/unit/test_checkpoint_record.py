"""The run record's checkpoints against the disk (vanished ones), and storage errors at a
manifest's read: retried, never taken for damage (real files; the faults through BATON_FAULTS)."""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from core.checkpoint import manifest, storage
from core.checkpoint.commit import commit, tmp_step_dir
from core.checkpoint.hdf5 import write_shard
from core.checkpoint.spec import TensorSlice
from core.errors import CheckpointError, RunFolderError, TransientIOError
from core.job import faults
from core.record import events as ev
from core.record.state import RunState, apply, state_from_data, state_to_data


def _save(root: Path, step: int, *, keep_last: int = 10, retired: list[int] | None = None) -> Path:
    tmp = tmp_step_dir(root, step)
    s = TensorSlice(name="w", global_shape=(4, 8), offset=(0, 0), shape=(4, 8), dtype="float32")
    ack = write_shard(tmp / manifest.rank_file_name(0), [(s, np.full((4, 8), step, np.float32))], {"step": step},
                      {"step": step, "rank": 0})
    return commit(root, step, tmp, [ack], {"layout": {"dp": 1}}, keep_last=keep_last, retired=retired)


def test_commits_retention_and_resumes_fold_into_the_recorded_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    state = RunState()
    for step in (10, 20, 30):
        retired: list[int] = []
        _save(root, step, keep_last=2, retired=retired)
        apply(state, ev.CheckpointCommitted(step=step, folder=manifest.step_dir_name(step), seconds=0.1, bytes=1,
                                            retired=tuple(retired)))
    assert manifest.committed_steps(root) == [20, 30]  # the disk, independently of the record
    assert (state.checkpoints, state.retired) == ((20, 30), (10,))
    apply(state, ev.Resumed(step=20, checkpoint="step_00000020", saved_layout=None, layout="x", seconds=0.0))
    assert state.checkpoints == (20,)  # 30 is redone (it was damaged, or given up)
    apply(state, ev.RestartFromScratch(reason="--from-scratch"))
    assert state.checkpoints == () and state.retired == (10,)


def test_the_newest_recorded_checkpoint_gone_is_a_refusal_naming_it_and_what_is_left(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        _save(root, step)
    assert manifest.vanished(root, (10, 20)) == (None, [])
    shutil.rmtree(root / "step_00000020")
    refusal, notes = manifest.vanished(root, (10, 20))
    assert refusal is not None and notes == [] and "\n" not in refusal
    assert all(f in refusal for f in (str(root), "step_00000020 missing", "restore it", "--from-scratch",
                                      "step_00000010, the newest left"))
    shutil.move(root, tmp_path / "elsewhere")  # a scratch purge of the whole folder
    refusal, _ = manifest.vanished(root, (10, 20))
    assert refusal is not None and "folder itself is gone" in refusal and "step 0" in refusal
    assert "step_00000020, step_00000010 missing" in refusal


def test_an_older_one_gone_is_a_note_and_a_damaged_one_is_not_gone(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        _save(root, step)
    shutil.rmtree(root / "step_00000010")
    assert manifest.vanished(root, (10, 20)) == (None, [f"checkpoint {root / 'step_00000010'}: missing, though the "
                                                        "run's record says it was committed; the resume uses a newer one"])
    os.rename(root / "step_00000020", root / "step_00000020.damaged-0a0b0c0d")
    refusal, notes = manifest.vanished(root, (20,))
    assert refusal is None and notes == []  # damaged: today's handling (set aside, named), not a vanishing
    _save(root, 30)
    assert manifest.vanished(root, (10, 20))[0] is None  # a newer one than the record knows (a crash before it)


@pytest.fixture
def inject(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Set BATON_FAULTS for this process, the counts started afresh."""
    def set_faults(value: str, role: str = "cli") -> None:
        monkeypatch.setenv(faults.ENV, value)
        faults._settings.cache_clear()
        faults._opens.update(dict.fromkeys(faults._opens, 0))
        faults.set_process(role)

    yield set_faults
    monkeypatch.delenv(faults.ENV, raising=False)
    faults._settings.cache_clear()
    faults.set_process("cli")


@pytest.mark.parametrize("fault", ["manifest_eio", "manifest_estale"])
def test_a_storage_error_at_the_manifest_is_retried_and_the_checkpoint_reads(tmp_path: Path, inject, fault: str
                                                                              ) -> None:
    step_dir = _save(tmp_path, 10)
    inject(f"{fault}=3")
    assert manifest.verify(step_dir) == []
    assert manifest.read_manifest(step_dir).step == 10 and faults._opens[fault] == 3


def test_a_storage_error_that_lasts_is_a_transient_error_never_a_problem_of_the_checkpoint(tmp_path: Path, inject,
                                                                                          monkeypatch) -> None:
    step_dir = _save(tmp_path, 10)
    monkeypatch.setattr(storage, "IO_DEADLINE_S", 0.3)
    inject("manifest_estale=1000")
    with pytest.raises(TransientIOError, match=r"step_00000010/manifest.json: Stale .*the filesystem failed"):
        manifest.verify(step_dir)  # raised: never returned as a problem (which would set it aside)
    inject("manifest_estale=worker:1000")  # another role's fault: this process reads
    assert manifest.verify(step_dir) == []
    inject("manifest_estale=cli:1000")
    with pytest.raises(TransientIOError):
        manifest.newest_intact(tmp_path)
    assert manifest.committed_steps(tmp_path) == [10] and manifest.damaged(tmp_path) == []


def test_a_manifest_the_process_may_not_read_is_the_user_s_to_fix_not_damage(tmp_path: Path, monkeypatch) -> None:
    step_dir = _save(tmp_path, 10)

    def denied(path: object) -> None:  # root reads through chmod: the errno as the filesystem gives it
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(faults, "manifest_open", denied)
    with pytest.raises(RunFolderError, match="Permission denied.*not damaged"):
        manifest.verify(step_dir)
    (step_dir / manifest.MANIFEST_NAME).write_text('{"format": "baton-checkpoint"')
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="not valid JSON"):  # a format mismatch is the checkpoint's
        manifest.read_manifest(step_dir)


def test_a_state_json_of_an_older_baton_without_the_recorded_checkpoints_reads_and_checks_nothing(tmp_path: Path
                                                                                                 ) -> None:
    data = state_to_data(RunState(step=20))
    del data["checkpoints"], data["retired"]
    state = state_from_data(json.loads(json.dumps(data)), "state.json")
    assert (state.checkpoints, state.retired) == ((), ())
    assert manifest.vanished(tmp_path / "checkpoints", state.checkpoints) == (None, [])


def test_step_folders_left_empty_by_a_purge_are_gone(tmp_path: Path) -> None:
    """A scratch purge that deletes files and leaves folders: a final-name folder without its
    manifest is not a checkpoint, so the resume is refused rather than starting over."""
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        _save(root, step)
    for step in (10, 20):
        for f in (root / manifest.step_dir_name(step)).iterdir():
            f.unlink()
    refusal, _ = manifest.vanished(root, (10, 20))
    assert refusal is not None and "step_00000020, step_00000010 missing" in refusal and "step 0" in refusal
