"""metrics.jsonl: one ``StepRecord`` per training step, written by the controller.

Read by `baton status --watch`, `baton report`, `baton doctor`, the sweep ledger and the
Prometheus endpoint. On disk a record is a flat JSON object; optional per-rank fields are
left out when the task does not measure them. ``to_data``/``from_data`` are inverses;
readers ignore keys they do not know (a newer Baton may add some) and skip a torn last
line (a crash mid-append).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config.schema import build
from core.config.schema import to_data as _plain
from core.errors import RunFolderError
from core.record.runfolder import write_atomic

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One step as the controller saw it. Per-rank lists are in rank order."""

    step: int  # 0-based index of the step
    loss: float  # mean over the data-parallel replicas
    grad_norm: float | None = None
    lr: float | None = None
    tokens: int = 0  # tokens of the global batch
    tokens_per_s: float = 0.0
    step_time_s: float = 0.0  # wall time of the step's call, as the controller measured it
    time: float = 0.0  # unix seconds when it was recorded
    rank_step_time_s: tuple[float, ...] = ()
    rss_mb: tuple[float, ...] = ()
    data_wait_s: tuple[float, ...] | None = None
    grad_sync_s: tuple[float, ...] | None = None
    compute_s: tuple[float, ...] | None = None  # per rank: the step less data wait and gradient reduction
    cuda_peak_mb: tuple[float, ...] | None = None
    rss_peak_mb: tuple[float, ...] | None = None  # per rank: peak resident memory during the step
    sync_logprob_maxdiff: float | None = None  # after a generator's weight sync at this step
    # program: grpo or ppo (core.controller.rl_program), on its RL steps
    reward_mean: float | None = None
    reward_std: float | None = None
    response_length: float | None = None
    clip_frac: float | None = None
    policy_version: int | None = None  # the policy that generated this step's responses
    kl: float | None = None  # the actor's KL estimate to the reference (rl.kl.estimator), token mean
    kl_coef: float | None = None  # the KL coefficient this step's update used
    entropy: float | None = None  # of the actor's distribution over response tokens, token mean
    ratio_max: float | None = None  # the largest new/old probability ratio of the last update epoch
    phase_s: dict[str, float] | None = None  # wall seconds per phase: sync, generate, reward, old, ref, values,
    # critic, update
    # program: ppo, on its RL steps
    value_loss: float | None = None  # the critic's clipped value loss in its first epoch (token mean)
    values_mean: float | None = None  # the critic's values of the step's response tokens before its update


_FIELDS = {f.name for f in dataclasses.fields(StepRecord)}
OPTIONAL_PER_RANK = ("data_wait_s", "grad_sync_s", "compute_s", "cuda_peak_mb", "rss_peak_mb", "sync_logprob_maxdiff",
                     "reward_mean", "reward_std", "response_length", "clip_frac", "policy_version", "kl", "kl_coef", "entropy", "ratio_max",
                     "phase_s", "value_loss", "values_mean")


def to_data(record: StepRecord) -> dict[str, Any]:
    """The JSON object of one line (optional fields that are None left out)."""
    return {k: v for k, v in _plain(record).items() if not (v is None and k in OPTIONAL_PER_RANK)}


def from_data(data: Any, where: str) -> StepRecord:
    """A record from one JSON object; unknown keys are ignored, bad values are a RunFolderError."""
    if not isinstance(data, dict):
        raise RunFolderError(f"{where}: not a JSON object")
    return build(StepRecord, {k: v for k, v in data.items() if k in _FIELDS}, where, error=RunFolderError)


def append(path: Path, record: StepRecord) -> None:
    """Add one record (one line; the controller is the only writer)."""
    with path.open("a") as f:
        f.write(json.dumps(to_data(record)) + "\n")


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return
    lines = raw.split(b"\n")
    for n, line in enumerate(lines, start=1):
        if line.strip():
            yield n, line


def read(path: Path, *, strict: bool = False) -> list[StepRecord]:
    """Every record, oldest first. A torn last line is skipped with a warning; another bad line
    is skipped too unless ``strict`` (then a RunFolderError names it)."""
    out = []
    lines = list(_lines(path))
    for i, (n, line) in enumerate(lines):
        try:
            out.append(from_data(json.loads(line), f"{path} line {n}"))
        except (ValueError, RunFolderError) as exc:
            if i == len(lines) - 1 and not line.endswith(b"}"):
                log.warning("%s: skipped a torn last line (%d bytes)", path, len(line))
            else:
                why = str(exc) if isinstance(exc, RunFolderError) else f"{path} line {n}: {exc}"
                if strict:
                    raise RunFolderError(why) from None
                log.warning("skipped: %s", why)
    return out


def keep_before(path: Path, step: int) -> list[StepRecord]:
    """After a resume from step ``step``, the steps past it are redone: drop their records.
    Returns what is kept (a torn last line goes too)."""
    if not path.exists():
        return []
    kept = [r for r in read(path) if r.step < step]
    write_atomic(path, "".join(json.dumps(to_data(r)) + "\n" for r in kept))
    return kept

