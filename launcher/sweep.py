"""Sweeps as data: parse a sweep file, expand it to points, validate every point's config.

A sweep file::

    name: toy-lr-seed          # optional; default: the sweep file's stem
    base: toy.yaml             # a path relative to this file, or an inline mapping
    grid:                      # dotted keys to lists: the Cartesian product
      optimizer.lr: [0.05, 0.1]
      seed: [1, 2]
    zip:                       # groups whose lists vary together (equal lengths);
      - parallel.tp: [1, 2]    # each group is one more axis of the product
        trainer.n_gpus_per_node: [2, 4]
    exclude:                   # partial points: every point matching all items is removed
      - {optimizer.lr: 0.05, seed: 2}
    include:                   # whole points added after the expansion
      - {optimizer.lr: 0.2, seed: 3}
    max_running: 2             # at most this many points at once (null: no limit)
    metric: loss               # the metrics.jsonl key that ranks points
    mode: min                  # min or max

Points are numbered from 0 in expansion order (first grid key slowest, then the zip
groups, then the includes). Each point's run id is a readable slug plus a short sha256
of its sorted, resolved parameters, so the same point always gets the same run folder:
``<runs_root>/<name>/<run id>/``, next to the sweep's ledger (``launcher.ledger``).

The file is read by the experiment loader (``core.config.run``): one-line errors for a file
that is empty, not UTF-8, not valid YAML or with a key given twice. At most 10000 points.

Everything here is pure: nothing is written and nothing is submitted.
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import itertools
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from core.config import run as config_mod
from core.config.inputs import check_name, check_text
from core.config.run import RunConfig, set_dotted
from core.config.schema import build, field_paths, to_data
from core.errors import ConfigError

log = logging.getLogger(__name__)

# Keys a point may not set: they decide where the sweep's runs and ledger live.
RESERVED_KEYS = ("name", "runs_root")
# Short names for the run id slug; any other key uses its last dotted part.
SLUG_NAMES = {
    "optimizer.lr": "lr", "training.global_batch_size": "gbs", "training.micro_batch_size": "mbs",
    "parallel.tp": "tp", "parallel.pp": "pp", "trainer.nodes": "nodes", "trainer.n_gpus_per_node": "gpn",
    "trainer.steps": "steps", "parallel.distributed_optimizer": "distopt", "training.recompute": "recompute",
}
_SLUG_MAX = 48
MAX_POINTS = 10_000  # a sweep of more is a typo in a grid; split it

# --- heuristics (documented as such: starting points, each overridable per point) ---------

AUTO_LR_BASE = 3e-6       # learning rate at a global batch of 1024 samples
AUTO_LR_BATCH = 1024
MB_PER_SAMPLE = 3500      # rough GPU memory per sample of per-GPU batch


def auto_lr(global_batch_size: int) -> float:
    """Heuristic ``optimizer.lr: auto``: 3e-6 × sqrt(global_batch / 1024) (square-root scaling).

    The same rule as ``RunConfig.lr``; set ``optimizer.lr`` (or sweep it) to override.
    """
    if global_batch_size <= 0:
        raise ConfigError(f"training.global_batch_size: {global_batch_size!r} must be > 0")
    return AUTO_LR_BASE * math.sqrt(global_batch_size / AUTO_LR_BATCH)


def per_gpu_batch(gpu_mem_mb: float) -> int:
    """Heuristic per-GPU batch: gpu_mem_mb / 3500, rounded down to a power of two, at least 1.

    A model-blind first guess (80 GiB → 16); ``core.config.plan.resolve_micro_batch`` is the
    model-aware resolver of ``training.micro_batch_size: auto``. Set the key to override.
    """
    if gpu_mem_mb <= 0:
        raise ConfigError(f"gpu_mem_mb: {gpu_mem_mb!r} must be > 0")
    samples = int(gpu_mem_mb // MB_PER_SAMPLE)
    return 1 if samples < 1 else 1 << (samples.bit_length() - 1)


# --- the file's schema --------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SweepFile:
    """The sweep file as written; ``core.config.schema.build`` checks keys and types."""

    name: str | None = None
    base: str | dict[str, Any] | None = None
    grid: dict[str, list[Any]] = field(default_factory=dict)
    zip: list[dict[str, list[Any]]] = ()  # type: ignore[assignment]
    include: list[dict[str, Any]] = ()  # type: ignore[assignment]
    exclude: list[dict[str, Any]] = ()  # type: ignore[assignment]
    max_running: int | None = None
    metric: str = "loss"
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        if self.base is None:
            raise ConfigError("base: required: a path to an experiment YAML (relative to the sweep file) or a mapping")
        if not self.base:
            raise ConfigError("base: empty; give a path to an experiment YAML (relative to the sweep file) or a mapping")
        if isinstance(self.base, str):
            check_text("base", self.base)
        if self.name is not None:
            check_name("name", self.name)
        if self.max_running is not None and not 1 <= self.max_running <= MAX_POINTS:
            raise ConfigError(f"max_running: {self.max_running} must be ≥ 1 and ≤ {MAX_POINTS}, or null for no limit")
        if not check_text("metric", self.metric):
            raise ConfigError("metric: must be a metrics.jsonl key, e.g. loss")
        seen: dict[str, str] = {}
        for key, values in self.grid.items():
            _check_axis(f"grid.{key}", key, values, seen)
        for g, group in enumerate(self.zip):
            if not group:
                raise ConfigError(f"zip[{g}]: empty group; give keys with lists of equal length")
            lengths = {key: len(values) for key, values in group.items()}
            if len(set(lengths.values())) > 1:
                desc = ", ".join(f"{k} has {n}" for k, n in lengths.items())
                raise ConfigError(f"zip[{g}]: lists of unequal length ({desc}); a zip group varies them together")
            for key, values in group.items():
                _check_axis(f"zip[{g}].{key}", key, values, seen)
        for kind, items in (("include", self.include), ("exclude", self.exclude)):
            for i, item in enumerate(items):
                if not item:
                    raise ConfigError(f"{kind}[{i}]: empty mapping; give dotted keys and values")
                for key in item:
                    _check_key(f"{kind}[{i}].{key}", key)
        swept = set(seen)
        for i, item in enumerate(self.exclude):
            stray = sorted(set(item) - swept)
            if stray:
                raise ConfigError(f"exclude[{i}].{stray[0]}: not a swept key (swept: {', '.join(sorted(swept))})")


def _check_key(path: str, key: str) -> None:
    if key in RESERVED_KEYS:
        raise ConfigError(f"{path}: {key!r} cannot vary within a sweep (the sweep's runs and ledger live in "
                          "<runs_root>/<name>); set it on the base or as an override")
    valid = _valid_paths()
    if key not in valid:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        raise ConfigError(f"{path}: unknown key" + (f"; did you mean {close[0]!r}?" if close else ""))


def _check_axis(path: str, key: str, values: list[Any], seen: dict[str, str]) -> None:
    _check_key(path, key)
    if not values:
        raise ConfigError(f"{path}: empty list; give at least one value")
    if key in seen:
        raise ConfigError(f"{path}: swept twice (also at {seen[key]}); a key belongs to one axis")
    seen[key] = path


def _valid_paths() -> list[str]:
    return field_paths(RunConfig)


# --- the expanded, validated sweep --------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Point:
    """One point: its number, parameters (dotted key → resolved value), run id and config."""

    index: int
    params: tuple[tuple[str, Any], ...]
    run_id: str
    cfg: RunConfig

    @property
    def param_dict(self) -> dict[str, Any]:
        return dict(self.params)

    def describe(self) -> str:
        return ", ".join(f"{k}={_fmt(v)}" for k, v in self.params)


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """A parsed sweep file with every point validated."""

    name: str
    path: Path                 # the sweep file
    text: str                  # its text, copied next to the runs
    base: dict[str, Any]       # the base config data, overrides applied
    spec: SweepFile
    points: tuple[Point, ...]

    @property
    def keys(self) -> list[str]:
        """Every swept key, in axis order (then keys only includes set)."""
        out: list[str] = []
        for p in self.points:
            out.extend(k for k, _ in p.params if k not in out)
        return out

    @property
    def sweep_dir(self) -> Path:
        """``<runs_root>/<name>``: the ledger and every point's run folder."""
        return Path(self.points[0].cfg.runs_root).expanduser().resolve() / self.name


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> Sweep:
    """Read, expand and validate a sweep file; ``overrides`` apply to the base of every point."""
    path = Path(path)
    data, text = config_mod.read_yaml(path, kind="sweep file")
    try:
        spec = build(SweepFile, data, finite=True)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return plan_sweep(spec, path=path, text=text, overrides=overrides or [])


def plan_sweep(spec: SweepFile, *, path: Path, text: str, overrides: list[str]) -> Sweep:
    """Expand ``spec`` and validate each point's full RunConfig; the first bad point is named."""
    base = _base_data(spec, path)
    name = spec.name or _name_of(path)
    swept = set(spec.grid) | {k for g in spec.zip for k in g} | {k for i in spec.include for k in i}
    for text_ov in overrides:
        key = ".".join(config_mod.parse_override(text_ov)[0])
        if key in swept:
            raise ConfigError(f"override {key}: this key is swept by {path.name}; change the sweep file instead")
        if key == "name":
            raise ConfigError(f"override name: the sweep's name comes from {path.name} (name:) or its file name")
    base = config_mod.apply_overrides(base, overrides)
    base["name"] = name
    try:
        raw = expand(spec)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    points: list[Point] = []
    bad: list[str] = []
    for index, params in enumerate(raw):
        try:
            points.append(make_point(index, params, base))
        except ConfigError as exc:
            bad.append(f"point {index} ({_describe(params)}): {exc}")
    if bad:
        more = f" (and {len(bad) - 1} more bad point(s))" if len(bad) > 1 else ""
        raise ConfigError(f"{path}: {bad[0]}{more}; nothing was submitted")
    by_id: dict[str, Point] = {}
    for p in points:
        if p.run_id in by_id:
            raise ConfigError(f"{path}: point {p.index} ({p.describe()}) is the same as point "
                              f"{by_id[p.run_id].index}; remove one of them")
        by_id[p.run_id] = p
    log.debug("sweep %s: %d points", name, len(points))
    return Sweep(name=name, path=path, text=text, base=base, spec=spec, points=tuple(points))


def _name_of(path: Path) -> str:
    """The sweep's default name: its file's stem, made a valid run name."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", path.stem)[:128]
    return stem if re.match(r"[A-Za-z0-9]", stem) else f"sweep{stem}"[:128]


def _base_data(spec: SweepFile, path: Path) -> dict[str, Any]:
    if isinstance(spec.base, dict):
        return copy.deepcopy(spec.base)
    assert isinstance(spec.base, str)
    base_path = Path(spec.base).expanduser()
    if not base_path.is_absolute():
        base_path = path.resolve().parent / base_path
    try:
        return config_mod.read_yaml(base_path)[0]
    except ConfigError as exc:
        raise ConfigError(f"{path}: base: {exc}") from None


def expand(spec: SweepFile) -> list[dict[str, Any]]:
    """The points' parameters: grid × zip groups, minus excludes, plus includes (deduplicated)."""
    axes: list[list[dict[str, Any]]] = [[{key: v} for v in values] for key, values in spec.grid.items()]
    for group in spec.zip:
        n = len(next(iter(group.values())))
        axes.append([{key: values[i] for key, values in group.items()} for i in range(n)])
    count = math.prod(len(axis) for axis in axes) if axes else 0
    if count + len(spec.include) > MAX_POINTS:
        raise ConfigError(f"sweep: {count + len(spec.include)} points, more than {MAX_POINTS}; "
                          "sweep fewer values or split the sweep")
    points = [_merge(parts) for parts in itertools.product(*axes)] if axes else []
    for i, ex in enumerate(spec.exclude):
        kept = [p for p in points if not all(k in p and p[k] == v for k, v in ex.items())]
        if len(kept) == len(points):
            log.warning("exclude[%d] %s matches no point", i, ex)
        points = kept
    for item in spec.include:
        if dict(item) not in points:
            points.append(dict(item))
    if not points:
        raise ConfigError("sweep: no points; give a grid, zip groups or include points (or exclude fewer)")
    return points


def _merge(parts: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in parts:
        out.update(part)
    return out


def make_point(index: int, params: dict[str, Any], base: dict[str, Any]) -> Point:
    """Apply ``params`` to ``base`` and validate the full config; resolve the values for the id."""
    data = copy.deepcopy(base)
    for key, value in params.items():
        _set(data, key, value)
    cfg = config_mod.from_data(data)
    resolved = to_data(cfg)
    items = tuple((key, _get(resolved, key)) for key in params)
    return Point(index=index, params=items, run_id=run_id(items), cfg=cfg)


def _set(data: dict[str, Any], key: str, value: Any) -> None:
    set_dotted(data, key.split("."), copy.deepcopy(value), where=f"{key} (in the base config)")


def _get(data: dict[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        node = node[part]
    return list(node) if isinstance(node, tuple) else node


def run_id(params: tuple[tuple[str, Any], ...] | dict[str, Any]) -> str:
    """``<slug>-<8 hex>``: a readable slug and sha256 of the sorted parameter items.

    Both depend only on the set of (key, resolved value) pairs, not on the file's key order.
    """
    items = sorted(dict(params).items())
    digest = hashlib.sha256(json.dumps(items, sort_keys=True, default=str, separators=(",", ":")).encode())
    slug = "_".join(SLUG_NAMES.get(k, k.rsplit(".", 1)[-1]) + _fmt(v) for k, v in items)
    slug = re.sub(r"[^A-Za-z0-9.+_-]", "", slug)[:_SLUG_MAX].strip("._-")
    return f"{slug}-{digest.hexdigest()[:8]}" if slug else digest.hexdigest()[:8]


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _describe(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_fmt(v)}" for k, v in params.items())


def chain_waits(count: int, max_running: int | None, busy: list[str]) -> list[str | int | None]:
    """What each of ``count`` points to submit waits for, to keep at most ``max_running`` at once.

    Slurm holds the rest, so no process stays alive on the login node: there are
    ``max_running`` dependency chains, and a point waits (``afterany``) for the previous
    point of its chain. ``busy`` are the job ids ending the sweep's active chains (queued
    or running points nothing waits for yet). Each answer is None (start at once), a job
    id from ``busy`` (str), or the position of an earlier point of this batch (int).
    """
    if max_running is None:
        return [None] * count
    free = max(0, max_running - len(busy))
    tails: list[str | int | None] = [*([None] * free), *busy]
    out: list[str | int | None] = []
    for i in range(count):
        slot = i % len(tails)
        out.append(tails[slot])
        tails[slot] = i
    return out
