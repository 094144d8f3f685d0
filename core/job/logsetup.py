"""Logging for the two job-side entry points: every record carries role and rank.

    2026-12-02 17:20:01,123 INFO [worker r3@node2] core.worker.runtime: registered ...

Only the entry points call ``configure``; library modules just use getLogger(__name__).
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s [%(baton_role)s] %(name)s: %(message)s"


class _RoleFilter(logging.Filter):
    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def filter(self, record: logging.LogRecord) -> bool:
        record.baton_role = self.label
        return True


_filter = _RoleFilter("baton")


def configure(label: str, log_file: Path | None, *, level: int = logging.INFO) -> None:
    """Send records to ``log_file`` and stderr, each tagged with ``label``."""
    _filter.label = label
    root = logging.getLogger()
    root.setLevel(level)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    # stderr (the .out file of a process) gets warnings and worse; the log file gets all.
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setLevel(logging.WARNING)
    handlers: list[logging.Handler] = [stderr]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.addFilter(_filter)
        root.addHandler(handler)


def set_label(label: str) -> None:
    """Change the role label once more is known (rank, parallel coordinates)."""
    _filter.label = label


def switch_file(log_file: Path) -> None:
    """Move file logging to ``log_file`` (a worker learns its rank after registering)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_filter)
    root.addHandler(handler)
