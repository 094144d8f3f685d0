"""The models a role holds, built on this rank's stage of the layout Megatron was set up with.

``trained``: the GPT in the configured precision with Megatron's DDP wrapper and optimizer
(the actor; the critic with its value head); ``sharded``: ZeRO-3, the GPT in fp32 storage
fully sharded over data parallelism with FSDP2 (core.model.gpt.fsdp); ``frozen``: a copy
of the GPT with no gradients and no optimizer (the reference policy).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from core.config.run import RunConfig
from core.model.gpt import fsdp
from core.model.gpt import model as model_mod
from core.model.gpt.optim import lr_at

log = logging.getLogger(__name__)


def wrap_ddp(model: torch.nn.Module, cfg: RunConfig, *, grad_reduce_in_fp32: bool) -> Any:
    """Megatron's DistributedDataParallel: grads reduced (averaged) over DP in finalize, or
    bucket by bucket while backward runs (``parallel.overlap_grad_reduce``: the same sums in
    the same order, so the same gradients bit for bit)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
        bucket_size=cfg.parallel.bucket_size,
        use_distributed_optimizer=cfg.parallel.distributed_optimizer,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_optimizer(model_chunks: list[Any], cfg: RunConfig) -> Any:
    """Adam over fp32 main weights; ZeRO-1 sharding over DP when distributed_optimizer."""
    tc = model_chunks[0].config
    o = cfg.optimizer
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr_at(0, cfg),
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.beta1,
        adam_beta2=o.beta2,
        adam_eps=o.eps,
        clip_grad=cfg.training.grad_clip,
        bf16=tc.bf16,
        fp16=tc.fp16,
        params_dtype=tc.params_dtype,
        # fp16: dynamic loss scaling from here (Megatron's default 2**32 skips a dozen steps first)
        initial_loss_scale=cfg.training.mixed_precision.initial_loss_scale,
        use_distributed_optimizer=cfg.parallel.distributed_optimizer,
    )
    return get_megatron_optimizer(config, model_chunks)


def trained(cfg: RunConfig, *, on_cuda: bool, rank: int,
            head: Callable[[torch.nn.Module], None] | None = None) -> tuple[Any, list[Any], Any]:
    """(model, its DDP-wrapped chunks, optimizer) in the configured precision (logged);
    ``head`` replaces the model's output layer before it is wrapped (the critic's)."""
    tconfig = model_mod.transformer_config(cfg.model, cfg.parallel, cfg.training, on_cuda=on_cuda)
    gpt = model_mod.build_model(tconfig, cfg.model, on_cuda=on_cuda)
    if head is not None:
        head(gpt)
    precision = model_mod.resolve_precision(cfg.training, on_cuda=on_cuda)
    log.info("rank %d computes in %s%s, reduces gradients in %s, dropout hidden %g attention %g", rank,
             precision.param_dtype, " over fp32 master weights" if precision.param_dtype != torch.float32 else "",
             "fp32" if precision.grad_reduce_in_fp32 else precision.param_dtype, cfg.model.hidden_dropout,
             cfg.model.attention_dropout)
    ddp = wrap_ddp(gpt, cfg, grad_reduce_in_fp32=precision.grad_reduce_in_fp32)
    optimizer = build_optimizer([ddp], cfg)
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.no_sync_func = ddp.no_sync
    if tconfig.fp16:
        tconfig.grad_scale_func = optimizer.scale_loss
    return gpt, [ddp], optimizer


def sharded(cfg: RunConfig, *, on_cuda: bool, rank: int) -> tuple[Any, dict[str, Any], fsdp.ShardedAdam]:
    """ZeRO-3: (the model in fp32 storage fully sharded over data parallelism (FSDP2), its
    parameters' global names, its optimizer)."""
    fp32 = dataclasses.replace(cfg.training, mixed_precision=dataclasses.replace(
        cfg.training.mixed_precision, param_dtype="fp32", reduce_dtype="fp32"))
    tconfig = model_mod.transformer_config(cfg.model, cfg.parallel, fp32, on_cuda=on_cuda)
    gpt, names = fsdp.shard(model_mod.build_model(tconfig, cfg.model, on_cuda=on_cuda), cfg, cfg.dims.dp)
    log.info("rank %d: parameters, gradients and optimizer state sharded over %d data-parallel ranks (FSDP2)",
             rank, cfg.dims.dp)
    return gpt, names, fsdp.ShardedAdam(gpt, cfg)


def frozen(cfg: RunConfig, *, on_cuda: bool) -> Any:
    """The GPT in the configured layout and precision, no gradients, in eval mode (its
    weights are loaded from a checkpoint)."""
    tconfig = copy.copy(model_mod.transformer_config(cfg.model, cfg.parallel, cfg.training, on_cuda=on_cuda))
    model = model_mod.build_model(tconfig, cfg.model, on_cuda=on_cuda)
    model.requires_grad_(False)
    return model.eval()
