"""The generator's model: a second GPT in its own layout, and both ends of weight syncs.

Colocated, the generator's model lives in the trainer's processes: the trainer keeps
Megatron's global parallel state and the generator's model gets a process-group collection
of its own (``GPTModel(pg_collection=...)``). Split, it lives in processes of its own, whose
world is the generator's alone. The rollout role (core.model.gpt.roles.rollout) serves it;
the actor role the trainer's side (``prompts``, ``trainer_probe``). Either way its groups are
``generator.tp`` consecutive ranks of its world, one pipeline stage, the rest data-parallel
replicas. Its weights come only from weight syncs (``core.model.gpt.sync`` running a plan of
``core.flows.reshard``); ``version`` is the trainer step they were taken after.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection

from core.config.dims import ParallelDims
from core.config.run import RunConfig
from core.flows import calls as gen_calls
from core.model.gpt import generate as gen_mod
from core.model.gpt import model as model_mod
from core.model.gpt import sync
from core.model.gpt.state import is_writer, sharded_params, slice_of
from core.model.gpt.step import label_logprobs
from core.wire.ragged import FLOATS, TOKENS, Ragged


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


class WeightLink:
    """One rank's ends of the weight syncs: the trainer slices it holds (``trainer_chunks``:
    every replica's, so that each can send its share; only the first replica's with
    ``every_replica`` false, when the replicas may differ between averages: parallel.sync),
    the generator slices it holds (``model``), and how pieces travel: the default group
    (colocated: plan ranks are its ranks) or ``bridge`` (split: plan ranks are bridge ranks).
    A sync asked to ``keep`` leaves a host copy of the sources it sent (``kept``: the policy
    the rollouts in flight come from, rl.max_staleness > 0); one ``from_kept`` sends that
    copy instead of the parameters (a restarted generator, after the trainer moved on)."""

    def __init__(self, rank: int, *, trainer_chunks: list[Any] | None, model: Any | None) -> None:
        self.rank, self.trainer_chunks, self.model = rank, trainer_chunks, model
        self.every_replica = True
        self.bridge: Any = None
        self.staging: Any = None  # a vLLM replica's (core.model.gpt.vllm_rollout): its targets, told of syncs
        self.version = -1
        self._prepared: tuple[int, list[Any]] | None = None
        self.kept: list[tuple[Any, torch.Tensor]] | None = None  # the sources at the last ``keep`` sync, on the host

    def join(self, req: gen_calls.Bridge, *, backend: str, timeout_s: float) -> None:
        self.bridge = sync.connect(req.master_addr, req.master_port, name=req.name, rank=self.rank, size=req.size,
                                   backend=backend, timeout_s=timeout_s)

    def _sources(self) -> list[tuple[Any, torch.Tensor]]:
        if self.trainer_chunks is None:
            return []
        return [(slice_of(sh, dtype=_name(p)), p) for sh, p in sharded_params(self.trainer_chunks)
                if self.every_replica or is_writer(sh)]

    def _keep(self) -> None:
        """Copy the sources just sent into host buffers (allocated once, pinned on a GPU; the
        copy is queued on the stream, before any later update of the parameters)."""
        live = self._sources()
        if self.kept is None or [s for s, _ in self.kept] != [s for s, _ in live]:
            self.kept = [(s, torch.empty(p.shape, dtype=p.dtype, pin_memory=p.is_cuda)) for s, p in live]
        for (_, host), (_, param) in zip(self.kept, live, strict=True):
            host.copy_(param.detach(), non_blocking=True)

    def _kept_sources(self) -> list[tuple[Any, torch.Tensor]]:
        """The host copy of the last ``keep`` sync's sources, on the sources' device for the send
        (a GPU holds this second copy only while the sync runs)."""
        if self.kept is None:
            if self.trainer_chunks is None:
                return []
            raise RuntimeError(f"rank {self.rank}: a sync from the kept policy, but no sync kept one")
        live = self._sources()
        device = live[0][1].device if live else torch.device("cpu")
        return [(s, t.to(device)) for s, t in self.kept]

    def _targets(self) -> list[tuple[Any, torch.Tensor]]:
        if self.staging is not None:
            return self.staging.targets()
        return [] if self.model is None else [(slice_of(sh, dtype=_name(p)), p) for sh, p in sharded_params([self.model])]

    def held(self) -> gen_calls.HeldSlices:
        return gen_calls.HeldSlices(sources=tuple(s for s, _ in self._sources()),
                                    targets=tuple(s for s, _ in self._targets()))

    def sync(self, req: gen_calls.SyncWeights) -> gen_calls.Synced:
        t0 = time.perf_counter()
        if req.from_kept:  # a restarted generator: the policy its rollouts in flight came from
            moved = sync.run_plan(sync.prepare(req.pieces, self.rank, sync.index(self._kept_sources()),
                                               sync.index(self._targets())), link=self.bridge)
        else:
            key = hash(req.pieces)
            if self._prepared is None or self._prepared[0] != key:  # bound to parameter views once per plan
                self._prepared = (key, sync.prepare(req.pieces, self.rank, sync.index(self._sources()),
                                                    sync.index(self._targets())))
            moved = sync.run_plan(self._prepared[1], link=self.bridge)
            if req.keep:
                self._keep()
        self.version = req.version
        if self.staging is not None:
            self.staging.synced(req.version)
        targets = self._targets()  # a vLLM leader's are the trainer's dtype, which is its engine's
        return gen_calls.Synced(version=self.version, bytes_received=moved.received, bytes_sent=moved.sent,
                                seconds=time.perf_counter() - t0,
                                dtype=targets[0][0].dtype if targets else "")


class Rollout:
    """This rank's generator model (rank ``rank`` of a world laid out as ``dims``) and what
    the generator calls do with it."""

    def __init__(self, cfg: RunConfig, dims: ParallelDims, rank: int, *, on_cuda: bool) -> None:
        g = cfg.generator
        self.dims, self.coords, self.cfg = dims, dims.coords(rank), cfg
        parallel = dataclasses.replace(cfg.parallel, tp=g.tp, pp=1)
        config = model_mod.transformer_config(cfg.model, parallel, cfg.training, on_cuda=on_cuda)
        self.model = GPTModel(
            config=config, transformer_layer_spec=model_mod.layer_spec(config, on_cuda=on_cuda),
            vocab_size=cfg.model.vocab_size, max_sequence_length=cfg.model.seq_length, pre_process=True,
            post_process=True, share_embeddings_and_output_weights=cfg.model.tie_embeddings, parallel_output=True,
            pg_collection=process_groups(dims, rank), **model_mod.position_options(cfg.model))
        if on_cuda:
            self.model.cuda(torch.cuda.current_device())
        self.model.eval()
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
        self.link: WeightLink | None = None  # set by the task: the weight syncs that fill this model

    @property
    def version(self) -> int:
        return -1 if self.link is None else self.link.version

    def score(self, req: gen_calls.LogProbs) -> gen_calls.LogProbs:
        """Teacher-forced log-probs of ``req.labels`` after ``req.tokens`` (every rank of a
        replica computes; its first tensor-parallel rank answers)."""
        if not req.tokens:
            return gen_calls.LogProbs()
        tokens = torch.tensor(req.tokens, dtype=torch.int64, device=self.device)
        logp = gen_mod.label_logprobs(self.model, tokens, torch.tensor(req.labels, dtype=torch.int64,
                                                                       device=self.device))
        if self.coords.tp != 0:
            return gen_calls.LogProbs()
        return gen_calls.LogProbs(logprobs=tuple(map(tuple, logp.float().cpu().tolist())))

    def generate(self, req: gen_calls.Generate) -> gen_calls.Generated:
        how = gen_mod.Sampling(max_new_tokens=req.max_new_tokens, temperature=req.temperature, top_k=req.top_k,
                               top_p=req.top_p, eos=tuple(req.eos))
        if not req.prompts:  # more replicas than prompts
            return gen_calls.Generated(replica=self.coords.dp if self.coords.tp == 0 else -1, version=self.version)
        # One stream per (seed, prompt): the controller keys ``seed`` by run seed, step and
        # sample, so what a prompt draws does not depend on the layout that generates it.
        indices = req.indices or tuple(range(len(req.prompts)))
        out = gen_mod.decode(self.model, req.prompts.tolist(), how, max_length=self.cfg.model.seq_length,
                             seeds=[(req.seed * 1_000_003 + i) % 2**63 for i in indices], pads=req.pads,
                             max_batch_tokens=self.cfg.generator.max_batch_tokens)
        if self.coords.tp != 0:
            return gen_calls.Generated()
        return gen_calls.Generated(replica=self.coords.dp, version=self.version, kv_cache_bytes=out.kv_cache_bytes,
                                   tokens=Ragged.of(out.tokens, TOKENS), logprobs=Ragged.of(out.logprobs, FLOATS))


def prompts(step_ctx: Any, req: gen_calls.Prompts) -> gen_calls.PromptSet:
    """The first ``req.length`` tokens of held-out sequences (this rank's shard, step 0 on)."""
    rows: list[tuple[int, ...]] = []
    step = 0
    while len(rows) < req.count:
        for mb in step_ctx.source.micro_batches(step, "eval"):
            rows += [tuple(int(t) for t in row[:req.length]) for row in mb.tokens]
        step += 1
    return gen_calls.PromptSet(prompts=tuple(rows[:req.count]))


def trainer_probe(step_ctx: Any, req: gen_calls.Probe) -> gen_calls.LogProbs:
    """The trainer's log-probs of the first held-out micro-batch of ``req.step`` of data
    replica 0, with its tokens and labels; from its last stage's first tp rank (the
    controller has the generator score the same tokens)."""
    batch = step_ctx.source.micro_batches(req.step, "eval")[0]
    if req.next_token:  # a vLLM generator scores a sequence's own next tokens (prompt log-probs): the last is cut
        batch = dataclasses.replace(batch, labels=np.concatenate([batch.tokens[:, 1:], batch.labels[:, -1:]], axis=1))
    logp = label_logprobs(step_ctx, batch)
    c = step_ctx.coords
    if logp is None or c.dp != 0 or c.tp != 0:
        return gen_calls.LogProbs()
    logp = logp.reshape(batch.tokens.shape)
    return gen_calls.LogProbs(tokens=tuple(map(tuple, batch.tokens.tolist())),
                              labels=tuple(map(tuple, batch.labels.tolist())),
                              logprobs=tuple(map(tuple, (logp[:, :-1] if req.next_token else logp).float().cpu().tolist())))


def _name(t: torch.Tensor) -> str:
    return sync.NAMES[t.dtype]
