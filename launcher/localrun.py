"""A local run's processes on record, and ``baton cancel`` of a local run.

The local supervisor (``launcher.local``: a foreground ``baton submit``, or one sent to the
background) writes ``local.json`` in the run folder: its host, its pid and that pid's start
time, and the same of every controller and worker process it started (each the leader of
a process group of its own). ``cancel`` reads it:

- on another host it refuses in one line naming the host (a pid means nothing there);
- a pid is signalled only while it still belongs to the run: alive, with the start time
  recorded for it (a pid the kernel gave to another process since has another one);
- the supervisor gets SIGTERM, which it answers as Ctrl-C: the controller checkpoints, every
  child is ended, the run is recorded stopped; ``cancel`` waits for that with a deadline;
- children left without their supervisor (it was SIGKILLed) are ended by process group:
  the controller first with SIGTERM (it checkpoints), then SIGKILL for whatever remains;

then the run is recorded cancelled.
"""
from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from core.errors import UserError
from core.record import events as ev
from core.record.runfolder import RunFolder, read_json, write_json
from core.record.state import RunRecord

FILE = "local.json"
_POLL_S = 0.1


@dataclass(frozen=True, kw_only=True)
class Proc:
    """One process of the run: its pid and the start time the kernel gave it (clock ticks
    since boot, /proc/PID/stat field 22), which tells it apart from a later process that
    reuses the pid."""

    pid: int
    start: int | None
    role: str  # "supervisor" | "controller" | "worker"

    def alive(self) -> bool:
        """Still this very process (not a zombie, not a reused pid)."""
        now = start_ticks(self.pid)
        return now is not None and now == self.start


def start_ticks(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot), None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def path(run: RunFolder) -> Path:
    return run.path / FILE


def record(run: RunFolder, children: Iterable[tuple[int, str]]) -> None:
    """Write local.json: this process (the supervisor) and ``children`` (pid, role)."""
    me = os.getpid()
    write_json(path(run), {
        "host": socket.gethostname(), "pid": me, "start": start_ticks(me),
        "children": [{"pid": pid, "start": start_ticks(pid), "role": role} for pid, role in children]})


def recorded(run: RunFolder) -> tuple[str, Proc, list[Proc]] | None:
    """(host, supervisor, children) from local.json; None when the run has none."""
    if not path(run).is_file():
        return None
    data = read_json(path(run))
    try:
        sup = Proc(pid=int(data["pid"]), start=data.get("start"), role="supervisor")
        kids = [Proc(pid=int(c["pid"]), start=c.get("start"), role=str(c["role"])) for c in data.get("children", [])]
        return str(data["host"]), sup, kids
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path(run)}: not a local run's record ({exc}); remove it if no process of the run is left") \
            from exc


def cancel(run: RunFolder, *, timeout_s: float) -> str:
    """End a local run (see the module's docstring) and record it cancelled; what was done."""
    found = recorded(run)
    if found is None:
        raise UserError(f"{run.path}: not a Slurm run and no {FILE} (no local supervisor recorded its processes)")
    host, sup, kids = found
    if host != socket.gethostname():
        raise UserError(f"{run.path}: its local run is supervised on host {host} (pid {sup.pid}), not this one "
                        f"({socket.gethostname()}); run `baton cancel {run.path}` on {host}")
    deadline = time.monotonic() + timeout_s
    done = "nothing of the run was running"
    ended = sup.alive() or any(k.alive() for k in kids)
    if sup.alive():
        os.kill(sup.pid, signal.SIGTERM)  # answered as Ctrl-C: checkpoint, end every child, record
        done = f"the supervisor (pid {sup.pid}) ended the run"
        _wait([sup, *kids], deadline - min(5.0, timeout_s / 4))
    left = [k for k in kids if k.alive()]
    if left:
        controller = [k for k in left if k.role == "controller"]
        _signal_groups(controller, signal.SIGTERM)  # it checkpoints, as for a preemption
        _wait(controller, deadline - min(2.0, timeout_s / 8))
        _signal_groups(left, signal.SIGKILL)
        _wait(left, deadline)
        done = f"ended {len(left)} process(es) of the run left without their supervisor"
    still = [k.pid for k in [sup, *kids] if k.alive()]
    if still:
        raise UserError(f"{run.path}: pid(s) {', '.join(map(str, still))} still running after {timeout_s:.0f} s; "
                        "retry with a longer --timeout")
    record = RunRecord(run)
    status = record.read().status
    if not ended and status.final:  # an ended run: nothing to cancel, nothing written
        return f"{done}; the run had ended ({status}), nothing recorded"
    record.append(ev.Cancelled(job_id=f"local:{sup.pid}"))  # a completed or failed run stays so
    return done


def _signal_groups(procs: list[Proc], signum: int) -> None:
    """``signum`` to each process's group (each child leads its own), if it is still the run's."""
    for p in procs:
        if p.alive():
            try:
                os.killpg(p.pid, signum)
            except ProcessLookupError:
                pass


def _wait(procs: list[Proc], deadline: float) -> None:
    """Until none of ``procs`` is alive, or ``deadline`` (time.monotonic)."""
    while any(p.alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
