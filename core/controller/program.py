"""The controller's training program: one readable loop over the worker group.

    register → setup → resume from the latest committed checkpoint → for each step:
    [stop? checkpoint now and return] train_step, record, maybe checkpoint → final checkpoint

Bulk tensors never come here; each step brings back a few numbers per rank, and a
checkpoint brings back one small ack per rank, after which this process commits it.
At every step boundary the stop policy (core.controller.stop) is asked whether a preemption
signal arrived or the walltime is near; then the step just finished is checkpointed
synchronously and ``run_all`` returns the request, so no finished step is lost. Failures
propagate as exceptions; core.controller.recovery decides what happens next.
"""
from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.checkpoint import manifest
from core.controller.dispatch import collect_all
from core.controller.group import WorkerGroup
from core.controller.stop import StopPolicy, StopRequest
from core.record.runfolder import RunFolder, event, write_atomic
from core.spec import config as config_mod
from core.spec.config import RunConfig

if TYPE_CHECKING:
    from core.controller.metrics import Metrics

log = logging.getLogger(__name__)


def model_hash(cfg: RunConfig) -> str:
    """What a checkpoint must agree with to be loadable: the model's shape, not its layout."""
    return hashlib.sha256(json.dumps(config_mod.to_dict(cfg)["model"], sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Program:
    cfg: RunConfig
    run: RunFolder
    group: WorkerGroup
    state: dict[str, Any]
    stop: StopPolicy = field(default_factory=lambda: StopPolicy(None, None))
    metrics: Metrics | None = None  # the Prometheus endpoint (core.controller.metrics); None when metrics.enabled is false
    _pending: tuple[int, Path, float] | None = field(default=None, init=False)
    _started: float = field(default_factory=time.monotonic, init=False)
    _useful_s: float = field(default=0.0, init=False)
    _alloc_base: float | None = field(default=None, init=False)
    _step_s: float = field(default=0.0, init=False)  # a moving average of the step's wall time
    _save_s: float | None = field(default=None, init=False)  # how long the last save took to commit

    def save_state(self) -> None:
        self.run.write_state(self.state)

    # --- the whole run ------------------------------------------------------------------
    def run_all(self) -> StopRequest | None:
        """The whole run; returns the stop request that ended it early, None when it finished."""
        self.setup()
        self.resume()
        stop = self.train()
        if stop is None:
            self.finish()
        return stop

    def forget_async(self) -> None:
        """After a failure: an async save in flight will never be committed (its folder is debris)."""
        self._pending = None

    def setup(self) -> None:
        group = self.group
        group.wait_for_workers()
        addr, port = group.rendezvous
        t0 = time.perf_counter()
        infos = group.call(
            "setup", config=config_mod.to_dict(self.cfg), master_addr=addr, master_port=port,
            timeout_s=self.cfg.timeouts.setup_s,
        )
        if self.metrics is not None:
            self.metrics.observe_dispatch("setup", time.perf_counter() - t0)
        self.state["ranks"] = [
            {"rank": p.rank, "node": p.node, "host": p.host, "pid": p.pid, **(infos[p.rank] or {})}
            for p in sorted(group.peers.values(), key=lambda p: p.rank)
        ]
        event(self.state, "workers_ready", world_size=group.world_size, epoch=group.epoch,
              generation=group.generation)
        self.save_state()

    def resume(self) -> None:
        """Continue from the newest committed checkpoint that verifies (any layout)."""
        step_dir = manifest.latest_valid(self.run.checkpoints, log=log)
        if step_dir is None:
            if int(self.state.get("step", 0)) > 0:
                log.warning("no committed checkpoint in %s: starting again from step 0", self.run.checkpoints)
                event(self.state, "restart_from_scratch", reason="no committed checkpoint")
            self.state["step"] = 0
            self._trim_metrics(0)
            return
        saved = manifest.read_manifest(step_dir)
        if saved.config_hash not in (None, model_hash(self.cfg)):
            raise config_mod.ConfigError(
                f"{step_dir}: saved with another model (config hash {saved.config_hash}, "
                f"this config {model_hash(self.cfg)}); resume with the run's own model section"
            )
        t0 = time.perf_counter()
        self.group.call("ckpt_load", step_dir=str(step_dir), timeout_s=self.cfg.timeouts.checkpoint_s)
        step = int(saved.step)
        self.state["step"] = step
        self._trim_metrics(step)
        event(self.state, "resumed", step=step, checkpoint=step_dir.name, saved_layout=saved.layout,
              layout=self.group.dims.describe(), seconds=round(time.perf_counter() - t0, 3))
        log.info("resumed from %s (saved as %s, now %s)", step_dir, saved.layout, self.group.dims.describe())
        self.save_state()

    def train(self) -> StopRequest | None:
        cfg = self.cfg
        start = int(self.state.get("step", 0))
        owners = self.group.dims.loss_owners()
        interval = cfg.checkpoint.interval_steps
        for step in range(start, cfg.trainer.steps):
            stop = self.stop.check(step_s=self._step_s, save_s=self._save_s)
            if stop is not None:
                self._stop_at_boundary(step, stop)
                return stop
            t0 = time.perf_counter()
            results = self.group.call("train_step", step=step, collect=collect_all, timeout_s=cfg.timeouts.step_s)
            wall = time.perf_counter() - t0
            self._step_s = wall if step == start else 0.8 * self._step_s + 0.2 * wall
            record = self._record(step, results, owners, wall)
            self.run.append_metrics(record)
            self._observe(record, wall)
            self.state.update(step=step + 1, last_loss=record["loss"], updated=time.time())
            if self._pending is not None:
                self._poll_async()
            done = step + 1
            if interval and done % interval == 0 and done < cfg.trainer.steps:
                self.checkpoint(done)
            if done % cfg.trainer.log_interval_steps == 0 or done == cfg.trainer.steps:
                log.info("step %d/%d loss %.4f (%.3f s)", done, cfg.trainer.steps, record["loss"], wall)
                self.save_state()
        return None

    def _stop_at_boundary(self, step: int, stop: StopRequest) -> None:
        """Make ``step`` (every step finished so far) durable before the job goes away."""
        kind = "time_running_out" if stop.cause == "time_running_out" else "preempted"
        event(self.state, kind, step=step, cause=stop.cause, signal=stop.signal, detail=stop.detail,
              time_left_s=None if stop.time_left_s is None else round(stop.time_left_s, 1), signal_at=stop.signal_at)
        log.warning("%s at step %d (%s): checkpointing, then requeueing", stop.cause, step, stop.detail)
        self.save_state()
        self._wait_async()
        if step > 0 and step not in manifest.committed_steps(self.run.checkpoints):
            timeout = self.cfg.timeouts.checkpoint_s
            if stop.time_left_s is not None:  # commit within the time Slurm leaves us
                timeout = max(1.0, min(timeout, stop.time_left_s - 2.0))
            self.checkpoint(step, blocking=True, timeout_s=timeout)

    def finish(self) -> None:
        step = int(self.state.get("step", 0))
        if self.cfg.checkpoint.at_end and step not in manifest.committed_steps(self.run.checkpoints):
            self.checkpoint(step, blocking=True)
        self._wait_async()

    # --- checkpoints ----------------------------------------------------------------------
    def checkpoint(self, step: int, *, blocking: bool = False, timeout_s: float | None = None) -> None:
        """Order every rank to write its shard of ``step``; commit once all have acked."""
        self._wait_async()
        tmp = manifest.tmp_step_dir(self.run.checkpoints, step)
        attrs = {"step": step, "layout": self.group.dims.describe(), "config_hash": model_hash(self.cfg)}
        async_save = self.cfg.checkpoint.async_save and not blocking
        t0 = time.perf_counter()
        acks = self.group.call("ckpt_save", step=step, tmp_dir=str(tmp), attrs=attrs, async_save=async_save,
                               timeout_s=timeout_s or self.cfg.timeouts.checkpoint_s)
        if async_save:
            self._pending = (step, tmp, t0)
            event(self.state, "checkpoint_started", step=step, blocked_s=round(time.perf_counter() - t0, 3))
            return
        self._commit(step, tmp, acks, t0)

    def _poll_async(self) -> None:
        assert self._pending is not None
        step, tmp, t0 = self._pending
        acks = self.group.call("ckpt_poll", step=step, timeout_s=self.cfg.timeouts.call_s)
        if all(a is not None for a in acks):
            self._pending = None
            self._commit(step, tmp, acks, t0)

    def _wait_async(self) -> None:
        if self._pending is None:
            return
        step, tmp, t0 = self._pending
        self._pending = None
        acks = self.group.call("ckpt_wait", step=step, timeout_s=self.cfg.timeouts.checkpoint_s)
        self._commit(step, tmp, acks, t0)

    def _commit(self, step: int, tmp: Path, acks: list[dict[str, Any]], t0: float) -> None:
        meta = {
            "layout": self.group.dims.describe(),
            "dims": {"tp": self.group.dims.tp, "pp": self.group.dims.pp, "dp": self.group.dims.dp},
            "config_hash": model_hash(self.cfg),
            "loop": {"step": step, "epoch": self.group.epoch, "generation": self.group.generation,
                     "last_loss": self.state.get("last_loss")},
        }
        final = manifest.commit(self.run.checkpoints, step, tmp, acks, meta,
                                world_size=self.group.world_size, keep_last=self.cfg.checkpoint.keep_last)
        seconds = time.perf_counter() - t0
        self._save_s = seconds
        nbytes = sum(int(a.get("size_bytes", 0)) for a in acks)
        event(self.state, "checkpoint_committed", step=step, folder=final.name, seconds=round(seconds, 3),
              bytes=nbytes)
        log.info("checkpoint of step %d committed in %.2f s (%.1f MB)", step, seconds, nbytes / 1e6)
        if self.metrics is not None:
            self.metrics.observe_checkpoint(seconds, nbytes)
        self.save_state()

    # --- metrics ------------------------------------------------------------------------
    def _trim_metrics(self, step: int) -> None:
        """After a resume, the steps past the checkpoint are redone: drop their records."""
        if not self.run.metrics.exists():
            return
        keep = [line for line in self.run.metrics.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) < step]
        write_atomic(self.run.metrics, "".join(line + "\n" for line in keep))
        # Goodput counts the steps that survive: work redone after a requeue was not useful.
        self._useful_s = sum(float(json.loads(line).get("step_time_s", 0.0)) for line in keep)

    def _observe(self, record: dict[str, Any], wall: float) -> None:
        """Feed the Prometheus endpoint. Allocated time carries across requeues in state.json."""
        goodput = self.state.setdefault("goodput", {"allocated_s": 0.0})
        if self._alloc_base is None:  # what earlier epochs (before a requeue) were allocated
            self._alloc_base = float(goodput.get("allocated_s", 0.0))
        self._useful_s += wall
        goodput.update(useful_s=self._useful_s, allocated_s=self._alloc_base + time.monotonic() - self._started)
        if self.metrics is None:
            return
        self.metrics.observe_step(record)
        self.metrics.observe_dispatch("train_step", wall)
        self.metrics.observe_goodput(goodput["useful_s"], goodput["allocated_s"])
        now = time.monotonic()
        for peer in self.group.peers.values():
            self.metrics.observe_heartbeat_lag(peer.rank, now - peer.last_seen)

    def _record(self, step: int, results: list[Any], owners: list[int], wall: float) -> dict[str, Any]:
        losses = [results[r]["loss"] for r in owners]
        first = results[owners[0]]
        tokens = sum(int(results[r].get("tokens", 0)) for r in owners)
        record = {
            "step": step,
            "loss": statistics.fmean(losses),
            "grad_norm": first.get("grad_norm"),
            "lr": first.get("lr"),
            "tokens": tokens,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "step_time_s": wall,
            "rank_step_time_s": [float(r.get("step_time_s", 0.0)) for r in results],
            # A task that does not measure its memory gets the worker's last heartbeat figure.
            "rss_mb": [float(r.get("rss_mb") or self.group.peers[i].rss_mb) for i, r in enumerate(results)],
            "time": time.time(),
        }
        for key in ("data_wait_s", "cuda_peak_mb", "grad_sync_s"):
            if all(key in r for r in results):
                record[key] = [float(r[key]) for r in results]
        return record
