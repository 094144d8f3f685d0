"""The controller's training program: one readable loop over the role groups.

    register → setup → resume from the latest committed checkpoint [→ the validation a stop
    skipped] → for each step: [stop? checkpoint now and return] train_step, [validate],
    record, maybe checkpoint → final checkpoint

Bulk tensors never come here; each step brings back a few numbers per rank, and a
checkpoint one small ack per rank (core.checkpoint.coordinator commits it). At every step
boundary the stop policy (core.controller.stop) is asked whether a preemption signal
arrived or the walltime is near; then the step just finished is checkpointed
synchronously and ``run_all`` returns the request, so no finished step is lost. A
validation (``rl.val_every``) due after a step is not started once a stop is requested
(unless it is the run's last step): the stop saves the step at once, and the resumed run
validates that step first, to the same numbers (validation draws from no training stream).
The stop policy counts the last validation's wall time into the next step's when one is due.
A signal that arrives during a validation still waits for it. Failures propagate as
exceptions; core.controller.recovery decides what happens next.
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.checkpoint import calls as ckpt_calls
from core.checkpoint import manifest
from core.checkpoint.coordinator import CheckpointCoordinator
from core.checkpoint.loop import LoopState
from core.config import rl as rl_spec
from core.config import run as config_mod
from core.config.run import RunConfig
from core.config.runplan import RunPlan
from core.controller.generation import GeneratorFlow
from core.controller.group import WorkerGroup
from core.controller.rl_program import RLStep
from core.controller.roles import RoleGroup, Span
from core.controller.rollouts import ATTACHMENT as ROLLOUTS_FILE
from core.controller.saving import SavePolicy
from core.controller.stop import StopPolicy, StopRequest
from core.controller.sync_policy import SyncPolicy
from core.errors import UserError, WorkerLostError
from core.job import faults
from core.record import events as ev
from core.record import steps as step_records
from core.record.memory import MemoryReport
from core.record.runfolder import RunFolder
from core.record.state import Goodput, RankInfo, RunRecord
from core.record.steps import StepRecord
from core.rl.reward_pool import Scorer
from core.wire import calls
from core.wire.contract import NO_ARGS
from core.wire.rl_calls import PolicyResult

if TYPE_CHECKING:
    from core.controller.metrics import Metrics

log = logging.getLogger(__name__)

Results = Sequence[calls.StepResult | PolicyResult]  # every trainer rank's, in rank order


@dataclass
class Program:
    cfg: RunConfig
    plan: RunPlan
    run: RunFolder
    record: RunRecord
    workers: WorkerGroup  # every worker process; calls go through the role groups below
    trainer: RoleGroup
    checkpoints: CheckpointCoordinator  # the trainer's checkpoints
    stop: StopPolicy = field(default_factory=lambda: StopPolicy(None, None))
    metrics: Metrics | None = None  # the Prometheus endpoint; None when metrics.enabled is false
    generator: RoleGroup | None = field(default=None, init=False)  # with a generator group in the plan
    flow: GeneratorFlow | None = field(default=None, init=False)  # the generator's flow, once set up
    rl: RLStep | None = field(default=None, init=False)  # program: grpo or ppo, once set up
    rewards: Scorer | None = field(default=None, init=False)  # grpo, ppo: the reward processes, once per controller
    sync: SyncPolicy | None = field(default=None, init=False)  # parallel.sync: periodic averaging of replicas
    saves: SavePolicy = field(init=False)  # when to checkpoint
    step: int = field(default=0, init=False)  # steps done
    last_loss: float | None = field(default=None, init=False)
    _started: float = field(default_factory=time.monotonic, init=False)
    _useful_s: float = field(default=0.0, init=False)
    _alloc_base: float | None = field(default=None, init=False)
    _step_s: float = field(default=0.0, init=False)  # a moving average of the step's wall time
    _val_s: float = field(default=0.0, init=False)  # the last validation's wall time (rl.val_every)
    _epoch_start: int | None = field(default=None, init=False)  # the step this allocation began at
    _resumed_from: Path | None = field(default=None, init=False)  # the checkpoint this allocation loaded
    # recovery's: restart a split generator's workers alone (the ranks restarted), or raise
    restart_generator: Callable[[WorkerLostError], tuple[int, ...]] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        gen = self.plan.generator
        self.generator = None if gen is None else RoleGroup(self.workers, gen)
        self.saves = SavePolicy(self.checkpoints, self.cfg.checkpoint, total_steps=self.cfg.trainer.steps,
                                loop_of=self._loop_state, attach=self._attachments)

    def run_all(self) -> StopRequest | None:
        """The whole run; returns the stop request that ended it early, None when it finished."""
        self.setup()
        self.resume()
        # the loop state of the checkpoint this allocation resumed from (read once)
        loop = LoopState.from_meta(manifest.read_manifest(self._resumed_from).meta.get("loop")
                                   if self._resumed_from else None)
        if self.cfg.parallel.sync.local:
            self.sync = SyncPolicy(self.cfg.parallel.sync, every=loop.sync_every)
        if self.generator is not None:  # the second compute flow, synced from the restored trainer
            self.flow = GeneratorFlow(self.cfg, self.run, self.workers, self.trainer, self.generator)
            self.flow.start(self.step)
            if self.cfg.program in rl_spec.RL_PROGRAMS:
                if self.rewards is None:  # started once: a recovery's next run_all keeps them
                    rl = self.cfg.rl
                    self.rewards = Scorer(rl.reward, workers=rl.reward_workers, timeout_s=rl.reward_timeout_s)
                self.rewards.start()  # a reward that cannot be loaded fails here, before the first RL step
                self.rl = RLStep(self.cfg, self.trainer, self.flow, self.saves, self.rewards,
                                 on_generator_lost=self._generator_lost)
                if self.generator.plan.own_processes:  # its workers restart alone (lost, they fail only its calls)
                    self.workers.restartable = frozenset(self.generator.ranks)
                self.rl.restore(loop, self._resumed_from)
                self._validate_pending(step_records.read(self.run.metrics))
        stop = self.train()
        if stop is None:
            self.saves.at_end(self.step, self.last_loss)
        return stop

    def _generator_lost(self, exc: WorkerLostError) -> None:
        """A wait for a rollout found workers of the split generator, and only those, lost: have
        recovery restart them alone (it raises when it decides otherwise), then set the new
        ones up, bridge them and sync them to the policy the lost ones held. The trainer's
        workers keep their state; the caller starts the lost rollouts again."""
        assert self.flow is not None
        if self.restart_generator is None:
            raise exc
        ranks = self.restart_generator(exc)
        self.setup(rejoin=ranks)
        self.flow.rejoin()
        log.info("the generator's ranks %s rejoined at step %d, synced to version %d", list(ranks), self.step,
                 self.flow.version)

    def setup(self, rejoin: tuple[int, ...] = ()) -> None:
        """Register the workers, then every rank joins its process group and builds its model
        (each group with processes of its own from its first rank's rendezvous). ``rejoin``:
        only these ranks (a group's, restarted alone) register and are set up."""
        self.workers.wait_for_workers(ranks=rejoin or None)
        t0 = time.perf_counter()
        hosts = [g for g in (self.trainer, self.generator) if g is not None and g.plan.own_processes
                 and (not rejoin or set(g.ranks) <= set(rejoin))]
        setups = {g.name: self._setup_request(g) for g in hosts}
        span = Span(self.workers, *hosts)
        infos = span.call_each(calls.SETUP, {r: setups[self.plan.role_of(r).name] for r in span.ranks},
                               timeout_s=self.cfg.timeouts.setup_s)
        if self.metrics is not None:
            self.metrics.observe_dispatch("setup", time.perf_counter() - t0)
        before = {r.rank: r for r in self.record.read().ranks} if rejoin else {}
        peers = sorted(self.workers.peers.values(), key=lambda p: p.rank)
        ranks = tuple(before[p.rank] if p.rank not in infos else RankInfo(
            rank=p.rank, node=p.node, host=p.host, pid=p.pid, coords=infos[p.rank].coords, layers=infos[p.rank].layers,
            num_params=infos[p.rank].num_params, device=infos[p.rank].device, role=self.plan.role_of(p.rank).name)
            for p in peers)
        first = self.trainer.plan.first_rank
        micro = infos[first].micro_batch_size if first in infos else self.record.read().micro_batch_size
        group = self.workers
        with self.record.update(ev.WorkersReady(world_size=group.world_size, epoch=group.epoch,
                                                generation=group.generation, micro_batch_size=micro, ranks=ranks)) as s:
            if self._alloc_base is None:  # what earlier epochs (before a requeue) held their allocation
                self._alloc_base = s.goodput.allocated_s

    def _setup_request(self, group: RoleGroup) -> calls.Setup:
        """SETUP for ``group``'s ranks: its own rendezvous; the plan's micro-batch for the trainer."""
        addr, port = group.rendezvous()
        return calls.Setup(master_addr=addr, master_port=port, config_hash=config_mod.config_hash(self.cfg),
                           micro_batch_size=self.plan.micro_batch_size if group is self.trainer else None)

    def resume(self) -> None:
        """Continue from the newest committed checkpoint that verifies (any layout)."""
        before = self.record.read()
        step_dir = self.checkpoints.resume_point(from_scratch=before.from_scratch, recorded=before.checkpoints)
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
        # The steps past the checkpoint are redone: their records are marked superseded (kept),
        # and goodput counts only the steps that survive (work redone after a requeue was not useful).
        kept = step_records.supersede(self.run.metrics, self.step, self.workers.epoch)
        self._useful_s = sum(r.step_time_s for r in kept)
        self.last_loss = kept[-1].loss if kept else None

    def _initialise(self) -> ev.Event:
        """``init_from``: the trainer's model weights from another run's checkpoint, or from a
        Hugging Face checkpoint folder (``hf:PATH``, pinned absolute at submit)."""
        if str(self.cfg.init_from).startswith("hf:"):
            self.trainer.call(ckpt_calls.CKPT_LOAD, ckpt_calls.Load(step_dir=str(self.cfg.init_from), into="weights"),
                              timeout_s=self.cfg.timeouts.checkpoint_s)
            log.info("model weights imported from %s", self.cfg.init_from)
            return ev.InitialisedFrom(checkpoint=str(self.cfg.init_from), step=0)
        init = manifest.init_checkpoint(*rl_spec.init_from(str(self.cfg.init_from)))
        self.trainer.call(ckpt_calls.CKPT_LOAD, ckpt_calls.Load(step_dir=str(init), into="weights"),
                          timeout_s=self.cfg.timeouts.checkpoint_s)
        log.info("model weights initialised from %s", init)
        return ev.InitialisedFrom(checkpoint=str(init), step=manifest.read_manifest(init).step)

    def train(self) -> StopRequest | None:
        cfg = self.cfg
        start = self.step
        for step in range(start, cfg.trainer.steps):
            stop = self.stop.check(step_s=self._step_s + self._validation_s(step + 1),
                                   save_s=self.checkpoints.last_save_s)
            if stop is not None:
                if stop.cause == "time_running_out" and step == self._epoch_start:
                    raise UserError(
                        f"recovery.walltime_margin_s: the time limit leaves no time to train ({stop.detail}) at "
                        f"step {step}, where this allocation began: a requeue would do the same again; ask for a "
                        "longer time limit (--time, slurm.workers.time) or a smaller recovery.walltime_margin_s")
                self._stop_at_boundary(step, stop)
                return stop
            if self.rl is not None and step >= cfg.rl.warmup_steps:
                self.rl.load_reference(step, self.last_loss)  # once per allocation, outside the step's time
            t0 = time.perf_counter()
            results, extra, request = self._one_step(step)
            wall = time.perf_counter() - t0
            self._step_s = wall if step == start else 0.8 * self._step_s + 0.2 * wall
            record = dataclasses.replace(self._record(step, results, wall), **extra)
            done = step + 1
            if self.flow is not None and self.flow.due(done):
                self._rollouts_done()  # the generator's ranks are free for the sync
                gap = max(self.flow.sync(done), record.sync_logprob_maxdiff or 0.0)
                record = dataclasses.replace(record, sync_logprob_maxdiff=gap, **self.flow.sent)
                if self.rl is None:  # an RL program's samples.jsonl holds its validation responses
                    self.flow.generate(done)
            if self.rl is not None and self.rl.validation.due(done):
                if done < cfg.trainer.steps and self.stop.stop_requested():  # saved at the next boundary
                    log.warning("a stop was requested: the validation of step %d runs when the run resumes", done)
                else:
                    record = self._validate(done, record)
            if self.flow is not None:  # the generations' KV cache (baton plan --check compares it)
                record = dataclasses.replace(record, gen_kv_cache_mb=self.flow.take_kv_cache_mb())
            step_records.append(self.run.metrics, record)
            faults.at_point(step, "between")  # tests: a stop that lands between two steps
            if self.sync is not None:
                self.record.append(*self.sync.observe(done, request, record))
            self._observe(record, wall)
            self.step, self.last_loss = done, record.loss
            self.saves.maybe_save(done, record.loss)
            if done % cfg.trainer.log_interval_steps == 0 or done == cfg.trainer.steps:
                log.info("step %d/%d loss %.4f (%.3f s)", done, cfg.trainer.steps, record.loss, wall)
                self.save_progress()
        return None

    def _validation_s(self, done: int) -> float:
        """What the validation after ``done`` steps adds to the step (the last one's wall time)."""
        return self._val_s if self.rl is not None and self.rl.validation.due(done) else 0.0

    def _validate(self, done: int, record: StepRecord) -> StepRecord:
        """``record`` with the validation of the policy after ``done`` steps, its wall time
        in ``phase_s`` as ``val``."""
        assert self.rl is not None
        t0 = time.perf_counter()
        self._rollouts_done()  # the generator's ranks are free for the sync to the validated policy
        fields = self.rl.validation.run(done)
        self._val_s = time.perf_counter() - t0
        return dataclasses.replace(record, **fields, phase_s={**(record.phase_s or {}), "val": round(self._val_s, 4)})

    def _validate_pending(self, kept: Sequence[StepRecord]) -> None:
        """A stop skipped the validation of the step this allocation resumed from (``train``):
        run it now, as the uninterrupted run did after that step, and append the step's record
        again with its fields (the latest record of a step is the current one)."""
        done = self.step
        if self.rl is None or not kept or kept[-1].step != done - 1 or not self.rl.validation.due(done):
            return
        if kept[-1].val_reward_mean is None:
            log.info("validating step %d, which the stop before this resume skipped", done)
            step_records.append(self.run.metrics, self._validate(done, kept[-1]))

    def _one_step(self, step: int) -> tuple[Results, dict[str, Any], calls.Step]:
        """Step ``step``: an RL iteration past the warm start, else a training step (with the
        replicas' sync); every rank's results, the record's extra fields, the step request."""
        request = calls.Step(step=step) if self.sync is None else self.sync.request(
            step, checkpoint_due=self.saves.on_interval(step + 1), last=step + 1 == self.cfg.trainer.steps)
        request = dataclasses.replace(request, measure=step == self._epoch_start)
        if self.rl is not None and step >= self.cfg.rl.warmup_steps:
            results, extra = self.rl.run(step)
            return results, extra, request
        results = self.trainer.call(calls.TRAIN_STEP, request, timeout_s=self.cfg.timeouts.step_s)
        self._write_memory(step, results)
        return results, {}, request

    def _write_memory(self, step: int, results: list[Any]) -> None:
        """memory.json: what every rank measured it held at ``step`` (the allocation's first)."""
        measured = [getattr(r, "memory", None) for r in results]
        if any(measured):
            state = self.record.read()
            MemoryReport.from_results(step, state.micro_batch_size, state.ranks[0].device if state.ranks else "cpu",
                                      measured).write(self.run.memory)

    def close(self) -> None:
        """End what the program holds besides the workers: the reward processes."""
        if self.rewards is not None:
            self.rewards.close()

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
        # Before the replicas change an async save may still be writing: wait for it no longer
        # than Slurm leaves. If it cannot finish, the next epoch resumes from the checkpoint
        # before it (the coordinator records why) rather than the job being killed mid-write.
        if not self.checkpoints.drain(timeout_s=self.stop.time_budget_s(self.cfg.timeouts.checkpoint_s)):
            log.warning("no time left to save step %d: requeueing from the last committed checkpoint", step)
            return
        budget = self.stop.time_budget_s(self.cfg.timeouts.checkpoint_s)
        if self.rl is not None and not self.rl.rollouts.ready(budget):  # the save keeps them: they must end first
            self.checkpoints.abandon(step, budget, f"the rollouts in flight did not end within {budget:.0f} s, the "
                                     "time the job has left")
            return
        if self.sync is not None and self.sync.unsynced:  # a checkpoint holds one replica: make them equal
            self.trainer.call(calls.AVERAGE, NO_ARGS, timeout_s=self.cfg.timeouts.step_s)
            self.sync.averaged()
        self.saves.at_stop(step, self.last_loss, self.stop.time_budget_s(self.cfg.timeouts.checkpoint_s))

    def _rollouts_done(self) -> None:
        """Wait for the rollouts in flight (rl.max_staleness), if any."""
        if self.rl is not None:
            self.rl.rollouts.drain()

    def _attachments(self) -> dict[str, bytes]:
        """The program's files in a checkpoint: the rollouts started and not yet trained on
        (complete: those in flight are waited for)."""
        data = None if self.rl is None else self.rl.rollouts.to_bytes()
        return {} if data is None else {ROLLOUTS_FILE: data}

    def _loop_state(self, step: int, loss: float | None) -> LoopState:
        """What a checkpoint of ``step`` records of the loop: the policy version (the step the
        generator was last synced to) and the programs' state."""
        return LoopState(step=step, last_loss=loss, policy_version=None if self.flow is None else self.flow.version,
                         kl_coef=None if self.rl is None else self.rl.kl.value,
                         sync_every=None if self.sync is None else self.sync.every)

    # --- metrics ------------------------------------------------------------------------
    def started_at(self, unix_time: float) -> None:
        """This epoch's allocated time counts from ``unix_time`` (the allocation's start on Slurm,
        core.job.slurmctl.allocation_start; the controller process's start elsewhere)."""
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
        for peer in self.workers.peers.values():
            self.metrics.observe_heartbeat_lag(peer.rank, now - peer.last_seen)

    def _record(self, step: int, results: Results, wall: float) -> StepRecord:
        owners = self.trainer.owners(results)
        losses = [o.loss for o in owners if o.loss is not None]
        if len(losses) != len(owners):
            raise ValueError(f"train_step of step {step}: a loss owner reported no loss")
        tokens = sum(o.tokens for o in owners)

        def per_rank(values: list[float | None]) -> tuple[float, ...] | None:
            return None if any(v is None for v in values) else tuple(float(v) for v in values)  # type: ignore[arg-type]

        return StepRecord(
            step=step, loss=statistics.fmean(losses), grad_norm=owners[0].grad_norm, lr=owners[0].lr,
            tokens=tokens, tokens_per_s=tokens / wall if wall > 0 else 0.0, step_time_s=wall, time=time.time(),
            rank_step_time_s=tuple(r.step_time_s for r in results),
            # A task that does not measure its memory gets the worker's last heartbeat figure.
            rss_mb=tuple(r.rss_mb or self.workers.peers[rank].rss_mb for rank, r in zip(self.trainer.ranks, results,
                                                                                        strict=True)),
            data_wait_s=per_rank([r.data_wait_s for r in results]),
            grad_sync_s=per_rank([r.grad_sync_s for r in results]), compute_s=per_rank([r.compute_s for r in results]),
            cuda_peak_mb=per_rank([r.cuda_peak_mb for r in results]),
            rss_peak_mb=per_rank([r.rss_peak_mb for r in results]),
        )
