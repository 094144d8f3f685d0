"""The job's record and requeue through ``scontrol``: the only module that runs it.

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
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEFAULT_SIGNAL_LEAD_S = 90.0  # matches the default sbatch --signal=USR2@90 (core.config.jobspec)
CLOCK_REFRESH_S = 60.0  # the end time can change (scontrol update TimeLimit=...): re-read it
SCONTROL_TIMEOUT_S = 20.0

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


@dataclass(frozen=True, kw_only=True)
class JobTimes:
    """What ``scontrol show job -o`` says about the job's end (the earliest of its components)."""

    end_time: float | None  # unix seconds; None when unlimited or unknown
    preempt_time: float | None  # set once Slurm has decided to preempt the job
    state: str
    restarts: int | None = None  # Slurm's requeue count of the job (the largest of its components)
    start_time: float | None = None  # when this allocation began (the earliest component's StartTime)


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
    restarts: list[int] = []
    starts: list[float] = []
    for line in text.splitlines():
        fields = dict(_FIELD_RE.findall(line))
        if not fields:
            continue
        if (end := _slurm_time(fields.get("EndTime", ""))) is not None:
            ends.append(end)
        if (pre := _slurm_time(fields.get("PreemptTime", ""))) is not None:
            preempts.append(pre)
        if (start := _slurm_time(fields.get("StartTime", ""))) is not None:
            starts.append(start)
        states.append(fields.get("JobState", ""))
        if fields.get("Restarts", "").isdigit():
            restarts.append(int(fields["Restarts"]))
    return JobTimes(end_time=min(ends) if ends else None, preempt_time=min(preempts) if preempts else None,
                    state=",".join(states), restarts=max(restarts) if restarts else None,
                    start_time=min(starts) if starts else None)


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


# Slurm checks signal times on a coarse timer: "the signal may be sent up to 60 seconds
# earlier than specified" (sbatch --signal). A walltime warning may come that much early.
SIGNAL_EARLY_S = 60.0 + 5.0


def is_walltime(times: JobTimes, now: float, lead_s: float) -> bool:
    """A signal at ``now`` is the walltime warning (not a preemption) when Slurm has not
    marked the job preempted and its end time is within the signal's lead (Slurm may send it
    up to a minute early)."""
    return (times.preempt_time is None and times.end_time is not None
            and times.end_time - now <= lead_s + SIGNAL_EARLY_S)


def classify(times: JobTimes | None, now: float, lead_s: float, restart_count: int | None = None) -> str:
    """Why a signal came: ``preemption``, ``walltime``, ``requeued`` (Slurm requeued the job
    itself, e.g. a node of it went down: its ``Restarts`` is past ``restart_count``, the
    count this allocation started with; observed ``COMPLETING,PENDING`` then ``PENDING``),
    ``ending`` (Slurm is already ending the job: scancel, or the limit hit without warning)
    or ``signal`` (someone else sent it)."""
    if times is None:
        return "preemption"  # no record to tell: act as for the earlier, shorter deadline
    if times.preempt_time is not None:
        return "preemption"
    if restart_count is not None and times.restarts is not None and times.restarts > restart_count:
        return "requeued"
    if any(s != "RUNNING" for s in times.state.split(",") if s):
        return "ending"
    return "walltime" if is_walltime(times, now, lead_s) else "signal"


class JobClock:
    """Seconds left before Slurm ends the job; the end time is re-read every CLOCK_REFRESH_S."""

    def __init__(self, job_id: str, *, lead_s: float = DEFAULT_SIGNAL_LEAD_S, run: Runner = _run,
                 now: Callable[[], float] = time.time, restart_count: int | None = None) -> None:
        self.job_id = job_id
        self.lead_s = lead_s
        self.restart_count = restart_count  # SLURM_RESTART_COUNT of this allocation
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
        return classify(self.times(fresh=True), self._now(), self.lead_s, self.restart_count)


def clock_for(environ: Mapping[str, str]) -> JobClock | None:
    """The job's clock under Slurm (SLURM_JOB_ID), None elsewhere (no walltime locally)."""
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    lead = environ.get("BATON_SIGNAL_LEAD_S")
    restarts = environ.get("SLURM_RESTART_COUNT", "0")
    return JobClock(job_id, lead_s=float(lead) if lead else DEFAULT_SIGNAL_LEAD_S,
                    restart_count=int(restarts) if restarts.isdigit() else None)


def allocation_start(environ: Mapping[str, str], process_start: float, run: Runner = _run) -> float:
    """When this epoch's allocation began, for goodput: Slurm's start of the job
    (``SLURM_JOB_START_TIME``, Slurm >= 23.02; else the job record's ``StartTime``, which a
    requeue resets), never later than ``process_start`` (the controller's, also the answer
    off Slurm or when Slurm does not say)."""
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        return process_start
    text = environ.get("SLURM_JOB_START_TIME", "")
    if text.isdigit():
        start: float | None = float(text)
    else:
        times = show_job(job_id, run)
        start = None if times is None else times.start_time
    if start is None:
        log.warning("goodput: no start time for job %s from Slurm; counting from the controller's start", job_id)
        return process_start
    return min(start, process_start)  # a slurmctld clock ahead of this node's must not cut the epoch short


@dataclass(frozen=True, kw_only=True)
class RequeueResult:
    ok: bool
    detail: str


def requeue(job_id: str, *, exclude: Sequence[str] = (), readmit: Sequence[str] = (), floor: Sequence[str] = (),
            component_id: str | None = None, run: Runner = _run,
            on_note: Callable[[str, tuple[str, ...]], None] | None = None) -> RequeueResult:
    """Put the running job back in the queue (same id, SLURM_RESTART_COUNT + 1).

    ``exclude``: nodes the next run must avoid (Baton's own, oldest first), added on
    ``component_id`` (the workers' component, default the job itself) to the ones it already
    excludes (the user's own ``--exclude``, earlier exclusions): never replacing them.
    ``readmit``: Baton's earlier exclusions that Slurm reports back in service, taken off the
    list (never one of ``floor``). ``floor``: the user's own exclusions (the run's
    ``slurm.workers.exclude``), kept whatever happens: when the job's list cannot be read,
    the new list is ``floor`` plus ``exclude`` rather than ``exclude`` alone. The list never
    leaves the job's partition fewer nodes than it asks for (see ``_fit``). ``on_note``
    (why, the new list) hears of each such adjustment while the job is held, before the
    release ends this process. A job Slurm is already requeueing (preemption with
    PreemptMode=REQUEUE) counts as requeued.
    """
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the job's kill must not cut this short
    try:
        if not exclude and not readmit:
            return _scontrol(run, ["scontrol", "requeue", job_id])
        held = _scontrol(run, ["scontrol", "requeuehold", job_id])
        pending = not held.ok and _PENDING in held.detail.lower()  # Slurm requeued it already
        if not held.ok and not pending:
            return held
        target = component_id or job_id
        nodes, notes = _new_exclusions(target, run, exclude=list(exclude), readmit=list(readmit), floor=list(floor))
        upd = _scontrol(run, ["scontrol", "update", f"JobId={target}", f"ExcNodeList={','.join(nodes)}"])
        for note in notes:
            log.warning("%s", note)
            if on_note is not None:
                on_note(note, tuple(nodes))
        rel = None if pending else _scontrol(run, ["scontrol", "release", job_id])
        if rel is not None and not rel.ok:
            return rel
        return RequeueResult(ok=True, detail=f"requeued excluding {','.join(nodes) or 'no nodes'}"
                             + "".join(f"; {n}" for n in notes)
                             + ("" if upd.ok else f" (exclusion failed: {upd.detail})"))
    finally:
        signal.signal(signal.SIGTERM, old)


EXCLUDE_CAP = 8  # Baton's own exclusions when the partition's size cannot be read


def _new_exclusions(target: str, run: Runner, *, exclude: list[str], readmit: list[str],
                    floor: list[str]) -> tuple[list[str], list[str]]:
    """The workers' new ExcNodeList and the notes on how it was made (see ``requeue``)."""
    notes: list[str] = []
    fields = _job_fields(target, run)
    if fields is None:
        current = floor
        notes.append(f"the job's ExcNodeList could not be read: kept the run's slurm.workers.exclude "
                     f"({','.join(floor) or 'none'}) and added Baton's own")
    else:
        value = fields.get("ExcNodeList", "")
        current = [] if value in ("", "(null)") else split_hostlist(value)
    back = [n for n in readmit if n not in floor and n in current]
    if back:
        notes.append(f"back in service in Slurm, no longer excluded: {', '.join(back)}")
    own = [n for n in dict.fromkeys(exclude) if n not in floor]
    kept = [n for n in dict.fromkeys([*floor, *current]) if n not in back and n not in own]
    chosen, dropped, why = _fit(kept, own, fields, run)
    nodes = [n for n in dict.fromkeys([*floor, *current, *own]) if n in set(chosen)]  # the job's order, then Baton's
    if dropped:
        notes.append(f"not excluding {', '.join(dropped)}: {why}")
    return nodes, notes


def _fit(kept: list[str], own: list[str], fields: dict[str, str] | None,
         run: Runner) -> tuple[list[str], list[str], str]:
    """``kept`` (the user's and earlier exclusions) plus as many of Baton's ``own`` (node
    names; the newest, last, first) as leave the job's partition(s) the nodes the job asks
    for (NumNodes); when that cannot be read, at most EXCLUDE_CAP of Baton's own.
    (The list, Baton's nodes left out, why.)"""
    need = fields.get("NumNodes", "").split("-")[0] if fields else ""
    parts = fields.get("Partition", "") if fields else ""
    total = _partition_nodes(parts, run) if parts and need.isdigit() else None
    taken = (_hostnames(kept, run) if kept else set()) if total is not None else None
    if total is None or taken is None:
        if len(own) <= EXCLUDE_CAP:
            return [*kept, *own], [], ""
        return ([*kept, *own[-EXCLUDE_CAP:]], own[:-EXCLUDE_CAP],
                f"the partition's node count could not be read: Baton excludes at most {EXCLUDE_CAP} nodes")
    left = total - taken
    chosen: set[str] = set()
    for n in reversed(own):
        if len(left - chosen - {n}) >= int(need):
            chosen.add(n)
    dropped = [n for n in own if n not in chosen]
    return ([*kept, *(n for n in own if n in chosen)], dropped,
            f"partition {parts} would keep fewer than the {need} node(s) the job asks for" if dropped else "")


def _job_fields(job_id: str, run: Runner) -> dict[str, str] | None:
    """The job's ``scontrol show job -o`` fields (its first line), None when it cannot be read."""
    try:
        proc = run(["scontrol", "show", "job", "-o", job_id])
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("scontrol show job %s failed: %s", job_id, exc)
        return None
    lines = proc.stdout.splitlines() if proc.returncode == 0 else []
    return dict(_FIELD_RE.findall(lines[0])) if lines and _FIELD_RE.search(lines[0]) else None


def _partition_nodes(partitions: str, run: Runner) -> set[str] | None:
    """The node names of ``partitions`` (comma-separated), None when sinfo does not answer."""
    proc = _answer(run, ["sinfo", "-h", "-N", "-p", partitions, "-o", "%N"])
    return None if proc is None else {line.strip() for line in proc.splitlines() if line.strip()}


def _hostnames(exprs: list[str], run: Runner) -> set[str] | None:
    """Hostlist expressions expanded (``scontrol show hostnames``), None when that fails."""
    proc = _answer(run, ["scontrol", "show", "hostnames", ",".join(exprs)])
    return None if proc is None else {line.strip() for line in proc.splitlines() if line.strip()}


def _answer(run: Runner, args: list[str]) -> str | None:
    """The stdout of a Slurm command that succeeded, else None (logged)."""
    try:
        proc = run(args)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("%s failed: %s", " ".join(args), exc)
        return None
    if proc.returncode != 0:
        log.warning("%s: rc %d: %s", " ".join(args), proc.returncode, proc.stderr.strip())
        return None
    return proc.stdout


_PENDING = "pending execution"  # scontrol's answer to a requeue of a job that is already pending


def unavailable_nodes(nodes: Sequence[str], run: Runner = _run) -> dict[str, tuple[str, str]]:
    """``{node: (state, reason)}`` for those of ``nodes`` that Slurm has taken out of service
    (down, drained or draining, failing, not responding); {} when none or sinfo does not answer."""
    if not nodes:
        return {}
    try:
        proc = run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N|%T|%E"])
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("sinfo failed: %s", exc)
        return {}
    found: dict[str, tuple[str, str]] = {}
    for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
        node, _, rest = line.partition("|")
        state, _, reason = rest.partition("|")
        if any(word in state for word in ("down", "drain", "fail", "*")):
            found[node.strip()] = (state.strip(), reason.strip())
    return found


IN_SERVICE = ("idle", "mixed", "allocated", "completing")  # sinfo %T of a node Slurm schedules on


def in_service(nodes: Sequence[str], run: Runner = _run) -> set[str]:
    """Those of ``nodes`` Slurm reports in service (idle, mixed, allocated: not down,
    drained, failing or unresponding); empty when none or sinfo does not answer."""
    if not nodes:
        return set()
    out = _answer(run, ["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N|%T"])
    states: dict[str, set[str]] = {}
    for line in (out or "").splitlines():
        node, _, state = line.partition("|")
        states.setdefault(node.strip(), set()).add(state.strip().rstrip("+"))
    return {n for n, seen in states.items() if n in nodes and seen <= set(IN_SERVICE)}


def split_hostlist(value: str) -> list[str]:
    """``node[1-2],gpu3`` → ["node[1-2]", "gpu3"]: commas inside brackets belong to the expression."""
    out, depth, part = [], 0, ""
    for ch in value:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append(part)
            part = ""
        else:
            part += ch
    return [p for p in [*out, part] if p]


def _scontrol(run: Runner, args: list[str]) -> RequeueResult:
    try:
        proc = run(args)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return RequeueResult(ok=False, detail=f"{' '.join(args)}: {exc}")
    out = (proc.stderr.strip() or proc.stdout.strip())
    if proc.returncode == 0:
        return RequeueResult(ok=True, detail=" ".join(args))
    if args[1] == "requeue" and _PENDING in out.lower():
        return RequeueResult(ok=True, detail="Slurm is already requeueing the job")
    return RequeueResult(ok=False, detail=f"{' '.join(args)}: rc {proc.returncode}: {out}")


# States after which the job runs nothing more (a requeued job is PENDING/REQUEUED again, not here).
FINAL_STATES = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                          "DEADLINE", "OUT_OF_MEMORY"})
JOB_OVER_TIMEOUT_S = 5.0  # asked on the login node too: never hold it up for long


def _quick(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=JOB_OVER_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


_CLUSTER: list[str | None] = []  # this node's Slurm cluster, once asked


def local_cluster(run: Runner | None = None) -> str | None:
    """This node's Slurm cluster: SLURM_CLUSTER_NAME inside a job, else scontrol's ClusterName
    (a login node; asked once per process); None when neither says."""
    if name := os.environ.get("SLURM_CLUSTER_NAME"):
        return name
    if not _CLUSTER:
        try:
            proc = (run or _quick)(["scontrol", "show", "config"])
            found = re.search(r"^ClusterName\s*=\s*(\S+)", proc.stdout, re.M) if proc.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            found = None
        _CLUSTER.append(found.group(1) if found else None)
    return _CLUSTER[0]


def job_over(job_id: str, run: Runner | None = None) -> bool | None:
    """Whether Slurm says job ``job_id`` is over: every component in a final state, or the job
    unknown to Slurm (purged after MinJobAge; ask only about a job of this node's cluster,
    ``local_cluster``: another cluster's live job is unknown here too). None when scontrol cannot say (absent, timed
    out, another error): the caller then treats the job as alive."""
    try:
        proc = (run or _quick)(["scontrol", "show", "job", "-o", job_id])
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("scontrol show job %s failed: %s", job_id, exc)
        return None
    if proc.returncode != 0:
        return True if "invalid job id" in (proc.stderr + proc.stdout).lower() else None
    states = [s for s in parse_show_job(proc.stdout).state.split(",") if s]
    return bool(states) and all(s in FINAL_STATES for s in states)
