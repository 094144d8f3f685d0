"""``GPTTask``: one rank of a Megatron-core GPT run, served to the controller.

The controller calls (core.wire.calls), in order: SETUP once (process group, Megatron's
parallel state, model, optimizer, data), then TRAIN_STEP / EVAL_STEP with the step number;
``close`` runs at shutdown. ``checkpoint_state`` / ``restore_state`` are not calls:
``core.checkpoint.service`` wraps them into the checkpoint calls.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from core.checkpoint.spec import TensorSlice
from core.errors import CheckpointError, ConfigError, LayoutError
from core.flows import calls as gen_calls
from core.job.process import rss_mb
from core.model.gpt import sizing
from core.spec import config as config_mod
from core.spec import rl as rl_spec
from core.spec.config import RunConfig
from core.spec.dims import Coords
from core.spec.generator import generator_dims, own_workers
from core.wire import calls, rl_calls
from core.wire.contract import Method
from core.worker.task import WorkerContext

log = logging.getLogger(__name__)


class GPTTask:
    """A Megatron-core GPT rank: the calls the controller may make."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.cfg: RunConfig = ctx.config
        self._step_ctx: Any = None  # core.model.gpt.step.StepContext once set up
        self._next_step = 0  # steps done: what a checkpoint taken now is "after"
        self._fence: Callable[[], None] = lambda: None  # core.checkpoint.service's, once bound
        self._rollout: Any = None  # core.model.gpt.rollout.Rollout: a colocated generator
        self._link: Any = None  # core.model.gpt.rollout.WeightLink: this rank's end of weight syncs
        self._reference: list[Any] = []  # an RL program with rl.kl: the frozen reference policy's chunks
        self._reference_loaded = False
        self._critic: Any = None  # program ppo: the value model's StepContext (core.model.gpt.critic)
        self._fsdp: dict[str, Any] | None = None  # parallel.sharding params: global names (core.model.gpt.fsdp)
        self._replicas: Any = None  # parallel.sync: core.model.gpt.local_sgd.Replicas

    def handlers(self) -> Mapping[Method[Any, Any], Callable[[Any], Any]]:
        table: dict[Method[Any, Any], Callable[[Any], Any]] = {
            calls.SETUP: self.setup,
            calls.TRAIN_STEP: self.train_step,
            calls.EVAL_STEP: self.eval_step,
            calls.LOAD_WEIGHTS: self.load_global_weights,
            calls.SAVE_WEIGHTS: self.save_global_weights,
            calls.AVERAGE: self.average_replicas,
        }
        if self.cfg.generator.enabled:
            table.update(self._generator_handlers())
        if self.cfg.program in rl_spec.RL_PROGRAMS:
            table[rl_calls.POLICY_STEP] = self.policy_step
            table[rl_calls.SCORE_ROWS] = self.score_rows
        if self.cfg.program == "ppo":
            table[rl_calls.CRITIC_STEP] = self.critic_step
            table[rl_calls.CRITIC_INIT] = self.critic_init
        return table

    def _generator_handlers(self) -> dict[Method[Any, Any], Callable[[Any], Any]]:
        """The trainer's side of the generator flow (core.model.gpt.rollout); colocated, the
        generator's side too."""
        from core.model.gpt import rollout  # torch and megatron: this module loads without them

        table: dict[Method[Any, Any], Callable[[Any], Any]] = {
            gen_calls.GEN_SLICES: lambda _: self._linked().held(),
            gen_calls.SYNC_WEIGHTS: lambda req: self._linked().sync(req),
            gen_calls.GEN_PROMPTS: lambda req: rollout.prompts(self._ready(), req),
            gen_calls.PROBE_BATCH: lambda req: rollout.trainer_probe(self._ready(), req),
        }
        if self.cfg.generator.split:
            table[gen_calls.BRIDGE] = lambda req: self._linked().join(
                req, backend="nccl" if self._ready().device.type == "cuda" else "gloo",
                timeout_s=self.cfg.timeouts.setup_s)
        else:
            table[gen_calls.SCORE] = lambda req: self._gen().score(req)
            table[gen_calls.GENERATE] = lambda req: self._gen().generate(req)
        return table

    # --- calls ------------------------------------------------------------------------------
    def setup(self, req: calls.Setup) -> calls.SetupInfo:
        """Join the group and build model, optimizer and data; where this rank sits and what it holds."""
        import torch  # torch and megatron: this module loads without them

        from core.parallel.imports import import_megatron  # torch: this module loads without it

        import_megatron()  # first, before any module below imports megatron.core
        from core.model.gpt import data  # torch and megatron: this module loads without them
        from core.model.gpt import model as model_mod  # torch and megatron: this module loads without them
        from core.model.gpt.step import StepContext  # torch and megatron: this module loads without them
        from core.parallel import cpu_shim, rng  # torch and megatron: this module loads without them
        from core.parallel.megatron import init_megatron  # torch and megatron: this module loads without them

        cfg, dims = self.cfg, self.cfg.dims
        on_cuda = self._check(req, dims)
        if not on_cuda:
            cpu_shim.activate_if_needed()
        init_megatron(
            dims, rank=self.ctx.rank, world_size=dims.world_size, master_addr=req.master_addr,
            master_port=req.master_port, backend="nccl" if on_cuda else "gloo", seed=cfg.seed,
            timeout_s=cfg.timeouts.setup_s,
        )
        gpt, chunks, optimizer = self._build(on_cuda)
        if cfg.program in rl_spec.RL_PROGRAMS and cfg.rl.kl.enabled:
            self._reference = [self._build_reference(on_cuda)]
        critic = self._build(on_cuda, critic=True)[1:] if cfg.program == "ppo" else None
        coords = dims.coords(self.ctx.rank)
        # The model is built from the run's seed on every rank; training draws from streams of
        # this rank's coordinates (core.parallel.rng), re-derived or restored on a resume.
        rng.seed_streams(cfg.seed, 0, Coords(rank=self.ctx.rank, tp=coords.tp, pp=coords.pp, dp=coords.dp),
                         on_cuda=on_cuda)
        if req.micro_batch_size is not None:
            cfg = sizing.with_micro_batch(cfg, req.micro_batch_size)
        elif cfg.training.micro_batch_size == "auto":
            cfg = sizing.with_micro_batch(cfg, sizing.auto_micro_batch(cfg, on_cuda=on_cuda))
        if cfg.generator.enabled:
            self._set_up_generator(cfg, chunks, on_cuda=on_cuda)
        source = data.from_config(cfg, dp=dims.dp, dp_rank=coords.dp)
        device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
        self.cfg = cfg
        self._step_ctx = StepContext(cfg=cfg, model_chunks=chunks, optimizer=optimizer, source=source, device=device,
                                     coords=Coords(rank=self.ctx.rank, tp=coords.tp, pp=coords.pp, dp=coords.dp),
                                     dims=dims)
        if critic is not None:
            self._critic = dataclasses.replace(self._step_ctx, model_chunks=critic[0], optimizer=critic[1])
        if cfg.parallel.sync.local:
            from core.model.gpt.local_sgd import Replicas  # torch and megatron: this module loads without them

            self._replicas = Replicas(self._step_ctx, cfg.parallel.sync)
        info = calls.SetupInfo(
            coords=self._step_ctx.coords, layers=tuple(model_mod.global_layer_indices(gpt)),
            num_params=model_mod.num_local_params(gpt), device="cuda" if on_cuda else "cpu",
            micro_batch_size=int(cfg.training.micro_batch_size))
        log.info("rank %d set up: %s", self.ctx.rank, info)
        return info

    def _set_up_generator(self, cfg: RunConfig, chunks: list[Any], *, on_cuda: bool) -> None:
        """This rank's end of weight syncs; colocated, the generator's model too (own groups)."""
        from core.model.gpt.rollout import Rollout, WeightLink  # torch and megatron: this module loads without them

        if cfg.generator.split:
            self._link = WeightLink(self.ctx.rank, trainer_chunks=chunks, model=None)
            return
        self._rollout = Rollout(cfg, generator_dims(cfg), self.ctx.rank, on_cuda=on_cuda)
        self._link = self._rollout.link = WeightLink(self.ctx.rank, trainer_chunks=chunks, model=self._rollout.model)

    def _check(self, req: calls.Setup, dims: Any) -> bool:
        """The controller's config and the group's size are this rank's; whether it runs on a GPU."""
        import torch  # torch and megatron: this module loads without them

        cfg = self.cfg
        if req.config_hash and req.config_hash != config_mod.config_hash(cfg):
            raise ConfigError(f"{self.ctx.run_dir / 'config.yaml'}: changed since the controller read it "
                              f"(hash {config_mod.config_hash(cfg)}, controller {req.config_hash}); resume the run "
                              "again with `baton submit --resume`")
        if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"trainer.device: 'cuda' but rank {self.ctx.rank} on {self.ctx.host} sees no GPU; "
                              "use trainer.device=auto or cpu")
        if dims.world_size + own_workers(cfg) != self.ctx.world_size:
            raise LayoutError(f"config describes {dims.world_size + own_workers(cfg)} workers ({dims.describe()}"
                              f"{' and the generator' if own_workers(cfg) else ''}) but this group has "
                              f"{self.ctx.world_size}")
        return cfg.trainer.device != "cpu" and torch.cuda.is_available()

    def _build(self, on_cuda: bool, *, critic: bool = False) -> tuple[Any, list[Any], Any]:
        """Model, DDP wrapper and optimizer in the configured precision (logged); ``critic``:
        the value model (core.model.gpt.critic)."""
        import torch  # torch and megatron: this module loads without them
        from megatron.core.distributed import finalize_model_grads  # torch and megatron: this module loads without them

        from core.model.gpt import model as model_mod  # torch and megatron: this module loads without them
        from core.model.gpt import optim  # torch and megatron: this module loads without them

        cfg = self.cfg
        if cfg.parallel.sharding == "params":
            return self._build_sharded(on_cuda)
        tconfig = model_mod.transformer_config(cfg.model, cfg.parallel, cfg.training, on_cuda=on_cuda)
        gpt = model_mod.build_model(tconfig, cfg.model, on_cuda=on_cuda)
        if critic:
            from core.model.gpt.critic import attach_head  # torch and megatron: this module loads without them

            attach_head(gpt, seed=cfg.seed)
        precision = model_mod.resolve_precision(cfg.training, on_cuda=on_cuda)
        log.info("rank %d computes in %s%s, reduces gradients in %s, dropout hidden %g attention %g", self.ctx.rank,
                 precision.param_dtype, " over fp32 master weights" if precision.param_dtype != torch.float32 else "",
                 "fp32" if precision.grad_reduce_in_fp32 else precision.param_dtype, cfg.model.hidden_dropout,
                 cfg.model.attention_dropout)
        ddp = optim.wrap_ddp(gpt, cfg, grad_reduce_in_fp32=precision.grad_reduce_in_fp32)
        optimizer = optim.build_optimizer([ddp], cfg)
        tconfig.finalize_model_grads_func = finalize_model_grads
        tconfig.no_sync_func = ddp.no_sync
        if tconfig.fp16:
            tconfig.grad_scale_func = optimizer.scale_loss
        return gpt, [ddp], optimizer

    def _build_sharded(self, on_cuda: bool) -> tuple[Any, list[Any], Any]:
        """ZeRO-3: the model in fp32 storage, fully sharded over data parallelism (FSDP2)."""
        from core.model.gpt import fsdp  # torch and megatron: this module loads without them
        from core.model.gpt import model as model_mod  # torch and megatron: this module loads without them

        cfg = self.cfg
        fp32 = dataclasses.replace(cfg.training, mixed_precision=dataclasses.replace(
            cfg.training.mixed_precision, param_dtype="fp32", reduce_dtype="fp32"))
        tconfig = model_mod.transformer_config(cfg.model, cfg.parallel, fp32, on_cuda=on_cuda)
        gpt, self._fsdp = fsdp.shard(model_mod.build_model(tconfig, cfg.model, on_cuda=on_cuda), cfg, cfg.dims.dp)
        log.info("rank %d: parameters, gradients and optimizer state sharded over %d data-parallel ranks (FSDP2)",
                 self.ctx.rank, cfg.dims.dp)
        return gpt, [gpt], fsdp.ShardedAdam(gpt, cfg)

    def _build_reference(self, on_cuda: bool) -> Any:
        """The reference policy: the actor's model in the actor's layout, frozen, no optimizer
        (its weights come from a checkpoint: ``load_reference``)."""
        from core.model.gpt import model as model_mod  # torch and megatron: this module loads without them

        cfg = self.cfg
        tconfig = copy.copy(model_mod.transformer_config(cfg.model, cfg.parallel, cfg.training, on_cuda=on_cuda))
        ref = model_mod.build_model(tconfig, cfg.model, on_cuda=on_cuda)
        ref.requires_grad_(False)
        return ref.eval()

    def score_rows(self, req: rl_calls.ScoreRows) -> rl_calls.RowScores:
        """The actor's or the reference's log-probs of this replica's rows (core.model.gpt.policy)."""
        from core.model.gpt.policy import score_rows  # torch and megatron: this module loads without them

        ctx = self._ready()
        if req.model == "reference" and not self._reference_loaded:
            raise RuntimeError(f"rank {self.ctx.rank}: the reference policy was asked for before it was loaded")
        chunks = {"actor": ctx.model_chunks, "reference": self._reference,
                  "critic": self._critic.model_chunks if self._critic else []}[req.model]
        return score_rows(ctx, req, chunks)

    def critic_step(self, req: rl_calls.CriticBatch) -> rl_calls.CriticResult:
        """One critic update on this replica's share of a rollout (core.model.gpt.critic)."""
        from core.model.gpt.critic import critic_step  # torch and megatron: this module loads without them

        self._ready()
        return rl_calls.CriticResult(rss_mb=rss_mb(), **critic_step(self._critic, req, before_update=self._fence))

    def critic_init(self, _req: Any) -> None:
        """The critic's transformer := the actor's (the first RL step)."""
        from core.model.gpt.critic import copy_from_actor  # torch and megatron: this module loads without them

        self._fence()
        copy_from_actor(self._ready().model_chunks, self._critic.model_chunks, self._critic.optimizer)

    def train_step(self, req: calls.Step) -> calls.StepResult:
        """One optimizer step on the global batch of ``req.step``."""
        from core.model.gpt import activations, memory  # torch and megatron: this module loads without them
        from core.model.gpt.step import train_step  # torch and megatron: this module loads without them

        if req.measure:  # the allocation's first step: what this rank holds (memory.json)
            activations.measure(True)
        out = train_step(self._ready(), req.step, before_update=self._fence, local=req.local)
        if req.measure:
            out["memory"] = memory.measured(self._ready(), self._ready().source.n_micro)
            activations.measure(False)
        self._next_step = req.step + 1
        if req.average:
            out["grad_sync_s"] = self.average_replicas(None).grad_sync_s
        return calls.StepResult(rss_mb=rss_mb(), **out)

    def average_replicas(self, _req: Any) -> calls.StepResult:
        """parallel.sync: average weights and Adam moments over the data-parallel replicas."""
        self._fence()
        t0 = time.perf_counter()
        self._ready()
        seconds = self._replicas.average()
        return calls.StepResult(step_time_s=time.perf_counter() - t0, grad_sync_s=seconds, rss_mb=rss_mb())

    def policy_step(self, req: rl_calls.PolicyBatch) -> rl_calls.PolicyResult:
        """One actor update on this replica's share of a rollout (core.model.gpt.policy)."""
        from core.model.gpt.policy import policy_step  # torch and megatron: this module loads without them

        out = policy_step(self._ready(), req, before_update=self._fence)
        self._next_step = req.step + 1
        return rl_calls.PolicyResult(rss_mb=rss_mb(), **out)

    def eval_step(self, req: calls.Step) -> calls.StepResult:
        """Forward only on the held-out batch of ``req.step``; the loss on loss owners."""
        from core.model.gpt.step import eval_step  # torch and megatron: this module loads without them

        return calls.StepResult(rss_mb=rss_mb(), **eval_step(self._ready(), req.step))

    def load_global_weights(self, req: calls.WeightsFile) -> None:
        """Load this rank's slices of an .npz of full global tensors (global name → array)."""
        self._fence()
        with np.load(req.path) as arrays:
            def read(name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
                return arrays[name][tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]

            self._load_weights(read)

    def save_global_weights(self, req: calls.WeightsFile) -> None:
        """Collective: global rank 0 writes every global weight, assembled, to ``path`` (.npz).

        Meant for tests and small models: all slices travel to rank 0 over the process group.
        """
        import torch.distributed as dist  # torch and megatron: this module loads without them

        from core.model.gpt.state import (  # torch and megatron: this module loads without them
            assemble,
            is_writer,
            sharded_params,
            slice_of,
        )

        if self._fsdp is not None:
            from core.model.gpt import fsdp  # torch and megatron: this module loads without them

            held = fsdp.weight_boxes(self._ready().model_chunks[0], self._fsdp)
        else:
            held = [(slice_of(sh), p) for sh, p in sharded_params(self._ready().model_chunks) if is_writer(sh)]
        mine = [(s, p.detach().float().cpu().numpy()) for s, p in held]
        gathered: list[Any] = [None] * dist.get_world_size() if self.ctx.rank == 0 else []
        dist.gather_object(mine, gathered if self.ctx.rank == 0 else None, dst=0)
        if self.ctx.rank == 0:
            arrays = assemble([item for part in gathered for item in part])
            tmp = Path(f"{req.path}.tmp.npz")
            np.savez(tmp, **arrays)
            tmp.replace(req.path)  # readers never see a half-written file

    def close(self) -> None:
        """Tear down Megatron and the process group."""
        from core.parallel.megatron import destroy_megatron  # torch and megatron: this module loads without them

        if self._step_ctx is not None:
            destroy_megatron()
            self._step_ctx = None

    # --- checkpoint hooks (core.checkpoint.service) ------------------------------------------------
    def bind_checkpoint_fence(self, fence: Callable[[], None]) -> None:
        """``fence`` runs before every change of the exported state: the optimizer step, a
        weights load (a checkpoint load is fenced by CheckpointService.load itself)."""
        self._fence = fence

    def checkpoint_state(self) -> tuple[list[tuple[TensorSlice, Any]], dict[str, Any]]:
        """This rank's slices (live: read until the next update) and blobs (collective over
        DP with the distributed optimizer)."""
        from core.model.gpt.state import export_state  # torch and megatron: this module loads without them

        ctx = self._ready()
        own = None
        if self._fsdp is not None:
            from core.model.gpt import fsdp  # torch and megatron: this module loads without them

            own = fsdp.export_items(ctx.model_chunks[0], self._fsdp, ctx.optimizer)
        items, blobs = export_state(ctx.model_chunks, ctx.optimizer, self._next_step, ctx.coords, ctx.dims, items=own)
        items += self._replicas.export() if self._replicas is not None else []
        if self._critic is not None:
            from core.model.gpt import critic  # torch and megatron: this module loads without them

            more, blobs["critic"] = critic.export(self._critic.model_chunks, self._critic.optimizer)
            items += more
        return items, blobs

    def restore_state(self, read: Callable[[str, tuple[int, ...], tuple[int, ...]], np.ndarray],
                      blobs: dict[str, Any]) -> None:
        """Load this rank's slices of a checkpoint, in this rank's layout."""
        from core.model.gpt.state import import_state  # torch and megatron: this module loads without them

        ctx = self._ready()  # CheckpointService.load has passed the fence already
        importer = None
        if self._fsdp is not None:
            from core.model.gpt import fsdp  # torch and megatron: this module loads without them

            names = self._fsdp
            importer = lambda rd, saved: fsdp.import_items(ctx.model_chunks[0], names, ctx.optimizer, rd, saved)  # noqa: E731
        self._next_step = import_state(ctx.model_chunks, ctx.optimizer, read, blobs, seed=self.cfg.seed,
                                       coords=ctx.coords, dims=ctx.dims, on_cuda=ctx.device.type == "cuda",
                                       importer=importer)
        if self._replicas is not None:
            self._replicas.restore(read)
        if self._critic is not None:
            from core.model.gpt import critic  # torch and megatron: this module loads without them

            if "critic" not in blobs:
                raise CheckpointError("the checkpoint holds no critic (it was not saved by a program: ppo run); "
                                      "start the PPO run from it with init_from instead")
            critic.restore(self._critic.model_chunks, self._critic.optimizer, read, blobs["critic"])

    def restore_weights(self, read: Callable[[str, tuple[int, ...], tuple[int, ...]], np.ndarray]) -> None:
        """Only the model weights of a checkpoint (any layout), the optimizer's from them:
        ``init_from``."""
        self._load_weights(read)

    def restore_reference(self, read: Callable[[str, tuple[int, ...], tuple[int, ...]], np.ndarray]) -> None:
        """The reference policy from a checkpoint's model weights (any layout; CKPT_LOAD with
        ``into="reference"``); its optimizer state is not read."""
        from core.model.gpt.state import load_model_slices  # torch and megatron: this module loads without them

        self._ready()
        if not self._reference:
            raise RuntimeError(f"rank {self.ctx.rank}: this run has no reference policy (rl.kl is off)")
        load_model_slices(self._reference, read)
        self._reference_loaded = True

    # --- helpers -----------------------------------------------------------------------------
    def _ready(self) -> Any:
        if self._step_ctx is None:
            raise RuntimeError(f"rank {self.ctx.rank}: call setup before any other method")
        return self._step_ctx

    def _linked(self) -> Any:
        self._ready()
        return self._link

    def _gen(self) -> Any:
        self._ready()
        return self._rollout

    def _load_weights(self, read: Callable[[str, tuple[int, ...], tuple[int, ...]], np.ndarray]) -> None:
        """This rank's slices of the model weights from ``read``; the optimizer's main weights
        refreshed from them."""
        from core.model.gpt.state import load_model_slices  # torch and megatron: this module loads without them

        if self._fsdp is not None:
            from core.model.gpt import fsdp  # torch and megatron: this module loads without them

            fsdp.load_weights(self._ready().model_chunks[0], self._fsdp, read)
        else:
            load_model_slices(self._ready().model_chunks, read)
        self._resync_main_params()
        if self._replicas is not None:
            self._replicas.reset()

    def _resync_main_params(self) -> None:
        """After writing model params directly, refresh the optimizer's fp32 copies."""
        self._step_ctx.optimizer.reload_model_params()
