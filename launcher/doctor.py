"""Known symptom → cause rules over a run's metrics.jsonl records and state.json.

Pure functions, no third-party imports: ``diagnose(records, state)`` returns the findings
of every rule, most severe first. Each rule reads only fields it knows and is silent when
the records do not carry them (a toy run has no ``data_wait_s``), so a rule never fires on
missing data. Records are ``core.record.steps.StepRecord`` (per-rank tuples are indexed by rank):

    step, loss, step_time_s (controller wall), rank_step_time_s[], rss_mb[],
    optional: data_wait_s[], grad_sync_s[], compute_s[], cuda_peak_mb[]

The straggler rule reads each rank's compute time where the records carry it (a synchronous
step's wall time is the slowest rank's on every rank: the others wait in the reduction).

The first ``WARMUP_FRACTION`` of steps (at least one) is left out of every rule: compile,
allocator and cache warm-up make the first steps unlike the rest.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from core.record.state import RunState, Status
from core.record.steps import StepRecord

INFO, WARNING, ERROR = "info", "warning", "error"
_ORDER = {ERROR: 0, WARNING: 1, INFO: 2}

WARMUP_FRACTION = 0.1
MIN_STEPS = 5                  # fewer steps after warm-up: too little to judge
DATA_WAIT_SHARE = 0.25         # data waits above this share of the step: loader-bound
GRAD_SYNC_S = 0.5              # gradient all-reduce above this: bucket size worth tuning
STRAGGLER_SCORE = 1.5          # a rank this much slower than the median ...
STRAGGLER_MIN_S = 0.005        # ... and at least this much slower (microsecond steps jitter by 2x)
SUSTAINED = 0.5                # ... in at least this share of the steps (also memory)
MEMORY_SPREAD = 0.25           # (max - min) / median of memory across ranks or steps
MEMORY_MIN_MB = 64.0           # spreads below this are noise, whatever the ratio


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One diagnosis: how bad, what, the numbers that show it, and what to do."""

    severity: str  # INFO, WARNING or ERROR
    title: str
    evidence: str
    advice: str


# --- helpers ------------------------------------------------------------------------------
def _floats(value: Sequence[float] | None) -> list[float] | None:
    """A per-rank field as a list, or None when the record does not carry it."""
    if not value:
        return None
    return [float(v) for v in value]


def _steady(records: Sequence[StepRecord]) -> list[StepRecord]:
    """The records after warm-up."""
    skip = max(1, int(len(records) * WARMUP_FRACTION)) if len(records) > MIN_STEPS else 0
    return list(records[skip:])


def _where(rank: int, state: RunState) -> str:
    """'rank 3 (node n2, host h2)', from the state's ``ranks`` when they are there."""
    for info in state.ranks:
        if info.rank == rank:
            parts = [f"node {info.node}" if info.node else "", f"host {info.host}" if info.host else ""]
            parts = [p for p in parts if p]
            return f"rank {rank} ({', '.join(parts)})" if parts else f"rank {rank}"
    return f"rank {rank}"


def _stage_of(rank: int, state: RunState) -> int:
    """The pipeline stage of a rank (``ranks[].coords.pp``), 0 when unknown."""
    for info in state.ranks:
        if info.rank == rank:
            return info.coords.pp
    return 0


# --- rules --------------------------------------------------------------------------------
def data_loading(records: Sequence[StepRecord], state: RunState) -> list[Finding]:
    """Ranks wait for batches a large share of each step: the loader, not the GPU, sets the pace."""
    shares: list[float] = []
    worst: tuple[float, int, float, float] = (0.0, 0, 0.0, 0.0)  # share, rank, wait, step
    for rec in _steady(records):
        waits = _floats(rec.data_wait_s)
        wall = rec.step_time_s
        if waits is None or not wall > 0:  # also skips a NaN wall
            continue
        shares.append(statistics.fmean(waits) / wall)
        rank = max(range(len(waits)), key=waits.__getitem__)
        if waits[rank] / wall > worst[0]:
            worst = (waits[rank] / wall, rank, waits[rank], float(wall))
    if len(shares) < MIN_STEPS or statistics.median(shares) < DATA_WAIT_SHARE:
        return []
    share = statistics.median(shares)
    return [Finding(
        severity=WARNING,
        title="data loading is the bottleneck",
        evidence=(f"ranks waited {share:.0%} of each step for data (median over {len(shares)} steps; "
                  f"compute share {1 - share:.0%}); worst: {_where(worst[1], state)} waited "
                  f"{worst[2]:.3f} s of a {worst[3]:.3f} s step"),
        advice=("use the memory-mapped HDF5 dataset: `baton data build INPUTS --output PATH`, then "
                "data.kind=hdf5 data.path=PATH; tokenizing or reading text inside the step cannot keep up"),
    )]


def gradient_sync(records: Sequence[StepRecord], state: RunState) -> list[Finding]:
    """Gradient all-reduce takes over GRAD_SYNC_S per step by itself: a step counts the rank that
    spent least in it (the last to arrive waits for no one), so peers waiting there for a
    straggler are the straggler rule's finding, not this one."""
    per_step = [s for rec in _steady(records) if (s := _floats(rec.grad_sync_s)) is not None]
    syncs = [min(s) for s in per_step]
    if len(syncs) < MIN_STEPS or statistics.median(syncs) <= GRAD_SYNC_S:
        return []
    return [Finding(
        severity=WARNING,
        title="gradient synchronisation is slow",
        evidence=(f"gradient all-reduce took {statistics.median(syncs) * 1000:.0f} ms per step (median over "
                  f"{len(syncs)} steps of the rank that waited least; max {max(map(max, per_step)) * 1000:.0f} ms), "
                  f"over {GRAD_SYNC_S * 1000:.0f} ms"),
        advice=("tune the all-reduce bucket size (Megatron DDP bucket_size: larger buckets, fewer all-reduces) "
                "and overlap the reduce with the backward pass (overlap_grad_reduce); check the interconnect"),
    )]


def _memory_series(records: Sequence[StepRecord]) -> tuple[str, list[list[float]]]:
    """Per-step per-rank memory in MiB: CUDA peak when the records carry it, else RSS."""
    for key in ("cuda_peak_mb", "rss_mb"):
        rows = [v for rec in records if (v := _floats(getattr(rec, key))) is not None and any(x > 0 for x in v)]
        if rows:
            return key, rows
    return "", []


def memory_variation(records: Sequence[StepRecord], state: RunState) -> list[Finding]:
    """Memory that differs strongly between ranks of one pipeline stage, or from step to step."""
    key, rows = _memory_series(_steady(records))
    if len(rows) < MIN_STEPS:
        return []
    what = "CUDA peak memory" if key == "cuda_peak_mb" else "resident memory"
    evidence: list[str] = []
    n = min(len(r) for r in rows)
    # Across ranks: compare ranks of the same pipeline stage only (stages hold different layers).
    stages: dict[int, list[int]] = {}
    for rank in range(n):
        stages.setdefault(_stage_of(rank, state), []).append(rank)
    spreads = []
    for row in rows:
        for ranks in stages.values():
            vals = [row[r] for r in ranks]
            if len(vals) > 1:
                spreads.append((max(vals) - min(vals), statistics.median(vals), ranks[vals.index(max(vals))]))
    wide = [s for s in spreads if s[0] >= MEMORY_MIN_MB and s[0] / max(s[1], 1e-9) > MEMORY_SPREAD]
    if spreads and len(wide) >= SUSTAINED * len(rows):
        top = max(wide, key=lambda s: s[0])
        evidence.append(f"{what} differs by up to {top[0]:.0f} MiB across ranks of one stage "
                        f"({top[0] / top[1]:.0%} of the median; highest {_where(top[2], state)}) in {len(wide)} steps")
    # Across steps: one rank going up and down (a steady climb is a leak, a different finding).
    for rank in range(n):
        series = [row[rank] for row in rows]
        lo, hi, med = min(series), max(series), statistics.median(series)
        climbs = sum(b >= a for a, b in zip(series, series[1:], strict=False)) >= 0.9 * (len(series) - 1)
        if hi - lo >= MEMORY_MIN_MB and (hi - lo) / max(med, 1e-9) > MEMORY_SPREAD and not climbs:
            evidence.append(f"{what} of {_where(rank, state)} swings between {lo:.0f} and {hi:.0f} MiB from step to step")
            break
    if not evidence:
        return []
    return [Finding(
        severity=WARNING,
        title="memory varies strongly across ranks or steps",
        evidence="; ".join(evidence),
        advice=("micro-batches are uneven (variable sequence lengths or unbalanced sharding): pack or pad "
                "sequences to a fixed length and give every data-parallel rank the same number of tokens"),
    )]


def straggler(records: Sequence[StepRecord], state: RunState) -> list[Finding]:
    """One rank (or one node's ranks) sustainedly slower than the median of the group."""
    slow: dict[int, list[float]] = {}
    steps = 0
    for rec in _steady(records):
        times = _floats(rec.compute_s) or _floats(rec.rank_step_time_s)  # compute: without the waits for it
        if times is None or len(times) < 2:
            continue
        median = statistics.median(times)
        if median <= 0:
            continue
        steps += 1
        for rank, t in enumerate(times):
            if t / median > STRAGGLER_SCORE and t - median >= STRAGGLER_MIN_S:
                slow.setdefault(rank, []).append(t / median)
    if steps < MIN_STEPS:
        return []
    what = "compute" if any(rec.compute_s for rec in records) else "step"
    sustained = {r: s for r, s in slow.items() if len(s) >= SUSTAINED * steps}
    findings = []
    for rank, scores in sorted(sustained.items(), key=lambda kv: -statistics.median(kv[1])):
        findings.append(Finding(
            severity=WARNING,
            title=f"straggler: {_where(rank, state)}",
            evidence=(f"{_where(rank, state)} was {statistics.median(scores):.1f}x the median {what} time in "
                      f"{len(scores)} of {steps} steps (threshold {STRAGGLER_SCORE}x); every other rank waits for it"),
            advice=("check that node: `nvidia-smi` clocks and temperature, other jobs on it, its NIC; "
                    "exclude it (slurm.workers.exclude=NODE) if it stays slow; `baton logs RUN --rank "
                    f"{rank}` for its own view"),
        ))
    return findings


def run_state(records: Sequence[StepRecord], state: RunState) -> list[Finding]:
    """A failed run: its recorded reason is the first thing to read."""
    if state.status is not Status.FAILED:
        return []
    return [Finding(
        severity=ERROR,
        title="the run failed",
        evidence=f"at step {state.step}/{state.total_steps or '?'}: {state.reason or 'no reason recorded'}",
        advice="read the named rank's log (`baton logs RUN --rank N`) or the controller's (`baton logs RUN --controller`)",
    )]


Rule = Callable[[Sequence[StepRecord], RunState], list[Finding]]
RULES: tuple[Rule, ...] = (run_state, data_loading, gradient_sync, straggler, memory_variation)


def diagnose(records: Sequence[StepRecord], state: RunState, rules: Sequence[Rule] = RULES) -> list[Finding]:
    """Every rule's findings, errors first, then warnings, then info."""
    findings = [f for rule in rules for f in rule(records, state)]
    return sorted(findings, key=lambda f: _ORDER.get(f.severity, 3))


def format_findings(findings: Sequence[Finding]) -> str:
    """Findings as a readable block; 'no findings' when there are none."""
    if not findings:
        return "no findings"
    out = []
    for f in findings:
        out += [f"[{f.severity}] {f.title}", f"  evidence: {f.evidence}", f"  advice:   {f.advice}"]
    return "\n".join(out)
