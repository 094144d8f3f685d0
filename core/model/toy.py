"""A deterministic numpy task for the control plane: no torch, starts in milliseconds.

Each rank fits its own linear model to batches drawn from (seed, step, rank), so a run is
reproducible and a loss that falls shows calls arrive in order. The extra methods
(``echo``, ``fail``, ``sleep``) exist so tests and benchmarks can drive the runtime.

Test-only knobs, read from the environment at setup (the recovery tests use them):
``BATON_TOY_FAIL_AT_STEP=s`` makes ``train_step(s)`` raise on every rank (a deterministic
bug); ``BATON_TOY_SAVE_DELAY_S=x`` makes each checkpoint save wait x seconds first (a
window to kill a worker while a checkpoint is being written); ``BATON_TOY_STEP_S=x`` makes
each step take x seconds more (a run long enough to be preempted; the losses are unchanged).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from core.checkpoint.spec import TensorSlice
from core.worker.task import WorkerContext

_DIM = 16


class ToyTask:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.seed = 0
        self.lr = 0.1
        self.w = np.zeros(_DIM)
        self.true_w = np.zeros(_DIM)
        self.fail_at_step = -1
        self.save_delay_s = 0.0
        self.step_delay_s = 0.0

    def rpc_table(self) -> Mapping[str, Callable[..., Any]]:
        return {
            "setup": self.setup,
            "train_step": self.train_step,
            "get_state": self.get_state,
            "set_state": self.set_state,
            "noop": self.noop,
            "echo": self.echo,
            "fail": self.fail,
            "sleep": self.sleep,
            "pid": self.pid,
        }

    def setup(self, config: dict[str, Any], master_addr: str = "", master_port: int = 0) -> dict[str, Any]:
        self.seed = int(config.get("seed", 0))
        lr = config.get("optimizer", {}).get("lr", 0.1)
        self.lr = 0.1 if lr == "auto" else min(float(lr), 0.2)
        self.true_w = np.random.default_rng(self.seed).normal(size=_DIM)
        self.w = np.zeros(_DIM)
        self.fail_at_step = int(os.environ.get("BATON_TOY_FAIL_AT_STEP", "-1"))
        self.save_delay_s = float(os.environ.get("BATON_TOY_SAVE_DELAY_S", "0"))
        self.step_delay_s = float(os.environ.get("BATON_TOY_STEP_S", "0"))
        return {"coords": {"tp": 0, "pp": 0, "dp": self.ctx.rank}, "layers": [], "num_params": _DIM, "device": "cpu"}

    def train_step(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        if step == self.fail_at_step:
            raise RuntimeError(f"toy failure at step {step} (BATON_TOY_FAIL_AT_STEP)")
        rng = np.random.default_rng([self.seed, step, self.ctx.rank])
        x = rng.normal(size=(32, _DIM))
        y = x @ self.true_w
        err = x @ self.w - y
        loss = float(np.mean(err**2))
        grad = 2 * x.T @ err / len(x)
        self.w = self.w - self.lr * grad
        if self.step_delay_s:
            time.sleep(self.step_delay_s)  # the knob: a longer step
        return {"loss": loss, "grad_norm": float(np.linalg.norm(grad)), "lr": self.lr, "tokens": 32,
                "step_time_s": time.perf_counter() - t0}

    def checkpoint_state(self) -> tuple[list[tuple[TensorSlice, np.ndarray]], dict[str, Any]]:
        """Each rank's own weights under a per-rank name (the toy has no sharded tensors)."""
        if self.save_delay_s:
            time.sleep(self.save_delay_s)  # the knob under test: a slow checkpoint write
        name = f"toy.w.rank{self.ctx.rank}"
        item = TensorSlice(name=name, global_shape=(_DIM,), offset=(0,), shape=(_DIM,), dtype="float64")
        return [(item, self.w.copy())], {"rank": self.ctx.rank}

    def restore_state(self, read: Callable[[str, tuple[int, ...], tuple[int, ...]], np.ndarray],
                      blobs: dict[str, Any]) -> None:
        self.w = np.array(read(f"toy.w.rank{self.ctx.rank}", (0,), (_DIM,)), dtype=np.float64)

    def get_state(self) -> dict[str, Any]:
        return {"w": self.w}

    def set_state(self, w: np.ndarray) -> None:
        self.w = np.array(w, dtype=np.float64)

    def noop(self) -> None:
        return None

    def echo(self, **kwargs: Any) -> dict[str, Any]:
        return {"rank": self.ctx.rank, **kwargs}

    def fail(self, message: str = "requested failure") -> None:
        raise RuntimeError(message)

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)  # the behaviour under test: a slow call
        return seconds

    def pid(self) -> int:
        return os.getpid()
