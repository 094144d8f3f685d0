"""Prepare a run folder on the login node: resolved config, plan, keys, initial state.

Pure preparation, no submission: both backends call ``prepare_run`` (new run) or
``prepare_resume`` (an existing folder, next epoch) and then start processes their way.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from core.errors import UserError
from core.record import events as ev
from core.record.runfolder import RunFolder, write_atomic
from core.record.state import RunRecord, RunState, Status
from core.spec import config as config_mod
from core.spec.config import RunConfig
from core.spec.runplan import plan_run


def generate_keys(keys_dir: Path) -> None:
    """CURVE keys via a subprocess: the login-node CLI never imports zmq itself."""
    proc = subprocess.run(
        [sys.executable, "-m", "core.wire.transport", "keygen", str(keys_dir)],
        capture_output=True, text=True, timeout=60,
    )
    if proc.returncode != 0:
        raise UserError(f"{keys_dir}: key generation failed: {proc.stderr.strip().splitlines()[-1:]}")


def prepare_run(cfg: RunConfig, *, backend: str, run_id: str | None = None) -> RunFolder:
    """Create the run folder of a validated config: config, plan, keys, the first state."""
    run = RunFolder.create(Path(cfg.runs_root).expanduser().resolve(), cfg.name, run_id)
    write_atomic(run.config, config_mod.dump(cfg))
    write_atomic(run.plan, plan_run(cfg).to_json())
    generate_keys(run.keys)
    now = time.time()
    RunRecord(run).create(RunState(status=Status.CREATED, backend=backend, total_steps=cfg.trainer.steps,
                                   created=now, updated=now), ev.Created(backend=backend))
    return run


def prepare_resume(run_dir: Path, overrides: list[str]) -> tuple[RunFolder, RunConfig, int]:
    """Re-open a run folder for its next epoch; overrides (e.g. a new layout) are applied."""
    run = RunFolder.open(run_dir.expanduser().resolve())
    cfg = config_mod.load(run.config, overrides)
    if overrides:
        write_atomic(run.config, config_mod.dump(cfg))
    write_atomic(run.plan, plan_run(cfg).to_json())  # planned again: a plan of an older Baton is replaced
    record = RunRecord(run)
    epoch = record.read().restarts + 1
    with record.update(ev.ResumeRequested(epoch=epoch, overrides=tuple(overrides))) as s:
        s.restarts, s.status = epoch, Status.RESUMING
    return run, cfg, epoch
