"""``baton submit``: validate, write the run folder, start the run (local or Slurm)."""
from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from core.checkpoint import manifest
from core.config import run as config_mod
from core.errors import ExitCode, UserError
from core.record.runfolder import RunFolder, new_run_id
from core.record.state import RunRecord
from launcher import local, runprep, slurm, slurm_jobs


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "submit", help="validate a config and start a run",
        description="Validate EXPERIMENT.yaml with key=value overrides, write the run folder and start "
        "the run: on Slurm as one heterogeneous job (returns at once), or locally as processes "
        "(returns when the run ends).",
    )
    p.add_argument("config", type=Path, nargs="?", help="experiment YAML (omit with --resume)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. parallel.tp=2")
    p.add_argument("--backend", choices=["auto", "local", "slurm"], default="auto",
                   help="auto (default): slurm when sbatch is on PATH, else local processes")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR",
                   help="continue an existing run folder from its latest committed checkpoint")
    p.add_argument("--from-scratch", action="store_true",
                   help="with --resume: when no checkpoint of the run verifies, or its newest checkpoints are "
                        "missing, go on from the newest one left, or start again from step 0 when none is (the "
                        "damaged checkpoints are kept); without it such a resume is refused")
    p.add_argument("--dry-run", action="store_true",
                   help="slurm: print the exact job script and submit nothing (nothing is written)")
    slurm.add_sbatch_arguments(p)
    p.set_defaults(func=run)


def pick_backend(choice: str) -> str:
    if choice != "auto":
        return choice
    return "slurm" if shutil.which("sbatch") else "local"


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    resume: runprep.Resume | None = None
    if args.resume is not None:
        if args.config is not None:  # with --resume, every positional is an override
            overrides.insert(0, str(args.config))
        resume = runprep.check_resume(args.resume, overrides, from_scratch=args.from_scratch)
        _refuse_an_active_job(resume.run)
        for note in resume.notes:
            print(f"note: {note}")
        cfg, epoch, run_folder = resume.cfg, resume.epoch, resume.run
    else:
        if args.config is None:
            raise config_mod.ConfigError("submit: give an experiment YAML, or --resume RUN_DIR")
        if args.from_scratch:
            raise config_mod.ConfigError("--from-scratch: only with --resume RUN_DIR")
        cfg = config_mod.load(args.config, overrides)
        run_folder, epoch = None, 0
    backend = pick_backend(args.backend)
    if backend == "slurm":
        return _run_slurm(args, cfg, run_folder, epoch, resume)
    if args.dry_run:
        raise config_mod.ConfigError("--dry-run: only with the slurm backend; add --backend slurm")
    if resume is not None:
        runprep.begin_resume(resume)
    if run_folder is None:
        run_folder = runprep.prepare_run(cfg, backend=backend)
    print(f"run folder: {run_folder.path}", flush=True)
    from launcher.progress import LiveProgress  # rich: only a run in the foreground shows live progress

    live = LiveProgress(run_folder, cfg.trainer.steps)
    try:
        code = local.run_local(run_folder, cfg, epoch=epoch, tick=live.poll)
    finally:
        _quietly(live.close)
    if local.interrupted(code):  # Ctrl-C, SIGTERM, SIGHUP: the terminal may be gone
        _quietly(lambda: _summary(run_folder, cfg))
        return code
    return _summary(run_folder, cfg, code)


def _quietly(say: Callable[[], object]) -> None:
    """Say it if the terminal is still there (after a SIGHUP it may not be)."""
    try:
        say()
    except OSError:
        pass


def _summary(run_folder: RunFolder, cfg: config_mod.RunConfig, code: int = ExitCode.OK) -> int:
    """How a local run ended, in a few lines; the exit code for ``code`` (the run's)."""
    state = RunRecord(run_folder).read()
    print(f"run {state.status.value} at step {state.step}/{cfg.trainer.steps}"
          + (f", last loss {state.last_loss:.4f}" if state.last_loss is not None else "")
          + (f": {state.reason}" if state.reason else ""))
    for finding in manifest.findings(run_folder.checkpoints):
        print(f"note: {finding}")
    print(f"run folder: {run_folder.path}")
    if code == ExitCode.USER_ERROR:  # the run refused its input (e.g. no checkpoint verifies): say it once
        print(f"baton: error: {state.reason or 'the run refused its input; see ' + str(run_folder.controller_log)}",
              file=sys.stderr)
        return ExitCode.USER_ERROR
    return ExitCode.OK if code == ExitCode.OK else ExitCode.FAILED


def _refuse_an_active_job(run: RunFolder) -> None:
    """A run whose Slurm job is still pending or running is not resumed beside it."""
    job_id = slurm_jobs.job_id_of(run)
    if job_id is None or shutil.which("squeue") is None:
        return
    states = slurm_jobs.job_states(job_id, max_age_s=0)
    active = {c: s for c, s in states.items() if slurm_jobs.baton_state(s) in slurm_jobs.ACTIVE}
    if active:
        shown = ", ".join(f"{c} {s}" for c, s in sorted(active.items()))
        raise UserError(f"{run.path}: its job {job_id} is still in Slurm ({shown}); wait for it or "
                        f"`baton cancel {run.path}` first, then resume")


def _run_slurm(args: argparse.Namespace, cfg: config_mod.RunConfig, run_folder: RunFolder | None, epoch: int,
               resume: runprep.Resume | None) -> int:
    """Preflight, then one heterogeneous job; returns at once (or prints the script and writes
    nothing: --dry-run)."""
    spec = slurm.job_spec_for(cfg, args)  # built once: the dry run, preflight and submit use this value
    runs_root = Path(cfg.runs_root).expanduser().resolve()
    if args.dry_run:
        if run_folder is None:  # the inputs a submit checks, checked (nothing written)
            cfg = runprep.checked(cfg)[0]
        planned = run_folder or RunFolder(runs_root / cfg.name / new_run_id())
        print(slurm.render(planned, cfg, spec, epoch=epoch), end="")
        return ExitCode.OK
    slurm.preflight(spec, runs_root, min_time_min=slurm.min_walltime_min(cfg))
    if resume is not None:
        runprep.begin_resume(resume)
    if run_folder is None:
        run_folder = runprep.prepare_run(cfg, backend="slurm")
    job_id = slurm.submit(run_folder, cfg, spec, epoch=epoch)
    print(f"submitted job {job_id} (controller {job_id}+0, workers {job_id}+1)")
    print(f"run folder: {run_folder.path}")
    where = shlex.quote(str(run_folder.path))
    print(f"follow it:  baton status {where}   baton logs {where}   baton cancel {where}")
    return ExitCode.OK
