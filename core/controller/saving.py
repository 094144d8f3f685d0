"""When the controller's program checkpoints: one object decides, the loop asks it.

    saves.maybe_save(done, loss)     every ``checkpoint.interval_steps`` (not the last step)
    saves.at_stop(step, loss, t)     a stop at a step boundary: that step, synchronously,
                                     within ``t``, the time Slurm leaves (StopPolicy.time_budget_s)
    saves.at_end(step, loss)         the run's end (``checkpoint.at_end``)
    saves.now(step, loss)            a program's own point (the RL reference policy)

Every save records the loop's state (``core.checkpoint.loop.LoopState``), which the
program provides: the policy version and its programs' state; and the program's files
(``attach``: an RL run's rollouts started and not yet trained on, core.controller.rollouts).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

from core.checkpoint.coordinator import CheckpointCoordinator
from core.checkpoint.loop import LoopState
from core.config.run import CheckpointConfig

LoopOf = Callable[[int, "float | None"], LoopState]  # (step, last loss) → what the checkpoint records
AttachOf = Callable[[], Mapping[str, bytes]]  # the program's files in a checkpoint: name → bytes


class SavePolicy:
    def __init__(self, checkpoints: CheckpointCoordinator, cfg: CheckpointConfig, *, total_steps: int,
                 loop_of: LoopOf, attach: AttachOf = dict) -> None:
        self.checkpoints = checkpoints
        self.interval = cfg.interval_steps
        self.at_end_enabled = cfg.at_end
        self.total_steps = total_steps
        self.loop_of = loop_of
        self.attach = attach

    def on_interval(self, done: int) -> bool:
        """``checkpoint.interval_steps`` falls on ``done``."""
        return bool(self.interval) and done % self.interval == 0

    def due(self, done: int) -> bool:
        """A save after step ``done``: on the interval, except the run's last (``at_end`` saves that)."""
        return self.on_interval(done) and done < self.total_steps

    def maybe_save(self, done: int, loss: float | None) -> None:
        """After step ``done``: commit a finished async save, then save if the interval says so."""
        self.checkpoints.poll()
        if self.due(done):
            self.checkpoints.save(self.loop_of(done, loss), attachments=self.attach())

    def at_stop(self, step: int, loss: float | None, timeout_s: float) -> None:
        """Make ``step`` durable before the job goes away, within ``timeout_s`` (nothing to do
        at step 0 or when it is committed already)."""
        self.checkpoints.drain(timeout_s=timeout_s)
        if step > 0 and not self.checkpoints.committed(step):
            # Tried even when Slurm's clock says no time is left: that clock is often behind a
            # preemption's grace time, and a save Slurm cuts off mid-write is only debris.
            self.checkpoints.save(self.loop_of(step, loss), blocking=True, timeout_s=max(1.0, timeout_s),
                                  attachments=self.attach())

    def at_end(self, step: int, loss: float | None) -> None:
        if self.at_end_enabled and not self.checkpoints.committed(step):
            self.checkpoints.save(self.loop_of(step, loss), blocking=True, attachments=self.attach())
        self.checkpoints.drain()

    def now(self, step: int, loss: float | None) -> None:
        """A blocking save of ``step`` unless it is committed already."""
        self.checkpoints.drain()  # an async save of this very step may be in flight
        if not self.checkpoints.committed(step):
            self.checkpoints.save(self.loop_of(step, loss), blocking=True, attachments=self.attach())
