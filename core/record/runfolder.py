"""The run folder: where a run's config, plan, keys, state, metrics, logs and checkpoints live.

    <runs_root>/<name>/<run_id>/
      config.yaml  plan.json  job.sbatch  keys/  controller.json  state.json  events.jsonl
      metrics.jsonl  memory.json  logs/{controller.log, worker_r00000.log, ...}  checkpoints/

Paths, and the atomic write every JSON file goes through (temporary file, fsync, rename),
so a reader on another node never sees half a file. What the files hold is read and
written by the modules beside this one: ``state`` (state.json, events.jsonl), ``steps``
(metrics.jsonl), ``memory`` (memory.json), ``plans`` (plan.json). No third-party imports: the launcher uses it too.
"""
from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import UserError


def write_atomic(path: Path, data: str | bytes, *, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` so readers see the old or the new file, never a mix."""
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: unreadable ({exc}); the run folder may be damaged") from None


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


@dataclass(frozen=True)
class RunFolder:
    """Paths inside one run folder."""

    path: Path

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def plan(self) -> Path:
        return self.path / "plan.json"

    @property
    def sbatch(self) -> Path:
        return self.path / "job.sbatch"

    @property
    def keys(self) -> Path:
        return self.path / "keys"

    @property
    def controller(self) -> Path:
        return self.path / "controller.json"

    @property
    def state(self) -> Path:
        return self.path / "state.json"

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def memory(self) -> Path:
        """What each rank held at the first step of the last allocation (``baton plan --check``)."""
        return self.path / "memory.json"

    @property
    def samples(self) -> Path:
        """The generator's continuations (one JSON object per line)."""
        return self.path / "samples.jsonl"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def worker_log(self, rank: int) -> Path:
        return self.logs / f"worker_r{rank:05d}.log"

    @property
    def controller_log(self) -> Path:
        return self.logs / "controller.log"

    @classmethod
    def create(cls, runs_root: Path, name: str, run_id: str | None = None) -> RunFolder:
        """Make a fresh run folder (mode 0700) with its logs/ and checkpoints/."""
        path = runs_root / name / (run_id or new_run_id())
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=False)
        except FileExistsError:
            raise UserError(f"{path}: run folder exists already; pass --resume {path} to continue it") from None
        except OSError as exc:
            raise UserError(f"{path}: cannot create the run folder ({exc.strerror}); check runs_root") from None
        os.chmod(path, 0o700)
        run = cls(path)
        run.logs.mkdir()
        run.checkpoints.mkdir()
        return run

    @classmethod
    def open(cls, path: Path) -> RunFolder:
        """An existing run folder; a path that is not one is a UserError."""
        run = cls(path)
        if not run.config.is_file():
            raise UserError(f"{path}: not a Baton run folder (no config.yaml); pass the folder `baton submit` printed")
        return run
