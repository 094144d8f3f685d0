"""Prepare a run folder on the login node: resolved config, plan, keys, initial state.

Pure preparation, no submission: both backends call ``prepare_run`` (new run) or
``prepare_resume`` (an existing folder, next epoch) and then start processes their way.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from core.errors import UserError
from core.record.runfolder import RunFolder, event, write_atomic, write_json
from core.spec import config as config_mod
from core.spec.config import RunConfig


def generate_keys(keys_dir: Path) -> None:
    """CURVE keys via a subprocess: the login-node CLI never imports zmq itself."""
    proc = subprocess.run(
        [sys.executable, "-m", "core.wire.transport", "keygen", str(keys_dir)],
        capture_output=True, text=True, timeout=60,
    )
    if proc.returncode != 0:
        raise UserError(f"{keys_dir}: key generation failed: {proc.stderr.strip().splitlines()[-1:]}")


def plan_data(cfg: RunConfig) -> dict[str, object]:
    """plan.json: the layout and memory plan of a GPT; just the layout for the toy model."""
    if cfg.model.kind != "gpt":
        dims = cfg.dims
        return {"dims": {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp}, "world_size": dims.world_size}
    from core.spec.plan import make_plan

    return json.loads(make_plan(cfg).to_json())  # type: ignore[no-any-return]


def prepare_run(cfg: RunConfig, *, backend: str, run_id: str | None = None) -> RunFolder:
    """Create the run folder of a validated config."""
    run = RunFolder.create(Path(cfg.runs_root).expanduser().resolve(), cfg.name, run_id)
    write_atomic(run.config, config_mod.dump(cfg))
    write_json(run.plan, plan_data(cfg))
    generate_keys(run.keys)
    state: dict[str, object] = {
        "status": "created", "backend": backend, "step": 0, "total_steps": cfg.trainer.steps,
        "restarts": 0, "created": time.time(),
    }
    event(state, "created", backend=backend)
    run.write_state(state)
    return run


def prepare_resume(run_dir: Path, overrides: list[str]) -> tuple[RunFolder, RunConfig, int]:
    """Re-open a run folder for its next epoch; overrides (e.g. a new layout) are applied."""
    run = RunFolder.open(run_dir.expanduser().resolve())
    cfg = config_mod.load(run.config, overrides)
    if overrides:
        write_atomic(run.config, config_mod.dump(cfg))
        write_json(run.plan, plan_data(cfg))
    state = run.read_state()
    epoch = int(state.get("restarts", 0)) + 1
    state.update(restarts=epoch, status="resuming")
    event(state, "resume_requested", epoch=epoch, overrides=list(overrides))
    run.write_state(state)
    return run, cfg, epoch
