"""The run record (core.record.state, events, steps): one locked reader/writer, typed, tolerant."""
from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.config.dims import Coords
from core.errors import RunFolderError
from core.record import events as ev
from core.record import steps
from core.record.memory import MemoryReport, RankMemory
from core.record.runfolder import RunFolder
from core.record.state import (
    FOLD,
    Budget,
    Goodput,
    RankInfo,
    RunRecord,
    RunState,
    SlurmInfo,
    Status,
    apply,
    state_from_data,
    state_to_data,
)

N_PROCS, N_EVENTS = 2, 300


def _folder(tmp_path: Path) -> RunFolder:
    run = RunFolder(tmp_path)
    RunRecord(run).create(RunState(status=Status.CREATED, total_steps=10), ev.Created(backend="local"))
    return run


def _append_many(path: str, writer: int, n: int) -> None:
    record = RunRecord(RunFolder(Path(path)))
    for i in range(n):
        if i % 3 == 0:  # state updates interleaved with events: no update may be lost either
            with record.update(ev.Completed(step=writer * 100_000 + i)) as s:
                s.step += 1
        else:
            record.append(ev.Completed(step=writer * 100_000 + i))


@pytest.mark.timeout(120)
def test_two_processes_appending_at_once_lose_nothing_and_the_files_always_parse(tmp_path: Path) -> None:
    run = _folder(tmp_path)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(str(tmp_path), w, N_EVENTS)) for w in range(N_PROCS)]
    for p in procs:
        p.start()
    record, reads = RunRecord(run), 0
    try:
        while any(p.is_alive() for p in procs):  # read while they write: every read must parse
            record.read()
            record.events()
            reads += 1
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0] * N_PROCS
    assert reads > 0
    got = sorted(e.step for e in record.events() if isinstance(e, ev.Completed))
    assert got == sorted(w * 100_000 + i for w in range(N_PROCS) for i in range(N_EVENTS))
    updates = sum(1 for i in range(N_EVENTS) if i % 3 == 0)
    assert record.read().step == N_PROCS * updates


def test_an_update_inside_an_update_is_refused_rather_than_deadlocking(tmp_path: Path) -> None:
    record = RunRecord(_folder(tmp_path))
    with record.update() as s:
        s.step = 3
        record.append(ev.Completed(step=3))  # appending while the lock is held is fine
        with pytest.raises(RuntimeError, match="an update inside an update"), record.update():
            pass
    assert record.read().step == 3 and [ev.kind_of(e) for e in record.events()] == ["created", "completed"]


def test_a_body_that_raises_writes_nothing(tmp_path: Path) -> None:
    record = RunRecord(_folder(tmp_path))
    with pytest.raises(ValueError), record.update(ev.Completed(step=1)) as s:
        s.step = 99
        raise ValueError("no")
    assert record.read().step == 0 and len(record.events()) == 1


def test_a_torn_last_event_line_is_skipped_and_the_next_append_starts_a_new_line(tmp_path: Path) -> None:
    run = _folder(tmp_path)
    with run.events.open("ab") as f:
        f.write(b'{"time": 1.0, "event": "compl')  # a crash mid-append
    record = RunRecord(run)
    assert [ev.kind_of(e) for e in record.events()] == ["created"]
    record.append(ev.Completed(step=5))
    assert [ev.kind_of(e) for e in record.events()] == ["created", "completed"]


@pytest.mark.parametrize(("content", "fragment"), [
    (b"", "not valid JSON"),
    (b"[1, 2]", "holds a JSON list, not an object"),
    (b'{"version": 99}', "version 99, this Baton reads"),
    (b'{"version": 2, "status": "exploded"}', "status: 'exploded' is not"),
    (b'{"version": 2, "step": "ten"}', "step: 'ten' is not an integer"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
])
def test_a_damaged_or_newer_state_is_one_error_naming_the_file(tmp_path: Path, content: bytes, fragment: str) -> None:
    run = RunFolder(tmp_path)
    run.state.write_bytes(content)
    with pytest.raises(RunFolderError, match=fragment) as info:
        RunRecord(run).read()
    assert str(run.state) in str(info.value) and "\n" not in str(info.value)


def test_a_missing_state_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(RunFolderError, match="state.json: missing"):
        RunRecord(RunFolder(tmp_path)).read()


def test_an_untyped_state_of_an_older_baton_is_read_and_its_history_moves_to_events(tmp_path: Path) -> None:
    run = RunFolder(tmp_path)
    old = {"status": "requeue", "backend": "local", "step": 40, "total_steps": 100, "restarts": 1, "last_loss": 0.5,
           "ranks": [{"rank": 0, "node": "n", "host": "h", "pid": 7, "coords": {"tp": 0, "pp": 0, "dp": 0},
                      "layers": [0, 1], "num_params": 10, "device": "cpu"}],
           "recovery": {"retries": 1, "node_failures": {"n": 1}, "exclude": [], "last_failure_step": 30},
           "history": [{"time": 1.0, "event": "created", "backend": "local"},
                       {"time": 2.0, "event": "some_future_kind", "x": 1}]}
    run.state.write_text(json.dumps(old))
    record = RunRecord(run)
    state = record.read()
    assert state.status is Status.REQUEUED and state.step == 40 and state.recovery.retries == 1
    assert state.ranks[0].coords == Coords(rank=0, tp=0, pp=0, dp=0) and state.ranks[0].layers == (0, 1)
    assert [ev.kind_of(e) for e in record.events()] == ["created", "some_future_kind"]
    with record.update() as s:  # the first write moves the history out, once
        s.step = 41
    assert [ev.kind_of(e) for e in record.events()] == ["created", "some_future_kind"]
    assert "history" not in json.loads(run.state.read_text())
    assert ev.to_data(record.events()[1]) == {"time": 2.0, "event": "some_future_kind", "x": 1}


# --- every type round-trips through JSON ----------------------------------------------------
_text = st.text(max_size=8)
_num = st.floats(allow_nan=False, allow_infinity=False)
_maybe_int = st.none() | st.integers(-5, 10**6)


def _field_value(tp: Any) -> st.SearchStrategy[Any]:
    table: dict[Any, st.SearchStrategy[Any]] = {
        int: st.integers(-5, 10**9), float: _num, str: _text, bool: st.booleans(),
        int | None: _maybe_int, float | None: st.none() | _num, str | None: st.none() | _text,
        tuple[str, ...]: st.lists(_text, max_size=3).map(tuple), tuple[int, ...]: st.lists(st.integers(0, 10**6),
                                                                                            max_size=3).map(tuple),
        dict[str, str]: st.dictionaries(_text, _text, max_size=3),
        tuple[RankInfo, ...]: st.lists(st.deferred(lambda: _ranks), max_size=2).map(tuple),
    }
    return table.get(tp, st.none() | _text | st.integers(0, 9) | st.lists(st.integers(0, 9), max_size=3))


def _event_strategy(cls: type[ev.Event]) -> st.SearchStrategy[ev.Event]:
    hints = __import__("typing").get_type_hints(cls)
    kwargs = {f.name: _field_value(hints[f.name]) for f in dataclasses.fields(cls) if f.name != "time"}
    return st.builds(cls, time=_num, **kwargs)


@settings(max_examples=300, deadline=None)
@given(st.one_of([_event_strategy(cls) for cls in ev.KINDS.values()]))
def test_every_event_kind_round_trips_through_json(event: ev.Event) -> None:
    line = json.dumps(ev.to_data(event))
    assert ev.from_data(json.loads(line), "events.jsonl line 1") == event


_ranks = st.builds(RankInfo, rank=st.integers(0, 99), node=_text, host=_text, pid=st.integers(1, 10**6),
                   coords=st.none() | st.builds(Coords, rank=st.integers(0, 9), tp=st.integers(0, 9),
                                                pp=st.integers(0, 9), dp=st.integers(0, 9)),
                   layers=st.lists(st.integers(0, 99), max_size=4).map(tuple), num_params=st.integers(0, 10**9),
                   device=_text)
_states = st.builds(
    RunState, status=st.sampled_from(list(Status)), backend=_text, step=st.integers(0, 10**6),
    total_steps=st.integers(0, 10**6), restarts=st.integers(0, 99), epoch=st.integers(0, 99),
    generation=st.integers(0, 99), created=_num, updated=_num, last_loss=st.none() | _num, reason=_text,
    micro_batch_size=_maybe_int, ranks=st.lists(_ranks, max_size=3).map(tuple),
    recovery=st.builds(Budget, retries=st.integers(0, 9), node_failures=st.dictionaries(_text, st.integers(0, 9)),
                       exclude=st.lists(_text, max_size=2).map(tuple), last_failure_step=st.integers(-1, 99)),
    goodput=st.builds(Goodput, allocated_s=_num, useful_s=_num),
    checkpoints=st.lists(st.integers(0, 10**6), max_size=3).map(tuple),
    retired=st.lists(st.integers(0, 10**6), max_size=3).map(tuple),
    slurm=st.builds(SlurmInfo, job_id=st.none() | _text,
                    controller_task=st.dictionaries(_text, st.none() | _text | st.integers(0, 9), max_size=3)),
)


@settings(max_examples=200, deadline=None)
@given(_states)
def test_the_run_state_round_trips_through_json(state: RunState) -> None:
    assert state_from_data(json.loads(json.dumps(state_to_data(state))), "state.json") == state


@settings(max_examples=200, deadline=None)
@given(st.builds(
    steps.StepRecord, step=st.integers(0, 10**6), loss=_num, grad_norm=st.none() | _num, lr=st.none() | _num,
    tokens=st.integers(0, 10**9), tokens_per_s=_num, step_time_s=_num, time=_num,
    rank_step_time_s=st.lists(_num, max_size=4).map(tuple), rss_mb=st.lists(_num, max_size=4).map(tuple),
    data_wait_s=st.none() | st.lists(_num, max_size=4).map(tuple),
    grad_sync_s=st.none() | st.lists(_num, max_size=4).map(tuple),
    cuda_peak_mb=st.none() | st.lists(_num, max_size=4).map(tuple)))
def test_a_step_record_round_trips_through_json(record: steps.StepRecord) -> None:
    assert steps.from_data(json.loads(json.dumps(steps.to_data(record))), "metrics.jsonl line 1") == record


def test_step_records_skip_a_torn_line_and_a_resume_supersedes_redone_steps_deleting_none(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    for i in range(5):
        steps.append(path, steps.StepRecord(step=i, loss=1.0 / (i + 1), time=time.time()))
    with path.open("a") as f:
        f.write('{"step": 5, "lo')
    assert [r.step for r in steps.read(path)] == [0, 1, 2, 3, 4]
    before = path.read_bytes()
    kept = steps.supersede(path, 3, epoch=1)
    assert [r.step for r in kept] == [0, 1, 2]
    assert path.read_bytes().startswith(before)  # appended to, never rewritten: the torn line stays
    for i in (3, 4, 5):
        steps.append(path, steps.StepRecord(step=i, loss=10.0 + i, time=time.time()))
    lines = path.read_text().splitlines()
    assert lines[5] == '{"step": 5, "lo' and json.loads(lines[6])["superseded_from"] == 3  # on a line of its own
    assert [(r.step, r.loss) for r in steps.read(path)] == [(0, 1.0), (1, 0.5), (2, 1 / 3), (3, 13.0), (4, 14.0),
                                                            (5, 15.0)]
    every = steps.read(path, superseded=True)
    assert [(r.step, r.superseded) for r in every] == [(0, False), (1, False), (2, False), (3, True), (4, True),
                                                       (3, False), (4, False), (5, False)]
    assert "superseded" not in json.loads(lines[-1])  # a reader's flag, never written
    assert steps.supersede(path, 6, epoch=2) and path.read_text().splitlines() == lines  # nothing redone: no marker


# --- the fold: every event that changes the state changes it one way --------------------------
def test_an_appended_event_is_folded_into_the_state(tmp_path: Path) -> None:
    run = _folder(tmp_path)
    record = RunRecord(run)
    assert record.read().backend == "local"  # create folds `created`
    record.append(ev.Submitted(backend="slurm", job_id="42", epoch=0))
    s = record.read()
    assert (s.status, s.backend, s.slurm.job_id) == (Status.SUBMITTED, "slurm", "42")
    record.append(ev.ControllerStarted(node="n1", epoch=2, pid=7, total_steps=30))
    s = record.read()
    assert (s.status, s.epoch, s.restarts, s.total_steps, s.reason) == (Status.RUNNING, 2, 2, 30, "")
    ranks = (RankInfo(rank=0, node="n1", host="h", pid=8, device="cpu"),)
    record.append(ev.WorkersReady(world_size=1, epoch=2, generation=1, micro_batch_size=4, ranks=ranks))
    s = record.read()
    assert (s.ranks, s.generation, s.micro_batch_size) == (ranks, 1, 4)
    record.append(ev.Failed(reason="boom", step=3))
    assert (record.read().status, record.read().reason) == (Status.FAILED, "boom")
    record.append(ev.Cancelled(job_id="42"))  # a failed run stays failed
    assert record.read().status is Status.FAILED
    record.append(ev.CheckpointCommitted(step=3, folder="step_3", seconds=1.0, bytes=1))  # the checkpoints only
    assert record.read().status is Status.FAILED and record.read().checkpoints == (3,) and len(record.events()) == 7


def test_update_folds_its_events_before_the_body_and_an_append_inside_it_at_once(tmp_path: Path) -> None:
    record = RunRecord(_folder(tmp_path))
    with record.update(ev.RestartingWorkers(generation=2, backoff_s=0.0, retry=1, max_retries=3)) as s:
        assert s.generation == 2 and s.step == 0
        s.step = 7  # what no event carries (an older Baton's restarting_workers has no step)
        record.append(ev.Stopped(step=7, reason="scancel"))
        assert (s.status, s.reason) == (Status.STOPPED, "scancel")
    s = record.read()
    assert (s.generation, s.step, s.status, s.reason) == (2, 7, Status.STOPPED, "scancel")
    assert sorted(ev.kind_of(e) for e in record.events()) == ["created", "restarting_workers", "stopped"]


def test_events_of_an_older_baton_without_the_newer_fields_still_read() -> None:
    old = {"time": 1.0, "event": "workers_ready", "world_size": 2, "epoch": 0, "generation": 0}
    assert ev.from_data(old, "events.jsonl line 1") == ev.WorkersReady(time=1.0, world_size=2, epoch=0, generation=0)
    started = ev.from_data({"time": 1.0, "event": "controller_started", "node": "n", "epoch": 1, "pid": 3}, "line 2")
    state = RunState(total_steps=50)
    apply(state, started)
    assert (state.status, state.total_steps) == (Status.RUNNING, 50)  # an older event leaves total_steps as it was


def test_every_folded_kind_is_a_kind_of_the_history() -> None:
    assert set(FOLD) <= set(ev.KINDS.values())


# --- memory.json ---------------------------------------------------------------------------
def test_a_memory_report_is_written_in_its_shape_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "memory.json"
    report = MemoryReport.from_results(0, 4, "cuda", [(1.0, 2.0, 3.0, 4.0), None, (5.0, 6.0)])
    report.write(path)
    assert json.loads(path.read_text()) == {"step": 0, "micro_batch_size": 4, "device": "cuda", "ranks": [
        {"weights_bytes": 1.0, "grads_bytes": 2.0, "optimizer_bytes": 3.0, "activations_bytes": 4.0}, {},
        {"weights_bytes": 5.0, "grads_bytes": 6.0}]}
    back = MemoryReport.read(path)
    assert back == report and back.ranks[1] == RankMemory() and back.ranks[2].optimizer_bytes is None


@pytest.mark.parametrize(("content", "fragment"), [
    (None, "memory.json: missing; the ranks measure"),
    (b"{not json", "memory.json: unreadable"),
    (b"[1, 2]", "expected a mapping"),
    (b'{"step": 0, "micro_batch_size": 4, "device": "cpu"}', "ranks: missing"),
    (b'{"step": 0, "micro_batch_size": 4, "device": "cpu", "ranks": [{"weights_bytes": "x"}]}', "weights_bytes"),
])
def test_a_missing_or_damaged_memory_report_is_one_error_naming_the_file(tmp_path: Path, content: bytes | None,
                                                                        fragment: str) -> None:
    path = tmp_path / "memory.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(RunFolderError, match=fragment) as info:
        MemoryReport.read(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_restarting_workers_records_the_generation_and_the_steps_done(tmp_path: Path) -> None:
    record = RunRecord(_folder(tmp_path))
    record.append(ev.RestartingWorkers(generation=3, backoff_s=1.0, retry=2, max_retries=3, step=12))
    s = record.read()
    assert (s.generation, s.step) == (3, 12)
