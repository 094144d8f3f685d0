"""What a checkpoint records of the controller's loop (the manifest's ``meta.loop``).

The controller writes it with every commit and reads it back once when an allocation
resumes: the step, the epoch and worker generation that saved it, the last loss, the
policy version a generator was last synced to, and the program's own state (an RL
program's adaptive KL coefficient, the replicas' sync period under ``parallel.sync``).
On disk it is a flat JSON object; a key whose value is unset is left out, as older
checkpoints have it, and keys an older or newer Baton wrote are ignored.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class LoopState:
    step: int = 0
    epoch: int = 0
    generation: int = 0
    last_loss: float | None = None
    policy_version: int | None = None  # the trainer step a generator was last synced to
    kl_coef: float | None = None  # an RL program's (adaptive) KL coefficient
    sync_every: int | None = None  # parallel.sync: the replicas' averaging period

    def to_meta(self) -> dict[str, Any]:
        """The manifest's ``meta.loop``; the program's optional state only where set."""
        data = dataclasses.asdict(self)
        for key in ("kl_coef", "sync_every"):
            if data[key] is None:
                del data[key]
        return data

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any] | None) -> LoopState:
        """A checkpoint's ``meta.loop`` (absent or partial in older checkpoints: defaults)."""
        data = meta or {}
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
