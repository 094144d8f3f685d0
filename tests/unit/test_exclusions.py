"""A requeue's node exclusions (core.job.slurmctl.requeue, core.controller.recovery's
readmission): they never fail open (the user's own are kept when the job's list cannot be
read), nodes Slurm puts back in service leave Baton's list, and the list never leaves the
partition too few nodes. The Slurm commands are faked at the process boundary (recorded output)."""
from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest

from core.config import run as config_mod
from core.controller.recovery import Recovery
from core.job import slurmctl
from core.record import events as ev
from core.record.runfolder import RunFolder
from core.record.state import Budget, RunRecord, RunState, Status

# The workers' component of a held het job (slurm 22.05, `scontrol show job -o 17`).
HELD = ("JobId=17 HetJobId=16 HetJobOffset=1 JobName=toy JobState=PENDING Reason=JobHeldUser Requeue=1 "
        "Restarts=1 Partition=gpu NumNodes=2-2 NumCPUs=2 ExcNodeList={exc} Features=(null)")
PARTITION = "node1\nnode2\nnode3\nnode4\nnode5\nnode6\n"  # sinfo -h -N -p gpu -o %N


class Slurm:
    """Answers Slurm commands from a table keyed by the command's first words; records them."""

    def __init__(self, answers: dict[str, tuple[int, str]]) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(args))
        line = " ".join(args)
        key = max((k for k in self.answers if line.startswith(k)), key=len, default=None)
        rc, out = self.answers[key] if key is not None else (0, "")
        return subprocess.CompletedProcess(list(args), rc, out, "" if rc == 0 else "slurm_load_jobs error")

    def update(self) -> str:
        """The ExcNodeList the requeue set."""
        (upd,) = [c for c in self.calls if c[:2] == ["scontrol", "update"]]
        return upd[-1].removeprefix("ExcNodeList=")


def test_an_unreadable_exclusion_list_keeps_the_users_own_and_adds_batons() -> None:
    slurm = Slurm({"scontrol show job": (1, "")})
    notes: list[tuple[str, tuple[str, ...]]] = []
    result = slurmctl.requeue("16", exclude=["bad7"], floor=["gpu[3-4]", "login1"], component_id="17", run=slurm,
                              on_note=lambda why, nodes: notes.append((why, nodes)))
    assert result.ok and slurm.update() == "gpu[3-4],login1,bad7"  # not "bad7" alone: the user's stay
    assert notes and "could not be read" in notes[0][0] and notes[0][1] == ("gpu[3-4]", "login1", "bad7")
    assert slurm.calls[-1] == ["scontrol", "release", "16"]


def test_a_node_back_in_service_leaves_batons_exclusions_but_never_the_users() -> None:
    slurm = Slurm({"scontrol show job": (0, HELD.format(exc="gpu[3-4],bad1,node5,node6")),
                   "sinfo -h -N -p gpu": (0, PARTITION), "scontrol show hostnames": (0, "gpu3\ngpu4\nbad1\nnode6\n")})
    result = slurmctl.requeue("16", exclude=["node6"], readmit=["node5", "bad1"], floor=["gpu[3-4]", "bad1"],
                              component_id="17", run=slurm)
    assert result.ok and slurm.update() == "gpu[3-4],bad1,node6"
    assert "no longer excluded: node5" in result.detail


def test_only_a_readmission_still_updates_the_held_job() -> None:
    slurm = Slurm({"scontrol show job": (0, HELD.format(exc="node5"))})
    assert slurmctl.requeue("16", readmit=["node5"], component_id="17", run=slurm).ok
    assert slurm.update() == "" and slurm.calls[0] == ["scontrol", "requeuehold", "16"]


def test_exclusions_never_leave_the_partition_fewer_nodes_than_the_job_asks_for() -> None:
    # gpu has node1..node6; the user excludes node1-node3; the job needs 2: one more may go
    slurm = Slurm({"scontrol show job": (0, HELD.format(exc="node[1-3]")), "sinfo -h -N -p gpu": (0, PARTITION),
                   "scontrol show hostnames": (0, "node1\nnode2\nnode3\n")})
    result = slurmctl.requeue("16", exclude=["node4", "node5"], floor=["node[1-3]"], component_id="17", run=slurm)
    assert result.ok and slurm.update() == "node[1-3],node5"  # the newest exclusion kept, node4 left to Slurm
    assert "not excluding node4: partition gpu would keep fewer than the 2 node(s)" in result.detail


def test_without_the_partitions_size_batons_exclusions_are_capped() -> None:
    slurm = Slurm({"scontrol show job": (0, HELD.format(exc="(null)")), "sinfo": (1, "")})
    own = [f"n{i}" for i in range(slurmctl.EXCLUDE_CAP + 2)]
    result = slurmctl.requeue("16", exclude=own, component_id="17", run=slurm)
    assert result.ok and slurm.update().split(",") == own[2:]
    assert "not excluding n0, n1: the partition's node count could not be read" in result.detail


def test_in_service_means_idle_mixed_or_allocated_in_every_partition() -> None:
    shown = ("node2|idle\nnode3|mixed\nnode4|allocated+\nnode5|drained\nnode6|down*\nnode7|idle*\n"
             "node8|idle\nnode8|draining\n")  # node8: in two partitions, draining in one
    slurm = Slurm({"sinfo": (0, shown)})
    assert slurmctl.in_service([f"node{i}" for i in range(2, 9)], run=slurm) == {"node2", "node3", "node4"}
    assert slurm.calls == [["sinfo", "-h", "-N", "-n", "node2,node3,node4,node5,node6,node7,node8", "-o", "%N|%T"]]
    assert slurmctl.in_service(["node2"], run=Slurm({"sinfo": (1, "")})) == set()  # no answer: nothing readmitted


def test_a_requeue_readmits_batons_earlier_exclusions_that_slurm_put_back(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    run = RunFolder(tmp_path)
    record = RunRecord(run)
    # node3, node4: excluded while Slurm had them down; node6: for failures Slurm never saw (idle to it)
    budget = Budget(retries=1, node_failures={"node3": 2, "node4": 3, "node5": 1, "node6": 2},
                    exclude=("node3", "node4", "node6"), down=("node3", "node4"))
    record.create(RunState(status=Status.RUNNING, total_steps=10, recovery=budget), ev.Created(backend="slurm"))
    slurm = Slurm({"sinfo": (0, "node3|idle\nnode4|drained\nnode6|idle\n")})
    monkeypatch.setattr(slurmctl.subprocess, "run", lambda args, **kw: slurm(args))  # the process boundary
    cfg = config_mod.load(Path("experiments/toy.yaml"), [])
    program = SimpleNamespace(record=record, cfg=cfg, step=7)
    assert Recovery(program, worker_restarts=False, on_slurm=True)._readmit(()) == ("node3",)  # type: ignore[arg-type]
    after = record.read().recovery
    limit = cfg.recovery.node_failure_limit
    assert after.exclude == ("node4", "node6") and after.down == ("node4",)
    assert after.node_failures == {"node3": limit - 1, "node4": 3, "node5": 1, "node6": 2}
    (back,) = [e for e in record.events() if isinstance(e, ev.NodeReadmitted)]
    assert (back.node, back.step, back.failures) == ("node3", 7, limit - 1)
    assert Recovery(program, worker_restarts=False, on_slurm=True)._readmit(("node4",)) == ()  # type: ignore[arg-type]
