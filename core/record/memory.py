"""memory.json: what every rank measured it held at the first training step of an allocation.

Written by the controller (``core.controller.program``) from that step's results, read by
`baton plan --check` (``launcher.plan_check``) beside the plan's estimate::

    {"step": 0, "micro_batch_size": 4, "device": "cuda",
     "ranks": [{"weights_bytes": 1.2e9, "grads_bytes": ..., "optimizer_bytes": ..., "activations_bytes": ...}, ...]}

A rank that measured nothing is ``{}``. A missing or damaged file is one ``RunFolderError``
naming it.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config.schema import build
from core.errors import RunFolderError
from core.record.runfolder import write_json

# The order of ``core.wire.calls.StepResult.memory``.
CATEGORIES = ("weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """Bytes one rank held, by category; None: not measured."""

    weights_bytes: float | None = None
    grads_bytes: float | None = None
    optimizer_bytes: float | None = None
    activations_bytes: float | None = None

    @classmethod
    def from_measured(cls, measured: Sequence[float] | None) -> RankMemory:
        """From a step result's ``memory`` (CATEGORIES' order; None or short: the rest unmeasured)."""
        return cls(**dict(zip(CATEGORIES, measured or (), strict=False)))


@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """One allocation's first step: what each rank (in rank order) held."""

    step: int
    micro_batch_size: int | None  # as the workers resolved it
    device: str  # the ranks' device: "cuda" or "cpu"
    ranks: tuple[RankMemory, ...]

    @classmethod
    def from_results(cls, step: int, micro_batch_size: int | None, device: str,
                     measured: Sequence[Sequence[float] | None]) -> MemoryReport:
        """From the step results' ``memory``, one per rank in rank order."""
        return cls(step=step, micro_batch_size=micro_batch_size, device=device,
                   ranks=tuple(RankMemory.from_measured(m) for m in measured))

    def to_data(self) -> dict[str, Any]:
        ranks = [{k: getattr(r, k) for k in CATEGORIES if getattr(r, k) is not None} for r in self.ranks]
        return {"step": self.step, "micro_batch_size": self.micro_batch_size, "device": self.device, "ranks": ranks}

    def write(self, path: Path) -> None:
        """Replace ``path`` atomically."""
        write_json(path, self.to_data())

    @classmethod
    def read(cls, path: Path) -> MemoryReport:
        """The report at ``path``; missing, unreadable or not a report: a RunFolderError naming it."""
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise RunFolderError(f"{path}: missing; the ranks measure what they hold at the first training step of "
                                 "an allocation: run (or resume) the run for at least one step") from None
        except (OSError, ValueError, RecursionError) as exc:
            raise RunFolderError(f"{path}: unreadable ({exc}); resume the run for a step to write it again") from None
        return build(cls, data, str(path), error=RunFolderError)
