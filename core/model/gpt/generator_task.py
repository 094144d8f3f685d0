"""``GeneratorTask``: one rank of a generator that runs on workers of its own (split placement).

Its ranks follow the trainer's (global rank = trainer world size + its rank in the
generator). The controller calls, in order: SETUP (its own torch.distributed world and
Megatron state in the generator's layout, the model), BRIDGE (the group over every worker
that weight syncs run on), then at every sync GEN_SLICES (once), SYNC_WEIGHTS, SCORE (the
probe), and GENERATE. It holds no state a checkpoint needs: its weights are the trainer's,
synced again after every restart.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from core.errors import ConfigError, LayoutError
from core.flows import calls as gen_calls
from core.job.process import rss_mb
from core.spec import config as config_mod
from core.spec.config import RunConfig
from core.spec.generator import generator_dims, own_workers
from core.wire import calls
from core.wire.contract import Method
from core.worker.task import WorkerContext

log = logging.getLogger(__name__)


class GeneratorTask:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.cfg: RunConfig = ctx.config
        self.dims = generator_dims(self.cfg)
        self.rank = ctx.rank - self.cfg.trainer.world_size  # in the generator's own world
        self._rollout: Any = None  # core.model.gpt.rollout.Rollout once set up
        self._on_cuda = False

    def handlers(self) -> Mapping[Method[Any, Any], Callable[[Any], Any]]:
        return {
            calls.SETUP: self.setup,
            gen_calls.BRIDGE: lambda req: self._ready().link.join(
                req, backend="nccl" if self._on_cuda else "gloo", timeout_s=self.cfg.timeouts.setup_s),
            gen_calls.GEN_SLICES: lambda _: self._ready().link.held(),
            gen_calls.SYNC_WEIGHTS: lambda req: self._ready().link.sync(req),
            gen_calls.SCORE: lambda req: self._ready().score(req),
            gen_calls.GENERATE: lambda req: self._ready().generate(req),
        }

    def setup(self, req: calls.Setup) -> calls.SetupInfo:
        """Join the generator's world (its first rank's rendezvous) and build its model."""
        import torch  # torch and megatron: this module loads without them

        from core.parallel.imports import import_megatron  # torch: this module loads without it

        import_megatron()
        from core.model.gpt import model as model_mod  # torch and megatron: this module loads without them
        from core.model.gpt.rollout import Rollout, WeightLink  # torch and megatron: this module loads without them
        from core.parallel import cpu_shim  # torch and megatron: this module loads without them
        from core.parallel.megatron import init_megatron  # torch and megatron: this module loads without them

        cfg = self.cfg
        if req.config_hash and req.config_hash != config_mod.config_hash(cfg):
            raise ConfigError(f"{self.ctx.run_dir / 'config.yaml'}: changed since the controller read it; resume "
                              "the run again with `baton submit --resume`")
        if cfg.trainer.world_size + own_workers(cfg) != self.ctx.world_size:
            raise LayoutError(f"config describes {cfg.trainer.world_size} trainer and {own_workers(cfg)} generator "
                              f"workers but this group has {self.ctx.world_size}")
        on_cuda = self._on_cuda = cfg.trainer.device != "cpu" and torch.cuda.is_available()
        if not on_cuda:
            cpu_shim.activate_if_needed()
        init_megatron(self.dims, rank=self.rank, world_size=self.dims.world_size, master_addr=req.master_addr,
                      master_port=req.master_port, backend="nccl" if on_cuda else "gloo", seed=cfg.seed,
                      timeout_s=cfg.timeouts.setup_s)
        rollout = Rollout(cfg, self.dims, self.rank, on_cuda=on_cuda)
        rollout.link = WeightLink(self.ctx.rank, trainer_chunks=None, model=rollout.model)
        self._rollout = rollout
        info = calls.SetupInfo(coords=dataclasses.replace(self.dims.coords(self.rank), rank=self.ctx.rank),
                               layers=tuple(model_mod.global_layer_indices(rollout.model)),
                               num_params=model_mod.num_local_params(rollout.model), device="cuda" if on_cuda else "cpu")
        log.info("generator rank %d (worker %d) set up: %s, rss %.0f MB", self.rank, self.ctx.rank, info, rss_mb())
        return info

    def close(self) -> None:
        from core.parallel.megatron import destroy_megatron  # torch and megatron: this module loads without them

        if self._rollout is not None:
            destroy_megatron()
            self._rollout = None

    def _ready(self) -> Any:
        if self._rollout is None:
            raise RuntimeError(f"generator rank {self.rank}: call setup before any other method")
        return self._rollout

