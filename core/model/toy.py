"""A deterministic numpy task for the control plane: no torch, starts in milliseconds.

Each rank fits its own linear model to batches drawn from (seed, step, rank), so a run is
reproducible and a loss that falls shows calls arrive in order. It serves the training
calls (core.wire.calls) and a few of its own so tests and benchmarks can drive the
runtime: NOOP, ECHO, FAIL, SLEEP, PID, GET_STATE, SET_STATE.

Test-only knobs, read from the environment at setup (the recovery tests use them):
``BATON_TOY_FAIL_AT_STEP=s`` makes ``train_step(s)`` raise the same ValueError on every rank
(a deterministic bug); ``BATON_TOY_SAVE_DELAY_S=x`` makes each checkpoint save wait x seconds first (a
window to kill a worker while a checkpoint is being written); ``BATON_TOY_STEP_S=x`` makes
each step take x seconds more (a run long enough to be preempted; the losses are unchanged);
``BATON_TOY_SETUP_S=x`` makes setup take x seconds (a worker importing its libraries;
``BATON_TOY_SETUP_RANK=r``: on rank r only);
``BATON_TOY_SAVE_ENOSPC_ONCE=1`` makes the first checkpoint save of the run fail with
"No space left on device" (once: a marker file in the run folder remembers it).
"""
from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.checkpoint.spec import TensorSlice
from core.config.dims import Coords
from core.job import faults
from core.job.process import rss_mb
from core.wire import calls
from core.wire.contract import Method, NoArgs
from core.worker.task import WorkerContext

_DIM = 16


@dataclass(frozen=True, kw_only=True)
class Echo:
    """What ECHO sends back, with the rank added: a scalar, a list (split by dp), a string, an array."""

    v: int | None = None
    xs: tuple[Any, ...] = ()
    k: str = ""
    a: Any = None  # a numpy array


@dataclass(frozen=True, kw_only=True)
class Echoed(Echo):
    rank: int


@dataclass(frozen=True, kw_only=True)
class Fail:
    message: str = "requested failure"


@dataclass(frozen=True, kw_only=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, kw_only=True)
class Weights:
    w: Any  # a numpy array of _DIM float64


NOOP = Method("noop", NoArgs, None)
ECHO = Method("echo", Echo, Echoed)
FAIL = Method("fail", Fail, None)
SLEEP = Method("sleep", Sleep, float)
PID = Method("pid", NoArgs, int)
GET_STATE = Method("get_state", NoArgs, Weights)
SET_STATE = Method("set_state", Weights, None)


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
        self.enospc_once = False

    def handlers(self) -> Mapping[Method[Any, Any], Callable[[Any], Any]]:
        return {
            calls.SETUP: self.setup,
            calls.TRAIN_STEP: self.train_step,
            GET_STATE: lambda _: Weights(w=self.w),
            SET_STATE: self.set_state,
            NOOP: lambda _: None,
            ECHO: lambda req: Echoed(rank=self.ctx.rank, v=req.v, xs=req.xs, k=req.k, a=req.a),
            FAIL: self.fail,
            SLEEP: self.sleep,
            PID: lambda _: os.getpid(),
        }

    def close(self) -> None:
        pass

    def setup(self, req: calls.Setup) -> calls.SetupInfo:
        cfg = self.ctx.config
        self.seed = cfg.seed
        lr = cfg.optimizer.lr
        self.lr = 0.1 if lr == "auto" else min(float(lr), 0.2)
        self.true_w = np.random.default_rng(self.seed).normal(size=_DIM)
        self.w = np.zeros(_DIM)
        self.fail_at_step = int(os.environ.get("BATON_TOY_FAIL_AT_STEP", "-1"))
        self.save_delay_s = float(os.environ.get("BATON_TOY_SAVE_DELAY_S", "0"))
        self.step_delay_s = float(os.environ.get("BATON_TOY_STEP_S", "0"))
        self.enospc_once = os.environ.get("BATON_TOY_SAVE_ENOSPC_ONCE") == "1"
        self._slow_setup()
        return calls.SetupInfo(coords=Coords(rank=self.ctx.rank, tp=0, pp=0, dp=self.ctx.rank), num_params=_DIM)

    def _slow_setup(self) -> None:
        seconds, only = float(os.environ.get("BATON_TOY_SETUP_S", "0")), os.environ.get("BATON_TOY_SETUP_RANK")
        if seconds and (only is None or int(only) == self.ctx.rank):
            self.ctx.log.info("toy setup takes %.1f s (BATON_TOY_SETUP_S)", seconds)
            time.sleep(seconds)  # the knob: a slow start-up

    def train_step(self, req: calls.Step) -> calls.StepResult:
        t0 = time.perf_counter()
        step = req.step
        if step == self.fail_at_step:
            raise ValueError(f"toy failure at step {step} (BATON_TOY_FAIL_AT_STEP)")
        faults.raise_at_step(step, self.ctx.rank)
        rng = np.random.default_rng([self.seed, step, self.ctx.rank])
        x = rng.normal(size=(32, _DIM))
        y = x @ self.true_w
        err = x @ self.w - y
        loss = float(np.mean(err**2))
        grad = 2 * x.T @ err / len(x)
        self.w = self.w - self.lr * grad
        if self.step_delay_s:
            time.sleep(self.step_delay_s)  # the knob: a longer step
        return calls.StepResult(loss=loss, grad_norm=float(np.linalg.norm(grad)), lr=self.lr, tokens=32,
                                step_time_s=time.perf_counter() - t0, rss_mb=rss_mb())

    def checkpoint_state(self) -> tuple[list[tuple[TensorSlice, np.ndarray]], dict[str, Any]]:
        """Each rank's own weights under a per-rank name (the toy has no sharded tensors)."""
        if self.save_delay_s:
            time.sleep(self.save_delay_s)  # the knob under test: a slow checkpoint write
        marker = self.ctx.run_dir / "toy-enospc-done"
        if self.enospc_once and not marker.exists():
            marker.touch()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.ctx.run_dir / "checkpoints"))
        name = f"toy.w.rank{self.ctx.rank}"
        item = TensorSlice(name=name, global_shape=(_DIM,), offset=(0,), shape=(_DIM,), dtype="float64")
        return [(item, self.w.copy())], {"rank": self.ctx.rank}

    def restore_state(self, read: Callable[[str, tuple[int, ...], tuple[int, ...]], np.ndarray],
                      blobs: dict[str, Any]) -> None:
        self.w = np.array(read(f"toy.w.rank{self.ctx.rank}", (0,), (_DIM,)), dtype=np.float64)

    def set_state(self, req: Weights) -> None:
        self.w = np.array(req.w, dtype=np.float64)

    @staticmethod
    def fail(req: Fail) -> None:
        raise RuntimeError(req.message)

    @staticmethod
    def sleep(req: Sleep) -> float:
        time.sleep(req.seconds)  # the behaviour under test: a slow call
        return req.seconds
