"""Faults classified by cause, with real processes (toy task, local backend): a checkpoint
save on a real full disk (a small tmpfs under checkpoints/), every rank raising the same
transient error (a real TCP reset, gloo's timeout) or a RuntimeError of unknown cause, and
the same bug on every rank. The toy is deterministic per step given its state, so a
recovered run must reproduce the uninterrupted run's loss at every step, exactly."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.checkpoint import manifest
from tests.helpers import fill_up, losses, small_tmpfs, submitted_runs, toy_reference, wait_for

pytestmark = pytest.mark.timeout(180)
STEPS = 200
COMMON = [
    f"trainer.steps={STEPS}", "optimizer.lr=0.002", "trainer.log_interval_steps=20", "recovery.backoff_s=0.2",
    "checkpoint.interval_steps=20", "timeouts.heartbeat_interval_s=0.1", "timeouts.heartbeat_timeout_s=1.5",
    "timeouts.controller_lost_s=3",
]
CHECKPOINT_BYTES = 48 << 10  # a toy checkpoint on tmpfs: 4 shards of 2 pages, the manifest, `latest`


@pytest.fixture
def submit(tmp_path: Path) -> Iterator[Any]:
    with submitted_runs(tmp_path, COMMON) as start:
        yield start


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The loss at every step of an uninterrupted run of the same config."""
    return toy_reference(tmp_path_factory.mktemp("reference"), COMMON)


def _no_crash(run: Any) -> None:
    """No worker died of a signal: every loss was a remote error, no log shows a segfault."""
    for e in run.events("worker_lost"):
        assert e["failure"] == "remote_error", e
    for log in (run.run_dir / "logs").glob("*.log"):
        text = log.read_text(errors="replace")
        assert "Segmentation fault" not in text and "SIGSEGV" not in text and "Fatal Python error" not in text, log


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_on_a_full_disk_is_retried_once_space_is_freed_and_the_run_completes_exactly(
        submit, reference, mode: str) -> None:
    """checkpoints/ is a small tmpfs with room for one checkpoint: step 20's commits, step 40's
    shards meet a full disk (some ranks' mid-file). The save fails as a transient error; once
    the test deletes the filler, the retry resumes from step 20 and the run ends as if nothing
    happened. An async save meets it on its writer thread: the error comes with the poll."""
    r = submit(f"checkpoint.async={mode == 'async'}", env={"BATON_TOY_SETUP_S": "1.5"})  # time to mount
    ckpts = r.run_dir / "checkpoints"
    with small_tmpfs(ckpts, 1 << 20):
        try:
            filler = fill_up(ckpts, leave_bytes=CHECKPOINT_BYTES + (8 << 10))
            lost = wait_for(lambda: r.events("worker_lost"), 60, "the save that meets the full disk")
            assert manifest.committed_steps(ckpts) == [20], "the full disk was not met at step 40's save"
            filler.unlink()
            assert r.finish() == 0, r.output
        finally:
            r.cleanup()
        assert all("No space left on device" in e["why"] and e["step"] >= 40 for e in lost), lost
        assert losses(r.run_dir, every_step_once=True) == reference
        assert r.state()["status"] == "completed"
        assert [e["step"] for e in r.events("resumed")][-1:] == [20]
        assert manifest.damaged(ckpts) == [] and r.events("checkpoint_damaged") == []
        steps = manifest.committed_steps(ckpts)
        assert steps == [STEPS - 20, STEPS] and all(manifest.verify(ckpts / f"step_{s:08d}") == [] for s in steps)
        assert not [p for p in ckpts.iterdir() if ".tmp-" in p.name]  # the failed save's folder: removed
    _no_crash(r)


@pytest.mark.parametrize("kind", ["conn_reset", "collective_timeout", "runtime_error"])
def test_every_rank_raising_the_same_transient_or_unknown_error_is_retried_and_completes_exactly(
        submit, reference, kind: str) -> None:
    r = submit(env={"BATON_FAULTS": f"raise_at_step=50:{kind}"})
    assert r.finish() == 0, r.output
    assert losses(r.run_dir, every_step_once=True) == reference
    (lost, *_) = r.events("worker_lost")
    assert lost["step"] == 50 and "the same on all 4 ranks" in lost["why"], lost
    assert [e["generation"] for e in r.events("restarting_workers")] == [1]
    assert r.state()["status"] == "completed"
    _no_crash(r)


@pytest.mark.parametrize(("kind", "named", "code"), [
    ("type_error", "TypeError: injected TypeError at step 50", 1),
    ("user_error", "UserError: injected bad input at step 50", 2),
])
def test_the_same_bug_or_user_error_on_every_rank_fails_at_once_naming_it(submit, kind: str, named: str,
                                                                          code: int) -> None:
    r = submit(env={"BATON_FAULTS": f"raise_at_step=50:{kind}"})
    assert r.finish() == code, r.output
    state = r.state()
    assert state["status"] == "failed" and state["step"] == 50
    exc_type, message = named.split(": ")
    assert f"raised {exc_type} in train_step: {message}" in state["reason"], state["reason"]
    assert "the same on all 4 ranks" in state["reason"] and "not retried" in state["reason"]
    assert r.events("restarting_workers") == [] and r.events("worker_lost") == []
