"""``baton report PATH [--out DIR]``: PNG plots of a run's metrics, or of a sweep's points.

A run folder gets ``report/loss.png``, ``report/tokens_per_s.png`` and
``report/rank_step_time.png`` (one line per rank), plus ``report/memory.png`` when the
records carry memory. The loss and throughput plots mark the run's checkpoints, preemptions,
requeues, lost workers and resumes with vertical lines at their steps. An RL run adds
``reward.png`` (mean and ± std), ``kl.png`` (KL to the reference and the entropy),
``response_length.png`` (mean, min and max) and ``phases.png`` (seconds per phase of each RL step); PPO's
``value.png`` (the critic's value loss and mean value). A sweep folder (one with a ledger,
``sweep.json``, or any folder holding several run folders) gets ``report/sweep_loss.png``:
every point's loss curve. ``--superseded`` adds to a run's loss.png, faded, the records of
the steps a resume redid (metrics.jsonl keeps them, marked superseded) and says how many.

matplotlib is an optional extra (``pip install 'baton[plots]'``), imported only when a
report is drawn, and drawn on ``matplotlib.figure.Figure`` objects with the Agg canvas:
no pyplot, no global backend, no display needed.
"""
from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.errors import ExitCode, UserError
from core.record import steps
from core.record.runfolder import RunFolder
from core.record.state import RunRecord
from core.record.steps import StepRecord

log = logging.getLogger(__name__)

LEDGER_NAMES = ("sweep.json", "ledger.json")  # launcher.ledger writes sweep.json
MISSING = "matplotlib is not installed: pip install 'baton[plots]'"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``report`` command."""
    p = sub.add_parser("report", help="plot a run's (or a sweep's) metrics to PNG files",
                       description="Plot loss, tokens/s and per-rank step time from a run's metrics.jsonl "
                       "into RUN_DIR/report/; for a sweep folder, one plot comparing every point's loss. "
                       "Needs matplotlib: pip install 'baton[plots]'.")
    p.add_argument("run_dir", type=Path, metavar="PATH", help="a run folder or a sweep folder")
    p.add_argument("--out", type=Path, default=None, metavar="DIR", help="where to write the PNGs (default PATH/report)")
    p.add_argument("--superseded", action="store_true",
                   help="a run: also plot the loss of the steps a resume redid, faded (metrics.jsonl keeps them, "
                        "marked superseded), and list how many there are")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Draw the report and print the files written."""
    path = Path(args.run_dir).expanduser()
    if not path.is_dir():
        raise UserError(f"{path}: no such folder; pass a run folder or a sweep folder")
    sweep = is_sweep(path)
    written = report_sweep(path, args.out) if sweep else report_run(path, args.out, superseded=args.superseded)
    if args.superseded and not sweep:
        print(superseded_line(RunFolder.open(path)))
    for p in written:
        print(p)
    return ExitCode.OK


# --- finding the data ---------------------------------------------------------------------
def _figure_class() -> Any:
    """matplotlib's Figure with the Agg canvas, or a UserError naming the extra to install."""
    try:
        import matplotlib  # optional: pip install 'baton[plots]'

        matplotlib.use("Agg")  # a login node has no display; harmless when already Agg
        from matplotlib.figure import Figure  # optional, as above
    except ImportError:
        raise UserError(MISSING) from None
    return Figure


def _is_run(path: Path) -> bool:
    return (path / "config.yaml").is_file()


def is_sweep(path: Path) -> bool:
    """A folder with a sweep ledger, or one that is not a run but holds several runs."""
    if any((path / name).is_file() for name in LEDGER_NAMES):
        return True
    return not _is_run(path) and len([c for c in path.iterdir() if c.is_dir() and _is_run(c)]) >= 2


def sweep_points(path: Path) -> list[tuple[str, Path]]:
    """(label, run folder) of each point: from the ledger when there is one, else the subfolders.

    The ledger is read as plain JSON (``points[].run_dir`` and ``params``) so the report
    keeps working on a ledger of another version; points without a run folder are skipped.
    """
    for name in LEDGER_NAMES:
        ledger = path / name
        if not ledger.is_file():
            continue
        try:
            data = json.loads(ledger.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"{ledger}: unreadable ledger ({exc})") from None
        points = []
        for entry in data.get("points", []) if isinstance(data, dict) else []:
            if not isinstance(entry, dict) or not entry.get("run_dir"):
                continue
            run_dir = Path(entry["run_dir"])
            if not run_dir.is_absolute():
                run_dir = path / run_dir
            params = entry.get("params") or {}
            label = " ".join(f"{k}={v}" for k, v in params.items()) if isinstance(params, dict) and params else run_dir.name
            points.append((label, run_dir))
        if points:
            return points
    return [(c.name, c) for c in sorted(path.iterdir()) if c.is_dir() and _is_run(c)]


def by_step(records: Sequence[StepRecord]) -> list[StepRecord]:
    """One record per step, in step order; after a requeue the re-run step's last record wins."""
    latest: dict[int, StepRecord] = {}
    for rec in records:
        latest[rec.step] = rec
    return [latest[s] for s in sorted(latest)]


def _series(records: Sequence[StepRecord], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for rec in records:
        v = getattr(rec, key)
        if v is not None:
            xs.append(rec.step)
            ys.append(float(v))
    return xs, ys


def _rank_series(records: Sequence[StepRecord], key: str) -> dict[int, tuple[list[int], list[float]]]:
    out: dict[int, tuple[list[int], list[float]]] = {}
    for rec in records:
        for rank, v in enumerate(getattr(rec, key) or ()):
            xs, ys = out.setdefault(rank, ([], []))
            xs.append(rec.step)
            ys.append(float(v))
    return out


# --- drawing ------------------------------------------------------------------------------
def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


# The events a curve is marked with, their colour and line style: where a run was interrupted.
MARKS = {"checkpoint_committed": ("checkpoint", "tab:green", ":"), "preempted": ("preempted", "tab:red", "--"),
         "time_running_out": ("time running out", "tab:red", "--"), "requeued": ("requeued", "tab:red", "-"),
         "worker_lost": ("worker lost", "tab:orange", "--"), "resumed": ("resumed", "tab:blue", "-")}


def run_marks(run: RunFolder) -> list[tuple[int, str]]:
    """(step, kind) of every event a plot marks, from the run's history."""
    out = []
    for e in RunRecord(run).events():
        step = getattr(e, "step", None)
        if e.KIND in MARKS and isinstance(step, int):
            out.append((step, e.KIND))
    return out


def _plot(figure: Any, path: Path, title: str, ylabel: str, lines: list[tuple[str, list[int], list[float]]],
          *, log_y: bool = False, marks: Sequence[tuple[int, str]] = (),
          faded: Sequence[tuple[str, list[int], list[float]]] = ()) -> Path:
    fig = figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    for label, xs, ys in lines:
        ax.plot(xs, ys, label=label, linewidth=1.2)
    for label, xs, ys in faded:
        ax.plot(xs, ys, label=label, linestyle="none", marker=".", markersize=3, color="grey", alpha=0.4)
    labelled: set[str] = set()
    for step, kind in marks:
        name, colour, style = MARKS[kind]
        ax.axvline(step, color=colour, linestyle=style, linewidth=0.9, alpha=0.7,
                   label=None if name in labelled else name)
        labelled.add(name)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log_y and all(y > 0 for _, _, ys in lines for y in ys):
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if 1 < len(lines) + len(faded) + len(labelled) <= 16:
        ax.legend(fontsize="small")
    return _save(fig, path)


def superseded_line(run: RunFolder) -> str:
    """How many records of redone steps metrics.jsonl keeps, and of which steps."""
    old = sorted({r.step for r in steps.read(run.metrics, superseded=True) if r.superseded})
    if not old:
        return f"{run.metrics}: no superseded records (no resume redid a step)"
    return f"{run.metrics}: superseded records of {len(old)} redone steps ({old[0]}..{old[-1]}), faded in loss.png"


def report_run(run_dir: Path, out: Path | None = None, *, superseded: bool = False) -> list[Path]:
    """Write the run's PNGs into ``out`` (default RUN_DIR/report); return their paths.
    ``superseded``: loss.png shows the loss of the steps a resume redid too, faded."""
    run_folder = RunFolder.open(run_dir)
    records = by_step(steps.read(run_folder.metrics))
    if not records:
        raise UserError(f"{run_folder.metrics}: no step recorded yet; run `baton status {run_dir}` to see where it is")
    figure = _figure_class()
    out = Path(out) if out is not None else run_folder.path / "report"
    out.mkdir(parents=True, exist_ok=True)
    name = f"{run_folder.path.parent.name}/{run_folder.path.name}"
    marks = run_marks(run_folder)
    written = [
        _plot(figure, out / "loss.png", f"loss: {name}", "loss", [("loss", *_series(records, "loss"))], log_y=True,
              marks=marks, faded=_superseded(run_folder) if superseded else ()),
        _plot(figure, out / "tokens_per_s.png", f"throughput: {name}", "tokens/s",
              [("tokens/s", *_series(records, "tokens_per_s"))], marks=marks),
    ]
    ranks = _rank_series(records, "rank_step_time_s")
    if ranks:
        written.append(_plot(figure, out / "rank_step_time.png", f"step time per rank: {name}", "seconds",
                             [(f"rank {r}", xs, ys) for r, (xs, ys) in sorted(ranks.items())]))
    for key in ("cuda_peak_mb", "rss_mb"):
        mem = _rank_series(records, key)
        if mem and any(y > 0 for _, ys in mem.values() for y in ys):
            written.append(_plot(figure, out / "memory.png", f"{'CUDA peak' if key == 'cuda_peak_mb' else 'RSS'} "
                                 f"per rank: {name}", "MiB", [(f"rank {r}", xs, ys) for r, (xs, ys) in sorted(mem.items())]))
            break
    return written + _rl_plots(figure, out, name, records)


def _superseded(run: RunFolder) -> list[tuple[str, list[int], list[float]]]:
    old = [r for r in steps.read(run.metrics, superseded=True) if r.superseded]
    return [("superseded (redone)", [r.step for r in old], [r.loss for r in old])] if old else []


def _rl_plots(figure: Any, out: Path, name: str, records: Sequence[StepRecord]) -> list[Path]:
    """The RL steps' plots: nothing when no step carries a reward. reward.png adds the
    validations' mean rewards (rl.val_every) at the steps after which they ran."""
    xs, mean = _series(records, "reward_mean")
    if not xs:
        return []
    _, std = _series(records, "reward_std")
    band = std if len(std) == len(mean) else [0.0] * len(mean)
    held_out = [(label, *_series(records, key)) for label, key in (("validation, greedy", "val_reward_mean"),
                                                                   ("validation, sampled", "val_reward_mean_sampled"))]
    written = [_plot(figure, out / "reward.png", f"reward: {name}", "reward", [
        ("mean", xs, mean), ("mean + std", xs, [m + d for m, d in zip(mean, band, strict=True)]),
        ("mean - std", xs, [m - d for m, d in zip(mean, band, strict=True)])] + [v for v in held_out if v[1]])]
    kl = [(k, *_series(records, k)) for k in ("kl", "entropy")]
    if any(line[1] for line in kl):
        written.append(_plot(figure, out / "kl.png", f"KL to the reference and entropy: {name}", "nats",
                             [line for line in kl if line[1]]))
    lengths = [(label, *_series(records, k)) for label, k in (("mean", "response_length"),
                                                              ("min", "response_length_min"),
                                                              ("max", "response_length_max"))]
    written.append(_plot(figure, out / "response_length.png", f"response length: {name}", "tokens",
                         lengths[:1] + [line for line in lengths[1:] if line[1]]))
    value = [(k, *_series(records, k)) for k in ("value_loss", "values_mean")]
    if value[0][1]:
        written.append(_plot(figure, out / "value.png", f"critic: {name}", "value", value))
    phases: dict[str, tuple[list[int], list[float]]] = {}
    for rec in records:
        for phase, seconds in (rec.phase_s or {}).items():
            px, py = phases.setdefault(phase, ([], []))
            px.append(rec.step)
            py.append(float(seconds))
    if phases:
        written.append(_plot(figure, out / "phases.png", f"time per RL phase: {name}", "seconds",
                             [(k, *v) for k, v in phases.items()], log_y=True))
    return written


def report_sweep(sweep_dir: Path, out: Path | None = None) -> list[Path]:
    """Write ``sweep_loss.png`` comparing every point's loss curve; return its path."""
    lines = []
    for label, run_dir in sweep_points(sweep_dir):
        records = by_step(steps.read(RunFolder(run_dir).metrics))
        xs, ys = _series(records, "loss")
        if xs:
            lines.append((label, xs, ys))
        else:
            log.info("%s: no steps recorded yet; left out of the plot", run_dir)
    if not lines:
        raise UserError(f"{sweep_dir}: no point of this sweep has recorded a step yet")
    figure = _figure_class()
    out = Path(out) if out is not None else sweep_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    return [_plot(figure, out / "sweep_loss.png", f"loss per point: {sweep_dir.name}", "loss", lines, log_y=True)]
