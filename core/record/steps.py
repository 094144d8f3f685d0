"""metrics.jsonl: one ``StepRecord`` per training step, written by the controller.

Read by `baton status --watch`, `baton report`, `baton doctor`, the sweep ledger and the
Prometheus endpoint. On disk a record is a flat JSON object; optional per-rank fields are
left out when the task does not measure them. ``to_data``/``from_data`` are inverses;
readers ignore keys they do not know (a newer Baton may add some) and skip a torn line
(a crash mid-append; the next append starts on a new line).

The file is append-only: nothing is ever deleted from it. A resume that redoes steps
appends a marker line (``supersede``); ``read`` returns the current records (the latest
of each step), and with ``superseded=True`` the redone ones too, flagged.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config.schema import build
from core.config.schema import to_data as _plain
from core.errors import RunFolderError

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
    gen_kv_cache_mb: float | None = None  # the largest KV cache a generator replica allocated in the step's
    # generations (MiB; baton plan --check compares it with the plan's)
    sync_bytes_sent_max: int | None = None  # ... the bytes the rank that sent most sent to other ranks
    sync_bytes_sent_total: int | None = None  # ... and all ranks together (local copies not counted)
    # program: grpo or ppo (core.controller.rl_program), on its RL steps
    reward_mean: float | None = None
    reward_std: float | None = None
    response_length: float | None = None  # the mean; with its min and max over the step's responses
    response_length_min: int | None = None
    response_length_max: int | None = None
    stopped_frac: float | None = None  # of the responses that ended at a stop token (rl.stop, count_to's eot)
    clip_frac: float | None = None
    policy_version: int | None = None  # the policy that generated this step's responses
    staleness: int | None = None  # step - policy_version: how many updates the responses' policy lags (rl.max_staleness)
    kl: float | None = None  # the actor's KL estimate to the reference (rl.kl.estimator): a token mean over
    # the first epoch's responses whatever rl.loss_agg_mode (the loss's KL term is aggregated by the mode)
    kl_coef: float | None = None  # the KL coefficient this step's update used
    entropy: float | None = None  # of the old policy's distribution (scored before the update), token mean
    ratio_max: float | None = None  # the largest new/old probability ratio of the last update epoch
    optimizer_steps: int | None = None  # the actor's optimizer steps: ppo_epochs × mini-batches
    phase_s: dict[str, float] | None = None  # wall seconds per phase: sync, generate, reward, old, ref, values,
    # critic, update
    # program: grpo or ppo with rl.val_every, on the steps after which the policy is validated
    val_reward_mean: float | None = None  # mean reward of greedy responses to the held-out prompts
    val_reward_mean_sampled: float | None = None  # ... of responses sampled at rl.temperature
    # program: ppo, on its RL steps
    value_loss: float | None = None  # the critic's clipped value loss in its first epoch (token mean)
    values_mean: float | None = None  # the critic's values of the step's response tokens before its update
    superseded: bool = False  # read(superseded=True): a record of a step a resume redid (never written)


_FIELDS = {f.name for f in dataclasses.fields(StepRecord)}
OPTIONAL_PER_RANK = ("data_wait_s", "grad_sync_s", "compute_s", "cuda_peak_mb", "rss_peak_mb", "sync_logprob_maxdiff",
                     "gen_kv_cache_mb", "sync_bytes_sent_max", "sync_bytes_sent_total",
                     "reward_mean", "reward_std", "response_length", "response_length_min",
                     "response_length_max", "stopped_frac", "clip_frac", "policy_version", "staleness", "kl", "kl_coef", "entropy", "ratio_max",
                     "optimizer_steps", "phase_s", "value_loss", "values_mean", "val_reward_mean", "val_reward_mean_sampled")


MARKER = "superseded_from"  # a line {"superseded_from": STEP, "epoch": N, "time": T}: a resume redoes STEP on


def to_data(record: StepRecord) -> dict[str, Any]:
    """The JSON object of one line (optional fields that are None left out)."""
    return {k: v for k, v in _plain(record).items()
            if not (v is None and k in OPTIONAL_PER_RANK) and k != "superseded"}


def from_data(data: Any, where: str) -> StepRecord:
    """A record from one JSON object; unknown keys are ignored, bad values are a RunFolderError."""
    if not isinstance(data, dict):
        raise RunFolderError(f"{where}: not a JSON object")
    return build(StepRecord, {k: v for k, v in data.items() if k in _FIELDS}, where, error=RunFolderError)


def append(path: Path, record: StepRecord) -> None:
    """Add one record (one line; the controller is the only writer)."""
    _append_line(path, json.dumps(to_data(record)))


def supersede(path: Path, step: int, epoch: int) -> list[StepRecord]:
    """A resume from step ``step`` redoes the steps past it: their records stay, marked
    superseded by a marker line (``{"superseded_from": step, "epoch": epoch, "time": ...}``)
    when there are any. Returns the current records before ``step``."""
    current = read(path)
    if any(r.step >= step for r in current):
        _append_line(path, json.dumps({MARKER: step, "epoch": epoch, "time": time.time()}))
    return [r for r in current if r.step < step]


def _append_line(path: Path, line: str) -> None:
    """One line at the end; a torn last line (a crash mid-append) stays alone, never glued to it."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return
    lines = raw.split(b"\n")
    for n, line in enumerate(lines, start=1):
        if line.strip():
            yield n, line


def entries(path: Path, *, strict: bool = False) -> list[tuple[dict[str, Any], bool]]:
    """Every record's JSON object in file order, with whether it is superseded: a marker
    line supersedes the records before it at its step or later; of two records of one step,
    the earlier. A torn line (a crash mid-append: no closing brace) is skipped with a
    warning; another bad line is skipped too unless ``strict`` (then a RunFolderError names it)."""
    out: list[list[Any]] = []
    lines = list(_lines(path))
    last = lines[-1][0] if lines else 0
    for n, line in lines:
        try:
            data = json.loads(line)
            if isinstance(data, dict) and MARKER in data:
                for e in out:
                    e[1] = e[1] or e[0]["step"] >= int(data[MARKER])
                continue
            from_data(data, f"{path} line {n}")
        except (ValueError, TypeError, RecursionError, RunFolderError) as exc:
            if not line.rstrip().endswith(b"}"):
                log.warning("%s line %d: skipped a torn %sline (%d bytes)", path, n,
                            "last " if n == last else "", len(line))
                continue
            why = str(exc) if isinstance(exc, RunFolderError) else f"{path} line {n}: {exc}"
            if strict:
                raise RunFolderError(why) from None
            log.warning("skipped: %s", why)
            continue
        out.append([data, False])
    latest = {e[0]["step"]: i for i, e in enumerate(out) if not e[1]}
    return [(e[0], e[1] or latest.get(e[0]["step"]) != i) for i, e in enumerate(out)]


def read(path: Path, *, strict: bool = False, superseded: bool = False) -> list[StepRecord]:
    """The current records (one per step: the latest), oldest first; ``superseded``: every
    record, those a resume redid with ``superseded=True``. See ``entries`` for bad lines."""
    return [dataclasses.replace(from_data(d, str(path)), superseded=True) if gone else from_data(d, str(path))
            for d, gone in entries(path, strict=strict) if superseded or not gone]
