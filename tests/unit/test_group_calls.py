"""Group calls in flight (core.controller.group ``WorkerGroup.start_ranks`` / ``wait``,
core.controller.roles ``RoleGroup.start`` / ``Call.wait`` / ``Call.done``): two calls to
different ranks complete independently, an error surfaces at its call's wait, a reset
abandons what is pending.

The controller's side is real (ControllerSocket, WorkerGroup, its pump thread); the workers
are threads of this process on real CURVE ZeroMQ sockets that speak the wire protocol as a
worker process does (register, heartbeat, answer), so that the test decides when each answer
is sent: a HOLD call is answered only once the test opens that rank's gate.
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from core.config.dims import ParallelDims
from core.config.roles import RolePlan
from core.config.run import TimeoutsConfig
from core.controller.group import WorkerGroup
from core.controller.roles import RoleGroup
from core.errors import RemoteError, WorkerLostError
from core.record.runfolder import RunFolder
from core.wire import protocol
from core.wire.contract import Method
from core.wire.transport import ControllerSocket, WorkerSocket, generate_keys
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True, kw_only=True)
class Ask:
    v: int = 0


@dataclass(frozen=True, kw_only=True)
class Answer:
    rank: int
    v: int


ECHO = Method("echo", Ask, Answer)  # answered at once
HOLD = Method("hold", Ask, Answer)  # answered once the rank's gate is open
BOOM = Method("boom", Ask, Answer)  # the worker raises


class Worker(threading.Thread):
    """One worker rank in a thread: registers with ``rank_hint``, heartbeats from its own
    socket, serves calls in order until Shutdown or ``stop``."""

    def __init__(self, address: str, keys: Path, rank: int, *, generation: int = 0) -> None:
        super().__init__(name=f"fake-worker-{rank}", daemon=True)
        self.address, self.keys, self.rank, self.generation = address, keys, rank, generation
        self.gate, self.stop = threading.Event(), threading.Event()
        self.received: list[str] = []  # the methods of the calls it has taken up, in order
        self.beats: list[float] = []  # when the controller's heartbeats came (time.monotonic)
        self.aborts: list[str] = []  # the reasons of the aborts it was sent

    def run(self) -> None:
        identity = f"fake:{os.getpid()}:{self.rank}:{self.generation}".encode()
        sock = WorkerSocket(self.address, self.keys, identity=identity)
        hb = WorkerSocket(self.address, self.keys, identity=identity + b"/hb", share_context_with=sock)
        self._seq = 0
        try:
            sock.send(protocol.encode(protocol.Register(rank_hint=self.rank, host=socket.gethostname(), node="fake",
                                                        pid=os.getpid(), generation=self.generation)))
            while not self.stop.is_set():
                self._beat(hb)
                frames = sock.recv_within(0.05)
                if frames is None:
                    continue
                env = protocol.decode(frames)
                if isinstance(env.msg, protocol.Shutdown):
                    return
                if isinstance(env.msg, protocol.Call):
                    sock.send(self._answer(env, hb))
        finally:
            hb.close()
            sock.close()

    def _beat(self, hb: WorkerSocket) -> None:
        self._seq += 1
        hb.send(protocol.encode(protocol.Heartbeat(seq=self._seq, busy="")))
        while (frames := hb.recv_nowait()) is not None:  # the controller's heartbeats and aborts
            msg = protocol.decode(frames).msg
            if isinstance(msg, protocol.Heartbeat):
                self.beats.append(time.monotonic())
            elif isinstance(msg, protocol.Abort):
                self.aborts.append(msg.reason)

    def _answer(self, env: protocol.Envelope, hb: WorkerSocket) -> list[bytes | memoryview]:
        call = env.msg
        assert isinstance(call, protocol.Call)
        self.received.append(call.method)
        v = int(call.kwargs.get("v", 0))
        if call.method == HOLD.name:
            while not self.gate.wait(0.05) and not self.stop.is_set():
                self._beat(hb)
        if call.method == BOOM.name:
            return protocol.encode(protocol.Error(exc_type="RuntimeError", message=f"boom on rank {self.rank}",
                                                  traceback="Traceback ..."), req_id=env.req_id)
        return protocol.encode(protocol.Result(value=ECHO.encode_result(Answer(rank=self.rank, v=v))),
                               req_id=env.req_id)


@dataclass
class Fixture:
    workers: WorkerGroup
    ranks: list[Worker]  # every worker started, those of later generations appended
    address: str
    keys: Path

    def worker(self, rank: int, generation: int) -> Worker:
        """A worker of a later generation (not started yet), stopped with the others."""
        w = Worker(self.address, self.keys, rank, generation=generation)
        self.ranks.append(w)
        return w


@contextlib.contextmanager
def _group(tmp_path: Path, world_size: int, timeouts: TimeoutsConfig) -> Iterator[Fixture]:
    run = RunFolder(tmp_path / "run")
    run.path.mkdir()
    generate_keys(run.keys)
    sock = ControllerSocket(run.keys, bind_host="127.0.0.1")
    workers = WorkerGroup(sock, world_size=world_size, epoch=0, timeouts=timeouts, run=run)
    address = f"tcp://127.0.0.1:{sock.port}"
    ranks = [Worker(address, run.keys, r) for r in range(world_size)]
    for w in ranks:
        w.start()
    try:
        workers.wait_for_workers(60)
        yield Fixture(workers, ranks, address, run.keys)
    finally:
        for w in ranks:
            w.stop.set()
            if w.is_alive():
                w.join(timeout=10)
        workers.close()
        sock.close()


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Fixture]:
    with _group(tmp_path, 2, TimeoutsConfig()) as fixture:
        yield fixture


# The controller beats every 0.25 s (heartbeat_interval_s; controller_lost_s / 5 would be less),
# so that the trainer's workers get several while a generator's ranks register.
TIMEOUTS = TimeoutsConfig(controller_lost_s=1.0)


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[Fixture]:
    """Ranks 0-1 (a trainer's) and 2 (a split generator's), each having answered a call."""
    with _group(tmp_path, 3, TIMEOUTS) as fixture:
        assert fixture.workers.call_ranks(ECHO, {r: Ask(v=r) for r in range(3)}) == {
            r: Answer(rank=r, v=r) for r in range(3)}
        yield fixture


def _role(workers: WorkerGroup, first: int, name: str) -> RoleGroup:
    plan = RolePlan(name=name, first_rank=first, dims=ParallelDims(tp=1, pp=1, dp=1),  # type: ignore[arg-type]
                    placement="own" if name == "trainer" else "split", component=1 + first, nodes=1,
                    models=("actor",))
    return RoleGroup(workers, plan)


def test_the_later_call_to_another_rank_is_waited_first_while_the_earlier_runs_on(group: Fixture) -> None:
    workers, (rank0, rank1) = group.workers, group.ranks
    held = workers.start_ranks(HOLD, {0: Ask(v=10)})
    quick = workers.start_ranks(ECHO, {1: Ask(v=11)})
    wait_for(lambda: rank0.received == ["hold"], 30, "rank 0 to take up the held call")
    assert workers.wait(quick) == {1: Answer(rank=1, v=11)}  # while rank 0 is still holding
    assert workers.call_ranks(ECHO, {1: Ask(v=12)}) == {1: Answer(rank=1, v=12)}  # and again
    assert not workers.answered(held) and held.results == {}
    rank0.gate.set()
    wait_for(lambda: workers.answered(held), 30, "the held call's answer, kept by the pump while nobody waits")
    assert workers.wait(held) == {0: Answer(rank=0, v=10)}
    assert rank1.received == ["echo", "echo"]


def test_a_role_groups_call_runs_while_another_groups_call_is_in_flight(group: Fixture) -> None:
    trainer, generator = _role(group.workers, 0, "trainer"), _role(group.workers, 1, "generator")
    rollout = generator.start(HOLD, Ask(v=3))
    wait_for(lambda: group.ranks[1].received == ["hold"], 30, "the generator's rank to take up its call")
    assert trainer.call(ECHO, Ask(v=4)) == [Answer(rank=0, v=4)]
    update = trainer.start(ECHO, Ask(v=5))
    assert update.wait() == [Answer(rank=0, v=5)] and update.done()
    assert not rollout.done()
    group.ranks[1].gate.set()
    wait_for(rollout.done, 30, "the generator's answer")
    assert rollout.wait() == [Answer(rank=1, v=3)]


def test_an_error_of_a_started_call_surfaces_at_its_wait_and_only_there(group: Fixture) -> None:
    trainer, generator = _role(group.workers, 0, "trainer"), _role(group.workers, 1, "generator")
    failing = trainer.start(BOOM, Ask(v=1))
    fine = generator.start(ECHO, Ask(v=2))
    assert fine.wait() == [Answer(rank=1, v=2)]  # the other call's error is not this one's
    assert generator.call(ECHO, Ask(v=3)) == [Answer(rank=1, v=3)]
    wait_for(failing.done, 30, "the failing call's answer")
    with pytest.raises(RemoteError) as err:
        failing.wait()
    assert err.value.rank == 0 and err.value.method == "boom" and "boom on rank 0" in str(err.value)
    assert trainer.call(ECHO, Ask(v=4)) == [Answer(rank=0, v=4)]  # the rank serves on


def test_a_reset_abandons_the_calls_in_flight_naming_their_method(group: Fixture) -> None:
    trainer, generator = _role(group.workers, 0, "trainer"), _role(group.workers, 1, "generator")
    rollout = generator.start(HOLD, Ask(v=1))
    wait_for(lambda: group.ranks[1].received == ["hold"], 30, "the generator's rank to take up its call")
    group.workers.reset(generation=1)  # the workers are lost: the next generation will register
    assert rollout.done()  # nothing more will come: wait returns (raises) at once
    with pytest.raises(WorkerLostError) as err:
        rollout.wait()
    assert str(err.value).startswith("hold: the call was abandoned when its workers were replaced (generation 1)")
    assert err.value.ranks == [1]
    group.ranks[1].gate.set()  # its answer, when it comes, belongs to no call
    assert trainer.workers.generation == 1


# --- a split generator's workers lost and restarted alone --------------------------------------
def _lose(fixture: Fixture, rank: int) -> None:
    """The worker of ``rank`` falls silent (its thread ends); wait until the group says it is lost."""
    fixture.ranks[rank].stop.set()
    fixture.ranks[rank].join(timeout=10)
    wait_for(lambda: [p.rank for p in fixture.workers.lost()] == [rank], 30, f"rank {rank} declared lost")


def test_a_lost_worker_that_restarts_alone_fails_only_the_calls_that_wait_for_it(trio: Fixture) -> None:
    workers = trio.workers
    workers.restartable = frozenset({2})  # a split generator's rank under an RL program
    held = workers.start_ranks(HOLD, {0: Ask(v=1)})  # in flight on the trainer's rank 0 meanwhile
    wait_for(lambda: trio.ranks[0].received == ["echo", "hold"], 30, "rank 0 to take up the held call")
    _lose(trio, 2)
    assert workers.call_ranks(ECHO, {1: Ask(v=4)}) == {1: Answer(rank=1, v=4)}
    trio.ranks[0].gate.set()
    assert workers.wait(held) == {0: Answer(rank=0, v=1)}  # rank 2 was lost all along
    assert workers.call_ranks(ECHO, {0: Ask(v=5), 1: Ask(v=6)}) == {0: Answer(rank=0, v=5), 1: Answer(rank=1, v=6)}
    with pytest.raises(WorkerLostError) as err:
        workers.call_ranks(ECHO, {1: Ask(v=7), 2: Ask(v=7)})
    assert err.value.ranks == [2] and "rank 2 (pid" in str(err.value)
    with pytest.raises(WorkerLostError):
        workers.check()  # between calls: any loss
    assert not workers.peers[0].lost and not workers.peers[1].lost


def test_any_other_lost_worker_fails_every_call(trio: Fixture) -> None:
    workers = trio.workers
    workers.restartable = frozenset({2})
    _lose(trio, 1)  # a trainer's rank: its loss is the cause of whatever waits
    with pytest.raises(WorkerLostError) as err:
        workers.call_ranks(ECHO, {2: Ask(v=1)})
    assert err.value.ranks == [1]


def test_a_call_in_flight_to_a_replaced_rank_is_abandoned(trio: Fixture) -> None:
    workers = trio.workers
    rollout = workers.start_ranks(HOLD, {2: Ask(v=1)})
    wait_for(lambda: trio.ranks[2].received == ["echo", "hold"], 30, "rank 2 to take up the held call")
    update = workers.start_ranks(ECHO, {0: Ask(v=2), 1: Ask(v=3)})
    workers.replace([2], 1)
    assert workers.answered(rollout)  # nothing more will come: wait raises at once
    with pytest.raises(WorkerLostError) as err:
        workers.wait(rollout)
    assert err.value.ranks == [2] and "generation 1" in str(err.value)
    assert workers.wait(update) == {0: Answer(rank=0, v=2), 1: Answer(rank=1, v=3)}  # the trainer's goes on
    assert (workers.generation, sorted(workers.peers)) == (1, [0, 1])


def test_an_abort_of_some_ranks_reaches_those_alone(trio: Fixture) -> None:
    trio.workers.abort("controller: the generator restarts", ranks=[2])
    wait_for(lambda: trio.ranks[2].aborts, 30, "rank 2's abort")
    trio.workers.abort("controller: everyone")
    wait_for(lambda: all(w.aborts[-1:] == ["controller: everyone"] for w in trio.ranks), 30, "every rank's abort")
    assert [w.aborts for w in trio.ranks] == [["controller: everyone"]] * 2 + [
        ["controller: the generator restarts", "controller: everyone"]]


def test_a_replaced_rank_registers_while_the_others_are_served(trio: Fixture) -> None:
    """Rank 2 is lost and replaced by generation 1's rank 2, which takes longer to register than
    a worker may be silent: ranks 0-1 are heard and beaten meanwhile, never declared lost,
    and the three answer together afterwards."""
    workers, limit = trio.workers, TIMEOUTS.heartbeat_timeout_s
    _lose(trio, 2)
    workers.replace([2], 1)
    assert workers.lost() == [] and workers.generation == 1
    new = trio.worker(2, generation=1)
    late = threading.Timer(2 * limit, new.start)  # the registration this test is about takes this long
    late.start()
    t0 = time.monotonic()
    try:
        workers.wait_for_workers(60, ranks=[2])
    finally:
        late.cancel()
    assert time.monotonic() - t0 > limit
    assert workers.lost() == []
    for rank in (0, 1):
        assert workers.peers[rank].last_seen > t0 + limit  # its heartbeats handled during the registration
        assert any(t > t0 + limit for t in trio.ranks[rank].beats)  # and the controller's sent to it
    assert workers.peers[2].identity == f"fake:{os.getpid()}:2:1".encode()
    assert workers.call_ranks(ECHO, {r: Ask(v=10 + r) for r in range(3)}) == {
        r: Answer(rank=r, v=10 + r) for r in range(3)}
    assert new.received == ["echo"] and trio.ranks[2].received == ["echo"]  # the old rank 2 got nothing more
    assert [w.received for w in trio.ranks[:2]] == [["echo", "echo"]] * 2


def test_a_registration_of_replaced_ranks_fails_at_once_when_another_worker_is_lost(trio: Fixture) -> None:
    """While rank 2 registers again, rank 1 (which went on) falls silent: the wait ends with
    rank 1's loss (every worker must restart) instead of waiting out its deadline."""
    workers = trio.workers
    workers.restartable = frozenset({2})
    _lose(trio, 2)
    workers.replace([2], 1)
    trio.ranks[1].stop.set()
    with pytest.raises(WorkerLostError) as err:  # not RegistrationError: the deadline was not waited out
        workers.wait_for_workers(600, ranks=[2])  # nobody registers: only the loss can end it
    assert err.value.ranks == [1]
