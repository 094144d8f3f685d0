"""The generator role colocated with a trainer: a second GPT in its own layout, same processes.

The trainer keeps Megatron's global parallel state; the generator's model gets a process-
group collection of its own (``GPTModel(pg_collection=...)``): tensor-parallel groups of
``generator.tp`` consecutive ranks, one pipeline stage, the rest data-parallel replicas.
Its weights come only from weight syncs (``core.model.gpt.sync`` running a plan of
``core.flows.reshard``); ``version`` is the trainer step they were taken after.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection

from core.flows import calls as gen_calls
from core.model.gpt import generate as gen_mod
from core.model.gpt import model as model_mod
from core.model.gpt import sync
from core.model.gpt.state import is_writer, sharded_params, slice_of
from core.model.gpt.step import label_logprobs
from core.spec.config import RunConfig
from core.spec.dims import ParallelDims


def _groups(all_groups: list[list[int]], rank: int) -> Any:
    """Every rank creates every group (a collective, in one order); returns its own."""
    mine = None
    for ranks in all_groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def process_groups(dims: ParallelDims, rank: int) -> ProcessGroupCollection:
    """The groups a one-stage GPT in layout ``dims`` needs, over the whole world."""
    pgc = ProcessGroupCollection()
    single = _groups([[r] for r in range(dims.world_size)], rank)
    pgc.tp = _groups(dims.tp_groups(), rank)
    pgc.dp = _groups(dims.dp_groups(), rank)
    pgc.pp = pgc.cp = pgc.embd = pgc.pos_embd = single
    pgc.tp_cp = pgc.mp = pgc.tp
    pgc.dp_cp = pgc.dp
    return pgc


class Rollout:
    """This rank's generator model and what the generator calls do with it."""

    def __init__(self, cfg: RunConfig, rank: int, *, on_cuda: bool, trainer_chunks: list[Any]) -> None:
        g = cfg.generator
        self.rank = rank
        self.dims = ParallelDims(tp=g.tp, pp=1, dp=cfg.trainer.world_size // g.tp)
        self.coords = self.dims.coords(rank)
        self.cfg = cfg
        self.trainer_chunks = trainer_chunks
        parallel = dataclasses.replace(cfg.parallel, tp=g.tp, pp=1)
        config = model_mod.transformer_config(cfg.model, parallel, cfg.training, on_cuda=on_cuda)
        self.model = GPTModel(
            config=config, transformer_layer_spec=model_mod.layer_spec(on_cuda=on_cuda),
            vocab_size=cfg.model.vocab_size, max_sequence_length=cfg.model.seq_length, pre_process=True,
            post_process=True, share_embeddings_and_output_weights=False, parallel_output=True,
            position_embedding_type="learned_absolute", pg_collection=process_groups(self.dims, rank))
        if on_cuda:
            self.model.cuda(torch.cuda.current_device())
        self.model.eval()
        self.version = -1
        self._prepared: tuple[int, list[Any]] | None = None

    def _sources(self) -> list[tuple[Any, torch.Tensor]]:
        return [(slice_of(sh, dtype=_name(p)), p) for sh, p in sharded_params(self.trainer_chunks) if is_writer(sh)]

    def _targets(self) -> list[tuple[Any, torch.Tensor]]:
        return [(slice_of(sh, dtype=_name(p)), p) for sh, p in sharded_params([self.model])]

    def held(self) -> gen_calls.HeldSlices:
        return gen_calls.HeldSlices(sources=tuple(s for s, _ in self._sources()),
                                    targets=tuple(s for s, _ in self._targets()))

    def sync(self, req: gen_calls.SyncWeights) -> gen_calls.Synced:
        t0 = time.perf_counter()
        key = hash(req.pieces)
        if self._prepared is None or self._prepared[0] != key:  # bound to parameter views once per plan
            self._prepared = (key, sync.prepare(req.pieces, self.rank, sync.index(self._sources()),
                                                sync.index(self._targets())))
        got = sync.run_plan(self._prepared[1])
        self.version = req.version
        return gen_calls.Synced(version=self.version, bytes_received=got, seconds=time.perf_counter() - t0)

    def probe(self, step_ctx: Any, req: gen_calls.Probe) -> gen_calls.Probed:
        """Both models' log-probs of this rank's first held-out micro-batch of ``req.step``;
        compared where the trainer's come out (its last pipeline stage)."""
        batch = step_ctx.source.micro_batches(req.step, "eval")[0]
        trainer = label_logprobs(step_ctx, batch)
        if trainer is None:
            return gen_calls.Probed()
        tokens = torch.from_numpy(batch.tokens).to(step_ctx.device)
        mine = gen_mod.label_logprobs(self.model, tokens, torch.from_numpy(batch.labels).to(step_ctx.device))
        return gen_calls.Probed(max_abs_diff=float((mine - trainer.reshape(mine.shape)).abs().max()),
                                tokens=int(mine.numel()))

    def prompts(self, step_ctx: Any, req: gen_calls.Prompts) -> gen_calls.PromptSet:
        """The first ``req.length`` tokens of held-out sequences (this rank's shard, step 0 on)."""
        rows: list[tuple[int, ...]] = []
        step = 0
        while len(rows) < req.count:
            for mb in step_ctx.source.micro_batches(step, "eval"):
                rows += [tuple(int(t) for t in row[:req.length]) for row in mb.tokens]
            step += 1
        return gen_calls.PromptSet(prompts=tuple(rows[:req.count]))

    def generate(self, req: gen_calls.Generate) -> gen_calls.Generated:
        how = gen_mod.Sampling(max_new_tokens=req.max_new_tokens, temperature=req.temperature, top_k=req.top_k,
                               top_p=req.top_p, eos=req.eos)
        if not req.prompts:  # more replicas than prompts
            return gen_calls.Generated(replica=self.coords.dp if self.coords.tp == 0 else -1, version=self.version)
        # One stream per (seed, replica): the controller keys ``seed`` by run seed and step.
        seed = (req.seed * 1_000_003 + self.coords.dp) % 2**63
        tokens, logps = gen_mod.generate(self.model, req.prompts, how, seed=seed,
                                         max_length=self.cfg.model.seq_length)
        if self.coords.tp != 0:
            return gen_calls.Generated()
        return gen_calls.Generated(replica=self.coords.dp, version=self.version,
                                   tokens=tuple(map(tuple, tokens)), logprobs=tuple(map(tuple, logps)))


def _name(t: torch.Tensor) -> str:
    return sync.NAMES[t.dtype]
