"""Recovery with real processes on the local backend: lost and hung workers, preemption
signals, deterministic errors, exhausted retries, a kill during a checkpoint, a dead controller.

Each run is ``baton submit --backend local`` (the CLI is the supervisor, launcher/local.py);
the toy model is deterministic per step given its state, so a recovered run must reproduce
an uninterrupted run's loss at every step, exactly.
"""
from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.checkpoint import manifest
from core.config.run import TimeoutsConfig
from core.controller.group import WorkerGroup
from core.controller.main import publish_address
from core.errors import RegistrationError
from core.wire.protocol import Refuse, Register, decode, encode
from core.wire.transport import ControllerSocket, WorkerSocket
from tests.helpers import baton, losses, make_run, submitted_runs, toy_reference, wait_for

pytestmark = pytest.mark.timeout(180)
STEPS = 1200
COMMON = [
    f"trainer.steps={STEPS}", "optimizer.lr=0.002", "trainer.log_interval_steps=20", "recovery.backoff_s=0.2",
    "timeouts.heartbeat_interval_s=0.1", "timeouts.heartbeat_timeout_s=1.5", "timeouts.controller_lost_s=3",
]


@pytest.fixture
def submit(tmp_path: Path) -> Iterator[Any]:
    with submitted_runs(tmp_path, COMMON) as start:
        yield start


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The loss at every step of an uninterrupted run of the same config."""
    return toy_reference(tmp_path_factory.mktemp("reference"), COMMON)


def _pid_gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


@pytest.mark.slow
def test_kill_9_of_a_worker_mid_run_is_recovered_without_a_human(submit, reference) -> None:
    r = submit("checkpoint.interval_steps=100")
    r.wait_step(300)
    victim = r.worker_pid(2)
    os.kill(victim, signal.SIGKILL)
    assert r.finish() == 0, r.output
    state = r.state()
    assert state["status"] == "completed" and state["step"] == STEPS
    assert losses(r.run_dir, every_step_once=True) == reference
    lost = r.events("worker_lost")
    assert [(e["rank"], e["pid"], e["node"]) for e in lost] == [(2, victim, "local")]
    assert "process exited" in lost[0]["why"]
    assert [e["generation"] for e in r.events("restarting_workers")] == [1]
    assert [e["generation"] for e in r.events("workers_ready")] == [0, 1]
    resumed = r.events("resumed")[-1]
    assert resumed["step"] % 100 == 0 and resumed["step"] <= lost[0]["step"]
    shown = baton("status", str(r.run_dir)).stdout
    assert "worker_lost (failure=worker_lost, rank=2" in shown and "restarting_workers (generation=1" in shown


@pytest.mark.slow
def test_a_stopped_worker_is_detected_as_hung_killed_by_pid_and_replaced(submit, reference) -> None:
    r = submit("checkpoint.interval_steps=100")
    r.wait_step(300)
    victim = r.worker_pid(1)
    os.kill(victim, signal.SIGSTOP)
    assert r.finish() == 0, r.output
    assert losses(r.run_dir, every_step_once=True) == reference
    lost = r.events("worker_lost")
    assert [e["rank"] for e in lost] == [1] and "stopped (SIGSTOP)" in lost[0]["why"]
    assert _pid_gone(victim), "the stopped worker was left behind"
    assert f"ending pid {victim}" in r.output


def test_a_deterministic_error_fails_at_once_with_the_reason(submit) -> None:
    r = submit("checkpoint.interval_steps=100", env={"BATON_TOY_FAIL_AT_STEP": "250"})
    assert r.finish() == 1, r.output
    state = r.state()
    assert state["status"] == "failed" and state["step"] == 250
    assert "toy failure at step 250" in state["reason"] and "the same on all 4 ranks" in state["reason"]
    assert "not retried" in state["reason"]
    assert r.events("restarting_workers") == [] and r.events("worker_lost") == []
    assert "toy failure at step 250" in baton("status", str(r.run_dir)).stdout


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR2], ids=["SIGTERM", "SIGUSR2"])
def test_a_preemption_signal_to_the_controller_checkpoints_requeues_and_loses_no_step(
        submit, reference, signum) -> None:
    r = submit("checkpoint.interval_steps=0")  # only the preemption save can make the resume exact
    r.wait_step(300)
    os.kill(r.controller_pid(), signum)
    assert r.finish() == 0, r.output
    assert losses(r.run_dir, every_step_once=True) == reference
    (pre,) = r.events("preempted")
    assert pre["signal"] == signal.Signals(signum).name and pre["cause"] == "signal"
    step = pre["step"]
    assert step >= 300
    assert any(e["step"] == step for e in r.events("checkpoint_committed"))
    (req,) = r.events("requeued")
    assert req["step"] == step and req["backend"] == "local"
    assert [e["epoch"] for e in r.events("controller_started")] == [0, 1]
    (resumed,) = r.events("resumed")
    assert resumed["step"] == step, "steps were lost between the signal and the resume"
    state = r.state()
    assert state["status"] == "completed" and state["restarts"] == 1


@pytest.mark.slow
def test_retries_exhausted_fail_with_a_reason_naming_the_node(submit) -> None:
    r = submit("checkpoint.interval_steps=0", "recovery.max_retries=1")
    r.wait_step(200)
    os.kill(r.worker_pid(0), signal.SIGKILL)
    second = r.worker_pid(3, generation=1)
    os.kill(second, signal.SIGKILL)
    assert r.finish() == 1, r.output
    state = r.state()
    assert state["status"] == "failed"
    assert "gave up after 1 retries (recovery.max_retries)" in state["reason"]
    assert "rank 3" in state["reason"] and "failures by node: local: 2" in state["reason"]
    assert [e["rank"] for e in r.events("worker_lost")] == [0, 3]


@pytest.mark.slow
def test_a_worker_killed_during_a_checkpoint_write_resumes_from_the_previous_one(submit, reference) -> None:
    r = submit("checkpoint.interval_steps=200", env={"BATON_TOY_SAVE_DELAY_S": "0.5"})
    ckpts = r.run_dir / "checkpoints"
    wait_for(lambda: 200 in manifest.committed_steps(ckpts), 60, "checkpoint 200")
    wait_for(lambda: list(ckpts.glob("step_00000400.tmp-*")), 60, "the save of step 400 to start")
    os.kill(r.worker_pid(1), signal.SIGKILL)
    assert r.finish() == 0, r.output
    assert losses(r.run_dir, every_step_once=True) == reference
    resumed = r.events("resumed")
    assert [e["step"] for e in resumed] == [200], "not resumed from the previous committed checkpoint"
    committed = [e["step"] for e in r.events("checkpoint_committed")]
    assert committed[0] == 200 and committed.count(400) == 1  # 400 only after the restart
    assert not list(ckpts.glob("*.tmp-*")), "debris of the interrupted save is left"


@pytest.mark.slow
def test_a_controller_killed_9_is_relaunched_by_the_supervisor(submit, reference) -> None:
    r = submit("checkpoint.interval_steps=100")
    r.wait_step(300)
    os.kill(r.controller_pid(), signal.SIGKILL)
    assert r.finish() == 0, r.output
    assert losses(r.run_dir, every_step_once=True) == reference
    (died,) = r.events("controller_died")
    assert died["exit_code"] == -signal.SIGKILL and died["retry"] == 1
    assert [e["epoch"] for e in r.events("controller_started")] == [0, 1]
    assert r.state()["status"] == "completed"


@pytest.mark.slow
def test_a_worker_of_an_older_generation_is_refused_by_name(tmp_path: Path) -> None:
    r = make_run(tmp_path, "toy.yaml", [])
    sock = ControllerSocket(r.run.keys)
    info = publish_address(r.run, sock, host="127.0.0.1", epoch=0)
    group = WorkerGroup(sock, world_size=4, epoch=0,
                        timeouts=TimeoutsConfig(), run=r.run)
    group.reset(1)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            group.wait_for_workers(timeout_s=5)
        except RegistrationError as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    ws = WorkerSocket(info["address"], r.run.keys, identity=b"straggler")
    try:
        ws.send(encode(Register(rank_hint=0, host="h", node="n", pid=1, generation=0)))
        frames = ws.recv_within(5.0)
        assert frames is not None, "no answer to a registration of generation 0"
        env = decode(frames)
    finally:
        ws.close()
        t.join()
        group.close()
        sock.close()
    assert isinstance(env.msg, Refuse)
    assert env.msg.reason == "stale generation 0 of epoch 0: this run is at generation 1"
    assert errors and "generation 1" in str(errors[0])
