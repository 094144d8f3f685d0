"""core.job.signals, core.job.slurmctl and core.controller.stop: the signal flag, the job record (recorded scontrol output), stop
decisions and the requeue command sequences (a fake runner: no Slurm needed)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence

import pytest

from core.controller import stop
from core.controller.stop import StopPolicy
from core.job import signals, slurmctl
from core.job.signals import PreemptionFlag
from core.job.slurmctl import JobClock

# Recorded on the local cluster (slurm 22.05): a running job, the same job 1 s after a
# preemption (GraceTime=20), and a job after scancel. Times are the controller's local time.
RUNNING = ("JobId=16 JobName=low UserId=root(0) JobState=RUNNING Reason=None Requeue=1 Restarts=0 "
           "TimeLimit=00:10:00 StartTime=2026-12-02T18:34:22 EndTime=2026-12-02T18:44:22 Deadline=N/A "
           "PreemptEligibleTime=2026-12-02T18:34:22 PreemptTime=None Partition=low")
PREEMPTED = RUNNING.replace("EndTime=2026-12-02T18:44:22", "EndTime=2026-12-02T18:34:43").replace(
    "PreemptTime=None", "PreemptTime=2026-12-02T18:34:23")
CANCELLED = RUNNING.replace("JobState=RUNNING", "JobState=COMPLETING").replace(
    "EndTime=2026-12-02T18:44:22", "EndTime=2026-12-02T18:40:35")
# Right after `scontrol update NodeName=node3 State=DOWN` under a het job's workers: Slurm
# has requeued the job itself (Restarts + 1); the controller's component is still completing.
NODE_DOWN = (RUNNING.replace("JobState=RUNNING", "JobState=COMPLETING").replace("Restarts=0", "Restarts=1") + "\n"
             + RUNNING.replace("JobId=16", "JobId=17").replace("JobState=RUNNING", "JobState=PENDING").replace(
                 "Restarts=0", "Restarts=1"))
HET = RUNNING + "\n" + RUNNING.replace("JobId=16", "JobId=17").replace("EndTime=2026-12-02T18:44:22",
                                                                      "EndTime=2026-12-02T18:43:22")


def _t(text: str) -> float:
    return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))


class FakeRunner:
    """Records scontrol invocations; answers from a table of (argv[1], rc, stdout, stderr)."""

    def __init__(self, answers: dict[str, tuple[int, str, str]] | None = None) -> None:
        self.calls: list[list[str]] = []
        self.answers = answers or {}

    def __call__(self, args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(args))
        rc, out, err = self.answers.get(args[1], (0, "", ""))
        return subprocess.CompletedProcess(list(args), rc, out, err)


def test_parse_show_job_takes_the_earliest_end_of_all_components() -> None:
    t = slurmctl.parse_show_job(HET)
    assert t.end_time == _t("2026-12-02T18:43:22") and t.preempt_time is None and t.state == "RUNNING,RUNNING"
    p = slurmctl.parse_show_job(PREEMPTED)
    assert p.preempt_time == _t("2026-12-02T18:34:23") and p.end_time == _t("2026-12-02T18:34:43")


@pytest.mark.parametrize(("record", "now", "cause"), [
    (PREEMPTED, "2026-12-02T18:34:24", "preemption"),      # PreemptTime set, EndTime = now + grace
    (RUNNING, "2026-12-02T18:42:52", "walltime"),          # USR2@90 before the end
    (RUNNING, "2026-12-02T18:41:52", "walltime"),          # ... sent a minute early (Slurm's timer)
    (RUNNING, "2026-12-02T18:35:00", "signal"),            # a signal with the end far away
    (CANCELLED, "2026-12-02T18:40:35", "ending"),          # scancel: already COMPLETING
    (NODE_DOWN, "2026-12-02T18:40:35", "requeued"),        # a node went down: Slurm requeued the job
])
def test_a_signal_is_told_apart_by_the_job_record(record: str, now: str, cause: str) -> None:
    assert slurmctl.classify(slurmctl.parse_show_job(record), _t(now), lead_s=90, restart_count=0) == cause


def test_a_requeue_by_slurm_is_told_by_the_restart_count_this_allocation_began_with() -> None:
    times = slurmctl.parse_show_job(NODE_DOWN)
    assert times.restarts == 1 and times.state == "COMPLETING,PENDING"
    assert slurmctl.classify(times, 0.0, lead_s=90, restart_count=1) == "ending"  # already counted: not ours
    assert slurmctl.clock_for({"SLURM_JOB_ID": "16", "SLURM_RESTART_COUNT": "2"}).restart_count == 2


def test_without_a_record_a_signal_counts_as_preemption() -> None:
    assert slurmctl.classify(None, 0.0, lead_s=90) == "preemption"


def test_job_clock_rereads_the_record_only_now_and_then() -> None:
    now = [_t("2026-12-02T18:40:00")]
    runner = FakeRunner({"show": (0, RUNNING, "")})
    clock = JobClock("16", run=runner, now=lambda: now[0])
    assert clock.time_left_s() == pytest.approx(262.0)
    now[0] += 10
    assert clock.time_left_s() == pytest.approx(252.0)
    assert len(runner.calls) == 1  # cached
    now[0] += slurmctl.CLOCK_REFRESH_S
    clock.time_left_s()
    assert len(runner.calls) == 2 and runner.calls[0] == ["scontrol", "show", "job", "-o", "16"]


def test_should_save_now_compares_time_left_with_a_step_a_save_and_a_margin() -> None:
    assert not stop.should_save_now(None, step_s=1, save_s=1)
    assert not stop.should_save_now(100, step_s=10, save_s=20, margin_s=30)
    assert stop.should_save_now(59, step_s=10, save_s=20, margin_s=30)
    assert stop.should_save_now(99, step_s=10, save_s=None, margin_s=30)  # before a first save: 60 s assumed


def test_stop_policy_stops_proactively_before_the_walltime() -> None:
    now = [_t("2026-12-02T18:43:00")]  # 82 s left
    clock = JobClock("16", run=FakeRunner({"show": (0, RUNNING, "")}), now=lambda: now[0])
    assert StopPolicy(PreemptionFlag(), clock).check(step_s=1.0, save_s=2.0) is None
    now[0] = _t("2026-12-02T18:43:50")  # 32 s left < 1 + 2 + 30
    policy = StopPolicy(PreemptionFlag(), clock)
    stop = policy.check(step_s=1.0, save_s=2.0)
    assert stop is not None and stop.cause == "time_running_out" and stop.signal == ""


def test_stop_policy_uses_the_configured_walltime_margin() -> None:
    now = [_t("2026-12-02T18:43:00")]  # 82 s left: enough with the 30 s default, not with 90 s
    clock = JobClock("16", run=FakeRunner({"show": (0, RUNNING, "")}), now=lambda: now[0])
    assert StopPolicy(PreemptionFlag(), clock).check(step_s=1.0, save_s=2.0) is None
    stop = StopPolicy(PreemptionFlag(), clock, margin_s=90.0).check(step_s=1.0, save_s=2.0)
    assert stop is not None and stop.cause == "time_running_out" and "margin 90 s" in stop.detail


def test_stop_policy_reports_the_signal_and_its_cause() -> None:
    flag = PreemptionFlag()
    now = [_t("2026-12-02T18:34:24")]
    policy = StopPolicy(flag, JobClock("16", run=FakeRunner({"show": (0, PREEMPTED, "")}), now=lambda: now[0]))
    flag.set_for_test(signal.SIGUSR2)
    stop = policy.check(step_s=0.1, save_s=0.1)
    assert stop is not None and (stop.cause, stop.signal) == ("preemption", "SIGUSR2")
    assert stop.time_left_s == pytest.approx(19.0)
    assert StopPolicy(flag, None).check(step_s=0, save_s=0).cause == "signal"  # type: ignore[union-attr]


def test_the_flag_records_real_signals_and_the_process_survives_them() -> None:
    old = {s: signal.getsignal(s) for s in signals.SIGNALS}
    try:
        flag = PreemptionFlag.install()
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.is_set and flag.signal_name == "SIGUSR2" and flag.count == 2
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_requeue_is_one_scontrol_call_without_exclusions() -> None:
    runner = FakeRunner()
    assert slurmctl.requeue("16", run=runner).ok
    assert runner.calls == [["scontrol", "requeue", "16"]]


def test_requeue_with_exclusions_holds_updates_the_workers_component_and_releases() -> None:
    runner = FakeRunner()
    result = slurmctl.requeue("16", exclude=["node2", "node3"], component_id="17", run=runner)
    assert result.ok and "excluding node2,node3" in result.detail
    assert runner.calls == [["scontrol", "requeuehold", "16"],
                            ["scontrol", "show", "job", "-o", "17"],  # what it excludes already: none here
                            ["scontrol", "update", "JobId=17", "ExcNodeList=node2,node3"],
                            ["scontrol", "release", "16"]]
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # restored


def test_an_exclusion_adds_to_the_users_own_never_replaces_them() -> None:
    shown = "JobId=17 HetJobId=16 JobState=REQUEUE_HOLD ExcNodeList=gpu[3-4],bad1 Partition=gpu\n"
    runner = FakeRunner({"show": (0, shown, "")})
    result = slurmctl.requeue("16", exclude=["node2", "bad1"], component_id="17", run=runner)
    assert result.ok and ["scontrol", "update", "JobId=17", "ExcNodeList=gpu[3-4],bad1,node2"] in runner.calls
    assert slurmctl.split_hostlist("a[1,3-4],b,c[2]") == ["a[1,3-4]", "b", "c[2]"]


def test_a_job_slurm_is_already_requeueing_counts_as_requeued() -> None:
    runner = FakeRunner({"requeue": (1, "", "Job is pending execution for job 16")})
    assert slurmctl.requeue("16", run=runner).ok


def test_exclusions_on_a_job_slurm_requeued_itself_update_the_pending_job() -> None:
    runner = FakeRunner({"requeuehold": (1, "", "Job is pending execution for job 16")})
    result = slurmctl.requeue("16", exclude=["node3"], component_id="17", run=runner)
    assert result.ok and "excluding node3" in result.detail
    assert runner.calls[-1] == ["scontrol", "update", "JobId=17", "ExcNodeList=node3"]  # no release: not held


def test_unavailable_nodes_are_the_ones_slurm_took_out_of_service() -> None:
    shown = ("node2|mixed|none\nnode3|down|baton-test\nnode3|down|baton-test\nnode4|draining|bad gpu\n"
             "node5|idle*|Not responding\nnode6|allocated|none\n")
    runner = FakeRunner({"-h": (0, shown, "")})
    found = slurmctl.unavailable_nodes(["node2", "node3", "node4", "node5", "node6"], run=runner)
    assert found == {"node3": ("down", "baton-test"), "node4": ("draining", "bad gpu"),
                     "node5": ("idle*", "Not responding")}
    assert runner.calls == [["sinfo", "-h", "-N", "-n", "node2,node3,node4,node5,node6", "-o", "%N|%T|%E"]]
    assert slurmctl.unavailable_nodes([], run=runner) == {}


def test_a_refused_requeue_says_why() -> None:
    runner = FakeRunner({"requeue": (1, "", "Requested operation is presently disabled")})
    result = slurmctl.requeue("16", run=runner)
    assert not result.ok and "presently disabled" in result.detail
