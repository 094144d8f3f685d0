"""The controller's training program: one readable loop over the worker group.

    register → setup → resume from the latest committed checkpoint → for each step:
    [stop? checkpoint now and return] train_step, record, maybe checkpoint → final checkpoint

Bulk tensors never come here; each step brings back a few numbers per rank, and a
checkpoint one small ack per rank (core.checkpoint.coordinator commits it). At every step
boundary the stop policy (core.controller.stop) is asked whether a preemption signal
arrived or the walltime is near; then the step just finished is checkpointed
synchronously and ``run_all`` returns the request, so no finished step is lost. Failures
propagate as exceptions; core.controller.recovery decides what happens next.
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.checkpoint import calls as ckpt_calls
from core.checkpoint import manifest
from core.checkpoint.coordinator import CheckpointCoordinator
from core.controller.generation import GeneratorFlow
from core.controller.group import WorkerGroup
from core.controller.stop import StopPolicy, StopRequest
from core.controller.sync_policy import SyncPolicy
from core.errors import UserError
from core.record import events as ev
from core.record import steps as step_records
from core.record.memory import MemoryReport
from core.record.runfolder import RunFolder
from core.record.state import Goodput, RankInfo, RunRecord
from core.record.steps import StepRecord
from core.spec import config as config_mod
from core.spec import rl as rl_spec
from core.spec.config import RunConfig
from core.spec.runplan import RunPlan
from core.wire import calls
from core.wire.contract import NoArgs

if TYPE_CHECKING:
    from core.controller.metrics import Metrics
    from core.controller.rl_program import RLStep

log = logging.getLogger(__name__)


@dataclass
class Program:
    cfg: RunConfig
    plan: RunPlan
    run: RunFolder
    record: RunRecord
    group: WorkerGroup
    checkpoints: CheckpointCoordinator
    stop: StopPolicy = field(default_factory=lambda: StopPolicy(None, None))
    metrics: Metrics | None = None  # the Prometheus endpoint; None when metrics.enabled is false
    generator: GeneratorFlow | None = field(default=None, init=False)  # with generator.enabled, once set up
    rl: RLStep | None = field(default=None, init=False)  # program: grpo or ppo, once set up
    sync: SyncPolicy | None = field(default=None, init=False)  # parallel.sync: periodic averaging of replicas
    step: int = field(default=0, init=False)  # steps done
    last_loss: float | None = field(default=None, init=False)
    _started: float = field(default_factory=time.monotonic, init=False)
    _useful_s: float = field(default=0.0, init=False)
    _alloc_base: float | None = field(default=None, init=False)
    _step_s: float = field(default=0.0, init=False)  # a moving average of the step's wall time
    _epoch_start: int | None = field(default=None, init=False)  # the step this allocation began at
    _resumed_from: Path | None = field(default=None, init=False)  # the checkpoint this allocation loaded

    def run_all(self) -> StopRequest | None:
        """The whole run; returns the stop request that ended it early, None when it finished."""
        self.setup()
        self.resume()
        # the loop state of the checkpoint this allocation resumed from (read once)
        loop = (manifest.read_manifest(self._resumed_from).meta.get("loop") or {}) if self._resumed_from else {}
        if self.cfg.parallel.sync.local:
            self.sync = SyncPolicy(self.cfg.parallel.sync, every=loop.get("sync_every"))
        if self.cfg.generator.enabled:  # the second compute flow, synced from the restored trainer
            self.generator = GeneratorFlow(self.cfg, self.run, self.group)
            self.generator.start(self.step)
            if self.cfg.program in rl_spec.RL_PROGRAMS:
                from core.controller.rl_program import RLStep  # numpy: only RL programs need it

                self.rl = RLStep(self.cfg, self.group, self.generator, self.checkpoints)
                self.rl.restore(loop)
        stop = self.train()
        if stop is None:
            self.finish()
        return stop

    def setup(self) -> None:
        """Register the workers, then every rank joins its process group and builds its model
        (a split generator's ranks their own group, from their first rank's rendezvous)."""
        group = self.group
        group.wait_for_workers()
        addr, port = group.rendezvous_of(0)
        t0 = time.perf_counter()
        setup = calls.Setup(master_addr=addr, master_port=port, config_hash=config_mod.config_hash(self.cfg),
                            micro_batch_size=self.plan.micro_batch_size)
        trainer, n = self.plan.world_size, self.plan.generator_workers
        gen_addr, gen_port = group.rendezvous_of(trainer) if n else (addr, port)
        generator = dataclasses.replace(setup, master_addr=gen_addr, master_port=gen_port, micro_batch_size=None)
        infos = group.call(calls.SETUP, setup, timeout_s=self.cfg.timeouts.setup_s, collect=lambda res, _: res,
                           dispatch=lambda req, _: {r: req if r < trainer else generator for r in range(trainer + n)})
        if self.metrics is not None:
            self.metrics.observe_dispatch("setup", time.perf_counter() - t0)
        ranks = tuple(RankInfo(rank=p.rank, node=p.node, host=p.host, pid=p.pid, coords=infos[p.rank].coords,
                               layers=infos[p.rank].layers, num_params=infos[p.rank].num_params,
                               device=infos[p.rank].device, role="trainer" if p.rank < trainer else "generator")
                      for p in sorted(group.peers.values(), key=lambda p: p.rank))
        micro = infos[0].micro_batch_size
        with self.record.update(ev.WorkersReady(world_size=group.world_size, epoch=group.epoch,
                                                generation=group.generation, micro_batch_size=micro, ranks=ranks)) as s:
            if self._alloc_base is None:  # what earlier epochs (before a requeue) held their allocation
                self._alloc_base = s.goodput.allocated_s

    def resume(self) -> None:
        """Continue from the newest committed checkpoint that verifies (any layout)."""
        before = self.record.read()
        step_dir = self.checkpoints.resume_point(from_scratch=before.from_scratch)
        self.step = 0 if step_dir is None else self.checkpoints.load(step_dir)
        self._resumed_from = step_dir
        new: list[ev.Event] = []
        if step_dir is None and self.cfg.init_from is not None:
            new.append(self._initialise())
        if step_dir is None and before.step > 0:
            why = "--from-scratch" if before.from_scratch else "no committed checkpoint"
            log.warning("%s in %s: starting again from step 0", why, self.run.checkpoints)
            new.append(ev.RestartFromScratch(reason=why))
        if self._epoch_start is None:
            self._epoch_start = self.step
        with self.record.update(*new) as s:
            s.step, s.from_scratch = self.step, False
        # The steps past the checkpoint are redone: their records go, and goodput counts
        # only the steps that survive (work redone after a requeue was not useful).
        kept = step_records.keep_before(self.run.metrics, self.step)
        self._useful_s = sum(r.step_time_s for r in kept)
        self.last_loss = kept[-1].loss if kept else None

    def _initialise(self) -> ev.Event:
        """``init_from``: the trainer's model weights from another run's checkpoint."""
        init = manifest.init_checkpoint(*rl_spec.init_from(str(self.cfg.init_from)))
        self.group.call(ckpt_calls.CKPT_LOAD, ckpt_calls.Load(step_dir=str(init), into="weights"),
                        timeout_s=self.cfg.timeouts.checkpoint_s, collect=lambda res, _: res,
                        dispatch=lambda req, _n: {r: req for r in range(self.plan.world_size)})
        log.info("model weights initialised from %s", init)
        return ev.InitialisedFrom(checkpoint=str(init), step=manifest.read_manifest(init).step)

    def train(self) -> StopRequest | None:
        cfg = self.cfg
        start, interval = self.step, cfg.checkpoint.interval_steps
        for step in range(start, cfg.trainer.steps):
            stop = self.stop.check(step_s=self._step_s, save_s=self.checkpoints.last_save_s)
            if stop is not None:
                if stop.cause == "time_running_out" and step == self._epoch_start:
                    raise UserError(
                        f"recovery.walltime_margin_s: the time limit leaves no time to train ({stop.detail}) at "
                        f"step {step}, where this allocation began: a requeue would do the same again; ask for a "
                        "longer time limit (--time, slurm.workers.time) or a smaller recovery.walltime_margin_s")
                self._stop_at_boundary(step, stop)
                return stop
            rl_step = self.rl is not None and step >= cfg.rl.warmup_steps
            if rl_step:  # once per allocation, outside the step's time: save and load the reference
                self.rl.load_reference(step, self.last_loss)
            t0 = time.perf_counter()
            extra: dict[str, object] = {}
            request = calls.Step(step=step) if self.sync is None else self.sync.request(
                step, checkpoint_due=bool(interval) and (step + 1) % interval == 0, last=step + 1 == cfg.trainer.steps)
            request = dataclasses.replace(request, measure=step == self._epoch_start)
            if rl_step:
                results, extra = self.rl.run(step)
            else:
                results = self.group.call(calls.TRAIN_STEP, request, timeout_s=cfg.timeouts.step_s)
                self._write_memory(step, results)
            wall = time.perf_counter() - t0
            self._step_s = wall if step == start else 0.8 * self._step_s + 0.2 * wall
            record = dataclasses.replace(self._record(step, results, wall), **extra)
            done = step + 1
            if self.generator is not None and self.generator.due(done):
                gap = max(self.generator.sync(done), record.sync_logprob_maxdiff or 0.0)
                record = dataclasses.replace(record, sync_logprob_maxdiff=gap)
                self.generator.generate(done)
            step_records.append(self.run.metrics, record)
            if self.sync is not None:
                self.record.append(*self.sync.observe(done, request, record))
            self._observe(record, wall)
            self.step, self.last_loss = done, record.loss
            self.checkpoints.poll()
            if interval and done % interval == 0 and done < cfg.trainer.steps:
                self.checkpoints.save(done, loss=record.loss, **self._loop())
            if done % cfg.trainer.log_interval_steps == 0 or done == cfg.trainer.steps:
                log.info("step %d/%d loss %.4f (%.3f s)", done, cfg.trainer.steps, record.loss, wall)
                self.save_progress()
        return None

    def _write_memory(self, step: int, results: list[Any]) -> None:
        """memory.json: what every rank measured it held at ``step`` (the allocation's first)."""
        measured = [getattr(r, "memory", None) for r in results]
        if any(measured):
            state = self.record.read()
            MemoryReport.from_results(step, state.micro_batch_size, state.ranks[0].device if state.ranks else "cpu",
                                      measured).write(self.run.memory)

    def save_progress(self) -> None:
        """Write the step, the last loss and goodput into state.json."""
        with self.record.update() as s:
            s.step, s.last_loss, s.updated = self.step, self.last_loss, time.time()
            s.goodput = Goodput(allocated_s=self._allocated_s(), useful_s=self._useful_s)

    def _stop_at_boundary(self, step: int, stop: StopRequest) -> None:
        """Make ``step`` (every step finished so far) durable before the job goes away."""
        kind = ev.TimeRunningOut if stop.cause == "time_running_out" else ev.Preempted
        left = None if stop.time_left_s is None else round(stop.time_left_s, 1)
        self.record.append(kind(step=step, cause=stop.cause, signal=stop.signal, detail=stop.detail,
                                time_left_s=left, signal_at=stop.signal_at))
        log.warning("%s at step %d (%s): checkpointing, then requeueing", stop.cause, step, stop.detail)
        self.save_progress()
        self.checkpoints.drain()
        if self.sync is not None and self.sync.unsynced:  # a checkpoint holds one replica: make them equal
            self.group.call(calls.AVERAGE, NoArgs(), timeout_s=self.cfg.timeouts.step_s)
            self.sync.averaged()
        if step > 0 and not self.checkpoints.committed(step):
            timeout = self.cfg.timeouts.checkpoint_s
            if stop.time_left_s is not None:  # commit within the time Slurm leaves us
                timeout = max(1.0, min(timeout, stop.time_left_s - 2.0))
            self.checkpoints.save(step, loss=self.last_loss, blocking=True, timeout_s=timeout,
                                  **self._loop())

    def finish(self) -> None:
        if self.cfg.checkpoint.at_end and not self.checkpoints.committed(self.step):
            self.checkpoints.save(self.step, loss=self.last_loss, blocking=True, **self._loop())
        self.checkpoints.drain()

    def _loop(self) -> dict[str, Any]:
        """What a checkpoint records of the loop: the policy version (the step the generator
        was last synced to) and an RL program's state."""
        state = {**(self.rl.state() if self.rl else {}), **({"sync_every": self.sync.every} if self.sync else {})}
        return {"policy_version": None if self.generator is None else self.generator.version, "state": state or None}

    # --- metrics ------------------------------------------------------------------------
    def started_at(self, unix_time: float) -> None:
        """This epoch's allocated time counts from ``unix_time`` (the controller process's start)."""
        self._started = time.monotonic() - max(0.0, time.time() - unix_time)

    def _allocated_s(self) -> float:
        """Allocated time across requeues: what earlier epochs held, plus this one so far."""
        return (self._alloc_base or 0.0) + time.monotonic() - self._started

    def _observe(self, record: StepRecord, wall: float) -> None:
        """Feed the Prometheus endpoint."""
        self._useful_s += wall
        if self.metrics is None:
            return
        self.metrics.observe_step(record)
        self.metrics.observe_dispatch("train_step", wall)
        self.metrics.observe_goodput(self._useful_s, self._allocated_s())
        now = time.monotonic()
        for peer in self.group.peers.values():
            self.metrics.observe_heartbeat_lag(peer.rank, now - peer.last_seen)

    def _record(self, step: int, results: list[Any], wall: float) -> StepRecord:
        owners = [results[r] for r in self.group.dims.loss_owners()]
        losses = [o.loss for o in owners if o.loss is not None]
        if len(losses) != len(owners):
            raise ValueError(f"train_step of step {step}: a loss owner reported no loss")
        tokens = sum(o.tokens for o in owners)

        def per_rank(key: str) -> tuple[float, ...] | None:
            values = [getattr(r, key, None) for r in results]
            return None if any(v is None for v in values) else tuple(float(v) for v in values)

        return StepRecord(
            step=step, loss=statistics.fmean(losses), grad_norm=owners[0].grad_norm, lr=owners[0].lr,
            tokens=tokens, tokens_per_s=tokens / wall if wall > 0 else 0.0, step_time_s=wall, time=time.time(),
            rank_step_time_s=tuple(r.step_time_s for r in results),
            # A task that does not measure its memory gets the worker's last heartbeat figure.
            rss_mb=tuple(r.rss_mb or self.group.peers[i].rss_mb for i, r in enumerate(results)),
            data_wait_s=per_rank("data_wait_s"), grad_sync_s=per_rank("grad_sync_s"), compute_s=per_rank("compute_s"),
            cuda_peak_mb=per_rank("cuda_peak_mb"), rss_peak_mb=per_rank("rss_peak_mb"),
        )
