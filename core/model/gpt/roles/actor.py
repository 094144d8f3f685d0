"""The actor: the trained policy, the only model of a pretraining or SFT run.

Built as Megatron's DDP model and optimizer (core.model.gpt.build.trained), or with
``parallel.sharding: params`` as ZeRO-3 (FSDP2, core.model.gpt.fsdp); at ``start`` it
seeds this rank's training streams, resolves the micro batch and binds the data: the
``StepContext`` every other role of the process follows. With ``parallel.sync`` its data
replicas average periodically (local SGD, DiLoCo: core.model.gpt.local_sgd).

Calls: the training calls (core.wire.calls), the RL programs' update and scoring passes
(core.wire.rl_calls: POLICY_STEP, SCORE_ROWS of any model the process holds), and with a
generator the trainer's side of its flow (GEN_PROMPTS, PROBE_BATCH, the source end of
weight syncs). Checkpoint items: the model and its optimizer under their global names
(ZeRO-3: its shards as boxes), the blobs (step counters, RNG streams, data position), and
with DiLoCo the outer momentum (``sync.momentum.*``). CKPT_LOAD into weights (``init_from``):
``load_weights``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from core.config import rl as rl_spec
from core.config.dims import Coords
from core.config.roles import RolePlan
from core.flows import calls as gen_calls
from core.job.process import rss_mb
from core.model.gpt import activations, build, data, fsdp, memory, policy, rollout, sizing, step
from core.model.gpt import model as model_mod
from core.model.gpt.local_sgd import Replicas
from core.model.gpt.roles.base import Items, Rank, ReadFn, Role
from core.model.gpt.state import (
    assemble,
    export_state,
    import_state,
    is_writer,
    load_model_slices,
    sharded_params,
    slice_of,
)
from core.parallel import rng
from core.wire import calls, rl_calls
from core.wire.contract import Handlers


class ActorRole(Role):
    name = "actor"

    def __init__(self, rank: Rank, plan: RolePlan) -> None:
        super().__init__(rank, plan)
        self.next_step = 0  # steps done: what a checkpoint taken now is "after"
        self.gpt: Any = None  # this rank's stage of the GPT (inside the wrappers of ``chunks``)
        self.chunks: list[Any] = []
        self.optimizer: Any = None
        self.fsdp: dict[str, Any] | None = None  # ZeRO-3: the parameters' global names (core.model.gpt.fsdp)
        self.replicas: Replicas | None = None  # parallel.sync

    def build(self) -> None:
        cfg, rank = self.rank.cfg, self.rank.ctx.rank
        if cfg.parallel.sharding == "params":
            self.gpt, self.fsdp, self.optimizer = build.sharded(cfg, on_cuda=self.rank.on_cuda, rank=rank)
            self.chunks = [self.gpt]
        else:
            self.gpt, self.chunks, self.optimizer = build.trained(cfg, on_cuda=self.rank.on_cuda, rank=rank)

    def start(self, req: calls.Setup) -> None:
        r, cfg, dims = self.rank, self.rank.cfg, self.plan.dims
        c = dims.coords(self.plan.local(r.ctx.rank))
        coords = Coords(rank=r.ctx.rank, tp=c.tp, pp=c.pp, dp=c.dp)
        # The model is built from the run's seed on every rank; training draws from streams of
        # this rank's coordinates (core.parallel.rng), re-derived or restored on a resume.
        rng.seed_streams(cfg.seed, 0, coords, on_cuda=r.on_cuda)
        if req.micro_batch_size is not None:
            cfg = sizing.with_micro_batch(cfg, req.micro_batch_size)
        elif cfg.training.micro_batch_size == "auto":
            cfg = sizing.with_micro_batch(cfg, sizing.auto_micro_batch(cfg, on_cuda=r.on_cuda))
        r.cfg = cfg
        r.step = step.StepContext(cfg=cfg, model_chunks=self.chunks, optimizer=self.optimizer,
                                  source=data.from_config(cfg, dp=dims.dp, dp_rank=c.dp, run_dir=r.ctx.run_dir),
                                  device=r.device,
                                  coords=coords, dims=dims)
        if cfg.parallel.sync.local:
            self.replicas = Replicas(r.step, cfg.parallel.sync)
        r.link.trainer_chunks = self.chunks  # the source end of weight syncs
        r.link.every_replica = not cfg.parallel.sync.local  # replicas apart between averages: the first is the truth

    def info(self) -> calls.SetupInfo:
        r = self.rank
        return calls.SetupInfo(coords=r.ready().coords, layers=tuple(model_mod.global_layer_indices(self.gpt)),
                               num_params=model_mod.num_local_params(self.gpt), device=r.device.type,
                               micro_batch_size=int(r.cfg.training.micro_batch_size))

    def handlers(self) -> Handlers:
        cfg, ready = self.rank.cfg, self.rank.ready
        table: Handlers = {
            calls.TRAIN_STEP: self.train_step,
            calls.EVAL_STEP: self.eval_step,
            calls.LOAD_WEIGHTS: self.load_global_weights,
            calls.SAVE_WEIGHTS: self.save_global_weights,
            calls.AVERAGE: self.average_replicas,
        }
        if cfg.program in rl_spec.RL_PROGRAMS:
            table[rl_calls.POLICY_STEP] = self.policy_step
            table[rl_calls.SCORE_ROWS] = self.score_rows
        if cfg.generator.enabled:  # the trainer's side of the generator flow
            table[gen_calls.GEN_PROMPTS] = lambda req: rollout.prompts(ready(), req)
            table[gen_calls.PROBE_BATCH] = lambda req: rollout.trainer_probe(ready(), req)
            table.update(self.rank.link_handlers())
        return table

    def scored(self) -> list[Any]:
        return self.rank.ready().model_chunks

    # --- calls ------------------------------------------------------------------------------
    def train_step(self, req: calls.Step) -> calls.StepResult:
        """One optimizer step on the global batch of ``req.step``."""
        ctx = self.rank.ready()
        if req.measure:  # the allocation's first step: what this rank holds (memory.json)
            activations.measure(True)
        out = step.train_step(ctx, req.step, before_update=self.rank.fence, local=req.local)
        if req.measure:
            out["memory"] = memory.measured(ctx, ctx.source.n_micro)
            activations.measure(False)
        self.next_step = req.step + 1
        if req.average:
            out["grad_sync_s"] = self.average_replicas(None).grad_sync_s
        return calls.StepResult(rss_mb=rss_mb(), **out)

    def eval_step(self, req: calls.Step) -> calls.StepResult:
        """Forward only on the held-out batch of ``req.step``; the loss on loss owners."""
        return calls.StepResult(rss_mb=rss_mb(), **step.eval_step(self.rank.ready(), req.step))

    def average_replicas(self, _req: Any) -> calls.StepResult:
        """parallel.sync: average weights and Adam moments over the data-parallel replicas."""
        self.rank.fence()
        t0 = time.perf_counter()
        self.rank.ready()
        seconds = self.replicas.average()  # type: ignore[union-attr]  # AVERAGE is asked only with parallel.sync
        return calls.StepResult(step_time_s=time.perf_counter() - t0, grad_sync_s=seconds, rss_mb=rss_mb())

    def policy_step(self, req: rl_calls.PolicyBatch) -> rl_calls.PolicyResult:
        """One actor update on this replica's share of a rollout (core.model.gpt.policy)."""
        out = policy.policy_step(self.rank.ready(), req, before_update=self.rank.fence)
        self.next_step = req.step + 1
        return rl_calls.PolicyResult(rss_mb=rss_mb(), **out)

    def score_rows(self, req: rl_calls.ScoreRows) -> rl_calls.RowScores:
        """The log-probs (or the critic's values) of this replica's rows under ``req.model``."""
        ctx = self.rank.ready()
        role = self.rank.models.get(req.model)
        if role is None:
            raise RuntimeError(f"rank {self.rank.ctx.rank}: this run holds no {req.model} model")
        return policy.score_rows(ctx, req, role.scored())

    def load_global_weights(self, req: calls.WeightsFile) -> None:
        """Load this rank's slices of an .npz of full global tensors (global name → array)."""
        self.rank.fence()
        with np.load(req.path) as arrays:
            def read(name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
                return arrays[name][tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]

            self.load_weights(read)

    def save_global_weights(self, req: calls.WeightsFile) -> None:
        """Collective: global rank 0 writes every global weight, assembled, to ``path`` (.npz).

        Meant for tests and small models: all slices travel to rank 0 over the process group.
        """
        chunks, rank = self.rank.ready().model_chunks, self.rank.ctx.rank
        if self.fsdp is not None:
            held = fsdp.weight_boxes(chunks[0], self.fsdp)
        else:
            held = [(slice_of(sh), p) for sh, p in sharded_params(chunks) if is_writer(sh)]
        mine = [(s, p.detach().float().cpu().numpy()) for s, p in held]
        gathered: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
        dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
        if rank == 0:
            arrays = assemble([item for part in gathered for item in part])
            tmp = Path(f"{req.path}.tmp.npz")
            np.savez(tmp, **arrays)
            tmp.replace(req.path)  # readers never see a half-written file

    # --- checkpoint items -------------------------------------------------------------------
    def export(self) -> tuple[Items, dict[str, Any]]:
        """This rank's slices (live: read until the next update) and blobs (collective over
        DP with the distributed optimizer)."""
        ctx = self.rank.ready()
        own = None
        if self.fsdp is not None:
            own = fsdp.export_items(ctx.model_chunks[0], self.fsdp, ctx.optimizer)
        items, blobs = export_state(ctx.model_chunks, ctx.optimizer, self.next_step, ctx.coords, ctx.dims, items=own)
        items += self.replicas.export() if self.replicas is not None else []
        return items, blobs

    def restore(self, read: ReadFn, blobs: dict[str, Any]) -> None:
        ctx = self.rank.ready()  # CheckpointService.load has passed the fence already
        importer = None
        if self.fsdp is not None:
            names = self.fsdp
            importer = lambda rd, saved: fsdp.import_items(ctx.model_chunks[0], names, ctx.optimizer, rd, saved)  # noqa: E731
        self.next_step = import_state(ctx.model_chunks, ctx.optimizer, read, blobs, seed=self.rank.cfg.seed,
                                      coords=ctx.coords, dims=ctx.dims, on_cuda=ctx.device.type == "cuda",
                                      importer=importer)
        if self.replicas is not None:
            self.replicas.restore(read)

    def load_weights(self, read: ReadFn) -> None:
        """This rank's slices of the model weights from ``read`` (any layout); the optimizer's
        main weights refreshed from them, its moments as they are."""
        ctx = self.rank.ready()
        if self.fsdp is not None:
            fsdp.load_weights(ctx.model_chunks[0], self.fsdp, read)
        else:
            load_model_slices(ctx.model_chunks, read)
        ctx.optimizer.reload_model_params()  # the fp32 copies of the weights just written
        if self.replicas is not None:
            self.replicas.reset()
