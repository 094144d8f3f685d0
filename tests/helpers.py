"""Shared test helpers: deadline polling and local runs whose processes we own by pid."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from core.record.runfolder import RunFolder
from core.spec import config as config_mod
from launcher import local, runprep

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """Poll ``predicate`` until truthy; on timeout fail saying what was awaited."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.1f} s waiting for {what} (last value: {last!r})")


@dataclass
class LocalRun:
    """A run started from a test: controller and workers as our own child processes."""

    run: RunFolder
    cfg: config_mod.RunConfig
    controller: subprocess.Popen[bytes] | None = None
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, *, epoch: int = 0, controller: bool = True, workers: bool = True) -> LocalRun:
        if controller:
            self.controller = local._spawn(self.run, "controller", epoch=epoch, rank=None)
        if workers:
            self.workers = [local._spawn(self.run, "worker", epoch=epoch, rank=r) for r in range(self.cfg.trainer.world_size)]
        return self

    def state(self) -> dict[str, Any]:
        """state.json as plain data (through the run record), {} while it cannot be read."""
        from core.record.state import RunRecord, state_to_data

        try:
            return state_to_data(RunRecord(self.run).read())
        except Exception:  # noqa: BLE001 - mid-replace reads are retried by the poller
            return {}

    def log(self, name: str = "controller") -> str:
        path = self.run.controller_log if name == "controller" else self.run.worker_log(int(name))
        return path.read_text() if path.exists() else ""

    def procs(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in [self.controller, *self.workers] if p is not None]

    def cleanup(self) -> None:
        for p in self.procs():
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.kill()
            p.wait(timeout=10)


def make_run(tmp_path: Path, experiment: str, overrides: list[str]) -> LocalRun:
    cfg = config_mod.load(REPO / "experiments" / experiment, [f"runs_root={tmp_path}", *overrides])
    return LocalRun(run=runprep.prepare_run(cfg, backend="local"), cfg=cfg)


def history(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The run's events (events.jsonl, through the run record) as flat dicts, of ``kind`` if given."""
    from core.record import events as ev
    from core.record.state import RunRecord

    try:
        events = RunRecord(RunFolder(Path(run_dir))).events()
    except (OSError, ValueError):  # mid-write on a busy machine: the poller asks again
        return []
    return [ev.to_data(e) for e in events if kind is None or ev.kind_of(e) == kind]


def baton(*args: str, cwd: Path | None = None, timeout: float = 600,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would (``env``: variables added to this process's)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           **(env or {})}
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, env=env, timeout=timeout)


def scrape(address: str) -> dict[str, list[Any]]:
    """{sample name: [samples]} of one Prometheus scrape, parsed by prometheus_client itself."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(address, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out
