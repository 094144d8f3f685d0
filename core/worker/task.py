"""The seam between the generic worker runtime and the model code it serves.

A task is built once per worker process with a ``WorkerContext`` and exposes an explicit
table of callable methods: the controller calls them by name, with msgpack-able keyword
arguments, and gets back msgpack-able values (dicts, lists, scalars, numpy arrays).
No reflection: only what ``rpc_table`` lists can be called.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """What a worker knows about itself once the controller has welcomed it."""

    rank: int
    world_size: int
    epoch: int
    run_dir: Path
    host: str
    log: logging.Logger


class Task(Protocol):
    def rpc_table(self) -> Mapping[str, Callable[..., Any]]:
        """Method name → callable; the only methods the controller may call."""
        ...
