"""The control plane with real processes, real sockets, real signals (toy numpy task)."""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import zmq

from core.config.dims import ParallelDims
from core.config.roles import RolePlan
from core.config.run import TimeoutsConfig
from core.controller.group import WorkerGroup
from core.controller.main import publish_address
from core.controller.roles import RoleGroup
from core.errors import CallTimeoutError, RemoteError, WorkerLostError
from core.model.toy import ECHO, FAIL, NOOP, PID, SLEEP, Echo, Echoed, Fail, Sleep
from core.wire import protocol
from core.wire.contract import Collect, Dispatch, Method, NoArgs
from core.wire.transport import ControllerSocket, WorkerSocket, generate_keys
from tests.helpers import LocalRun, baton, history, make_run, wait_for

pytestmark = pytest.mark.timeout(120)
FAST = ["timeouts.heartbeat_interval_s=0.1", "timeouts.heartbeat_timeout_s=1.5", "timeouts.controller_lost_s=3"]


@pytest.fixture
def toy(local_runs: Callable[..., LocalRun]) -> Callable[..., LocalRun]:
    """``toy(*overrides, epoch=0, controller=True, workers=True)``: a toy run with FAST timeouts."""
    return lambda *overrides, **kw: local_runs("toy.yaml", *FAST, *overrides, **kw)


def test_local_run_with_four_workers_completes(tmp_path: Path) -> None:
    res = baton("submit", "experiments/toy.yaml", f"runs_root={tmp_path}", "--backend", "local", timeout=120)
    assert res.returncode == 0, res.stderr
    assert "run completed at step 20/20" in res.stdout
    run_dir = Path(res.stdout.strip().splitlines()[-1].split(": ", 1)[1])
    assert (run_dir / "config.yaml").is_file() and (run_dir / "plan.json").is_file()
    assert oct(run_dir.stat().st_mode & 0o777) == "0o700"
    for key in ("controller.key_secret", "worker.key_secret"):
        assert oct((run_dir / "keys" / key).stat().st_mode & 0o777) == "0o600"
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 20
    for r in range(4):
        assert "registered as rank" in (run_dir / "logs" / f"worker_r{r:05d}.log").read_text()


def _wait_progress(r: LocalRun) -> None:
    wait_for(lambda: r.state().get("step", 0) >= 5, 60, "the run to pass step 5")


@pytest.mark.slow
def test_kill_9_of_a_worker_is_reported_naming_its_rank(toy) -> None:
    r = toy("trainer.steps=1000000")
    _wait_progress(r)
    victim = r.workers[2]
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.time()
    state = wait_for(lambda: r.state() if r.state().get("status") == "failed" else None, 15, "the run to fail")
    assert "rank 2" in state["reason"] and "process exited" in state["reason"]
    failed_at = history(r.run.path)[-1]["time"]
    assert failed_at - killed < 1.5 + 1.0, f"detected after {failed_at - killed:.2f} s"
    assert r.controller is not None and r.controller.wait(timeout=15) == 1
    for w in r.workers:  # the survivors were told to abort and exited
        w.wait(timeout=15)


def test_a_stopped_worker_is_detected_as_hung(toy) -> None:
    r = toy("trainer.steps=1000000")
    _wait_progress(r)
    os.kill(r.workers[1].pid, signal.SIGSTOP)
    state = wait_for(lambda: r.state() if r.state().get("status") == "failed" else None, 15, "the run to fail")
    assert "rank 1" in state["reason"] and "stopped (SIGSTOP)" in state["reason"]


def _in_setup(r: LocalRun) -> None:
    wait_for(lambda: "registered as rank" in r.log("1") and not r.state().get("ranks"), 60,
             "rank 1 registered, the group not yet set up")


@pytest.mark.slow
def test_a_worker_silent_while_it_starts_is_given_the_startup_allowance(toy, monkeypatch) -> None:
    monkeypatch.setenv("BATON_TOY_SETUP_S", "8")  # rank 1 sets up, as a worker importing its libraries
    monkeypatch.setenv("BATON_TOY_SETUP_RANK", "1")  # the others are done: rank 1 holds the group back
    r = toy("trainer.steps=30", "timeouts.startup_heartbeat_timeout_s=30")
    wait_for(lambda: "toy setup takes" in r.log("1"), 60, "rank 1 to start its setup")
    os.kill(r.workers[1].pid, signal.SIGSTOP)  # its heartbeat thread starves, as on a busy host
    time.sleep(3.0)  # the fault under test: 3 s of silence, twice timeouts.heartbeat_timeout_s
    assert not r.state().get("ranks"), "rank 1 finished its setup before it was stopped (the test was starved)"
    os.kill(r.workers[1].pid, signal.SIGCONT)
    assert r.controller is not None and r.controller.wait(timeout=90) == 0
    assert r.state()["status"] == "completed" and history(r.run.path, "worker_lost") == []


def test_a_worker_that_dies_while_it_starts_is_named_at_once(toy, monkeypatch) -> None:
    monkeypatch.setenv("BATON_TOY_SETUP_S", "30")
    r = toy("trainer.steps=30", "timeouts.startup_heartbeat_timeout_s=600")
    _in_setup(r)
    killed = time.time()
    os.kill(r.workers[1].pid, signal.SIGKILL)
    state = wait_for(lambda: r.state() if r.state().get("status") == "failed" else None, 30, "the run to fail")
    assert "rank 1" in state["reason"] and "process exited" in state["reason"]
    assert history(r.run.path)[-1]["time"] - killed < 3.0 + 1.0  # not the 600 s start-up allowance


@pytest.mark.slow
def test_a_worker_whose_controller_is_killed_exits_by_itself(toy) -> None:
    r = toy("trainer.steps=1000000")
    _wait_progress(r)
    assert r.controller is not None
    os.kill(r.controller.pid, signal.SIGKILL)
    for w in r.workers:
        assert w.wait(timeout=3 + 10) == 3  # EXIT_CONTROLLER_LOST
    assert "controller silent" in r.log("0")


def _raw_dealer(address: str, *, public: bytes | None = None, secret: bytes | None = None, server: bytes | None = None):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if public is not None:
        s.curve_publickey, s.curve_secretkey, s.curve_serverkey = public, secret, server
    s.connect(address)
    return ctx, s


@pytest.mark.slow
def test_clients_without_the_run_keys_get_nothing_and_the_run_is_unaffected(toy, tmp_path: Path) -> None:
    r = toy("trainer.steps=400")
    info = wait_for(lambda: r.run.controller.exists() and __import__("json").loads(r.run.controller.read_text()), 30,
                    "controller.json")
    register = protocol.encode(protocol.Register(rank_hint=0, host="intruder", node="x", pid=1))
    # 1) no CURVE at all; 2) CURVE with a key pair the run did not issue.
    other = tmp_path / "otherkeys"
    generate_keys(other)
    server_public, _ = zmq.auth.load_certificate(str(r.run.keys / "controller.key_secret"))
    pub, sec = zmq.auth.load_certificate(str(other / "worker.key_secret"))
    for kwargs in ({}, {"public": pub, "secret": sec, "server": server_public}):
        ctx, s = _raw_dealer(info["address"], **kwargs)
        try:
            s.send_multipart(register)
            s.send_multipart(protocol.encode(protocol.Call(method=FAIL.name)))
            assert s.poll(1500) == 0, "an unauthenticated client got an answer"
        finally:
            ctx.destroy(linger=0)
    assert r.controller is not None and r.controller.wait(timeout=60) == 0
    assert r.state()["status"] == "completed" and r.state()["step"] == 400
    assert "refused a client at tcp://127.0.0.1:" in r.log()  # the knocks are in the controller's log


def test_a_worker_of_a_stale_epoch_is_refused_by_name(toy) -> None:
    r = toy("trainer.steps=1000000", epoch=1)
    info = wait_for(lambda: r.run.controller.exists() and __import__("json").loads(r.run.controller.read_text()), 30,
                    "controller.json")
    ws = WorkerSocket(info["address"], r.run.keys, identity=b"stale")
    try:
        ws.send(protocol.encode(protocol.Register(rank_hint=0, host="h", node="n", pid=1), epoch=0))
        frames = ws.recv_within(10.0)
        assert frames is not None, "no answer to a stale registration"
        env = protocol.decode(frames)
    finally:
        ws.close()
    assert isinstance(env.msg, protocol.Refuse)
    assert "stale epoch 0: this run is at epoch 1" in env.msg.reason
    _wait_progress(r)  # the real workers (epoch 1) are training regardless


# --- the WorkerGroup API, driven from this process against real worker processes --------

@pytest.fixture
def group(tmp_path: Path):
    r = make_run(tmp_path, "toy.yaml", [*FAST, "trainer.n_gpus_per_node=4"])
    sock = ControllerSocket(r.run.keys)
    publish_address(r.run, sock, host="127.0.0.1", epoch=0)
    workers = WorkerGroup(sock, world_size=4, epoch=0,
                          timeouts=TimeoutsConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5), run=r.run)
    g = RoleGroup(workers, RolePlan(name="trainer", first_rank=0, dims=ParallelDims(tp=1, pp=1, dp=4), placement="own",
                                    component=1, nodes=1, models=("toy",)))
    r.start(controller=False)
    workers.wait_for_workers(60)
    yield g, r
    workers.shutdown()
    for w in r.workers:
        w.wait(timeout=20)
    workers.close()
    sock.close()
    r.cleanup()


ECHO_FIRST = Method("echo", Echo, Echoed, collect=Collect.FIRST)
ECHO_REPLICAS = Method("echo", Echo, Echoed, dispatch=Dispatch.REPLICAS, collect=Collect.OWNERS)
ECHO_EACH = Method("echo", Echo, Echoed, dispatch=Dispatch.EACH)


def test_dispatch_and_collect_modes_declared_with_the_method(group) -> None:
    g, _ = group
    assert [x.rank for x in g.call(ECHO, Echo(v=1))] == [0, 1, 2, 3]
    assert g.call(ECHO_FIRST, Echo(v=2)) == [Echoed(rank=0, v=2)]
    split = g.call_each(ECHO_REPLICAS, [Echo(xs=(2 * d, 2 * d + 1), k="same") for d in range(4)])
    assert [x.xs for x in split] == [(0, 1), (2, 3), (4, 5), (6, 7)] and {x.k for x in split} == {"same"}
    assert [x.v for x in g.call_each(ECHO_EACH, [Echo(v=10 + r) for r in range(4)])] == [10, 11, 12, 13]
    arr = np.arange(8, dtype=np.float32)
    back = g.call(ECHO, Echo(a=arr))
    assert len(back) == 4 and all(np.array_equal(b.a, arr) for b in back)


def test_a_request_for_every_rank_of_a_replica_is_encoded_once(group, monkeypatch) -> None:
    """tp2 x dp2 over the same four workers: one encoding per replica's request (its arrays'
    frames sent to both its ranks), and one for a request every rank gets."""
    g, _ = group
    replicas = RoleGroup(g.workers, RolePlan(name="trainer", first_rank=0, dims=ParallelDims(tp=2, pp=1, dp=2),
                                             placement="own", component=1, nodes=1, models=("toy",)))
    calls: list[str] = []
    plain = protocol.encode

    def counting(msg: protocol.Message, **kw: int) -> list[bytes | memoryview]:
        if isinstance(msg, protocol.Call):  # not the heartbeats, sent from another thread meanwhile
            calls.append(msg.method)
        return plain(msg, **kw)

    monkeypatch.setattr(protocol, "encode", counting)
    shares = [Echo(a=np.arange(6, dtype=np.int32) + 10 * d) for d in range(2)]
    back = replicas.call_each(ECHO_REPLICAS, shares)
    assert calls == ["echo", "echo"]  # 4 ranks, 2 replicas
    assert [b.rank for b in back] == [0, 2] and all(np.array_equal(b.a, s.a) for b, s in zip(back, shares, strict=True))
    calls.clear()
    assert [b.rank for b in replicas.call(ECHO, Echo(a=np.zeros(3)))] == [0, 1, 2, 3] and calls == ["echo"]


def test_remote_errors_carry_rank_and_traceback(group) -> None:
    g, _ = group
    with pytest.raises(RemoteError) as info:
        g.call(FAIL, Fail(message="kaboom"))
    assert "raised RuntimeError in fail: kaboom" in str(info.value)
    assert "Traceback" in info.value.remote_traceback and "toy.py" in info.value.remote_traceback
    with pytest.raises(RemoteError, match="no method 'nope'"):
        g.call(Method("nope", NoArgs, None))
    assert g.call(NOOP) == [None] * 4  # the group is usable afterwards


@dataclass(frozen=True, kw_only=True)
class SleepAsText:
    seconds: str


def test_a_malformed_request_or_result_fails_that_call_by_method_and_field_and_both_sides_keep_serving(group) -> None:
    g, _ = group
    with pytest.raises(RemoteError) as info:  # the worker checks the request against its own method
        g.call(Method("sleep", SleepAsText, float), SleepAsText(seconds="long"))
    first = str(info.value).splitlines()[0]
    assert info.value.exc_type == "ProtocolError" and "sleep request.seconds: 'long' is not a number" in first
    assert "the same on all 4 ranks" in first
    with pytest.raises(RemoteError) as info:  # the controller checks every result
        g.call(Method("pid", NoArgs, str))
    first = str(info.value).splitlines()[0]
    assert "in pid: malformed result: pid result: " in first and "is not a string" in first
    assert g.call(NOOP) == [None] * 4 and len(set(g.call(PID))) == 4  # both sides serve on


def test_a_missed_deadline_names_the_missing_ranks(group) -> None:
    g, _ = group
    with pytest.raises(CallTimeoutError) as info:
        g.call(SLEEP, Sleep(seconds=3.0), timeout_s=0.5)
    assert info.value.missing == [0, 1, 2, 3] and "did not answer within 0.5 s" in str(info.value)


def test_heartbeats_continue_during_a_long_call_and_between_calls(group) -> None:
    g, _ = group
    assert g.call(SLEEP, Sleep(seconds=2.5), timeout_s=10) == [2.5] * 4  # longer than heartbeat_timeout_s
    before = g.workers.heartbeats_handled
    wait_for(lambda: g.workers.heartbeats_handled > before + 8, 5, "heartbeats handled by the idle pump")
    g.workers.check()


def test_a_worker_lost_between_calls_fails_the_next_call(group) -> None:
    g, r = group
    pids = g.call(PID)
    os.kill(pids[3], signal.SIGKILL)
    wait_for(lambda: g.workers.lost(), 5, "rank 3 declared lost")
    with pytest.raises(WorkerLostError) as info:
        g.call(NOOP)
    assert info.value.ranks == [3]
