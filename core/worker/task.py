"""The seam between the worker runtime and the model code it serves.

A task is built once per worker process with a ``WorkerContext`` and lists its handlers:
``{TRAIN_STEP: self.train_step, ...}``, each taking the method's typed request and
returning its typed result (``core.wire.contract``). Only what ``handlers`` lists can be
called. ``close`` runs when the controller shuts the worker down.

Model packages (``core.model``) import this module and nothing else of the worker role.
``ON_HARD_EXIT``: what a task started that must not outlive the process (a vLLM engine's
processes), ended when the worker exits at once (core.worker.heartbeat.hard_exit).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from core.config.roles import RolePlan
from core.config.run import RunConfig
from core.wire.contract import Method

ON_HARD_EXIT: list[Callable[[], None]] = []


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """What a worker knows about itself once the controller has welcomed it."""

    rank: int
    world_size: int
    epoch: int
    run_dir: Path
    host: str
    log: logging.Logger
    config: RunConfig  # the run's config.yaml, read once by this process
    roles: tuple[RolePlan, ...]  # the worker groups this rank serves (plan.json): its process's own first

    @property
    def role(self) -> RolePlan:
        """The group whose process this is."""
        return self.roles[0]


class Task(Protocol):
    def handlers(self) -> Mapping[Method[Any, Any], Callable[[Any], Any]]:
        """Method → handler; the only methods the controller may call."""
        ...

    def close(self) -> None:
        """Release what the task holds (process groups, files); the worker exits next."""
        ...
