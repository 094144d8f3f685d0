"""A group call in flight: what the controller keeps of a call between sending it
(``WorkerGroup.start_ranks``) and waiting for it (``WorkerGroup.wait``); the program holds it
through ``core.controller.roles.Call``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.wire.contract import Method


@dataclass(frozen=True)
class Pending:
    """A call sent and not yet waited for (``WorkerGroup.start_ranks``): its answers so far
    by rank, filled in as they arrive."""

    req: int
    method: Method[Any, Any]
    ranks: tuple[int, ...]
    timeout_s: float
    deadline: float
    results: dict[int, Any]
