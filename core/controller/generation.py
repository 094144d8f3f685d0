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
from core.spec.dims import ParallelDims
from core.wire.contract import NO_ARGS

log = logging.getLogger(__name__)


class GeneratorFlow:
    def __init__(self, cfg: RunConfig, run: RunFolder, group: WorkerGroup) -> None:
        self.cfg, self.run, self.group = cfg, run, group
        g = cfg.generator
        self.dims = ParallelDims(tp=g.tp, pp=1, dp=cfg.trainer.world_size // g.tp)
        self._plan: list[reshard.Piece] | None = None
        self._prompts: tuple[tuple[int, ...], ...] = ()
        self.version = -1

    def start(self, step: int) -> float:
        """After setup and resume: the plan, the prompts, samples past ``step`` cut, a first sync."""
        held = self.group.call(gen_calls.GEN_SLICES, NO_ARGS)
        self._plan = reshard.plan({r: h.sources for r, h in enumerate(held)},
                                  {r: h.targets for r, h in enumerate(held)},
                                  bucket_bytes=int(self.cfg.generator.bucket_mb * 2**20))
        g = self.cfg.generator
        self._prompts = self.group.call(gen_calls.GEN_PROMPTS, gen_calls.Prompts(count=g.num_prompts,
                                        length=g.prompt_length), collect=lambda res, _: res[0]).prompts
        _keep_until(self.run, step)
        return self.sync(step)

    def sync(self, step: int) -> float:
        """Trainer → generator at policy version ``step``; the probe's largest log-prob gap."""
        assert self._plan is not None
        pieces = self._plan

        def each(req: gen_calls.SyncWeights, dims: Any) -> dict[int, gen_calls.SyncWeights]:
            return {r: dataclasses.replace(req, pieces=tuple(reshard.for_rank(pieces, r)))
                    for r in range(dims.world_size)}

        synced = self.group.call(gen_calls.SYNC_WEIGHTS, gen_calls.SyncWeights(pieces=(), version=step), dispatch=each,
                                 timeout_s=self.cfg.timeouts.checkpoint_s)
        probed = self.group.call(gen_calls.PROBE, gen_calls.Probe(step=step), timeout_s=self.cfg.timeouts.step_s)
        gap = max(p.max_abs_diff for p in probed if p.max_abs_diff is not None)
        self.version = step
        log.info("generator synced to version %d: %.1f MB in %.3f s, probe log-prob gap %.2e", step,
                 sum(s.bytes_received for s in synced) / 2**20, max(s.seconds for s in synced), gap)
        tol = self.cfg.generator.logprob_tolerance
        if gap > tol:
            raise UserError(f"generator.logprob_tolerance: after the weight sync at step {step} the generator's "
                            f"log-probs differ from the trainer's by {gap:.3g} > {tol:g}; the layouts compute "
                            "differently beyond the tolerance (bf16?) or the sync is wrong: raise the tolerance "
                            "only if the gap is expected")
        return gap

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
            done = self.group.call(gen_calls.GENERATE, req, dispatch=self._split(replicas),
                                   timeout_s=self.cfg.timeouts.step_s)
            for part in sorted((d for d in done if d.replica >= 0), key=lambda d: d.replica):
                for prompt, tokens, logps in zip(self._chunk(part.replica, replicas), part.tokens, part.logprobs,
                                                 strict=True):
                    rows.append({"step": step, "version": part.version, "kind": "greedy" if greedy else "sampled",
                                 "sample": sample, "replica": part.replica, "prompt": list(prompt),
                                 "tokens": list(tokens), "logprobs": [round(x, 6) for x in logps]})
        with self.run.samples.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    def _chunk(self, replica: int, replicas: int) -> tuple[tuple[int, ...], ...]:
        return self._prompts[replica::replicas]

    def _split(self, replicas: int) -> Any:
        def each(req: gen_calls.Generate, dims: Any) -> dict[int, gen_calls.Generate]:
            return {r: dataclasses.replace(req, prompts=self._chunk(self.dims.coords(r).dp, replicas))
                    for r in range(dims.world_size)}
        return each


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
