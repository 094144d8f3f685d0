"""``baton sweep submit|status|resume|results``: many runs from one sweep file.

``submit`` plans (expands and validates every point: one bad point and nothing is
written), renders every point's job, writes the ledger and the run folders, then submits:
on Slurm each point as its own het job, and returns (``max_running`` is kept by Slurm
dependency chains, so nothing has to stay alive on the login node); locally the points
run one after another in the foreground. ``resume`` submits failed, cancelled and
never-submitted points again and leaves completed, queued and running ones alone.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path

from core.config import run as config_mod
from core.config.jobspec import HetJobSpec
from core.config.run import RunConfig
from core.errors import ExitCode, UserError
from core.record.runfolder import RunFolder
from core.record.state import RunRecord, Status
from launcher import ledger as ledger_mod
from launcher import local, runprep, slurm_jobs
from launcher import sweep as sweep_mod
from launcher.cmd_submit import pick_backend
from launcher.ledger import Entry, Ledger, PointStatus

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``sweep`` and its four actions."""
    p = sub.add_parser("sweep", help="submit, watch, resume and rank a sweep of runs",
                       description="Run a grid of experiments from one sweep file; see launcher/sweep.py for the format.")
    cmds = p.add_subparsers(dest="sweep_command", metavar="ACTION", parser_class=type(p))
    cmds.required = True
    s = cmds.add_parser("submit", help="validate and render every point, then submit each",
                        description="Expand SWEEP.yaml, validate and render every point (nothing is submitted if "
                                    "one is bad), write the ledger next to the runs and submit every point.")
    s.add_argument("sweep_file", type=Path, help="the sweep YAML")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides of the base, e.g. runs_root=/scratch/runs")
    s.add_argument("--backend", choices=["auto", "local", "slurm"], default="auto",
                   help="auto (default): slurm when sbatch is on PATH; local runs the points one after another")
    s.add_argument("--dry-run", action="store_true", help="print the points and what would be submitted; write nothing")
    s.set_defaults(func=run_submit)
    st = cmds.add_parser("status", help="one row per point, counts per state, the best point so far")
    st.add_argument("sweep_dir", type=Path, help="the folder `baton sweep submit` printed")
    st.set_defaults(func=run_status)
    r = cmds.add_parser("resume", help="resubmit failed, cancelled and never-submitted points",
                        description="Submit again every point that failed, was cancelled or never got submitted; "
                                    "completed, queued and running points are left alone.")
    r.add_argument("sweep_dir", type=Path)
    r.add_argument("--backend", choices=["auto", "local", "slurm"], default="auto",
                   help="auto (default): the backend the sweep was submitted with")
    r.set_defaults(func=run_resume)
    res = cmds.add_parser("results", help="final metrics per point, best first")
    res.add_argument("sweep_dir", type=Path)
    res.add_argument("--csv", type=Path, metavar="PATH", help="also write the table as CSV")
    res.set_defaults(func=run_results)


# --- the Slurm seam -------------------------------------------------------------------------


class SlurmBackend:
    """The calls this command makes into ``launcher.slurm`` (imported only when needed)."""

    def __init__(self) -> None:
        try:
            from launcher import slurm  # submitit: the local backend does without it
        except ImportError as exc:
            raise UserError(f"--backend slurm: launcher.slurm is not available ({exc}); use --backend local") from None
        self._slurm = slurm
        self._checked: set[tuple[HetJobSpec, Path, int]] = set()

    def preflight(self, cfg: RunConfig) -> None:
        """sinfo-backed checks, once per distinct job spec and runs root (a sweep repeats them)."""
        spec = self._slurm.job_spec_for(cfg)
        runs_root = Path(cfg.runs_root).expanduser().resolve()
        floor = self._slurm.min_walltime_min(cfg)
        key = (spec, runs_root, floor)
        if key not in self._checked:
            self._slurm.preflight(spec, runs_root, min_time_min=floor)
            self._checked.add(key)

    def render(self, run: RunFolder, cfg: RunConfig, *, after: str | None) -> str:
        """The exact script of one point; ``after``: the job it waits for."""
        spec = self._slurm.job_spec_for(cfg).with_job_flags(_dependency(after))
        return str(self._slurm.render(run, cfg, spec))

    def submit(self, run: RunFolder, cfg: RunConfig, *, epoch: int, after: str | None) -> str:
        """Submit one point (after the job ``after``, if given); returns its job id."""
        spec = self._slurm.job_spec_for(cfg).with_job_flags(_dependency(after))
        return str(self._slurm.submit(run, cfg, spec, epoch=epoch))

    def job_states(self, jobs: dict[str, Path]) -> dict[str, str]:
        """The leader's state of each job; answers are cached in the run folder for a few seconds."""
        out = {}
        for job_id, run_dir in jobs.items():
            states = slurm_jobs.job_states(job_id, run_dir / ".slurm_states.json")
            state = states.get(f"{job_id}+0") or next(iter(states.values()), None)
            if state:
                out[job_id] = state.split()[0]
        return out


def _dependency(after: str | None) -> list[str]:
    # afterany: the chain moves on however the previous point ended (completed, failed, cancelled).
    return [f"--dependency=afterany:{after}"] if after else []


def _lookup(ledger: Ledger) -> ledger_mod.JobStateLookup | None:
    if not any(e.backend == "slurm" and e.job_id for e in ledger.points):
        return None
    try:
        return SlurmBackend().job_states
    except UserError as exc:
        log.warning("%s", exc)
        return None


# --- submit and resume --------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """One point about to be started: its ledger entry, run folder, config and epoch."""

    entry: Entry
    run: RunFolder
    cfg: RunConfig
    epoch: int


def run_submit(args: argparse.Namespace) -> int:
    """Plan and render every point; then write the ledger and run folders; then submit."""
    sweep = sweep_mod.load_sweep(args.sweep_file, list(args.overrides))
    backend = pick_backend(args.backend)
    sweep_dir = sweep.sweep_dir
    if ledger_mod.ledger_path(sweep_dir).exists():
        raise UserError(f"{sweep_dir}: this sweep was submitted already; `baton sweep resume {sweep_dir}` "
                        "continues it, or set another name: in the sweep file")
    taken = [p.run_id for p in sweep.points if (sweep_dir / p.run_id).exists()]
    if taken:
        raise UserError(f"{sweep_dir / taken[0]}: a run folder of this sweep exists already; remove it or rename the sweep")
    waits = sweep_mod.chain_waits(len(sweep.points), sweep.spec.max_running if backend == "slurm" else None, [])
    slurm = SlurmBackend() if backend == "slurm" else None
    scripts: list[str] = []
    if slurm is not None:  # every point rendered before anything is written or submitted
        for p in sweep.points:
            try:
                slurm.preflight(p.cfg)
                scripts.append(slurm.render(RunFolder(sweep_dir / p.run_id), p.cfg, after=None))
            except UserError as exc:
                raise UserError(f"{sweep.path}: point {p.index} ({p.describe()}): {exc}; nothing was submitted") from None
    if args.dry_run:
        print(format_plan(sweep, backend, waits))
        if scripts:  # the chains add --dependency=afterany:<job of the point waited for>
            print(f"--- job script of point 0 (1 of {len(scripts)}) ---\n{scripts[0]}")
        return ExitCode.OK
    ledger = new_ledger(sweep, backend)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    ledger_mod.write_copy(sweep_dir, sweep.text)
    ledger_mod.write_ledger(sweep_dir, ledger)
    ready = [Ready(entry=e, run=runprep.prepare_run(p.cfg, backend=backend, run_id=p.run_id), cfg=p.cfg, epoch=0)
             for e, p in zip(ledger.points, sweep.points, strict=True)]
    print(f"sweep folder: {sweep_dir} ({len(ready)} points, backend {backend})")
    return launch(sweep_dir, ledger, ready, backend, slurm=slurm, busy=[])


def new_ledger(sweep: sweep_mod.Sweep, backend: str) -> Ledger:
    """A ledger with every point unsubmitted."""
    sweep_dir = sweep.sweep_dir
    points = tuple(Entry(index=p.index, params=p.param_dict, run_id=p.run_id, run_dir=str(sweep_dir / p.run_id))
                   for p in sweep.points)
    return Ledger(name=sweep.name, sweep_file=str(sweep.path.resolve()), created=time.time(), backend=backend,
                  metric=sweep.spec.metric, mode=sweep.spec.mode, max_running=sweep.spec.max_running,
                  base=sweep.base, points=points)  # type: ignore[arg-type]


def run_resume(args: argparse.Namespace) -> int:
    """Resubmit failed, cancelled and never-submitted points; validate and render all first."""
    sweep_dir = args.sweep_dir.expanduser().resolve()
    ledger = ledger_mod.read_ledger(sweep_dir)
    backend = ledger.backend if args.backend == "auto" else args.backend
    rows = ledger_mod.refresh(ledger, _lookup(ledger))
    todo = [r for r in rows if r.state in ledger_mod.RESUBMIT]
    if not todo:
        print(f"nothing to resume: {ledger_mod.count_line(rows)}")
        return ExitCode.OK
    slurm = SlurmBackend() if backend == "slurm" else None
    configs = [_point_config(ledger, r.entry) for r in todo]
    if slurm is not None:
        for r, cfg in zip(todo, configs, strict=True):
            try:
                slurm.preflight(cfg)
                slurm.render(RunFolder(Path(r.entry.run_dir)), cfg, after=None)
            except UserError as exc:
                raise UserError(f"{sweep_dir}: point {r.entry.index}: {exc}; nothing was resubmitted") from None
    ready = [_prepare_again(r, cfg, backend) for r, cfg in zip(todo, configs, strict=True)]
    print(f"resuming {len(ready)} point(s) of {sweep_dir}: {', '.join(str(r.entry.index) for r in ready)}")
    busy = _busy_tails(rows) if backend == "slurm" else []
    return launch(sweep_dir, ledger, ready, backend, slurm=slurm, busy=busy)


def _point_config(ledger: Ledger, entry: Entry) -> RunConfig:
    run = RunFolder(Path(entry.run_dir))
    if run.config.is_file():
        return config_mod.load(run.config)
    return sweep_mod.make_point(entry.index, dict(entry.params), dict(ledger.base)).cfg


def _prepare_again(row: PointStatus, cfg: RunConfig, backend: str) -> Ready:
    """A fresh run folder, the untouched one of a never-started point, or the next epoch."""
    e = row.entry
    run = RunFolder(Path(e.run_dir))
    if not run.config.is_file():
        return Ready(entry=e, run=runprep.prepare_run(cfg, backend=backend, run_id=e.run_id), cfg=cfg, epoch=0)
    if e.submissions == 0 and RunRecord(run).read().status is Status.CREATED:
        return Ready(entry=e, run=run, cfg=cfg, epoch=0)
    run, cfg, epoch = runprep.prepare_resume(run.path, [])
    return Ready(entry=e, run=run, cfg=cfg, epoch=epoch)


def _busy_tails(rows: list[PointStatus]) -> list[str]:
    """Job ids of queued/running points that no other active point waits for (chain ends)."""
    active = [r.entry for r in rows if r.state in ledger_mod.ACTIVE and r.entry.job_id]
    waited = {e.after for e in active}
    return [e.job_id for e in active if e.job_id not in waited]  # type: ignore[misc]


def launch(sweep_dir: Path, ledger: Ledger, ready: list[Ready], backend: str, *,
           slurm: SlurmBackend | None, busy: list[str]) -> int:
    """Start the ready points: Slurm jobs in dependency chains, or local runs one by one."""
    if backend == "local":
        return _run_locally(sweep_dir, ledger, ready)
    assert slurm is not None
    waits = sweep_mod.chain_waits(len(ready), ledger.max_running, busy)
    job_ids: list[str] = []
    for i, (item, wait) in enumerate(zip(ready, waits, strict=True)):
        after = job_ids[wait] if isinstance(wait, int) else wait
        try:
            job_id = slurm.submit(item.run, item.cfg, epoch=item.epoch, after=after)
        except UserError as exc:
            raise UserError(f"point {item.entry.index}: {exc}; {i} of {len(ready)} submitted; "
                            f"`baton sweep resume {sweep_dir}` submits the rest") from None
        job_ids.append(job_id)
        ledger = ledger_mod.store_entry(sweep_dir, replace(
            item.entry, backend="slurm", job_id=job_id, after=after, submitted=time.time(),
            submissions=item.entry.submissions + 1, state=ledger_mod.QUEUED, pid=None, host=None))
        print(f"point {item.entry.index} ({ledger_mod.describe(item.entry)}): job {job_id}"
              + (f" after {after}" if after else "") + f"  {item.run.path}")
    print(f"submitted {len(ready)} job(s); watch with `baton sweep status {sweep_dir}`")
    return ExitCode.OK


def _run_locally(sweep_dir: Path, ledger: Ledger, ready: list[Ready]) -> int:
    """Run the points one after another in the foreground (max_running is 1)."""
    failed = 0
    for item in ready:
        entry = replace(item.entry, backend="local", job_id=None, after=None, submitted=time.time(),
                        submissions=item.entry.submissions + 1, state=ledger_mod.RUNNING,
                        pid=os.getpid(), host=socket.gethostname())
        ledger_mod.store_entry(sweep_dir, entry)
        print(f"point {entry.index} ({ledger_mod.describe(entry)}): running in {item.run.path}", flush=True)
        code = local.run_local(item.run, item.cfg, epoch=item.epoch)
        state = RunRecord(item.run).read()
        final = (ledger_mod.COMPLETED if state.status is Status.COMPLETED
                 else ledger_mod.CANCELLED if local.interrupted(code) else ledger_mod.FAILED)
        ledger_mod.store_entry(sweep_dir, replace(entry, state=final, pid=None))
        print(f"point {entry.index}: {final} at step {state.step}/{item.cfg.trainer.steps}"
              + (f", last loss {state.last_loss:.4f}" if state.last_loss is not None else ""), flush=True)
        if local.interrupted(code):  # Ctrl-C, SIGTERM, SIGHUP
            print(f"interrupted; `baton sweep resume {sweep_dir}` continues")
            return code
        failed += final != ledger_mod.COMPLETED
    print(f"{len(ready) - failed} of {len(ready)} point(s) completed; `baton sweep results {sweep_dir}`")
    return ExitCode.FAILED if failed else ExitCode.OK


# --- status and results -------------------------------------------------------------------


def run_status(args: argparse.Namespace) -> int:
    """Print one row per point, the counts per state and the best point so far."""
    ledger = ledger_mod.read_ledger(args.sweep_dir)
    print(ledger_mod.format_status(ledger, ledger_mod.refresh(ledger, _lookup(ledger))))
    return ExitCode.OK


def run_results(args: argparse.Namespace) -> int:
    """Print the final metrics per point, best first; optionally write them as CSV."""
    ledger = ledger_mod.read_ledger(args.sweep_dir)
    rows = ledger_mod.refresh(ledger, _lookup(ledger))
    print(ledger_mod.format_results(ledger, rows))
    if args.csv is not None:
        args.csv.write_text(ledger_mod.results_csv(ledger, rows))
        print(f"csv: {args.csv}")
    return ExitCode.OK


def format_plan(sweep: sweep_mod.Sweep, backend: str, waits: list[str | int | None]) -> str:
    """``--dry-run``: every point, its run folder and (Slurm) the point it waits for."""
    keys = sweep.keys
    body = [[str(p.index), *(ledger_mod.fmt_value(p.param_dict.get(k)) for k in keys), p.run_id,
             "-" if w is None else f"point {w}"] for p, w in zip(sweep.points, waits, strict=True)]
    return "\n".join([f"sweep {sweep.name}: {len(sweep.points)} points, backend {backend}, folder {sweep.sweep_dir}",
                      ledger_mod.table(["point", *keys, "run id", "waits for"], body), "dry run: nothing written or submitted"])
