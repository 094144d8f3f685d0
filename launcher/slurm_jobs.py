"""The Slurm jobs Baton submitted: their states, `baton status` lines, cancel, and the run
folder of a job id. Only Slurm's command line tools (squeue, sacct, scancel): `baton
status` and `baton cancel` need no submitit.
"""
from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

from core.errors import UserError
from core.record import events as ev
from core.record.runfolder import RunFolder, read_json, write_json
from core.record.state import RunRecord, Status
from launcher import slurm_states

STATE_CACHE_S = 3.0  # job_states answers from the run folder's cache for this long
CLI_TIMEOUT_S = 30.0

# Slurm job state → Baton's word for it (launcher.slurm_states; anything else is "unknown").
SLURM_TO_BATON = slurm_states.JOB_STATES
ACTIVE = slurm_states.ACTIVE
baton_state = slurm_states.word


def run_cli(args: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a Slurm command line; a missing command or no answer is a UserError."""
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    except FileNotFoundError:
        raise UserError(f"{args[0]}: not found; run on a Slurm login node or use --backend local") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{' '.join(args)}: no answer within {CLI_TIMEOUT_S:.0f} s; is slurmctld up?") from None


def submitit_folder(run: RunFolder) -> Path:
    """submitit's job folder (pickled call, result, the controller's output)."""
    return run.path / "submitit"


def job_record(run: RunFolder) -> Path:
    """slurm.json: the job id, written once at submit (state.json is the controller's)."""
    return run.path / "slurm.json"


def _squeue(job_id: str) -> dict[str, str]:
    proc = run_cli(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%i %T"])  # -t all: ended jobs too
    if proc.returncode != 0:  # "Invalid job id specified" once the job has left the queue
        return {}
    return dict(line.split(None, 1) for line in proc.stdout.splitlines() if len(line.split()) == 2)


def _sacct(job_id: str) -> dict[str, str]:
    proc = run_cli(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State"])
    if proc.returncode != 0:  # no accounting storage
        return {}
    rows = [line.split("|", 1) for line in proc.stdout.splitlines() if "|" in line]
    return {jid.strip(): (state.split() or [""])[0] for jid, state in rows}


def job_states(job_id: str, cache: Path | None = None, max_age_s: float = STATE_CACHE_S) -> dict[str, str]:
    """{"ID+0": Slurm state, "ID+1": ...} from squeue, sacct for components squeue no longer
    lists. With ``cache``, answers younger than ``max_age_s`` come from that file: many
    `baton status` calls cost one squeue."""
    if cache is not None and max_age_s > 0:
        try:
            cached = read_json(cache)
            if cached.get("job_id") == job_id and time.time() - float(cached["time"]) < max_age_s:
                return dict(cached["states"])
        except (FileNotFoundError, UserError, KeyError, ValueError, TypeError):
            pass
    wanted = (f"{job_id}+0", f"{job_id}+1")
    states = {k: v for k, v in _squeue(job_id).items() if k in wanted}
    if len(states) < len(wanted):
        states = {**{k: v for k, v in _sacct(job_id).items() if k in wanted}, **states}
    if cache is not None:
        write_json(cache, {"job_id": job_id, "time": time.time(), "states": states})
    return dict(sorted(states.items()))


def job_id_of(run: RunFolder) -> str | None:
    """The run's Slurm job id (slurm.json, else state.json), None for a run not on Slurm."""
    try:
        data = read_json(job_record(run))
    except (FileNotFoundError, UserError):
        data = None
    job_id = data.get("job_id") if isinstance(data, dict) else None
    if job_id is None:
        job_id = RunRecord(run).read().slurm.job_id
    if job_id is not None and not re.fullmatch(r"\d+", str(job_id)):
        raise UserError(f"{job_record(run)}: job id {job_id!r} is not a Slurm job id (digits); the run folder is "
                        "damaged: find the job with `squeue --me` and cancel it with `scancel`")
    return None if job_id is None else str(job_id)


def _cache(run: RunFolder) -> Path:
    return run.path / ".slurm_states.json"


def slurm_status_lines(run: RunFolder) -> list[str]:
    """Lines for `baton status`: the job id and both components' Slurm states ([] off Slurm)."""
    job_id = job_id_of(run)
    if job_id is None:
        return []
    states = job_states(job_id, _cache(run))
    lines = [f"slurm:    job {job_id}"]
    for name, comp in (("controller", f"{job_id}+0"), ("workers", f"{job_id}+1")):
        s = states.get(comp)
        lines.append(f"  {name + ':':<11} {comp} {s} ({baton_state(s)})" if s else
                     f"  {name + ':':<11} {comp} not known to squeue or sacct")
    recorded = RunRecord(run).read().status
    if states and not any(baton_state(s) in ACTIVE for s in states.values()) and \
            recorded in (Status.SUBMITTED, Status.RUNNING, Status.RESUMING):
        lines.append(f"  note: the job has ended but the controller last recorded {recorded.value!r}; "
                     f"see {run.controller_log} and {submitit_folder(run)}")
    return lines


def cancel(run: RunFolder, timeout_s: float = 60.0) -> dict[str, str]:
    """scancel the leader id (both components end), wait for Slurm to say so, record it."""
    job_id = job_id_of(run)
    if job_id is None:
        raise UserError(f"{run.path}: not a Slurm run (no job id in slurm.json or state.json)")
    states = job_states(job_id, max_age_s=0)
    if states and not any(baton_state(s) in ACTIVE for s in states.values()):
        return states
    proc = run_cli(["scancel", job_id])
    if proc.returncode != 0:
        raise UserError(f"scancel {job_id}: {proc.stderr.strip() or proc.stdout.strip()}")
    deadline = time.monotonic() + timeout_s
    while True:
        states = job_states(job_id, max_age_s=0)
        if not any(baton_state(s) in ACTIVE for s in states.values()):
            break
        if time.monotonic() >= deadline:
            raise UserError(f"scancel {job_id}: still {states} after {timeout_s:.0f} s; see squeue -j {job_id}")
        time.sleep(1.0)
    RunRecord(run).append(ev.Cancelled(job_id=job_id, slurm=states))  # a completed or failed run stays so
    write_json(_cache(run), {"job_id": job_id, "time": time.time(), "states": states})
    return states


def _job_folder(job_id: str) -> str | None:
    """The job's run folder: its comment or working directory (squeue while Slurm still
    holds the job, then sacct; the accounting database stores '"' as '`')."""
    for args in (["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%k"],
                 ["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%Z"],
                 ["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "WorkDir"]):
        proc = run_cli(args)
        found = [x.strip() for x in proc.stdout.splitlines() if x.strip() not in ("", "(null)")] if proc.returncode == 0 else []
        for candidate in dict.fromkeys(c for f in found[:1] for c in (f, f.replace("`", '"'))):
            if (Path(candidate) / "config.yaml").is_file():
                return candidate
    return None


def resolve_status_target(arg: str) -> RunFolder:
    """A run folder path, or a Slurm job id (``123`` or ``123+1``) → its RunFolder.

    The job's ``--comment`` and working directory are its run folder (see render).
    """
    path = Path(arg).expanduser()
    if path.is_dir() or not re.fullmatch(r"\d+(\+\d+)?", arg):
        return RunFolder.open(path.resolve())
    job_id = arg.split("+")[0]
    folder = _job_folder(job_id)
    if folder is None:
        raise UserError(f"job {job_id}: no Baton run folder found via squeue or sacct; pass the run folder instead")
    return RunFolder.open(Path(folder))
