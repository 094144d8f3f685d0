"""How a Prometheus finds a run: its ``run`` label and a file-based service-discovery target.

Every series the controller serves carries ``run="<name>/<run id>"``: the run folder's last
two parts (``<runs_root>/<name>/<run id>/``), unique under one runs_root (a sweep's point ids
repeat across sweeps; with the name they do not). With ``metrics.sd_dir`` set, the controller
writes ``<sd_dir>/baton-<name>-<run id>.json`` when its endpoint starts, in Prometheus's
``file_sd_configs`` format::

    [{"targets": ["<host>:<port>"], "labels": {"job": "baton", "run": "<name>/<run id>", "node": ...}}]

atomically (temporary file, then rename: Prometheus may read the folder at any moment and
reads only ``*.json``; the temporary name does not match), and removes it when it ends. A
requeued or resumed run writes it again. A controller that died without its ``finally``
(SIGKILL, a lost node) leaves its file: Prometheus keeps the target and marks it down
(``up == 0``) until the run writes it again or someone deletes it.

No third-party imports: the login node checks ``sd_dir`` here (``check_sd_dir``).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from core.errors import ConfigError
from core.record.runfolder import write_json

log = logging.getLogger(__name__)

JOB = "baton"


def run_label(run_path: Path) -> str:
    """The ``run`` label of a run folder: ``<name>/<run id>``."""
    return f"{run_path.parent.name}/{run_path.name}"


def target_file(sd_dir: Path, run_path: Path) -> Path:
    """Where the run's target goes in ``sd_dir``."""
    return sd_dir / f"baton-{run_path.parent.name}-{run_path.name}.json"


def write_target(sd_dir: Path, run_path: Path, target: str, labels: dict[str, str]) -> Path | None:
    """Publish ``target`` (``host:port``) with ``labels``; the file, or None when it could not
    be written (logged: the run trains on without discovery, as without metrics)."""
    path = target_file(sd_dir, run_path)
    try:
        sd_dir.mkdir(parents=True, exist_ok=True)
        write_json(path, [{"targets": [target], "labels": {"job": JOB, "run": run_label(run_path), **labels}}])
    except OSError as exc:
        log.warning("metrics.sd_dir: cannot write %s (%s); Prometheus will not discover this run", path, exc)
        return None
    log.info("Prometheus target %s in %s", target, path)
    return path


def remove_target(path: Path) -> None:
    """Withdraw the run's target (a controller ending); a missing file is fine."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("metrics.sd_dir: cannot remove %s (%s); Prometheus will show the target down", path, exc)


def check_sd_dir(value: str) -> str:
    """``metrics.sd_dir`` checked on the login node (nothing created): a folder, or a path that
    can be created, writable either way; returned absolute. A one-line ConfigError otherwise."""
    path = Path(value).expanduser().absolute()
    probe = path
    while not probe.exists():
        if probe.is_symlink():  # a dangling link: mkdir would fail on the compute node
            raise ConfigError(f"metrics.sd_dir: {value!r}: {probe} is a broken symbolic link; give a folder that "
                              "every node mounts, where Prometheus reads its file_sd targets")
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"metrics.sd_dir: {value!r}: {probe} is not a folder; give a folder (or one to create) "
                          "that every node mounts, where Prometheus reads its file_sd targets")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == path else f"cannot be created ({probe} is not writable)"
        raise ConfigError(f"metrics.sd_dir: {value!r} {what}; give a folder you can write that every node mounts, "
                          "or unset metrics.sd_dir")
    return str(path)
