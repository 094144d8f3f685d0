"""Goodput counts from the allocation's start: core.job.slurmctl.allocation_start reads Slurm's
job start (SLURM_JOB_START_TIME, else scontrol's StartTime of every component) and falls back
to the controller's process start. scontrol is faked at its process boundary."""
from __future__ import annotations

import subprocess
from collections.abc import Sequence
from datetime import datetime

from core.job import slurmctl

# `scontrol show job -o 16` of a het job on the local cluster (slurm 22.05), components 16 and
# 17; times are the node's local time. The worker component started a second later.
COMPONENT = ("JobId={id} HetJobId=16 HetJobOffset={off} JobName=baton UserId=root(0) JobState=RUNNING "
             "Reason=None Requeue=1 Restarts=1 TimeLimit=00:10:00 SubmitTime=2026-12-02T18:30:01 "
             "EligibleTime=2026-12-02T18:34:10 StartTime={start} EndTime=2026-12-02T18:44:22 Deadline=N/A "
             "PreemptTime=None Partition=cpu")
HET = "\n".join([COMPONENT.format(id=16, off=0, start="2026-12-02T18:34:22"),
                 COMPONENT.format(id=17, off=1, start="2026-12-02T18:34:23")])
STARTED = datetime(2026, 12, 2, 18, 34, 22).timestamp()  # local time, as scontrol prints it
PROCESS = STARTED + 7.5  # the controller process started after the batch script and submitit


class Scontrol:
    """Answers every call with one (rc, stdout), or raises ``error``; records the calls."""

    def __init__(self, rc: int = 0, out: str = "", error: Exception | None = None) -> None:
        self.rc, self.out, self.error = rc, out, error
        self.calls: list[list[str]] = []

    def __call__(self, args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(args))
        if self.error is not None:
            raise self.error
        return subprocess.CompletedProcess(list(args), self.rc, self.out, "" if self.rc == 0 else "error")


def test_the_earliest_component_start_time_of_the_job_record() -> None:
    scontrol = Scontrol(out=HET)
    assert slurmctl.allocation_start({"SLURM_JOB_ID": "16"}, PROCESS, run=scontrol) == STARTED
    assert scontrol.calls == [["scontrol", "show", "job", "-o", "16"]]


def test_slurm_s_own_start_time_variable_needs_no_scontrol() -> None:
    scontrol = Scontrol(out=HET)
    env = {"SLURM_JOB_ID": "16", "SLURM_JOB_START_TIME": "1796300000"}
    assert slurmctl.allocation_start(env, 1796300042.0, run=scontrol) == 1796300000.0 and scontrol.calls == []


def test_no_start_from_slurm_counts_from_the_process_start() -> None:
    unknown = HET.replace("StartTime=2026-12-02T18:34:22", "StartTime=Unknown").replace(
        "StartTime=2026-12-02T18:34:23", "StartTime=None")
    for scontrol in (Scontrol(out=unknown), Scontrol(rc=1), Scontrol(error=FileNotFoundError("scontrol")),
                     Scontrol(error=subprocess.TimeoutExpired("scontrol", 20)), Scontrol(out="")):
        assert slurmctl.allocation_start({"SLURM_JOB_ID": "16"}, PROCESS, run=scontrol) == PROCESS
    garbled = {"SLURM_JOB_ID": "16", "SLURM_JOB_START_TIME": "yesterday"}  # not a number: the record is asked
    assert slurmctl.allocation_start(garbled, PROCESS, run=Scontrol(out=HET)) == STARTED


def test_locally_and_with_a_start_after_the_process_the_process_start_counts() -> None:
    scontrol = Scontrol(out=HET)
    assert slurmctl.allocation_start({}, PROCESS, run=scontrol) == PROCESS and scontrol.calls == []
    # slurmctld's clock ahead of this node's: the epoch is never shorter than the controller's life
    assert slurmctl.allocation_start({"SLURM_JOB_ID": "16"}, STARTED - 2.0, run=scontrol) == STARTED - 2.0
