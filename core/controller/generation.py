"""The generator flow as the controller drives it: sync, check, generate, record.

At the start of every allocation (after the trainer's state is restored: never from stale
memory) and after every ``generator.sync_interval_steps`` steps, the controller syncs the
trainer's weights into the generator (its own plan, core.flows.reshard, made once from
every rank's slices), checks the sync by both models' log-probs of a probe batch, and at
the interval also continues the run's prompts: one greedy continuation and
``samples_per_prompt`` sampled ones per prompt, appended to samples.jsonl (not under an RL
program: there samples.jsonl holds the validation responses, core.controller.validation). The policy
version is the trainer's step count at the sync. Sampling is keyed by (seed, step,
replica), so a resumed run writes the same samples as an uninterrupted one; rows past the
step a run resumes from are cut first.

The probe: the trainer answers a held-out batch with its log-probs, the generator scores
the same tokens, the controller compares (both at temperature 1: it checks the synced
weights; the samples' log-probs are at the sampling temperature, core.model.gpt.generate).
Prompts come from the trainer, continuations from the generator. With ``init_from: hf:PATH``
the folder's tokenizer names the continuations' stop tokens (generation_config.json's
``eos_token_id``; ``generator.eos`` overrides) and
each row adds ``text``: the continuation decoded up to, not including, its stop token. Colocated, every call goes to the trainer's ranks, which hold both models.
Split, the generator's ranks follow the trainer's, and a weight sync runs over both (on a
bridge group joined at the start).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from core.checkpoint.spec import TensorSlice
from core.config import tokvocab
from core.config.run import RunConfig
from core.controller.group import WorkerGroup
from core.controller.roles import Call, RoleGroup, Span
from core.data.tokenizer import load_tokenizer, text_before_stop
from core.errors import UserError
from core.flows import calls as gen_calls
from core.flows import reshard
from core.record.runfolder import RunFolder
from core.wire.ragged import TOKENS, Ragged, gathered

log = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True)
class Responses:
    """Each prompt's continuation, in prompt order: its tokens (int32 rows) and their
    log-probs at the sampling temperature (float32 rows), as GENERATE answers them."""

    tokens: Ragged
    logprobs: Ragged

    def until(self, stop: Sequence[int]) -> Responses:
        """Each response up to and including its first stop token (what follows it is padding):
        the policy is trained to emit the stop token, the reward's text ends before it."""
        if not stop:
            return self
        ends = []
        for row in self.tokens.rows():
            hits = np.flatnonzero(np.isin(row, stop))
            ends.append(int(hits[0]) + 1 if hits.size else len(row))
        return Responses(*(Ragged.of([r[:e] for r, e in zip(x.rows(), ends, strict=True)], x.values.dtype)
                           for x in (self.tokens, self.logprobs)))


class GeneratorFlow:
    def __init__(self, cfg: RunConfig, run: RunFolder, workers: WorkerGroup, trainer: RoleGroup,
                 generator: RoleGroup) -> None:
        self.cfg, self.run, self.trainer, self.generator = cfg, run, trainer, generator
        self.dims = generator.dims
        self.span = Span(workers, trainer, generator)  # a weight sync's ranks: both groups'
        self._plan: list[reshard.Piece] | None = None
        self.sent: dict[str, int] = {}  # the last sync's bytes sent, for the step record: the most by a rank, all
        self._prompts: tuple[tuple[int, ...], ...] = ()
        self.version = -1
        self._kv_cache_bytes = 0  # the largest KV cache a replica allocated since take_kv_cache_mb
        # init_from hf:PATH with a tokenizer in the folder: the samples' stop tokens and text
        self.tokenizer: Any = None
        self.stop: tuple[int, ...] = () if cfg.generator.eos is None else (cfg.generator.eos,)
        folder = tokvocab.hf_init_folder(cfg.init_from)
        if tokvocab.has_tokenizer(folder):
            self.tokenizer = load_tokenizer(tokvocab.HF_PREFIX + folder)
            self.stop = self.stop or tuple(self.tokenizer.stop_ids)

    def start(self, step: int) -> float:
        """After setup and resume: the bridge (split), the plan, the prompts, samples past
        ``step`` cut, a first sync."""
        g = self.cfg.generator
        self._connect()
        (first,) = self.trainer.call(gen_calls.GEN_PROMPTS, gen_calls.Prompts(count=g.num_prompts,
                                                                             length=g.prompt_length))
        self._prompts = first.prompts
        _keep_until(self.run, step)
        return self.sync(step)

    def rejoin(self) -> None:
        """After the generator's workers alone were restarted (the trainer's kept their state):
        a new bridge (the old one had the lost ranks), the plan's targets again, and a sync to
        the version the lost generator held, from the trainer's kept copy of it
        (``rl.max_staleness`` > 0: the trainer has moved on since) or from its weights."""
        self._connect()
        self.sync(self.version, probe=False, from_kept=self.keeps)

    @property
    def keeps(self) -> bool:
        """Whether every sync leaves the trainer's ranks a host copy of the policy it sent: with
        ``rl.max_staleness`` > 0 the rollouts in flight come from a policy the trainer has left."""
        return self.cfg.rl.max_staleness > 0

    def _connect(self) -> None:
        """The bridge (split: a group over both groups' ranks, named by the worker generation)
        and the weight-sync plan from every rank's slices."""
        cfg = self.cfg
        if self.generator.plan.own_processes:
            addr, port = self.trainer.rendezvous()  # the trainer's store hosts the bridge's rendezvous
            self.span.call(gen_calls.BRIDGE, gen_calls.Bridge(
                master_addr=addr, master_port=port, size=len(self.span.ranks),
                name=f"baton-bridge/{self.trainer.generation}/"), timeout_s=cfg.timeouts.setup_s)
        held = self.span.call(gen_calls.GEN_SLICES)
        if cfg.generator.engine == "vllm":  # each replica's leader holds every tensor whole (core.model.gpt.vllm_rollout)
            held = self._staged(held)
        self._plan = reshard.plan({r: h.sources for r, h in held.items()}, {r: h.targets for r, h in held.items()},
                                  bucket_bytes=int(cfg.generator.bucket_mb * 2**20))

    def _staged(self, held: dict[int, gen_calls.HeldSlices]) -> dict[int, gen_calls.HeldSlices]:
        """vLLM replicas: their targets are the trainer's tensors whole, in the trainer's dtype."""
        whole: dict[str, TensorSlice] = {}
        for h in held.values():
            for s in h.sources:
                whole.setdefault(s.name, TensorSlice(name=s.name, global_shape=s.global_shape, dtype=s.dtype,
                                                     offset=(0,) * len(s.global_shape), shape=s.global_shape))
        staged = self.generator.call(gen_calls.STAGE, gen_calls.Stage(tensors=tuple(whole[n] for n in sorted(whole))),
                                     timeout_s=self.cfg.timeouts.setup_s)
        out = dict(held)
        for rank, got in zip(self.generator.ranks, staged, strict=True):
            out[rank] = gen_calls.HeldSlices(sources=held[rank].sources, targets=got.targets)
        return out

    def sync(self, step: int, *, probe: bool = True, from_kept: bool = False) -> float:
        """Trainer → generator at policy version ``step``; the probe's largest log-prob gap
        (0 without the probe: an RL step measures the gap on its own responses instead).
        ``from_kept``: from the trainer's copy of the policy it last sent (``rejoin``)."""
        assert self._plan is not None
        pieces = self._plan
        synced = self.span.call_each(gen_calls.SYNC_WEIGHTS, {r: gen_calls.SyncWeights(
            pieces=tuple(reshard.for_rank(pieces, r)), version=step, keep=self.keeps and not from_kept,
            from_kept=from_kept) for r in self.span.ranks}, timeout_s=self.cfg.timeouts.checkpoint_s)
        gap = self._probe(step) if probe else 0.0
        self.version = step
        sent = [s.bytes_sent for s in synced.values()]
        self.sent = {"sync_bytes_sent_max": max(sent), "sync_bytes_sent_total": sum(sent)}
        log.log(logging.INFO if probe else logging.DEBUG, "generator synced to version %d: %.1f MB sent (at most "
                "%.1f MB by one rank) in %.3f s, probe log-prob gap %.2e", step, sum(sent) / 2**20, max(sent) / 2**20,
                max(s.seconds for s in synced.values()), gap)
        tol = self.cfg.generator.tolerance(next((s.dtype for s in synced.values() if s.dtype), "float32"))
        if gap > tol:
            raise UserError(f"generator.logprob_tolerance: after the weight sync at step {step} the generator's "
                            f"log-probs differ from the trainer's by {gap:.3g} > {tol:g}; the layouts compute "
                            "differently beyond the tolerance (bf16?) or the sync is wrong: raise the tolerance "
                            "only if the gap is expected")
        return gap

    def _probe(self, step: int) -> float:
        """The largest gap between both models' log-probs of a held-out batch of ``step``."""
        timeout = self.cfg.timeouts.step_s
        probe = gen_calls.Probe(step=step, next_token=self.cfg.generator.engine == "vllm")  # vLLM: prompt log-probs
        batch = self.trainer.call(gen_calls.PROBE_BATCH, probe, timeout_s=timeout)[0]
        shares = [dataclasses.replace(batch, logprobs=())] + [gen_calls.LogProbs()] * (self.dims.dp - 1)
        mine = self.generator.call_each(gen_calls.SCORE, shares, timeout_s=timeout)[0].logprobs
        return max(abs(a - b) for row, ref in zip(mine, batch.logprobs, strict=True)
                   for a, b in zip(row, ref, strict=True))

    def due(self, done: int) -> bool:
        return done % self.cfg.generator.sync_interval_steps == 0

    def generate(self, step: int) -> None:
        """Greedy and sampled continuations of the prompts at policy version ``step``."""
        g = self.cfg.generator
        rows: list[dict[str, Any]] = []
        for sample in range(1 + g.samples_per_prompt):
            greedy = sample == 0
            req = gen_calls.Generate(prompts=Ragged.of(self._prompts, TOKENS), max_new_tokens=g.max_new_tokens,
                                     temperature=0.0 if greedy else g.temperature, top_k=g.top_k, top_p=g.top_p,
                                     eos=self.stop, seed=(self.cfg.seed * 7919 + step) * 1009 + sample)
            for part in self._generate(req):
                for index, tokens, logps in zip(range(part.replica, len(self._prompts), self.dims.dp),
                                                part.tokens.tolist(), part.logprobs.tolist(), strict=True):
                    rows.append({"step": step, "version": part.version, "kind": "greedy" if greedy else "sampled",
                                 "sample": sample, "index": index, "replica": part.replica,
                                 "prompt": list(self._prompts[index]), "tokens": list(tokens),
                                 "logprobs": [round(x, 6) for x in logps], **self._text(tokens)})
        rows.sort(key=lambda r: (r["sample"], r["index"]))  # the same order whatever the layout
        with self.run.samples.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    def _text(self, tokens: Sequence[int]) -> dict[str, str]:
        """A sample's text (with a Hugging Face tokenizer): up to its first stop token, excluded."""
        return {} if self.tokenizer is None else {"text": text_before_stop(self.tokenizer, self.stop, tokens)}

    def _generate(self, req: gen_calls.Generate) -> list[gen_calls.Generated]:
        """GENERATE on every replica, each with its share of the prompts: every ``dp``-th, from
        its own index on; one answer per replica."""
        parts = self.generator.call_each(gen_calls.GENERATE, self._requests(req), timeout_s=self.cfg.timeouts.step_s)
        return self._measured(parts)

    def _requests(self, req: gen_calls.Generate) -> list[gen_calls.Generate]:
        shares = []
        for indices in self._shares(len(req.prompts)):
            pads = tuple(req.pads[i] for i in indices) if req.pads else ()
            shares.append(dataclasses.replace(req, prompts=req.prompts.take(indices), indices=indices, pads=pads))
        return shares

    def _measured(self, parts: list[gen_calls.Generated]) -> list[gen_calls.Generated]:
        # Generated.kv_cache_bytes: the largest KV cache the replica allocated in the call (0: none measured)
        self._kv_cache_bytes = max(self._kv_cache_bytes, *(p.kv_cache_bytes for p in parts))
        return parts

    def take_kv_cache_mb(self) -> float | None:
        """The largest KV cache a replica allocated in the generations since the last call, in
        MiB (the step record's ``gen_kv_cache_mb``); None without one."""
        held, self._kv_cache_bytes = self._kv_cache_bytes, 0
        return round(held / 2**20, 6) if held else None

    def _shares(self, rows: int) -> list[tuple[int, ...]]:
        """Each replica's prompts: every ``dp``-th, from its own index on."""
        return [tuple(range(replica, rows, self.dims.dp)) for replica in range(self.dims.dp)]

    def rollout(self, req: gen_calls.Generate) -> Responses:
        """Continue ``req.prompts`` (spread over the replicas); each prompt's tokens and log-probs, in order."""
        return self._responses(self._generate(req), len(req.prompts))

    def start_rollout(self, req: gen_calls.Generate, *, timeout_s: float) -> PendingRollout:
        """``rollout`` without waiting: GENERATE sent to every replica; ``wait()`` gives the
        responses. The generator's ranks serve their calls in order: a sync started later
        runs after it."""
        call = self.generator.start_each(gen_calls.GENERATE, self._requests(req), timeout_s=timeout_s)
        return PendingRollout(self, call, len(req.prompts))

    def _responses(self, parts: list[gen_calls.Generated], rows: int) -> Responses:
        """One answer per replica, in replica order (Collect.OWNERS), as each prompt's response in order."""
        if [p.replica for p in parts] != list(range(self.dims.dp)):
            raise RuntimeError(f"generator answers from replicas {[p.replica for p in parts]}, not in replica order")
        shares = self._shares(rows)
        return Responses(gathered([p.tokens for p in parts], shares), gathered([p.logprobs for p in parts], shares))


class PendingRollout:
    """A rollout in flight on the generator group (``GeneratorFlow.start_rollout``)."""

    def __init__(self, flow: GeneratorFlow, call: Call[gen_calls.Generated], rows: int) -> None:
        self.flow, self.call, self.rows = flow, call, rows

    def done(self) -> bool:
        return self.call.done()

    def wait(self) -> Responses:
        """Each prompt's tokens and log-probs, in order, once every replica has answered."""
        return self.flow._responses(self.flow._measured(self.call.wait()), self.rows)


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
