"""The rollouts an RL run has asked of the generator and not yet trained on (``rl.max_staleness``).

With ``rl.max_staleness: k > 0`` (split placement) the generator works ahead of the trainer
on a fixed schedule, so that the policy each rollout comes from is a function of the step
alone, never of timing:

    at the RL phase's first step w, and every k steps after it (a block's first step t):
        wait for every rollout still in flight, sync the generator to the trainer's policy
        (version t), then start the rollouts of steps t + 1 .. t + k (and t's own at w)
    every step s: train on rollout s (from policy w + (s - w - 1) // k * k for s > w, w at w:
    ``version_of``): its staleness, s - its version, is at most k

With k = 1 every step is a block's first: rollout s + 1 is generated from policy s while the
trainer updates policy s on rollout s (verl's one-step-off-policy). The generator's ranks
serve their calls in order, so a sync started after a rollout runs after it.

A checkpoint of step s keeps the rollouts started and not yet trained on (steps s .. s + k - 1
at most): the controller waits for those in flight (``drain``), and writes their tokens,
log-probs and versions into the step's folder (``ATTACHMENT``: a .npz, its size and checksum
in the manifest). A resume at s loads them back (``restore``) and trains on exactly what the
uninterrupted run did; a run stopped or killed between checkpoints resumes from the last one,
whose rollouts are complete. Prompts and sampling keys are functions of the step, so nothing
else is kept.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.config.run import RunConfig
from core.controller.generation import PendingRollout, Responses
from core.errors import CheckpointError, WorkerLostError
from core.wire.ragged import FLOATS, TOKENS, Ragged

log = logging.getLogger(__name__)

ATTACHMENT = "rollouts.npz"  # in a checkpoint's step folder, beside the rank files


@dataclass
class Rollout:
    """One step's rollout: the policy version it is generated from, in flight or done."""

    step: int
    version: int
    pending: PendingRollout | None = None
    done: Responses | None = None

    def wait(self) -> Responses:
        if self.done is None:
            assert self.pending is not None
            self.done, self.pending = self.pending.wait(), None
        return self.done


class Rollouts:
    """The started rollouts by step (at most ``k + 1``), in the order they were started."""

    def __init__(self, staleness: int, first_rl_step: int, key: str = "",
                 on_lost: Callable[[WorkerLostError], None] | None = None) -> None:
        self.k, self.first = staleness, first_rl_step
        self.key = key  # what the rollouts depend on besides the step (RLStep: the config's sampling and task)
        self.by_step: dict[int, Rollout] = {}
        # a wait that lost generator workers: restart them and the rollouts in flight, or raise (RLStep)
        self.on_lost = on_lost

    def version_of(self, step: int) -> int:
        """The policy version the schedule generates step ``step``'s rollout from."""
        return step if step <= self.first else self.first + (step - self.first - 1) // self.k * self.k

    def block_starts(self, step: int) -> bool:
        """``step`` begins a block: the generator is synced and the next rollouts started."""
        return step == self.first or (step - self.first) % self.k == 0 or step not in self.by_step

    def to_start(self, step: int, total: int) -> list[int]:
        """The steps whose rollouts a block beginning at ``step`` starts (none past the run's end)."""
        return [s for s in range(step, min(step + self.k + 1, total)) if s not in self.by_step]

    def add(self, step: int, version: int, pending: PendingRollout) -> None:
        self.by_step[step] = Rollout(step, version, pending=pending)

    def take(self, step: int) -> Rollout:
        """Step ``step``'s rollout, waited for; it leaves the queue."""
        self._wait(self.by_step[step])
        return self.by_step.pop(step)

    def drain(self) -> None:
        """Wait for every rollout in flight (the generator is then idle)."""
        for rollout in self.by_step.values():
            self._wait(rollout)

    def _wait(self, rollout: Rollout) -> Responses:
        """``rollout``'s responses; when its generator's workers were lost, ``on_lost`` restarts
        them and every rollout in flight (or raises), and the wait begins again."""
        while True:
            try:
                return rollout.wait()
            except WorkerLostError as exc:
                if self.on_lost is None:
                    raise
                self.on_lost(exc)

    def ready(self, timeout_s: float, *, poll_s: float = 0.05) -> bool:
        """Whether every rollout in flight has its answers within ``timeout_s`` (a stop's time
        budget: a save that would wait longer is not started)."""
        deadline = time.monotonic() + timeout_s
        while not all(r.pending is None or r.pending.done() for r in self.by_step.values()):
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)  # the answers arrive through the group's pump thread meanwhile
        return True

    # --- in a checkpoint ----------------------------------------------------------------
    def to_bytes(self) -> bytes | None:
        """The complete rollouts as one .npz (None when there are none): each step's version,
        tokens and log-probs (a Ragged's values and lengths)."""
        self.drain()
        if not self.by_step:
            return None
        arrays: dict[str, np.ndarray] = {"steps": np.array(sorted(self.by_step), dtype=np.int64),
                                         "key": np.array(self.key)}
        arrays["versions"] = np.array([self.by_step[s].version for s in sorted(self.by_step)], dtype=np.int64)
        for s in sorted(self.by_step):
            done = self._wait(self.by_step[s])
            for name, rows in (("tokens", done.tokens), ("logprobs", done.logprobs)):
                arrays[f"{s}.{name}.values"], arrays[f"{s}.{name}.lengths"] = rows.values, rows.lengths
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        return buf.getvalue()

    def restore(self, data: bytes, *, where: Path) -> None:
        """The rollouts a checkpoint kept (``to_bytes``), complete."""
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                kept: dict[int, Rollout] = {}
                for s, v in zip(z["steps"].tolist(), z["versions"].tolist(), strict=True):
                    responses = Responses(_rows(z, f"{s}.tokens", TOKENS), _rows(z, f"{s}.logprobs", FLOATS))
                    kept[int(s)] = Rollout(int(s), int(v), done=responses)
                saved_key = str(z["key"]) if "key" in z.files else ""
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:  # a torn or corrupt zip
            raise CheckpointError(f"{where}: the rollouts the checkpoint kept cannot be read ({exc})") from exc
        off = {s: r.version for s, r in kept.items() if r.version != self.version_of(s)}
        if saved_key != self.key or off:
            why = (f"steps {sorted(off)} come from versions {sorted(off.values())}, not rl.max_staleness = {self.k}'s"
                   if off else "they were sampled with other rl settings (a resume that changed them)")
            log.warning("%s: not using the %d rollout(s) kept for steps %s: %s; they are generated again from "
                        "this step's policy", where, len(kept), sorted(kept), why)
            return
        self.by_step = kept  # all of them or, on an error, none
        log.info("restored %d rollout(s) not yet trained on from %s: steps %s", len(self.by_step), where,
                 sorted(self.by_step))


def _rows(z: Any, name: str, dtype: np.dtype[Any]) -> Ragged:
    """Array pair ``name`` of a rollouts file as rows of exactly ``dtype`` (never converted: a
    file of another dtype is not one ``to_bytes`` wrote)."""
    values = z[f"{name}.values"]
    if values.dtype != dtype:
        raise ValueError(f"{name}.values is {values.dtype}, not {dtype}")
    return Ragged(values=values, lengths=z[f"{name}.lengths"])


def rollout_key(cfg: RunConfig) -> str:
    """What a step's rollout depends on besides its step and policy (a checkpoint's kept
    rollouts are used only under the same): the seed, the task's prompts, the sampling."""
    rl = cfg.rl
    fields = dict(seed=cfg.seed, task=rl.task, prompts=rl.prompts, n=rl.n, prompts_per_step=rl.prompts_per_step,
                  prompt_length=rl.prompt_length, max_response_length=rl.max_response_length,
                  temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p, stop=rl.stop, tokenizer=rl.tokenizer,
                  staleness=rl.max_staleness, warmup_steps=rl.warmup_steps, engine=cfg.generator.engine)
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
