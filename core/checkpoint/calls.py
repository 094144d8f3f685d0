"""The checkpoint calls: the controller's coordinator asks, each rank's service answers.

    CKPT_SAVE  Save     → Saved            write this rank's shard into a temporary step folder
    CKPT_POLL  Step     → ShardAck | None  the ack of an async save once durable (repeatable)
    CKPT_WAIT  Step     → ShardAck         block until the async save is durable
    CKPT_LOAD  Load     → Loaded           read this rank's slices (in its own layout); with
                                           ``into="weights"`` only the model weights (a run's
                                           ``init_from``), ``into="reference"`` those into the
                                           task's reference model (an RL run's)

The controller commits once every rank has acked (core.checkpoint.coordinator); a rank
only writes into the folder it is given.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from core.checkpoint.spec import ShardAck
from core.wire.calls import Step
from core.wire.contract import Method


@dataclass(frozen=True, kw_only=True)
class ShardAttrs:
    """Written into every shard file's attributes."""

    step: int
    layout: str
    config_hash: str


@dataclass(frozen=True, kw_only=True)
class Save:
    step: int
    tmp_dir: str
    attrs: ShardAttrs
    async_save: bool = False


@dataclass(frozen=True, kw_only=True)
class Saved:
    ack: ShardAck | None = None  # None: an async save is under way (CKPT_POLL / CKPT_WAIT)


@dataclass(frozen=True, kw_only=True)
class Load:
    step_dir: str
    into: Literal["state", "weights", "reference"] = "state"


@dataclass(frozen=True, kw_only=True)
class Loaded:
    step: int


CKPT_SAVE = Method("ckpt_save", Save, Saved)
CKPT_POLL = Method("ckpt_poll", Step, ShardAck | None)
CKPT_WAIT = Method("ckpt_wait", Step, ShardAck)
CKPT_LOAD = Method("ckpt_load", Load, Loaded)
