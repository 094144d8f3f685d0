"""Small helpers for tests that talk to the local Slurm cluster (tests/cluster/).

Every wait here is a bounded poll with a deadline: a timeout says what was awaited and
what was last seen. Nothing sleeps to synchronise outside such a poll loop.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from tests.helpers import REPO, read_state

T = TypeVar("T")

CLI_TIMEOUT_S = 20.0
POLL_INTERVAL_S = 0.25
# Node states that count as "up" (the trailing flags * ~ # ! % $ @ ^ - mean trouble or change).
UP_STATES = {"idle", "mix", "mixed", "alloc", "allocated", "comp", "completing", "plnd", "planned"}
# Job states after which a job will not run again by itself.
FINAL_STATES = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}


class SlurmCommandError(RuntimeError):
    pass


def run(args: list[str], timeout: float = CLI_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    """Runs a Slurm CLI command, capturing text output, with a timeout."""
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise SlurmCommandError(
            f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def wait_until(
    probe: Callable[[], T],
    done: Callable[[T], bool],
    timeout: float,
    awaited: str,
    interval: float = POLL_INTERVAL_S,
) -> T:
    """Polls probe() until done(value) or the deadline; returns the last value.

    On timeout raises TimeoutError naming what was awaited and the last value seen
    (or the last exception the probe raised).
    """
    deadline = time.monotonic() + timeout
    seen: object = "<nothing yet>"
    while True:
        try:
            value = probe()
            seen = value
            if done(value):
                return value
        except (SlurmCommandError, subprocess.TimeoutExpired, OSError) as exc:
            seen = f"<probe failed: {exc}>"
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {awaited}; last seen: {seen!r}")
        time.sleep(interval)


# ----------------------------------------------------------------------------- cluster


def node_states() -> dict[str, str]:
    """{node name: sinfo short state}, e.g. {"node1": "idle", "node2": "mix"}."""
    out = run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout
    states: dict[str, str] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


def cluster_problem(nodes: Iterable[str] = ("node1", "node2")) -> str | None:
    """None when sinfo answers and every node is up; otherwise what is wrong."""
    try:
        states = node_states()
    except FileNotFoundError:
        return "sinfo is not installed"
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    except SlurmCommandError as exc:
        return str(exc)
    bad = {n: states.get(n, "<missing>") for n in nodes if states.get(n) not in UP_STATES}
    if bad:
        return f"nodes not up: {bad} (sinfo saw {states})"
    return None


# -------------------------------------------------------------------------------- jobs


def sbatch(script: Path | str, *args: str) -> int:
    """Submits a batch script file; returns the (leader) job id."""
    out = run(["sbatch", "--parsable", *args, str(script)]).stdout.strip()
    return int(out.split(";")[0].split("+")[0])


def scancel(job_ids: Iterable[int]) -> None:
    ids = [str(j) for j in job_ids]
    if ids:
        run(["scancel", *ids], check=False)


def squeue_states(job_id: int) -> dict[str, str]:
    """{"ID" or "ID+N": state} from squeue; empty once the job has left the queue."""
    proc = run(["squeue", "-h", "-j", str(job_id), "-o", "%i %T"], check=False)
    if proc.returncode != 0:
        # squeue exits 1 with "Invalid job id specified" once a job is purged.
        return {}
    states = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


def sacct_states(job_id: int, duplicates: bool = False) -> list[tuple[str, str]]:
    """[(JobID, State)] allocation rows from sacct, e.g. [("7+0", "COMPLETED"), ...].

    With duplicates=True, earlier runs of a requeued job are listed as well (sacct -D).
    A state like "CANCELLED by 0" is reduced to its first word.
    """
    args = ["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", "JobID,State"]
    if duplicates:
        args.append("-D")
    rows = []
    for line in run(args).stdout.splitlines():
        if "|" in line:
            jid, state = line.split("|", 1)
            rows.append((jid.strip(), state.split()[0] if state.split() else ""))
    return rows


def wait_for_sacct(job_id: int, wanted: dict[str, str] | str, timeout: float) -> dict[str, str]:
    """Waits until sacct shows the wanted state(s).

    wanted: one state for every row (e.g. "COMPLETED"), or {JobID: state}
    (e.g. {"7+0": "COMPLETED", "7+1": "COMPLETED"}). Returns {JobID: state}.
    """

    def done(states: dict[str, str]) -> bool:
        if isinstance(wanted, str):
            return bool(states) and all(s == wanted for s in states.values())
        return all(states.get(k) == v for k, v in wanted.items())

    return wait_until(
        lambda: dict(sacct_states(job_id)),
        done,
        timeout,
        awaited=f"sacct to show job {job_id} as {wanted}",
    )


def wait_for_squeue(job_id: int, wanted: str, timeout: float) -> dict[str, str]:
    """Waits until every squeue row of the job is in state `wanted` (e.g. RUNNING)."""
    return wait_until(
        lambda: squeue_states(job_id),
        lambda states: bool(states) and all(s == wanted for s in states.values()),
        timeout,
        awaited=f"squeue to show job {job_id} as {wanted}",
    )


def job_field(job_id: int, field: str) -> str | None:
    """A field of `scontrol show job` (e.g. "Restarts", "JobState"); None if absent."""
    out = run(["scontrol", "-o", "show", "job", str(job_id)]).stdout
    first = out.splitlines()[0] if out else ""
    for token in first.split():
        key, _, value = token.partition("=")
        if key == field:
            return value
    return None


def wait_for_file(path: Path, timeout: float, awaited: str | None = None) -> str:
    """Waits until a file exists and is non-empty; returns its text."""
    return wait_until(
        lambda: path.read_text() if path.exists() else "",
        lambda text: bool(text),
        timeout,
        awaited=awaited or f"file {path}",
    )


def read_env_file(path: Path) -> dict[str, str]:
    """Parses KEY=VALUE lines."""
    env = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            env[key] = value
    return env


# ------------------------------------------------------------------------------- runs


def submit(root: Path, jobs: list[int], experiment: str, *args: str,
           env: dict[str, str] | None = None) -> tuple[int, Path]:
    """``baton submit EXPERIMENT runs_root=ROOT ARGS --backend slurm``; the job id is added
    to ``jobs`` (the slurm_jobs fixture scancels them). Returns (job id, run folder)."""
    cmd = [sys.executable, "-m", "launcher.cli", "submit", experiment, f"runs_root={root}", *args,
           "--backend", "slurm"]
    # The job inherits this environment (sbatch --export=ALL), test knobs included.
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    assert res.returncode == 0, res.stdout + res.stderr
    job = int(re.search(r"submitted job (\d+)", res.stdout).group(1))  # type: ignore[union-attr]
    jobs.append(job)
    return job, Path(re.search(r"^run folder: (.+)$", res.stdout, re.M).group(1))  # type: ignore[union-attr]


def finished(run: Path, job: int, within_s: float) -> dict[str, Any]:
    """Waits until the run's state.json says completed, failed or stopped; returns that state."""
    return wait_until(lambda: read_state(run), lambda s: s.get("status") in ("completed", "failed", "stopped"),
                      within_s, awaited=f"job {job} to finish its run in {run}")


def preempt_node2(shared_tmp: Path, jobs: list[int]) -> None:
    """Submit a job on ``high`` that needs all of node2: Slurm preempts what runs there on ``low``."""
    high = shared_tmp / "high.sbatch"
    high.write_text(textwrap.dedent("""\
        #!/bin/bash
        #SBATCH --job-name=baton-test-high
        #SBATCH --partition=high
        #SBATCH --nodes=1
        #SBATCH --ntasks=16
        #SBATCH --gpus-per-node=8
        #SBATCH --exclusive
        #SBATCH --time=5
        #SBATCH --output=/dev/null
        sleep 1
        """))
    jobs.append(sbatch(high))
