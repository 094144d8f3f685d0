"""A local run ends whole: a stop signal to a foreground ``baton submit`` (a closed terminal's
SIGHUP, a ``timeout`` wrapper's SIGTERM) and ``baton cancel`` end the controller and every
worker, checkpointed, and the run record says so (toy task: fast; real processes and signals).

Whether a process of the run is left is read from /proc independently of Baton's own record:
every process whose environment names the run folder (BATON_RUN_DIR) counts.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from core.checkpoint import manifest
from tests.helpers import REPO, baton, read_state, wait_for

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
FAST = ["timeouts.heartbeat_interval_s=0.1", "timeouts.heartbeat_timeout_s=1.5", "timeouts.controller_lost_s=3"]
WORKERS = 4  # experiments/toy.yaml


def _processes_of(run: Path) -> set[int]:
    """Every live process whose environment names ``run`` as its run folder."""
    needle = f"BATON_RUN_DIR={run}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


def _start(tmp_path: Path, *, session: bool = False) -> tuple[subprocess.Popen[str], Path]:
    """A toy `baton submit --backend local` that would train for a very long time, once every
    process of it runs and it has trained a few steps; ``session``: in a session of its own
    (as a run sent to the background of another terminal)."""
    out = (tmp_path / "submit.out").open("w")  # a file, not a pipe nobody reads
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "submit", "experiments/toy.yaml",
                             f"runs_root={tmp_path}", *FAST, "trainer.steps=100000000", "--backend", "local"],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out,
                            stderr=subprocess.STDOUT, text=True, start_new_session=session)
    run = wait_for(lambda: next(iter(tmp_path.glob("toy/*/local.json")), None), 60, "local.json").parent
    wait_for(lambda: read_state(run).get("step", 0) > 3, 60, "the run to train")
    assert len(_processes_of(run)) == 1 + WORKERS  # the controller and every worker, found in /proc
    return proc, run


def _end(proc: subprocess.Popen[str], run: Path) -> None:
    """Whatever a failed test left: only the processes of this run, by pid."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in _processes_of(run):
        os.kill(pid, signal.SIGKILL)


def _ended_whole(run: Path) -> dict[str, object]:
    """No process of the run is left; the run was checkpointed at the step it stopped at."""
    wait_for(lambda: not _processes_of(run), 30, "every process of the run to end")
    state = read_state(run)
    assert manifest.committed_steps(run / "checkpoints")[-1] == state["step"] > 3, state
    return state


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_to_a_foreground_submit_ends_every_process_of_the_run(tmp_path: Path, signum: int) -> None:
    proc, run = _start(tmp_path)
    try:
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == 128 + signum
        state = _ended_whole(run)
        assert state["status"] == "stopped" and signal.Signals(signum).name in state["reason"], state
    finally:
        _end(proc, run)


def test_cancel_ends_a_local_run_on_this_host_and_refuses_one_on_another(tmp_path: Path) -> None:
    proc, run = _start(tmp_path, session=True)
    try:
        record = (run / "local.json").read_text()
        (run / "local.json").write_text(json.dumps({**json.loads(record), "host": "elsewhere-node7"}))
        res = baton("cancel", str(run))
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert "elsewhere-node7" in res.stderr and proc.poll() is None  # nothing was signalled
        (run / "local.json").write_text(record)
        res = baton("cancel", str(run), timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert _ended_whole(run)["status"] == "cancelled"
    finally:
        _end(proc, run)


def test_cancel_ends_the_processes_a_killed_supervisor_left_and_never_a_reused_pid(tmp_path: Path) -> None:
    proc, run = _start(tmp_path, session=True)
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        proc.kill()  # SIGKILL: the supervisor cannot end its children
        proc.wait()
        assert len(_processes_of(run)) == 1 + WORKERS  # orphans, training on
        res = baton("cancel", str(run), timeout=120)
        assert res.returncode == 0 and "left without their supervisor" in res.stdout, res.stdout + res.stderr
        assert _ended_whole(run)["status"] == "cancelled"
        # local.json naming a pid that another process has now: never signalled
        data = json.loads((run / "local.json").read_text())
        data["pid"] = bystander.pid
        data["children"] = [{"pid": bystander.pid, "start": 1, "role": "controller"}]
        (run / "local.json").write_text(json.dumps(data))
        res = baton("cancel", str(run))
        assert res.returncode == 0 and "nothing of the run was running" in res.stdout, res.stdout + res.stderr
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        _end(proc, run)
