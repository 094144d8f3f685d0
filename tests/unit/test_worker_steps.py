"""The batch script's supervisor of one worker step (core.supervisor.worker_steps ``supervise``):
a request of workers.json that names ranks restarts the step only when it names the step's
first rank (``BATON_RANK_BASE``: a split generator's component, while the trainer's goes on);
either way the supervisor is at that generation afterwards.

The step is a real process (a small Python sleeper standing in for srun) that notes its
``BATON_GENERATION`` when it starts and that it was ended when it gets SIGTERM; the requests
are written with the controller's own ``request_workers``. ``supervise`` runs in a thread of
the test; which requests it has read is seen through ``read_request`` (wrapped, not replaced),
so that the test knows a request was acted on, or not, without waiting on a clock.
"""
from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.record.runfolder import RunFolder
from core.record.state import RunRecord, RunState, Status
from core.supervisor import worker_steps
from core.supervisor.contract import WorkerRequest, request_workers
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(120)

STEP = """\
import os, signal, sys, time
from pathlib import Path
out, pid = Path(sys.argv[1]), os.getpid()
def ended(signum, frame):
    (out / f"{pid}.ended").write_text("")
    sys.exit(3)
signal.signal(signal.SIGTERM, ended)
(out / f"{pid}.started").write_text(os.environ["BATON_GENERATION"])
while True:
    time.sleep(60)
"""


class Supervised:
    """``supervise`` of the sleeper step, for epoch 0 and the step whose first rank is ``first_rank``."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first_rank: int) -> None:
        self.run = RunFolder(tmp_path / "run")
        (self.run.path / "logs").mkdir(parents=True)
        RunRecord(self.run).create(RunState(status=Status.RUNNING))
        self.out = tmp_path / "steps"
        self.out.mkdir()
        (tmp_path / "step.py").write_text(STEP)
        self.seen: list[WorkerRequest | None] = []  # every read of workers.json, in order
        read = worker_steps.read_request

        def reading(run: RunFolder) -> WorkerRequest | None:
            self.seen.append(read(run))
            return self.seen[-1]

        monkeypatch.setattr(worker_steps, "read_request", reading)
        self.monkeypatch = monkeypatch
        self.code: list[int] = []
        cmd = [sys.executable, str(tmp_path / "step.py"), str(self.out)]
        self.thread = threading.Thread(target=lambda: self.code.append(
            worker_steps.supervise(self.run, cmd, epoch=0, first_rank=first_rank)), daemon=True)
        self.thread.start()

    def started(self) -> list[tuple[str, int]]:
        """(BATON_GENERATION, pid) of every step started so far, by generation."""
        return sorted((p.read_text(), int(p.stem)) for p in self.out.glob("*.started") if p.read_text())

    def ended(self, pid: int) -> bool:
        return (self.out / f"{pid}.ended").exists()

    def ask(self, req: WorkerRequest) -> None:
        """Write ``req`` and wait until the supervisor has read it and gone round once more."""
        request_workers(self.run, req)  # stamped with the time it is written

        def acted() -> bool:
            reads = [r is not None and dataclasses.replace(r, time=0.0) == req for r in self.seen]
            return True in reads[:-1]

        wait_for(acted, 30, f"the supervisor to act on generation {req.generation} ({req.reason})")

    def stop(self) -> int:
        self.monkeypatch.setattr(worker_steps._Stop, "requested", True)
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()
        return self.code[0]


@pytest.fixture
def supervised(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[int, Supervised]]:
    """The supervisors a test starts, stopped after it (before monkeypatch undoes the stop flag)."""
    made: dict[int, Supervised] = {}
    yield made
    for s in made.values():
        if s.thread.is_alive():
            s.stop()


def _first(supervised: dict[int, Supervised], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
           first_rank: int) -> tuple[Supervised, int]:
    s = supervised[first_rank] = Supervised(tmp_path, monkeypatch, first_rank)
    ((generation, pid),) = wait_for(s.started, 60, "generation 0 of the step")
    assert generation == "0"
    return s, pid


def test_a_request_for_other_ranks_leaves_the_step_running_at_the_new_generation(
        supervised: dict[int, Supervised], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, pid0 = _first(supervised, tmp_path, monkeypatch, first_rank=0)
    trainer.ask(WorkerRequest(epoch=0, generation=1, ranks=(2, 3), reason="the generator alone"))
    assert trainer.started() == [("0", pid0)] and not trainer.ended(pid0)  # still the same process
    trainer.ask(WorkerRequest(epoch=0, generation=1, reason="generation 1 again, every rank"))
    assert trainer.started() == [("0", pid0)]  # already at generation 1: nothing to do
    trainer.ask(WorkerRequest(epoch=0, generation=2, reason="every worker"))
    ((_, first), (generation, pid2)) = wait_for(lambda: trainer.started()[1:] and trainer.started(), 30,
                                                "generation 2 of the step")
    assert (first, generation) == (pid0, "2") and trainer.ended(pid0)
    assert trainer.stop() == 3 and trainer.ended(pid2)  # the last step's exit code, once ended


def test_a_request_naming_the_steps_first_rank_restarts_it(supervised: dict[int, Supervised], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    generator, pid0 = _first(supervised, tmp_path, monkeypatch, first_rank=2)
    generator.ask(WorkerRequest(epoch=0, generation=1, ranks=(2, 3), reason="the generator alone"))
    ((_, first), (generation, pid1)) = wait_for(lambda: generator.started()[1:] and generator.started(), 30,
                                                "generation 1 of the step")
    assert (first, generation) == (pid0, "1") and generator.ended(pid0) and not generator.ended(pid1)
    generator.ask(WorkerRequest(epoch=0, generation=2, ranks=(0, 1), reason="the trainer alone"))
    assert generator.started() == [("0", pid0), ("1", pid1)] and not generator.ended(pid1)
    assert generator.stop() == 3 and generator.ended(pid1)
