"""The sweep ledger: one JSON file next to the sweep's runs, readable from any login node.

    <runs_root>/<name>/
      sweep.yaml     the sweep file as submitted (a copy)
      sweep.json     this ledger
      <run id>/      one run folder per point (core.record.runfolder)

``sweep.json``::

    {"version": 1, "name": "toy-lr-seed", "sweep_file": "/abs/sweep.yaml", "created": 1.7e9,
     "backend": "slurm", "metric": "loss", "mode": "min", "max_running": 2,
     "base": {...the base config data, overrides applied...},
     "points": [{"index": 0, "params": {"optimizer.lr": 0.05, "seed": 1},
                 "run_id": "lr0.05_seed1-1a2b3c4d", "run_dir": "/abs/.../lr0.05_seed1-1a2b3c4d",
                 "backend": "slurm", "job_id": "123", "after": null, "submitted": 1.7e9,
                 "submissions": 1, "state": "queued", "pid": null, "host": null}, ...]}

Only ``baton sweep submit`` and ``resume`` write it, atomically (core.record.runfolder.write_json),
each change a read-modify-write of one point under ``sweep.lock`` (core.record.lock: flock,
fcntl or a lease file, as the filesystem allows), so two submitters on two login nodes lose
neither's points; ``status`` and ``results`` only read it. A point's live state is derived on each read from
its run's ``state.json`` and the Slurm job state (``refresh``); ``state`` in the file is
what the writer last knew.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from core.config.schema import build, to_data
from core.errors import RunFolderError, UserError
from core.record import steps
from core.record.lock import exclusive
from core.record.runfolder import RunFolder, read_json, write_atomic, write_json
from core.record.state import RunRecord, RunState
from launcher import slurm_states

log = logging.getLogger(__name__)

VERSION = 1
LEDGER_NAME = "sweep.json"
COPY_NAME = "sweep.yaml"
LOCK_NAME = "sweep.lock"

UNSUBMITTED, QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED = (
    "unsubmitted", "queued", "running", "completed", "failed", "cancelled")
STATES = (UNSUBMITTED, QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED)
RESUBMIT = (UNSUBMITTED, FAILED, CANCELLED)   # what `baton sweep resume` submits again
ACTIVE = (QUEUED, RUNNING)

# Baton's word for a Slurm job state (launcher.slurm_states) → the point's state. A job that
# completed while its run did not (the run's own word comes first: ``point_state``) failed.
POINT_STATES = {
    **dict.fromkeys(("pending", "held", "requeued"), QUEUED),
    **dict.fromkeys(("running", "suspended", "ending"), RUNNING),
    "cancelled": CANCELLED,
    **dict.fromkeys(("completed", "failed", "timeout", "preempted"), FAILED),
}

# {job id: run folder} → {job id: Slurm state of the leader}; ids Slurm does not know are left out.
JobStateLookup = Callable[[dict[str, Path]], dict[str, str]]


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One point as the ledger records it."""

    index: int
    params: dict[str, Any]
    run_id: str
    run_dir: str
    backend: str | None = None
    job_id: str | None = None
    after: str | None = None        # the job this one waits for (max_running chains)
    submitted: float | None = None
    submissions: int = 0
    state: str = UNSUBMITTED
    pid: int | None = None          # local backend: the sweep process running this point
    host: str | None = None


@dataclass(frozen=True, kw_only=True)
class Ledger:
    """The whole sweep: what was asked for and where each point stands."""

    version: int = VERSION
    name: str
    sweep_file: str
    created: float
    backend: str
    metric: str = "loss"
    mode: str = "min"
    max_running: int | None = None
    base: dict[str, Any] = field(default_factory=dict)
    points: list[Entry] = ()  # type: ignore[assignment]

    def with_entry(self, entry: Entry) -> Ledger:
        """A copy with the point at ``entry.index`` replaced."""
        return replace(self, points=tuple(entry if e.index == entry.index else e for e in self.points))


def ledger_path(sweep_dir: Path) -> Path:
    return sweep_dir / LEDGER_NAME


def write_ledger(sweep_dir: Path, ledger: Ledger) -> None:
    """Replace ``sweep.json`` atomically (a reader sees the old or the new ledger), under sweep.lock."""
    with exclusive(Path(sweep_dir) / LOCK_NAME):
        write_json(ledger_path(sweep_dir), to_data(ledger))


def store_entry(sweep_dir: Path, entry: Entry) -> Ledger:
    """Replace one point of ``sweep.json`` under sweep.lock: the ledger on disk read, the point
    changed, written back (another submitter's changes to other points are kept). The ledger."""
    with exclusive(Path(sweep_dir) / LOCK_NAME):
        ledger = read_ledger(sweep_dir).with_entry(entry)
        write_json(ledger_path(sweep_dir), to_data(ledger))
    return ledger


def write_copy(sweep_dir: Path, text: str) -> None:
    write_atomic(sweep_dir / COPY_NAME, text)


def read_ledger(sweep_dir: Path) -> Ledger:
    """The ledger of a sweep folder; a folder without one is a one-line UserError."""
    path = ledger_path(Path(sweep_dir).expanduser())
    try:
        data = read_json(path)
    except FileNotFoundError:
        raise UserError(f"{sweep_dir}: not a sweep folder (no {LEDGER_NAME}); pass the folder "
                        "`baton sweep submit` printed") from None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        found = data.get("version") if isinstance(data, dict) else None
        raise UserError(f"{path}: ledger version {found!r}, this Baton reads version {VERSION}")
    try:
        return build(Ledger, data)
    except ValueError as exc:
        raise UserError(f"{path}: damaged ledger ({exc})") from None


# --- live state ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PointStatus:
    """A point's live state: ledger entry + run state.json + Slurm + last metrics."""

    entry: Entry
    state: str
    step: int = 0
    total_steps: int | None = None
    last_loss: float | None = None
    restarts: int = 0
    reason: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # the last metrics.jsonl record's numbers
    metric: float | None = None                              # the ranking metric from it


def point_state(entry: Entry, run_status: str | None, job_state: str | None, *, local_alive: bool | None) -> str:
    """Combine what the ledger, the run folder and Slurm know into one point state.

    The run's own ``completed``/``failed`` wins; then Slurm's state; then the ledger.
    """
    if run_status == "completed":
        return COMPLETED
    if run_status == "failed":
        return FAILED
    if entry.backend == "local":
        if entry.state == RUNNING and local_alive is False:
            return CANCELLED  # the foreground sweep process is gone (Ctrl-C, killed)
        return entry.state
    if entry.job_id is None:
        return UNSUBMITTED
    if job_state is not None:
        return POINT_STATES.get(slurm_states.word(job_state), entry.state)
    if run_status == "running":
        return RUNNING
    if run_status == "cancelled":  # launcher.slurm_jobs.cancel records it
        return CANCELLED
    return entry.state if entry.state != UNSUBMITTED else QUEUED


def refresh(ledger: Ledger, job_states: JobStateLookup | None) -> list[PointStatus]:
    """Every point's live state, in point order; a Slurm lookup failure falls back to files.

    The job id the run folder records (``launcher.slurm.submit`` writes it) wins over the
    ledger's: a submitter interrupted between sbatch and the ledger write loses nothing.
    """
    runs = [_read_run_state(Path(e.run_dir)) for e in ledger.points]
    entries = [_with_recorded_job(e, run) for e, run in zip(ledger.points, runs, strict=True)]
    ids = {e.job_id: Path(e.run_dir) for e in entries if e.job_id is not None and e.backend == "slurm"}
    slurm: dict[str, str] = {}
    if ids and job_states is not None:
        try:
            slurm = job_states(ids)
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("Slurm job states unavailable (%s); states come from the run folders", exc)
    return [_point_status(e, run, slurm.get(e.job_id) if e.job_id else None, ledger.metric)
            for e, run in zip(entries, runs, strict=True)]


def _point_status(entry: Entry, run: RunState | None, job_state: str | None, metric: str) -> PointStatus:
    metrics = last_metrics(Path(entry.run_dir) / "metrics.jsonl")
    state = point_state(entry, run.status if run is not None else None, job_state, local_alive=_local_alive(entry))
    run = run if run is not None else RunState()
    return PointStatus(entry=entry, state=state, step=run.step, total_steps=run.total_steps or None,
                       last_loss=run.last_loss, restarts=run.restarts, reason=run.reason or None,
                       metrics=metrics, metric=metrics.get(metric))


def _with_recorded_job(entry: Entry, run: RunState | None) -> Entry:
    recorded = run.slurm.job_id if run is not None else None
    if not recorded or entry.backend == "local" or recorded == entry.job_id:
        return entry
    return replace(entry, backend="slurm", job_id=recorded,
                   state=QUEUED if entry.state == UNSUBMITTED else entry.state)


def _read_run_state(run_dir: Path) -> RunState | None:
    """The run's state; None when it has none yet (or a damaged one, logged)."""
    record = RunRecord(RunFolder(run_dir))
    if not record.exists():
        return None
    try:
        return record.read()
    except RunFolderError as exc:
        log.warning("%s", exc)
        return None


def _local_alive(entry: Entry) -> bool | None:
    """Whether the local sweep process running ``entry`` lives; None if it ran on another host."""
    if entry.pid is None or entry.host != socket.gethostname():
        return None
    try:
        os.kill(entry.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def last_metrics(path: Path, *, tail_bytes: int = 65536) -> dict[str, float]:
    """The numeric fields of the last complete record of ``metrics.jsonl`` (empty if none).

    Only the fields the line holds: a field it lacks is not reported as its default."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - tail_bytes))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return {}
    for raw in reversed(lines):
        try:
            data = json.loads(raw)
            record = steps.from_data(data, str(path))
        except (ValueError, RecursionError):  # a line being appended right now (RunFolderError is a ValueError)
            continue
        return {k: float(v) for k, v in steps.to_data(record).items()
                if k in data and isinstance(v, int | float) and not isinstance(v, bool)}
    return {}


def counts(rows: list[PointStatus]) -> dict[str, int]:
    """Points per state, every state listed (in lifecycle order)."""
    out = dict.fromkeys(STATES, 0)
    for r in rows:
        out[r.state] = out.get(r.state, 0) + 1
    return out


def ranked(rows: list[PointStatus], mode: str) -> list[PointStatus]:
    """Points with a metric, best first (ties by point index); then those without, by index."""
    sign = 1.0 if mode == "min" else -1.0
    with_metric = sorted((r for r in rows if r.metric is not None),
                         key=lambda r: (sign * r.metric, r.entry.index))  # type: ignore[operator]
    return with_metric + [r for r in rows if r.metric is None]


def best(rows: list[PointStatus], mode: str, *, completed_only: bool = False) -> PointStatus | None:
    """The best point by the sweep's metric (among completed points if asked); None if none has one."""
    pool = [r for r in rows if r.metric is not None and (r.state == COMPLETED or not completed_only)]
    ordered = ranked(pool, mode)
    return ordered[0] if ordered else None


# --- tables ---------------------------------------------------------------------------------


def _keys(ledger: Ledger) -> list[str]:
    out: list[str] = []
    for e in ledger.points:
        out.extend(k for k in e.params if k not in out)
    return out


def fmt_value(v: Any) -> str:
    """A parameter or metric for a table cell."""
    return "-" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v)


def describe(entry: Entry) -> str:
    """``key=value, ...`` of a point's parameters."""
    return ", ".join(f"{k}={fmt_value(v)}" for k, v in entry.params.items())


def table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
                     for line in [header, *rows])


def count_line(rows: list[PointStatus]) -> str:
    """``3 completed, 1 running (of 4)``: the non-zero counts per state."""
    c = counts(rows)
    return ", ".join(f"{n} {s}" for s, n in c.items() if n) + f" (of {len(rows)})"


def _best_line(ledger: Ledger, best: PointStatus | None, label: str) -> str:
    if best is None:
        return f"{label}: none yet (no point has reported {ledger.metric})"
    return (f"{label}: point {best.entry.index} ({describe(best.entry)}) {ledger.metric} {best.metric:.6g}"
            f" [{best.state}]  {best.entry.run_dir}")


def format_status(ledger: Ledger, rows: list[PointStatus]) -> str:
    """The status table: point, parameters, state, step/total, last loss, restarts, job."""
    keys = _keys(ledger)
    header = ["point", *keys, "state", "step", "loss", "restarts", "job"]
    body = [[str(r.entry.index), *(fmt_value(r.entry.params.get(k)) for k in keys), r.state,
             f"{r.step}/{r.total_steps if r.total_steps is not None else '?'}", fmt_value(r.last_loss),
             str(r.restarts), r.entry.job_id or "-"] for r in rows]
    return "\n".join([f"sweep {ledger.name}: {len(rows)} points, backend {ledger.backend}",
                      table(header, body), f"states: {count_line(rows)}",
                      _best_line(ledger, best(rows, ledger.mode), "best so far")])


def _metric_keys(ledger: Ledger, rows: list[PointStatus]) -> list[str]:
    found = {k for r in rows for k in r.metrics if k not in ("step", "time")}
    return [ledger.metric, *sorted(found - {ledger.metric})]


def format_results(ledger: Ledger, rows: list[PointStatus]) -> str:
    """Final metrics per point, best first, and the best completed point."""
    keys, metrics = _keys(ledger), _metric_keys(ledger, rows)[:5]
    header = ["rank", "point", *keys, "state", "step", *metrics]
    ordered = ranked(rows, ledger.mode)
    body = [[str(n), str(r.entry.index), *(fmt_value(r.entry.params.get(k)) for k in keys), r.state,
             f"{r.step}/{r.total_steps if r.total_steps is not None else '?'}",
             *(fmt_value(r.metrics.get(m)) for m in metrics)] for n, r in enumerate(ordered, 1)]
    top = best(rows, ledger.mode, completed_only=True)
    return "\n".join([f"sweep {ledger.name}: {ledger.metric} ({ledger.mode}), {count_line(rows)}",
                      table(header, body), _best_line(ledger, top, "best")])


def results_csv(ledger: Ledger, rows: list[PointStatus]) -> str:
    """The results as CSV, best first: every parameter and every numeric final metric."""
    keys, metrics = _keys(ledger), _metric_keys(ledger, rows)
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["rank", "point", "run_id", *keys, "state", "step", "total_steps", *metrics, "run_dir"])
    for n, r in enumerate(ranked(rows, ledger.mode), 1):
        w.writerow([n, r.entry.index, r.entry.run_id, *(r.entry.params.get(k, "") for k in keys), r.state,
                    r.step, r.total_steps, *(r.metrics.get(m, "") for m in metrics), r.entry.run_dir])
    return out.getvalue()
