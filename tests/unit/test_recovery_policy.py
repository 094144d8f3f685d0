"""core.controller.recovery.decide / deterministic, the retry budget (core.record.state) and
core.supervisor.contract: pure functions, and the contract on a real run record."""
from __future__ import annotations

import json
import time
from collections.abc import Collection
from pathlib import Path
from types import SimpleNamespace

import pytest

from core.config import run as config_mod
from core.controller.recovery import Decided, Failure, Recovery, decide, deterministic, signature
from core.controller.registration import Peer
from core.errors import ExitCode, RemoteError, WorkerLostError
from core.record import events as ev
from core.record.runfolder import RunFolder
from core.record.state import Budget, RunRecord, RunState, Status, state_from_data, state_to_data
from core.supervisor.contract import WorkerRequest, after_controller, read_request, request_path, request_workers


def _failure(node: str = "n1", step: int = 10) -> Failure:
    return Failure(kind="worker_lost", ranks=(2,), nodes=(node,), why=f"rank 2 on {node}: process exited", step=step)


def _decide(budget: Budget, **kw: object):
    args = {"max_retries": 3, "backoff_s": 5.0, "worker_restarts": True, "on_slurm": False, **kw}
    return decide(_failure(), budget, **args)  # type: ignore[arg-type]


def test_a_failure_with_retries_left_restarts_the_workers_with_doubling_backoff() -> None:
    b = Budget().spend(nodes=("n1",), step=10, committed_step=None)
    d = _decide(b)
    assert (d.action, d.backoff_s) == ("restart", 5.0)
    b = b.spend(nodes=("n2",), step=10, committed_step=None).spend(nodes=("n3",), step=10, committed_step=None)
    assert _decide(b).backoff_s == 20.0


def test_retries_spent_fail_naming_the_failure_and_the_nodes() -> None:
    b = Budget()
    for _ in range(4):
        b = b.spend(nodes=("n1",), step=10, committed_step=None)
    d = _decide(b)
    assert d.action == "fail" and "gave up after 3 retries" in d.reason
    assert "rank 2 on n1" in d.reason and "failures by node: n1: 4" in d.reason


def test_a_node_that_failed_twice_is_excluded_by_a_requeue_on_slurm() -> None:
    b = Budget().spend(nodes=("n1",), step=10, committed_step=None).spend(nodes=("n1",), step=12, committed_step=None)
    d = _decide(b, on_slurm=True)
    assert d.action == "requeue" and d.exclude == ("n1",)
    assert _decide(b, on_slurm=False).action == "restart"  # nothing to exclude locally


def test_a_failure_on_a_node_slurm_drained_requeues_without_it_at_once() -> None:
    b = Budget(exclude=("n0",)).spend(nodes=("n1",), step=10, committed_step=None)  # its first failure
    d = _decide(b, on_slurm=True, out_of_service=("n1",))
    assert d.action == "requeue" and d.exclude == ("n0", "n1") and "drained or down in Slurm" in d.reason
    assert _decide(b, on_slurm=True).action == "restart"  # not drained: a restart inside the allocation


def test_without_worker_restarts_slurm_requeues_and_elsewhere_the_run_fails_saying_why() -> None:
    b = Budget().spend(nodes=("n1",), step=10, committed_step=None)
    assert _decide(b, worker_restarts=False, on_slurm=True).action == "requeue"
    d = _decide(b, worker_restarts=False, on_slurm=False)
    assert d.action == "fail" and "no supervisor" in d.reason and "rank 2 on n1" in d.reason


def test_the_retries_are_forgiven_once_a_newer_checkpoint_commits_but_not_a_nodes_failures() -> None:
    b = Budget().spend(nodes=("n1",), step=57, committed_step=50)
    b = b.spend(nodes=("n1",), step=58, committed_step=50)
    assert b.retries == 2 and b.node_failures == {"n1": 2}
    b = b.spend(nodes=("n1",), step=90, committed_step=60)  # progress since the failure at 58
    assert b.retries == 1 and b.node_failures == {"n1": 3}


def test_a_node_failing_twice_far_apart_is_excluded_by_a_requeue() -> None:
    b = Budget().spend(nodes=("n2",), step=200, committed_step=200)
    assert _decide(b, worker_restarts=True, on_slurm=True).action == "restart"
    b = b.spend(nodes=("n2",), step=410, committed_step=400)  # progress in between
    d = _decide(b, worker_restarts=True, on_slurm=True)
    assert d.action == "requeue" and d.exclude == ("n2",) and b.retries == 1


def test_the_budget_round_trips_through_state() -> None:
    b = Budget(retries=2, node_failures={"n1": 2}, exclude=("n1",), last_failure_step=7)
    assert state_from_data(state_to_data(RunState(recovery=b)), "state.json").recovery == b
    assert state_from_data(state_to_data(RunState()), "state.json").recovery == Budget()


def _remote(rank: int = 1, exc_type: str = "RuntimeError", same: bool = False, user: bool = False) -> RemoteError:
    return RemoteError("boom", rank=rank, exc_type=exc_type, remote_traceback="", method="train_step",
                       same_on_all_ranks=same, user_error=user)


@pytest.mark.parametrize(("exc", "previous", "final"), [
    (_remote(exc_type="TypeError", same=True), (), True),                # every rank, one cause: a bug
    (_remote(same=True), (), False),                                     # a RuntimeError: one retry
    (_remote(same=True), (1, "RuntimeError", "train_step", 10), True),   # ... and back at the same step
    (_remote(exc_type="ConfigError", user=True), (), True),              # a user error (the worker flags it)
    (_remote(), (), False),                                              # one rank: maybe its node
    (_remote(), (1, "RuntimeError", "train_step", 10), True),            # the same again at step 10
    (_remote(), (1, "RuntimeError", "train_step", 9), False),            # another step
])
def test_deterministic_remote_errors_are_not_retried(exc: RemoteError, previous: tuple, final: bool) -> None:
    assert (deterministic(exc, 10, previous) is not None) is final
    assert signature(exc, 10) == (exc.rank, exc.exc_type, "train_step", 10)


def _run_folder(tmp_path: Path, status: str) -> RunFolder:
    run = RunFolder(tmp_path)
    (tmp_path / "logs").mkdir(exist_ok=True)
    RunRecord(run).create(RunState(status=Status(status), step=40, epoch=0))
    return run


def test_a_controller_that_died_is_requeued_within_the_budget_then_failed(tmp_path: Path) -> None:
    run = _run_folder(tmp_path, "running")
    record = RunRecord(run)
    assert after_controller(run, -9, max_retries=1, committed_step=None) is Status.REQUEUED
    state = record.read()
    assert state.status is Status.REQUEUED and state.recovery.retries == 1
    assert [ev.kind_of(e) for e in record.events()] == ["controller_died", "requeued"]
    with record.update() as s:
        s.status = Status.RUNNING
    assert after_controller(run, -9, max_retries=1, committed_step=None) is Status.FAILED
    state = record.read()
    assert state.status is Status.FAILED and "the controller died (signal 9)" in state.reason


def test_a_controller_that_died_while_slurm_ends_the_job_stops_without_a_retry(tmp_path: Path) -> None:
    run = _run_folder(tmp_path, "running")
    record = RunRecord(run)
    assert after_controller(run, 1, max_retries=3, committed_step=None, ending="job state CANCELLED") is Status.STOPPED
    state = record.read()
    assert state.recovery.retries == 0 and "job state CANCELLED" in state.reason and "--resume" in state.reason
    assert [ev.kind_of(e) for e in record.events()] == ["stopped"]


@pytest.mark.parametrize(("status", "decision"), [("requeued", Status.REQUEUED), ("completed", Status.COMPLETED),
                                                  ("failed", Status.FAILED), ("stopped", Status.STOPPED)])
def test_a_controller_that_had_its_last_word_is_followed(tmp_path: Path, status: str, decision: Status) -> None:
    assert after_controller(_run_folder(tmp_path, status), 0, max_retries=3, committed_step=None) is decision


def test_worker_requests_round_trip(tmp_path: Path) -> None:
    run = RunFolder(tmp_path)
    assert read_request(run) is None
    request_workers(run, WorkerRequest(epoch=2, generation=3, exclude=("n1",), reason="retry 1", time=5.0))
    assert read_request(run) == WorkerRequest(epoch=2, generation=3, exclude=("n1",), reason="retry 1", time=5.0)


def test_a_request_naming_ranks_round_trips_and_restarts_those_alone(tmp_path: Path) -> None:
    run = RunFolder(tmp_path)
    req = WorkerRequest(epoch=1, generation=2, ranks=(2, 3), reason="retry 1: the generator alone", time=5.0)
    request_workers(run, req)
    assert json.loads(request_path(run).read_text())["ranks"] == [2, 3]  # the file, read independently
    back = read_request(run)
    assert back == req and all(type(r) is int for r in back.ranks)
    assert [r for r in range(6) if back.restarts(r)] == [2, 3]


def test_a_request_without_ranks_restarts_every_rank(tmp_path: Path) -> None:
    """An older Baton's workers.json has no "ranks": every worker restarts, as it did then;
    so does a request naming none."""
    run = RunFolder(tmp_path)
    request_path(run).write_text(json.dumps({"epoch": 0, "generation": 1, "exclude": ["n1"], "reason": "r",
                                             "time": 1.0}))
    old = read_request(run)
    assert old == WorkerRequest(epoch=0, generation=1, exclude=("n1",), reason="r", time=1.0) and old.ranks == ()
    assert all(old.restarts(r) for r in range(8))
    request_workers(run, WorkerRequest(epoch=0, generation=2))
    assert json.loads(request_path(run).read_text())["ranks"] == []
    new = read_request(run)
    assert new is not None and new.generation == 2 and all(new.restarts(r) for r in range(8))


def test_a_request_with_unreadable_ranks_is_no_request(tmp_path: Path) -> None:
    run = RunFolder(tmp_path)
    request_path(run).write_text(json.dumps({"epoch": 0, "generation": 1, "ranks": ["two"]}))
    assert read_request(run) is None  # the supervisor keeps polling; it restarts nothing on a guess


def test_node_failure_limit_is_the_config_key_recovery_node_failure_limit() -> None:
    from core.config import run as config_mod
    from core.errors import ConfigError

    b = Budget().spend(nodes=("n1",), step=10, committed_step=None).spend(nodes=("n1",), step=12, committed_step=None)
    assert _decide(b, on_slurm=True, node_failure_limit=3).action == "restart"  # 2 < 3: not excluded yet
    d = _decide(b.spend(nodes=("n1",), step=13, committed_step=None), on_slurm=True, node_failure_limit=3,
                max_retries=5)
    assert d.action == "requeue" and d.exclude == ("n1",) and "recovery.node_failure_limit" in d.reason
    cfg = config_mod.from_data({"name": "x", "model": {"kind": "toy"}, "recovery": {"node_failure_limit": 3}})
    assert cfg.recovery.node_failure_limit == 3
    try:
        config_mod.from_data({"name": "x", "model": {"kind": "toy"}, "recovery": {"node_failure_limit": 0}})
    except ConfigError as exc:
        assert "recovery.node_failure_limit" in str(exc)
    else:
        raise AssertionError("recovery.node_failure_limit=0 was accepted")


# --- Recovery.restart_generator: a split generator's workers restarted alone --------------------
class Group:
    """The worker group as recovery drives it (its sockets and liveness: test_group_calls):
    ranks 0-1 the trainer's, 2-3 a split generator's; what it was told is recorded."""

    def __init__(self) -> None:
        self.epoch, self.generation = 0, 0
        self.peers = {r: Peer(rank=r, identity=b"w%d" % r, host="h", node=f"n{r // 2}", pid=100 + r, last_seen=0.0)
                      for r in range(4)}
        self.peers[3].lost = "no heartbeat for 2.1 s: process exited"
        self.aborted: list[tuple[str, tuple[int, ...] | None]] = []
        self.replaced: list[tuple[tuple[int, ...], int]] = []

    def abort(self, reason: str, *, ranks: Collection[int] | None = None) -> None:
        self.aborted.append((reason, None if ranks is None else tuple(ranks)))

    def replace(self, ranks: Collection[int], generation: int) -> None:
        self.replaced.append((tuple(ranks), generation))
        self.generation = generation

    def reset(self, generation: int) -> None:
        raise AssertionError("every worker was restarted: the trainer's should have gone on")

    def lost(self) -> list[Peer]:
        return [p for p in self.peers.values() if p.lost]


LOST = WorkerLostError("lost 1 worker(s): rank 3 (pid 103 on n1): process exited", ranks=[3])


def _program(tmp_path: Path, *, retries: int, stop: bool = False) -> SimpleNamespace:
    """What Recovery reads of the program, over a real run record; ``run_all`` loses the
    generator's rank 3 while it waits for a rollout (``restart_generator``, as Program does)."""
    run = RunFolder(tmp_path)
    (tmp_path / "logs").mkdir(parents=True)
    record = RunRecord(run)
    record.create(RunState(status=Status.RUNNING, step=7, recovery=Budget(retries=retries)))
    cfg = config_mod.from_data({"name": "x", "model": {"kind": "toy"},
                                "recovery": {"max_retries": 2, "backoff_s": 0.05}})
    program = SimpleNamespace(run=run, record=record, cfg=cfg, step=7, workers=Group(), restarted=[],
                              generator=SimpleNamespace(ranks=range(2, 4)),
                              stop=SimpleNamespace(stop_requested=lambda: stop))

    def run_all() -> None:
        program.restarted.append(program.restart_generator(LOST))  # then the program goes on and completes

    program.run_all = run_all
    return program


def test_a_generator_lost_alone_within_the_budget_restarts_its_ranks_alone(tmp_path: Path) -> None:
    program = _program(tmp_path, retries=0)
    slept: list[float] = []
    recovery = Recovery(program, worker_restarts=True, on_slurm=False,  # type: ignore[arg-type]
                        sleep=lambda s: (slept.append(s), time.sleep(s)))
    outcome = recovery.run()
    assert outcome.status is Status.COMPLETED and program.restarted == [(2, 3)]  # the whole group, inside the call
    reason = "retry 1 of 2: restarting the workers"
    group = program.workers
    assert group.aborted == [(f"controller: {reason}", (2, 3))] and group.replaced == [((2, 3), 1)]
    lost, restarting = [e for e in program.record.events() if isinstance(e, (ev.WorkerLost, ev.RestartingWorkers))]
    assert lost == ev.WorkerLost(failure="worker_lost", rank=3, node="n1", pid=103, step=7, epoch=0, generation=0,
                                 why="no heartbeat for 2.1 s: process exited", time=lost.time)
    assert restarting == ev.RestartingWorkers(generation=1, backoff_s=0.05, retry=1, max_retries=2, step=7,
                                              ranks=(2, 3), time=restarting.time)
    req = read_request(program.run)
    assert req == WorkerRequest(epoch=0, generation=1, ranks=(2, 3), reason=reason, time=req.time if req else 0.0)
    assert slept  # backed off before asking for the new workers
    state = program.record.read()
    assert state.recovery.retries == 1 and state.recovery.node_failures == {"n1": 1}


@pytest.mark.parametrize(("retries", "stop", "status"), [(2, False, Status.FAILED), (0, True, Status.REQUEUED)])
def test_any_other_decision_for_a_lost_generator_is_raised_and_ends_the_run(tmp_path: Path, retries: int, stop: bool,
                                                                            status: Status) -> None:
    """Retries spent: the run fails; a preemption meanwhile: it is requeued. Either way no
    generator restarts and ``Recovery.run`` returns that outcome."""
    program = _program(tmp_path, retries=retries, stop=stop)
    recovery = Recovery(program, worker_restarts=True, on_slurm=False)  # type: ignore[arg-type]
    with pytest.raises(Decided) as decided:
        recovery.restart_generator(LOST)
    outcome = decided.value.outcome
    assert outcome.status is status and not outcome.clean
    if status is Status.FAILED:
        assert outcome.exit_code is ExitCode.FAILED and "gave up after 2 retries" in outcome.reason
        assert program.workers.aborted == []  # the controller's exit aborts them all
    else:
        assert program.workers.aborted == [("controller: preempted while failing", None)]  # every worker
    assert program.workers.replaced == [] and read_request(program.run) is None
    assert [ev.kind_of(e) for e in program.record.events()] == ["worker_lost"]
    again = _program(tmp_path / "again", retries=retries, stop=stop)
    assert Recovery(again, worker_restarts=True, on_slurm=False).run() == outcome  # type: ignore[arg-type]
    assert again.restarted == []


def test_a_generator_lost_with_a_trainer_worker_is_not_restarted_alone(tmp_path: Path) -> None:
    """Rank 1 (the trainer's) was lost too (a host, a switch): the wait's error names the
    generator's rank only, but every lost rank is named again and every worker restarts."""
    program = _program(tmp_path, retries=0)
    program.workers.peers[1].lost = "no heartbeat for 2.0 s: process exited"
    recovery = Recovery(program, worker_restarts=True, on_slurm=False)  # type: ignore[arg-type]
    with pytest.raises(WorkerLostError) as err:
        recovery.restart_generator(LOST)
    assert err.value.ranks == [3, 1] and "ranks [1]" in str(err.value)
    assert program.workers.aborted == [] and program.workers.replaced == [] and read_request(program.run) is None
    assert program.record.events() == []  # recorded once, by the full restart that follows
