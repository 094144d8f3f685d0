"""Signals and the job's clock: the only module that installs signal handlers or runs ``scontrol``.

Slurm announces the end of a job with a signal: ``--signal=USR2@<lead>`` sends SIGUSR2
``lead`` seconds before the walltime limit, and at preemption (with
``preempt_send_user_signal``); SIGTERM follows at the end of the grace time. Handlers here
only record the signal; the controller acts on it at the next step boundary.

Walltime or preemption is told from the job record, not guessed (all observed on 22.05):
at preemption Slurm sets ``PreemptTime`` and moves ``EndTime`` to the preemption time
plus the partition's GraceTime; a walltime warning comes with ``PreemptTime=None``, the
job RUNNING and ``EndTime`` within the signal's lead of now; after ``scancel`` (SIGTERM)
the job is already COMPLETING with ``EndTime`` = now: it is ending, not to be requeued.

Requeue: ``scontrol requeue`` kills every step of the job at once, this process included
(SIGTERM, then SIGKILL after KillWait). To requeue with nodes excluded, the job is held
(``requeuehold``), its worker component updated (``ExcNodeList`` can only change on a
pending job) and released; SIGTERM is ignored meanwhile so the job's own kill does not cut
the sequence short (children inherit SIG_IGN).
"""
from __future__ import annotations

import logging
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
DEFAULT_SIGNAL_LEAD_S = 90.0  # matches launcher.slurm.DEFAULT_SIGNAL (USR2@90)
PROACTIVE_MARGIN_S = 30.0  # slack on top of one step and one save before the walltime
UNKNOWN_SAVE_S = 60.0  # a save's duration before the first one was measured
CLOCK_REFRESH_S = 60.0  # the end time can change (scontrol update TimeLimit=...): re-read it
SCONTROL_TIMEOUT_S = 20.0

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


# --------------------------------------------------------------------------------- signals


class PreemptionFlag:
    """Records SIGUSR2 / SIGTERM; the handler does nothing else (no I/O, no locks)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None  # time.time() of the first signal
        self.count = 0
        self.source = "this process"
        self._reported = 0

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum, self.received_at = signum, time.time()
        self.count += 1

    @classmethod
    def install(cls, signals: Sequence[int] = SIGNALS) -> PreemptionFlag:
        """A flag receiving ``signals`` in this process (main thread only)."""
        flag = cls()
        for s in signals:
            signal.signal(s, flag._handler)
        return flag

    @property
    def is_set(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def report_once(self, logger: logging.Logger, what: str) -> None:
        """Log newly received signals (called from ordinary code, never from the handler)."""
        if self.count > self._reported:
            self._reported = self.count
            logger.warning("received %s (%d signal(s) so far): %s", self.signal_name, self.count, what)

    def relay(self, name: str, source: str) -> None:
        """A signal another process received (a worker's heartbeat says so), as if received here."""
        if self.signum is None and name in signal.Signals.__members__:
            self.signum, self.received_at, self.source = int(signal.Signals[name]), time.time(), source
            self.count += 1

    def set_for_test(self, signum: int = signal.SIGUSR2) -> None:
        """What a delivered signal does, without a signal (unit tests)."""
        self._handler(signum, None)


# ------------------------------------------------------------------------------ job record


@dataclass(frozen=True, kw_only=True)
class JobTimes:
    """What ``scontrol show job -o`` says about the job's end (the earliest of its components)."""

    end_time: float | None  # unix seconds; None when unlimited or unknown
    preempt_time: float | None  # set once Slurm has decided to preempt the job
    state: str


_FIELD_RE = re.compile(r"(\w+)=(\S*)")


def _slurm_time(text: str) -> float | None:
    """``2026-12-02T18:34:43`` (the controller's local time) → unix seconds; None for None/Unknown."""
    try:
        return float(time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


def parse_show_job(text: str) -> JobTimes:
    """Parse ``scontrol show job -o ID`` (one line per het-job component)."""
    ends: list[float] = []
    preempts: list[float] = []
    states: list[str] = []
    for line in text.splitlines():
        fields = dict(_FIELD_RE.findall(line))
        if not fields:
            continue
        if (end := _slurm_time(fields.get("EndTime", ""))) is not None:
            ends.append(end)
        if (pre := _slurm_time(fields.get("PreemptTime", ""))) is not None:
            preempts.append(pre)
        states.append(fields.get("JobState", ""))
    return JobTimes(end_time=min(ends) if ends else None, preempt_time=min(preempts) if preempts else None,
                    state=",".join(states))


def show_job(job_id: str, run: Runner = _run) -> JobTimes | None:
    """The job's times from scontrol, or None when scontrol does not answer."""
    try:
        proc = run(["scontrol", "show", "job", "-o", job_id])
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("scontrol show job %s failed: %s", job_id, exc)
        return None
    if proc.returncode != 0:
        log.warning("scontrol show job %s: %s", job_id, proc.stderr.strip() or proc.stdout.strip())
        return None
    return parse_show_job(proc.stdout)


def is_walltime(times: JobTimes, now: float, lead_s: float) -> bool:
    """A signal at ``now`` is the walltime warning (not a preemption) when Slurm has not
    marked the job preempted and its end time is within the signal's lead."""
    return times.preempt_time is None and times.end_time is not None and times.end_time - now <= lead_s + 5.0


def classify(times: JobTimes | None, now: float, lead_s: float) -> str:
    """Why a signal came: ``preemption``, ``walltime``, ``ending`` (Slurm is already ending
    the job: scancel, or the limit hit without warning) or ``signal`` (someone else sent it)."""
    if times is None:
        return "preemption"  # no record to tell: act as for the earlier, shorter deadline
    if times.preempt_time is not None:
        return "preemption"
    if any(s != "RUNNING" for s in times.state.split(",") if s):
        return "ending"
    return "walltime" if is_walltime(times, now, lead_s) else "signal"


class JobClock:
    """Seconds left before Slurm ends the job; the end time is re-read every CLOCK_REFRESH_S."""

    def __init__(self, job_id: str, *, lead_s: float = DEFAULT_SIGNAL_LEAD_S, run: Runner = _run,
                 now: Callable[[], float] = time.time) -> None:
        self.job_id = job_id
        self.lead_s = lead_s
        self._run = run
        self._now = now
        self._times: JobTimes | None = None
        self._read_at = -1e18

    def times(self, *, fresh: bool = False) -> JobTimes | None:
        now = self._now()
        if fresh or now - self._read_at >= CLOCK_REFRESH_S:
            self._read_at = now
            self._times = show_job(self.job_id, self._run) or self._times
        return self._times

    def time_left_s(self) -> float | None:
        t = self.times()
        return None if t is None or t.end_time is None else t.end_time - self._now()

    def classify_signal(self) -> str:
        """``classify`` on a fresh read of the job record."""
        return classify(self.times(fresh=True), self._now(), self.lead_s)


# ------------------------------------------------------------------------- stop decisions


@dataclass(frozen=True, kw_only=True)
class StopRequest:
    """Why the controller stops training at this step boundary to checkpoint and requeue."""

    cause: str  # "preemption" | "walltime" | "signal" | "ending" (see classify) | "time_running_out"
    signal: str  # "SIGUSR2", "SIGTERM" or "" for a proactive stop
    time_left_s: float | None
    detail: str
    signal_at: float | None = None  # time.time() the signal arrived (here or at a worker)


def should_save_now(time_left_s: float | None, *, step_s: float, save_s: float | None,
                    margin_s: float = PROACTIVE_MARGIN_S) -> bool:
    """True when another step might leave no time to save: time left < step + save + margin."""
    if time_left_s is None:
        return False
    return time_left_s < step_s + (UNKNOWN_SAVE_S if save_s is None else save_s) + margin_s


class StopPolicy:
    """Asked at every step boundary: stop now? (a signal arrived, or the walltime is near)."""

    def __init__(self, flag: PreemptionFlag | None, clock: JobClock | None,
                 *, margin_s: float = PROACTIVE_MARGIN_S) -> None:
        self.flag = flag
        self.clock = clock
        self.margin_s = margin_s  # recovery.walltime_margin_s
        self._decided: StopRequest | None = None

    def check(self, *, step_s: float, save_s: float | None) -> StopRequest | None:
        if self._decided is not None:
            return self._decided
        if self.flag is not None and self.flag.is_set:
            self.flag.report_once(log, "checkpointing at this step boundary, then requeueing")
            cause = self.clock.classify_signal() if self.clock is not None else "signal"
            left = self.clock.time_left_s() if self.clock is not None else None
            self._decided = StopRequest(cause=cause, signal=self.flag.signal_name, time_left_s=left,
                                        detail=f"{self.flag.signal_name} received by {self.flag.source}",
                                        signal_at=self.flag.received_at)
        elif self.clock is not None:
            left = self.clock.time_left_s()
            if should_save_now(left, step_s=step_s, save_s=save_s, margin_s=self.margin_s):
                assert left is not None
                self._decided = StopRequest(
                    cause="time_running_out", signal="", time_left_s=left,
                    detail=f"{left:.0f} s left < step {step_s:.1f} s + save "
                           f"{UNKNOWN_SAVE_S if save_s is None else save_s:.1f} s + margin {self.margin_s:.0f} s "
                           "(recovery.walltime_margin_s)")
        return self._decided

    def stop_requested(self) -> bool:
        """A signal arrived (between steps, e.g. while waiting for workers)."""
        return self._decided is not None or (self.flag is not None and self.flag.is_set)


def clock_for(environ: Mapping[str, str]) -> JobClock | None:
    """The job's clock under Slurm (SLURM_JOB_ID), None elsewhere (no walltime locally)."""
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    lead = environ.get("BATON_SIGNAL_LEAD_S")
    return JobClock(job_id, lead_s=float(lead) if lead else DEFAULT_SIGNAL_LEAD_S)


# ---------------------------------------------------------------------------------- requeue


@dataclass(frozen=True, kw_only=True)
class RequeueResult:
    ok: bool
    detail: str


def requeue(job_id: str, *, exclude: Sequence[str] = (), component_id: str | None = None,
            run: Runner = _run) -> RequeueResult:
    """Put the running job back in the queue (same id, SLURM_RESTART_COUNT + 1).

    ``exclude``: nodes the next run must avoid, set on ``component_id`` (the workers'
    component, default the job itself). A job Slurm is already requeueing (preemption
    with PreemptMode=REQUEUE) counts as requeued.
    """
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the job's kill must not cut this short
    try:
        if not exclude:
            return _scontrol(run, ["scontrol", "requeue", job_id])
        held = _scontrol(run, ["scontrol", "requeuehold", job_id])
        if not held.ok:
            return held
        target = component_id or job_id
        upd = _scontrol(run, ["scontrol", "update", f"JobId={target}", f"ExcNodeList={','.join(exclude)}"])
        rel = _scontrol(run, ["scontrol", "release", job_id])
        if not rel.ok:
            return rel
        return RequeueResult(ok=True, detail=f"requeued excluding {','.join(exclude)}"
                             + ("" if upd.ok else f" (exclusion failed: {upd.detail})"))
    finally:
        signal.signal(signal.SIGTERM, old)


def _scontrol(run: Runner, args: list[str]) -> RequeueResult:
    try:
        proc = run(args)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return RequeueResult(ok=False, detail=f"{' '.join(args)}: {exc}")
    out = (proc.stderr.strip() or proc.stdout.strip())
    if proc.returncode == 0:
        return RequeueResult(ok=True, detail=" ".join(args))
    if args[1] == "requeue" and "pending execution" in out.lower():
        return RequeueResult(ok=True, detail="Slurm is already requeueing the job")
    return RequeueResult(ok=False, detail=f"{' '.join(args)}: rc {proc.returncode}: {out}")

