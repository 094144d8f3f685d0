"""A stop waits for an async save in flight no longer than Slurm leaves (core.controller.stop
``time_budget_s``, core.checkpoint.coordinator ``drain``): a fake clock and a scripted worker
group at the function boundary; the shards, the commit and the run record are real."""
from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.checkpoint import calls, manifest
from core.checkpoint.coordinator import CheckpointCoordinator
from core.checkpoint.hdf5 import write_shard
from core.checkpoint.loop import LoopState
from core.checkpoint.spec import ShardAck, TensorSlice
from core.config.dims import ParallelDims
from core.controller.stop import STOP_FLOOR_S, STOP_MARGIN_S, StopPolicy
from core.job.signals import PreemptionFlag
from core.job.slurmctl import JobClock
from core.record import events as ev
from core.record.runfolder import RunFolder
from core.record.state import RunRecord, RunState, Status

CHECKPOINT_S = 600.0  # timeouts.checkpoint_s
WORLD = 2
# `scontrol show job -o` of a job 1 s after its preemption (slurm 22.05, GraceTime=20; tests/unit/test_preemption.py)
PREEMPTED = ("JobId=16 JobName=low UserId=root(0) JobState=RUNNING Reason=None Requeue=1 Restarts=0 "
             "TimeLimit=00:10:00 StartTime=2026-12-02T18:34:22 EndTime=2026-12-02T18:34:43 Deadline=N/A "
             "PreemptEligibleTime=2026-12-02T18:34:22 PreemptTime=2026-12-02T18:34:23 Partition=low")


def _scontrol(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """The scontrol process boundary: every `scontrol show job` answers PREEMPTED."""
    assert list(args[:3]) == ["scontrol", "show", "job"], args
    return subprocess.CompletedProcess(list(args), 0, PREEMPTED, "")


class Clock:
    """Fake monotonic time: it moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        assert s >= 0
        self.t += s


class Ranks:
    """Two ranks of a worker group: each writes its real shard; an async save becomes durable
    ``durable_after_s`` of fake time after it starts."""

    def __init__(self, clock: Clock, durable_after_s: float) -> None:
        self.clock = clock
        self.durable_after_s = durable_after_s
        self.dims = ParallelDims(tp=1, pp=1, dp=WORLD)
        self.epoch = self.generation = 0
        self.calls: list[tuple[str, float | None]] = []
        self._acks: list[ShardAck] = []
        self._durable_at = 0.0

    def call(self, method: Any, request: Any = None, *, timeout_s: float | None = None) -> list[Any]:
        self.calls.append((method.name, timeout_s))
        if method is calls.CKPT_SAVE:
            self._acks = [_shard(Path(request.tmp_dir), request.step, r) for r in range(WORLD)]
            self._durable_at = self.clock.now() + (0.0 if not request.async_save else self.durable_after_s)
            return [calls.Saved(ack=None if request.async_save else a) for a in self._acks]
        if method is calls.CKPT_POLL:
            return list(self._acks) if self.clock.now() >= self._durable_at else [None] * WORLD
        if method is calls.CKPT_WAIT:
            self.clock.t = max(self.clock.t, self._durable_at)
            return list(self._acks)
        raise AssertionError(f"unexpected call {method.name}")


def _shard(tmp: Path, step: int, rank: int) -> ShardAck:
    s = TensorSlice(name="w", global_shape=(WORLD * 4, 8), offset=(rank * 4, 0), shape=(4, 8), dtype="float32")
    return write_shard(tmp / manifest.rank_file_name(rank), [(s, np.full((4, 8), float(step), np.float32))],
                       {}, {"step": step, "rank": rank})


def _coordinator(tmp_path: Path, durable_after_s: float) -> tuple[CheckpointCoordinator, Ranks, Clock, RunRecord]:
    """A coordinator with step 10 committed and an async save of step 20 in flight."""
    clock = Clock()
    run = RunFolder(tmp_path / "run")
    run.path.mkdir()
    record = RunRecord(run)
    record.create(RunState(status=Status.RUNNING, total_steps=100), ev.Created(backend="slurm"))
    ranks = Ranks(clock, durable_after_s)
    coord = CheckpointCoordinator(ranks, record, root=run.checkpoints, model_hash="h", keep_last=5, async_save=True,
                                  timeout_s=CHECKPOINT_S, poll_timeout_s=5.0, now=clock.now, sleep=clock.sleep)
    coord.save(LoopState(step=10), blocking=True)
    coord.save(LoopState(step=20))
    ranks.calls.clear()
    return coord, ranks, clock, record


def _policy(seconds_left: float | None) -> StopPolicy:
    """A stop policy whose Slurm clock says ``seconds_left`` (None: no Slurm job)."""
    if seconds_left is None:
        return StopPolicy(PreemptionFlag(), None)
    end = time.mktime(time.strptime("2026-12-02T18:34:43", "%Y-%m-%dT%H:%M:%S"))  # PREEMPTED's EndTime
    return StopPolicy(PreemptionFlag(), JobClock("16", run=_scontrol, now=lambda: end - seconds_left))


@pytest.mark.parametrize(("left", "budget"), [(30.0, 30.0 - STOP_MARGIN_S), (5.0, STOP_FLOOR_S), (-1.0, STOP_FLOOR_S),
                                              (5000.0, CHECKPOINT_S),
                                              (None, CHECKPOINT_S)])
def test_the_stop_budget_is_the_time_slurm_leaves_less_a_margin_else_the_checkpoint_timeout(
        left: float | None, budget: float) -> None:
    assert _policy(left).time_budget_s(CHECKPOINT_S) == pytest.approx(budget)


def test_a_save_that_cannot_finish_before_slurm_ends_the_job_is_abandoned_for_the_last_commit(tmp_path: Path) -> None:
    coord, ranks, clock, record = _coordinator(tmp_path, durable_after_s=50.0)
    start = clock.now()
    budget = _policy(30.0).time_budget_s(CHECKPOINT_S)  # 20 s: the save needs 50
    assert coord.drain(timeout_s=budget) is False
    assert clock.now() - start == pytest.approx(budget)  # waited what Slurm leaves, not the checkpoint timeout
    assert {name for name, _ in ranks.calls} == {"ckpt_poll"}  # never blocked in ckpt_wait: the ranks stay free
    (abandoned,) = [e for e in record.events() if isinstance(e, ev.CheckpointAbandoned)]
    assert (abandoned.step, abandoned.resume_step) == (20, 10) and "20 s" in abandoned.reason
    assert manifest.committed_steps(coord.root) == [10]
    polls = len(ranks.calls)
    assert coord.drain(timeout_s=budget) is True and len(ranks.calls) == polls  # nothing in flight any more


def test_a_save_that_finishes_within_the_time_left_is_committed(tmp_path: Path) -> None:
    coord, ranks, clock, record = _coordinator(tmp_path, durable_after_s=5.0)
    assert coord.drain(timeout_s=_policy(30.0).time_budget_s(CHECKPOINT_S)) is True
    assert manifest.committed_steps(coord.root) == [10, 20]
    assert not [e for e in record.events() if isinstance(e, ev.CheckpointAbandoned)]


def test_without_a_slurm_clock_the_drain_waits_with_the_checkpoint_timeout(tmp_path: Path) -> None:
    coord, ranks, clock, _ = _coordinator(tmp_path, durable_after_s=300.0)
    assert coord.drain(timeout_s=_policy(None).time_budget_s(CHECKPOINT_S)) is True
    assert ranks.calls == [("ckpt_wait", CHECKPOINT_S)]
    assert manifest.committed_steps(coord.root) == [10, 20]

