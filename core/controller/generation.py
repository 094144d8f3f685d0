"""The generator flow as the controller drives it: sync, check, generate, record.

At the start of every allocation (after the trainer's state is restored: never from stale
memory) and after every ``generator.sync_interval_steps`` steps, the controller syncs the
trainer's weights into the generator (its own plan, core.flows.reshard, made once from
every rank's slices), checks the sync by both models' log-probs of a probe batch, and at
the interval also continues the run's prompts: one greedy continuation and
``samples_per_prompt`` sampled ones per prompt, appended to samples.jsonl. The policy
version is the trainer's step count at the sync. Sampling is keyed by (seed, step,
replica), so a resumed run writes the same samples as an uninterrupted one; rows past the
step a run resumes from are cut first.

The probe: the trainer answers a held-out batch with its log-probs, the generator scores
the same tokens, the controller compares. Prompts come from the trainer, continuations from
the generator. Colocated, every call goes to the trainer's ranks, which hold both models.
Split, the generator's ranks follow the trainer's, and a weight sync runs over both (on a
bridge group joined at the start).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from core.controller.group import WorkerGroup
from core.errors import UserError
from core.flows import calls as gen_calls
from core.flows import reshard
from core.record.runfolder import RunFolder
from core.spec.config import RunConfig
from core.spec.generator import generator_dims
from core.wire.contract import NO_ARGS

log = logging.getLogger(__name__)


class GeneratorFlow:
    def __init__(self, cfg: RunConfig, run: RunFolder, group: WorkerGroup) -> None:
        self.cfg, self.run, self.group = cfg, run, group
        self.dims = generator_dims(cfg)
        trainer = cfg.trainer.world_size
        self.base = trainer if cfg.generator.split else 0  # the generator's first worker rank
        self.trainer_ranks = tuple(range(trainer))
        self.ranks = tuple(range(self.base, self.base + self.dims.world_size))  # the generator's
        self.sync_ranks = tuple(sorted({*self.trainer_ranks, *self.ranks}))
        self._plan: list[reshard.Piece] | None = None
        self._prompts: tuple[tuple[int, ...], ...] = ()
        self.version = -1

    def _call(self, method: Any, ranks: tuple[int, ...], req: Any = NO_ARGS, *, each: Any = None,
              timeout_s: float | None = None) -> dict[int, Any]:
        """``method`` on ``ranks`` (``each(rank)``: a rank's own request); every result by rank."""
        return self.group.call(method, req, dispatch=lambda r, _: {k: r if each is None else each(k) for k in ranks},
                               collect=lambda res, _: res, timeout_s=timeout_s)

    def start(self, step: int) -> float:
        """After setup and resume: the bridge (split), the plan, the prompts, samples past
        ``step`` cut, a first sync."""
        if self.cfg.generator.split:
            addr, port = self.group.rendezvous_of(0)  # the trainer's store hosts the bridge's rendezvous
            self._call(gen_calls.BRIDGE, self.sync_ranks, gen_calls.Bridge(
                master_addr=addr, master_port=port, size=len(self.sync_ranks),
                name=f"baton-bridge/{self.group.generation}/"), timeout_s=self.cfg.timeouts.setup_s)
        held = self._call(gen_calls.GEN_SLICES, self.sync_ranks)
        self._plan = reshard.plan({r: h.sources for r, h in held.items()}, {r: h.targets for r, h in held.items()},
                                  bucket_bytes=int(self.cfg.generator.bucket_mb * 2**20))
        g = self.cfg.generator
        self._prompts = self._call(gen_calls.GEN_PROMPTS, self.trainer_ranks, gen_calls.Prompts(
            count=g.num_prompts, length=g.prompt_length))[0].prompts
        _keep_until(self.run, step)
        return self.sync(step)

    def sync(self, step: int, *, probe: bool = True) -> float:
        """Trainer → generator at policy version ``step``; the probe's largest log-prob gap
        (0 without the probe: an RL step measures the gap on its own responses instead)."""
        assert self._plan is not None
        pieces = self._plan
        synced = self._call(gen_calls.SYNC_WEIGHTS, self.sync_ranks, each=lambda r: gen_calls.SyncWeights(
            pieces=tuple(reshard.for_rank(pieces, r)), version=step), timeout_s=self.cfg.timeouts.checkpoint_s)
        gap = self._probe(step) if probe else 0.0
        self.version = step
        log.log(logging.INFO if probe else logging.DEBUG, "generator synced to version %d: %.1f MB in %.3f s, probe "
                "log-prob gap %.2e", step, sum(s.bytes_received for s in synced.values()) / 2**20,
                max(s.seconds for s in synced.values()), gap)
        tol = self.cfg.generator.logprob_tolerance
        if gap > tol:
            raise UserError(f"generator.logprob_tolerance: after the weight sync at step {step} the generator's "
                            f"log-probs differ from the trainer's by {gap:.3g} > {tol:g}; the layouts compute "
                            "differently beyond the tolerance (bf16?) or the sync is wrong: raise the tolerance "
                            "only if the gap is expected")
        return gap

    def _probe(self, step: int) -> float:
        """The largest gap between both models' log-probs of a held-out batch of ``step``."""
        timeout = self.cfg.timeouts.step_s
        answers = self._call(gen_calls.PROBE_BATCH, self.trainer_ranks, gen_calls.Probe(step=step), timeout_s=timeout)
        batch = next(b for b in answers.values() if b.tokens)
        first = {self.base + r for r in range(self.dims.world_size) if self.dims.coords(r).dp == 0}
        scored = self._call(gen_calls.SCORE, self.ranks, timeout_s=timeout, each=lambda r: dataclasses.replace(
            batch, logprobs=()) if r in first else gen_calls.LogProbs())
        mine = next(s.logprobs for s in scored.values() if s.logprobs)
        return max(abs(a - b) for row, ref in zip(mine, batch.logprobs, strict=True)
                   for a, b in zip(row, ref, strict=True))

    def due(self, done: int) -> bool:
        return done % self.cfg.generator.sync_interval_steps == 0

    def generate(self, step: int) -> None:
        """Greedy and sampled continuations of the prompts at policy version ``step``."""
        g = self.cfg.generator
        replicas = self.dims.dp
        rows: list[dict[str, Any]] = []
        for sample in range(1 + g.samples_per_prompt):
            greedy = sample == 0
            req = gen_calls.Generate(prompts=self._prompts, max_new_tokens=g.max_new_tokens,
                                     temperature=0.0 if greedy else g.temperature, top_k=g.top_k, top_p=g.top_p,
                                     eos=g.eos, seed=(self.cfg.seed * 7919 + step) * 1009 + sample)
            done = self._call(gen_calls.GENERATE, self.ranks, timeout_s=self.cfg.timeouts.step_s,
                              each=lambda r, req=req: self._share(req, self.dims.coords(r - self.base).dp))
            for part in (d for d in done.values() if d.replica >= 0):
                for index, tokens, logps in zip(range(part.replica, len(self._prompts), replicas), part.tokens,
                                                part.logprobs, strict=True):
                    rows.append({"step": step, "version": part.version, "kind": "greedy" if greedy else "sampled",
                                 "sample": sample, "index": index, "replica": part.replica,
                                 "prompt": list(self._prompts[index]), "tokens": list(tokens),
                                 "logprobs": [round(x, 6) for x in logps]})
        rows.sort(key=lambda r: (r["sample"], r["index"]))  # the same order whatever the layout
        with self.run.samples.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    def _share(self, req: gen_calls.Generate, replica: int) -> gen_calls.Generate:
        """A replica's share of the prompts: every ``dp``-th, from its own index on."""
        indices = tuple(range(replica, len(req.prompts), self.dims.dp))
        return dataclasses.replace(req, prompts=tuple(req.prompts[i] for i in indices), indices=indices)

    def rollout(self, req: gen_calls.Generate) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
        """Continue ``req.prompts`` (spread over the replicas); (tokens, log-probs) per prompt, in order."""
        done = self._call(gen_calls.GENERATE, self.ranks, timeout_s=self.cfg.timeouts.step_s,
                          each=lambda r: self._share(req, self.dims.coords(r - self.base).dp))
        out: list[tuple[tuple[int, ...], tuple[float, ...]]] = [((), ())] * len(req.prompts)
        for part in (d for d in done.values() if d.replica >= 0):
            for index, tokens, logps in zip(range(part.replica, len(req.prompts), self.dims.dp), part.tokens,
                                            part.logprobs, strict=True):
                out[index] = (tuple(tokens), tuple(logps))
        return out


def _keep_until(run: RunFolder, step: int) -> None:
    """Cut samples.jsonl to the rows of steps ≤ ``step`` (a resume redoes the later ones)."""
    try:
        lines = run.samples.read_text().splitlines()
    except FileNotFoundError:
        return
    kept = [line for line in lines if line.strip() and _step_of(line) <= step]
    if len(kept) != len(lines):
        tmp = run.samples.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(run.samples)


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # a torn line: cut
