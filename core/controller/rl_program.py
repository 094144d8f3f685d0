"""One GRPO or PPO iteration as the controller runs it (``program: grpo|ppo``, core.config.rl).

    sync    the generator holds the policy of this step (synced if not; no probe: the
            step's own responses measure the gap)
    generate  prompts of the step (core.rl.tasks) × n, continued on the generator group
    reward  every response scored in the controller's reward processes (core.rl.reward_pool:
            ``rl.reward_workers``, ``rl.reward_timeout_s`` per call)
    old     the actor's log-probs of the responses before its update, and its entropy
    ref     the reference policy's log-probs (with a KL term, rl.kl)
            (every log-prob, the rollout's and the update's too, and the entropy at
            rl.temperature: log-softmax of logits / T, before top-k / top-p)
    values  ppo: the critic's value of every response token (and, at the first RL step, the
            critic's transformer copied from the actor first)
    critic  ppo: GAE advantages and returns (core.rl.advantages), then ``ppo_epochs`` critic
            epochs (CRITIC_STEP per mini-batch)
    update  grpo: group-normalised advantages (core.rl.advantages); then ``ppo_epochs`` actor
            epochs (POLICY_STEP per mini-batch: each data replica its share of it)

An epoch is one optimizer step per mini-batch (``rl.mini_batch_size`` responses in the
order they were generated; all of them without it), the same for the critic. The rows,
log-probs, advantages, values and returns are arrays throughout (``core.wire.ragged``: int32
tokens, float32 numbers, what the workers compute in; advantages and GAE are computed in
float64 and cast once), each mini-batch's requests built once and sent every epoch. Each step's
request carries the whole mini-batch's counts (``rl_calls.LossAgg``: response tokens, rows,
the horizon), so the workers aggregate the loss over all of it (``rl.loss_agg_mode``) and
the gradient does not depend on the micro-batching or dp. The step's record takes the last
epoch's numbers as the mean over its mini-batches (``ratio_max``: the largest; ``kl``: the
first epoch's token mean over every response, which the adaptive KL coefficient follows;
``value_loss``: the first epoch's), and ``optimizer_steps``, the actor's steps it took.

Each phase's wall time goes into the step's record (``phase_s``), with the actor vs
rollout log-prob gap of the step's responses (``sync_logprob_maxdiff``: both at
rl.temperature, the old policy's from SCORE_ROWS against GENERATE's own). With
``rl.val_every`` the program then validates the new policy on held-out prompts
(``RLStep.validation``, core.controller.validation), scored by ``RLStep.rewards`` as the
step's own responses are.

With ``rl.max_staleness: k > 0`` the rollouts are started ahead (core.controller.rollouts):
a step's sync and rollout are those of its block, and its responses come from a policy at
most k versions older (the step record's ``policy_version`` and ``staleness``).

Everything a step draws is keyed by (seed, step): prompts, and the sampling of each
response (seed, step, response index). A run resumed at step k asks and samples exactly
what the uninterrupted run did at step k, from the restored policy (the generator is
re-synced after every load).

The reference policy is a checkpoint: the run's own at ``rl.warmup_steps`` (the actor
when the RL phase begins, ``init_from``'s weights without a warm start; saved then, and
kept by retention for the run's life). Every allocation that trains
RL steps loads it into the trainer's reference model first. The adaptive KL coefficient
travels in each checkpoint's loop state.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from core.checkpoint import calls as ckpt_calls
from core.checkpoint import manifest
from core.checkpoint.loop import LoopState
from core.config import tokvocab
from core.config.plan import count_params
from core.config.run import RunConfig
from core.controller import rl_record
from core.controller.generation import GeneratorFlow, PendingRollout, Responses
from core.controller.roles import RoleGroup
from core.controller.rollouts import ATTACHMENT as ROLLOUTS_FILE
from core.controller.rollouts import Rollouts, rollout_key
from core.controller.saving import SavePolicy
from core.controller.validation import Validation
from core.data.tokenizer import text_before_stop
from core.errors import CheckpointError, ConfigError, WorkerLostError
from core.flows import calls as gen_calls
from core.job import faults
from core.rl import advantages, tasks
from core.rl.reward_pool import Scorer
from core.rl.rewards import Sample
from core.wire import rl_calls
from core.wire.contract import NO_ARGS
from core.wire.ragged import TOKENS, Ragged, gathered, joined

T = TypeVar("T")
log = logging.getLogger(__name__)


class RLStep:
    def __init__(self, cfg: RunConfig, trainer: RoleGroup, generator: GeneratorFlow, saves: SavePolicy,
                 scorer: Scorer, *, on_generator_lost: Callable[[WorkerLostError], None] | None = None) -> None:
        self.cfg, self.trainer, self.generator, self.saves = cfg, trainer, generator, saves
        self.checkpoints = saves.checkpoints
        self.scorer = scorer  # the controller's reward processes (Program owns them)
        self.tokenizer: Any = None  # task file: its tokenizer (response_text, stop tokens)
        self.stop: tuple[int, ...] = ()  # a response ends at the first of these (task file, count_to)
        if cfg.rl.task == "count_to":
            self.stop = (tasks.count_to_eot(cfg.model.vocab_size),)
        self.prompts: list[Any] = []
        if cfg.rl.task == "file":
            from core.data import prompts, tokenizer  # a tokenizer: only file tasks need one

            self.tokenizer = tokenizer.load_tokenizer(tokvocab.source(cfg.rl.tokenizer, cfg.init_from))
            self.stop = tokenizer.stop_ids(self.tokenizer, cfg.rl.stop)
            if self.tokenizer.vocab_size > cfg.model.vocab_size:
                raise ConfigError(f"rl.tokenizer: {self.tokenizer.name} has {self.tokenizer.vocab_size} tokens > "
                                  f"model.vocab_size = {cfg.model.vocab_size}; raise model.vocab_size to at least "
                                  f"{self.tokenizer.vocab_size}")
            self.prompts = prompts.read_prompts(cfg.rl.prompts or "", key=cfg.rl.prompt_key,
                                                tokenizer=self.tokenizer, length=cfg.rl.prompt_length,
                                                template_variables=cfg.rl.chat_template_kwargs)
        self.validation = Validation(cfg, generator, self._held_out(), score=self.rewards, text=self._text,
                                     stop=self.stop)
        kl = cfg.rl.kl
        coef = advantages.auto_kl_coef(count_params(cfg).total) if kl.coef == "auto" else float(kl.coef)
        self.kl = advantages.AdaptiveKL(value=coef, target=kl.target, horizon=kl.horizon)
        self.reference_step = cfg.rl.warmup_steps
        self._reference_loaded = False
        self.on_generator_lost = on_generator_lost  # Program: restart the generator's workers alone, or raise
        self.rollouts = Rollouts(cfg.rl.max_staleness, cfg.rl.warmup_steps, rollout_key(cfg),  # started ahead
                                 on_lost=self._generator_lost)
        if kl.enabled:
            self.checkpoints.pinned.add(self.reference_step)

    # --- state a checkpoint keeps (LoopState.kl_coef) -----------------------------------------
    def restore(self, loop: LoopState, step_dir: Path | None) -> None:
        """The adaptive coefficient where the checkpoint left it (a fixed one is the config's),
        and the rollouts it kept (started, not yet trained on: rl.max_staleness)."""
        if self.kl.target is not None and isinstance(loop.kl_coef, (int, float)):
            self.kl.value = float(loop.kl_coef)
        data = None if step_dir is None else manifest.read_attachment(step_dir, ROLLOUTS_FILE)
        if data is not None and self.cfg.rl.max_staleness:
            self.rollouts.restore(data, where=step_dir / ROLLOUTS_FILE)  # type: ignore[operator]
        elif data is not None:
            log.warning("%s: rollouts kept for rl.max_staleness > 0 are not used by this synchronous run", step_dir)

    def load_reference(self, step: int, loss: float | None) -> None:
        """Before the first RL step of an allocation: the reference policy from its checkpoint
        (saved now when the RL phase begins at ``step``)."""
        if self._reference_loaded or not self.cfg.rl.kl.enabled:
            return
        ref = self.reference_step
        self.checkpoints.drain()  # an async save of this very step may be in flight
        if step == ref:
            self.saves.now(ref, loss)
        where = self.checkpoints.root / manifest.step_dir_name(ref)
        if not self.checkpoints.committed(ref) or manifest.verify(where, checksums=False):
            later = [s for s in manifest.committed_steps(self.checkpoints.root) if s > ref]
            raise CheckpointError(
                f"{where}: the reference policy's checkpoint (the actor at rl.warmup_steps = {ref}) is missing or "
                f"damaged; restore it, or move aside the checkpoints after it ({', '.join(map(str, later)) or 'none'}) "
                "so that the run resumes before its RL phase and saves it again")
        self._load_reference(where)

    def _load_reference(self, step_dir: Path) -> None:
        self.trainer.call(ckpt_calls.CKPT_LOAD, ckpt_calls.Load(step_dir=str(step_dir), into="reference"),
                          timeout_s=self.checkpoints.timeout_s)
        self._reference_loaded = True

    # --- one step ----------------------------------------------------------------------------
    def run(self, step: int) -> tuple[list[rl_calls.PolicyResult], dict[str, Any]]:
        """One iteration at policy version ``step``: the last epoch's results by rank, and the
        step's RL numbers."""
        cfg, rl = self.cfg, self.cfg.rl
        phases: dict[str, float] = {}
        synced: dict[str, int] = {}  # the sync's bytes sent, when this step syncs
        asked, prompts, pads, done, version = self._rollout(step, phases, synced)
        responses = done.tokens.tolist()  # the rewards read Python tokens (and text)
        with _timed(phases, "reward"):
            scores = self.rewards(asked, responses, per=rl.n)
        sequences = joined(prompts, done.tokens)
        with _timed(phases, "old"):
            old, entropy = self._score("actor", sequences, pads)
        ref = None
        if rl.kl.enabled:
            with _timed(phases, "ref"):
                ref, _ = self._score("reference", sequences, pads)
        critic: dict[str, Any] = {}
        lengths = done.tokens.lengths
        if cfg.program == "ppo":  # values, GAE and the critic's update
            adv, critic = self._critic(step, sequences, pads, lengths, scores, phases)
        else:  # every response token its response's advantage (float32: what the workers compute in)
            per_row = advantages.grpo(scores, [i // rl.n for i in range(len(prompts))], norm_by_std=rl.norm_adv_by_std)
            adv = Ragged(values=np.repeat(per_row.astype(np.float32), lengths), lengths=lengths)
        faults.at_point(step, "updating")
        with _timed(phases, "update"):
            kl_now, results, steps = self._update(step, sequences, adv, pads, old, ref)
        owners = self.trainer.owners(results)
        coef = self.kl.value
        if kl_now is not None:
            self.kl.update(kl_now, len(sequences))
        extra = dict(reward_mean=statistics.fmean(scores), reward_std=statistics.pstdev(scores),
                     **rl_record.lengths(responses, self.stop), policy_version=version, staleness=step - version,
                     clip_frac=statistics.fmean(o.clip_frac or 0.0 for o in owners),
                     ratio_max=max(o.ratio_max or 0.0 for o in owners), entropy=entropy, kl=kl_now,
                     kl_coef=coef if ref else None, phase_s={k: round(v, 6) for k, v in phases.items()}, **critic,
                     optimizer_steps=steps, **synced, sync_logprob_maxdiff=rl_record.max_gap(old, done.logprobs))
        return results, extra

    def _rollout(self, step: int, phases: dict[str, float], synced: dict[str, int]
                 ) -> tuple[list[tasks.Asked], Ragged, list[int], Responses, int]:
        """Step ``step``'s prompts, their pads, the responses (up to their stop tokens) and the
        policy version they come from. Synchronous (``rl.max_staleness: 0``): the generator
        synced to this step's policy, then the rollout. Else the rollout started ahead
        (core.controller.rollouts), and at a block's first step the next ones started."""
        rl = self.cfg.rl
        asked = self._ask(step)
        prompts = Ragged.of([a.tokens for a in asked for _ in range(rl.n)], TOKENS)
        pads = [a.pad for a in asked for _ in range(rl.n)]  # each left-padded prompt's pads, masked out
        if not rl.max_staleness:
            with _timed(phases, "sync"):
                if self.generator.version != step:  # no probe: the gap on this step's responses is recorded
                    self.generator.sync(step, probe=False)
                    synced.update(self.generator.sent)
            with _timed(phases, "generate"):
                done = self._rollout_now(self._generate_request(step, prompts, pads))
            return asked, prompts, pads, done.until(self.stop), step
        if self.rollouts.block_starts(step):
            with _timed(phases, "wait"):  # the generator is idle once the rollouts it works on are done
                self.rollouts.drain()
            with _timed(phases, "sync"):
                if self.generator.version != step:
                    self.generator.sync(step, probe=False)
                    synced.update(self.generator.sent)
            for ahead in self.rollouts.to_start(step, self.cfg.trainer.steps):
                self.rollouts.add(ahead, step, self._start_rollout(ahead))
        with _timed(phases, "generate"):  # what is left of this step's rollout
            rollout = self.rollouts.take(step)
        faults.at_point(step, "generating")  # the next rollout is in flight (tests: a stop lands here)
        return asked, prompts, pads, rollout.wait().until(self.stop), rollout.version

    def _rollout_now(self, req: gen_calls.Generate) -> Responses:
        """``rl.max_staleness: 0``: the rollout of the policy the generator was just synced to,
        generated again by restarted workers if the generator's were lost meanwhile."""
        while True:
            try:
                return self.generator.rollout(req)
            except WorkerLostError as exc:
                self._generator_lost(exc)

    def _generator_lost(self, exc: WorkerLostError) -> None:
        """A wait for a rollout failed with ``exc``: when workers of the split generator, and
        only those, were lost, they are restarted alone and synced to the policy the generator
        held (the trainer's own or, with rl.max_staleness > 0, its kept copy: the one every
        rollout in flight came from), and the rollouts they lost are started again with the
        same keys (the caller waits again); anything else is raised as it is."""
        group = self.generator.generator
        if not (exc.ranks and set(exc.ranks) <= set(group.ranks) and group.plan.own_processes
                and self.on_generator_lost is not None):
            raise exc
        self.on_generator_lost(exc)
        for rollout in self.rollouts.by_step.values():
            if rollout.done is None:
                if rollout.version != self.generator.version:
                    raise RuntimeError(f"the rollout of step {rollout.step} comes from version {rollout.version}, "
                                       f"the restarted generator holds {self.generator.version}") from exc
                rollout.pending = self._start_rollout(rollout.step)

    def _start_rollout(self, step: int) -> PendingRollout:
        """Step ``step``'s rollout, started on the generator (it samples with the step's keys)."""
        rl = self.cfg.rl
        asked = self._ask(step)
        prompts = Ragged.of([a.tokens for a in asked for _ in range(rl.n)], TOKENS)
        pads = [a.pad for a in asked for _ in range(rl.n)]
        # queued behind the rollouts started before it: its deadline allows for them
        return self.generator.start_rollout(self._generate_request(step, prompts, pads),
                                            timeout_s=self.cfg.timeouts.step_s * (rl.max_staleness + 1))

    def _generate_request(self, step: int, prompts: Ragged, pads: list[int]) -> gen_calls.Generate:
        rl = self.cfg.rl
        return gen_calls.Generate(prompts=prompts, max_new_tokens=rl.max_response_length, temperature=rl.temperature,
                                  top_k=rl.top_k, top_p=rl.top_p, eos=self.stop,
                                  seed=(self.cfg.seed * 7919 + step) * 1009 + 7, pads=tuple(pads), step=step)

    def _critic(self, step: int, sequences: Ragged, pads: list[int], lengths: np.ndarray, scores: list[float],
                phases: dict[str, float]) -> tuple[Ragged, dict[str, Any]]:
        """PPO: the critic's values, GAE advantages and returns (the score on a response's last
        token), ``ppo_epochs`` critic updates; the actor's advantages and the step's critic numbers."""
        rl = self.cfg.rl
        if step == rl.warmup_steps:  # the RL phase begins: the critic starts as the actor
            self.trainer.call(rl_calls.CRITIC_INIT, NO_ARGS, timeout_s=self.cfg.timeouts.step_s)
        with _timed(phases, "values"):
            values, _ = self._score("critic", sequences, pads)
        mask = np.zeros((len(lengths), int(lengths.max())))
        reward, old = np.zeros_like(mask), np.zeros_like(mask)
        for i, n in enumerate(lengths.tolist()):
            mask[i, :n], reward[i, n - 1] = 1.0, scores[i]
        response = mask > 0  # row-major: the rows' tokens in the order of a Ragged's values
        old[response] = values.values
        adv, returns = advantages.gae(reward, old, mask, gamma=rl.gamma, lam=rl.lam)
        targets = Ragged(values=returns[response].astype(np.float32), lengths=lengths)
        batches = []
        for part in self._mini_batches(len(sequences)):
            rows = np.arange(len(sequences))[part]
            batches.append([rl_calls.CriticBatch(step=step, agg=self._agg(lengths[part]), prompt_length=rl.prompt_length,
                                                 sequences=sequences.take(share), returns=targets.take(share),
                                                 old_values=values.take(share), pads=tuple(pads[i] for i in share))
                            for share in self._split(rows)])
        first: list[float] = []
        with _timed(phases, "critic"):
            for epoch in range(rl.ppo_epochs):
                for shares in batches:
                    answers = self.trainer.call_each(rl_calls.CRITIC_STEP, shares, timeout_s=self.cfg.timeouts.step_s)
                    if epoch == 0:
                        first.append(self.trainer.owners(answers)[0].value_loss or 0.0)
        return (Ragged(values=adv[response].astype(np.float32), lengths=lengths),
                dict(value_loss=statistics.fmean(first), values_mean=float(old[response].mean())))

    def _ask(self, step: int) -> list[tasks.Asked]:
        cfg, rl = self.cfg, self.cfg.rl
        if self.prompts:
            return tasks.from_file(self.prompts, cfg.seed, step - rl.warmup_steps, rl.prompts_per_step)
        if rl.task == "count_to":
            return tasks.count_to(cfg.seed, step, rl.prompts_per_step, rl.prompt_length, rl.max_response_length,
                                  cfg.model.vocab_size)
        return tasks.counting(cfg.seed, step, rl.prompts_per_step, rl.prompt_length, cfg.model.vocab_size)

    def _held_out(self) -> list[tasks.Asked]:
        """The validation prompts (core.controller.validation): ``rl.val_prompts``' records (a
        file task: refused at submit without), else the built-in task's held-out set; none
        without ``rl.val_every``."""
        cfg, rl = self.cfg, self.cfg.rl
        if not rl.val_every:
            return []
        if rl.val_prompts is not None:
            from core.data import prompts  # as the training prompts: only file tasks read a file

            return tasks.held_out(prompts.read_prompts(rl.val_prompts, key=rl.prompt_key, tokenizer=self.tokenizer,
                                                       length=rl.prompt_length, what="rl.val_prompts",
                                                       template_variables=rl.chat_template_kwargs))
        if rl.task == "count_to":
            return tasks.count_to_held_out(cfg.seed, rl.prompts_per_step, rl.prompt_length, rl.max_response_length,
                                           cfg.model.vocab_size)
        return tasks.counting_held_out(cfg.seed, rl.prompts_per_step, rl.prompt_length, cfg.model.vocab_size)

    def rewards(self, asked: Sequence[tasks.Asked], responses: Sequence[tuple[int, ...]], *, per: int = 1
                ) -> list[float]:
        """Every response's reward; response ``i`` answers ``asked[i // per]``. The one place
        the controller scores responses (the training step's and validation's)."""
        return self.scorer.score_all([Sample(tuple(asked[i // per].tokens), r, self._meta(asked[i // per].meta, r),
                                             i // per) for i, r in enumerate(responses)])

    def _text(self, response: tuple[int, ...]) -> dict[str, str]:
        """A response's text for samples.jsonl (a file task's: before its stop token)."""
        if self.tokenizer is None:
            return {}
        return {"text": text_before_stop(self.tokenizer, self.stop, response)}

    def _meta(self, meta: dict[str, Any], response: tuple[int, ...]) -> dict[str, Any]:
        """A prompt's metadata for the reward; a file task's with ``response_text``."""
        if self.tokenizer is None:
            return meta
        return {**meta, "response_text": text_before_stop(self.tokenizer, self.stop, response)}

    def _update(self, step: int, sequences: Ragged, adv: Ragged, pads: list[int], old: Ragged, ref: Ragged | None
                ) -> tuple[float | None, list[rl_calls.PolicyResult], int]:
        """``ppo_epochs`` actor epochs of one optimizer step per mini-batch; (the first epoch's
        KL to the reference, a token mean over every response (None without a reference), the
        last epoch's results by rank merged over its mini-batches, the optimizer steps taken).
        Each mini-batch's requests are built once and sent every epoch (one encoding per replica)."""
        rl = self.cfg.rl
        coef = self.kl.value if ref else 0.0
        batches = []
        for part in self._mini_batches(len(sequences)):
            rows = np.arange(len(sequences))[part]
            batches.append([rl_calls.PolicyBatch(step=step, agg=self._agg(adv.lengths[part]),
                                                 prompt_length=rl.prompt_length, sequences=sequences.take(share),
                                                 kl_coef=coef, advantages=adv.take(share), old_logprobs=old.take(share),
                                                 ref_logprobs=ref.take(share) if ref else Ragged.empty(),
                                                 pads=tuple(pads[i] for i in share))
                            for share in self._split(rows)])
        epochs = [[self.trainer.call_each(rl_calls.POLICY_STEP, shares, timeout_s=self.cfg.timeouts.step_s)
                   for shares in batches] for _ in range(rl.ppo_epochs)]
        kl = None
        if ref:  # each mini-batch's token mean (the same on every owner) weighed by its tokens
            weighed = [(self.trainer.owners(results)[0].kl or 0.0) * shares[0].agg.tokens
                       for results, shares in zip(epochs[0], batches, strict=True)]
            kl = sum(weighed) / sum(shares[0].agg.tokens for shares in batches)
        return kl, rl_record.merged(epochs[-1]), len(batches) * rl.ppo_epochs

    def _mini_batches(self, rows: int) -> list[slice]:
        """The rows of each optimizer step of an epoch, in order (``rl.mini_batch_size``)."""
        size = self.cfg.rl.mini_batch_size or rows
        return [slice(start, start + size) for start in range(0, rows, size)]

    def _agg(self, lengths: np.ndarray) -> rl_calls.LossAgg:
        """A mini-batch's loss aggregation: its counts (``lengths``: each response's tokens)."""
        rl = self.cfg.rl
        return rl_calls.LossAgg(mode=rl.loss_agg_mode, tokens=int(lengths.sum()), rows=len(lengths),
                                horizon=rl.max_response_length)

    def _score(self, model: str, sequences: Ragged, pads: list[int]) -> tuple[Ragged, float]:
        """Per response its tokens' log-probs under ``model`` (the critic: values), in order;
        the actor's entropy (token mean over every response)."""
        mini_batch = (self.cfg.rl.mini_batch_size or 0) // self.trainer.dims.dp  # each replica's, as updated
        shares = self._split(np.arange(len(sequences)))
        requests = [rl_calls.ScoreRows(model=model, prompt_length=self.cfg.rl.prompt_length,  # type: ignore[arg-type]
                                       sequences=sequences.take(share), pads=tuple(pads[i] for i in share),
                                       mini_batch=mini_batch) for share in shares]
        answers = self.trainer.call_each(rl_calls.SCORE_ROWS, requests, timeout_s=self.cfg.timeouts.step_s)
        out = gathered([part.values if model == "critic" else part.logprobs for part in answers], shares)
        entropy = sum(part.entropy_sum for part in answers)
        tokens = sum(part.tokens for part in answers)
        return out, entropy / max(tokens, 1)

    def _split(self, items: Sequence[T]) -> list[Sequence[T]]:
        """Each data replica's share of ``items``: every ``dp``-th, from the replica's index on."""
        dp = self.trainer.dims.dp
        return [items[d::dp] for d in range(dp)]


@contextmanager
def _timed(phases: dict[str, float], name: str) -> Any:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = time.perf_counter() - t0
