"""Layouts Megatron (and FSDP2) can run, checked against the whole config before anything
starts: one line naming the key and the numbers."""
from __future__ import annotations

from typing import TYPE_CHECKING

from core.errors import ConfigError, LayoutError

if TYPE_CHECKING:  # config imports this module for its validation
    from core.spec.config import RunConfig


def _check_zero3(cfg: RunConfig) -> None:
    """What ``parallel.sharding: params`` runs with so far; the rest refused in one line."""
    p, mp = cfg.parallel, cfg.training.mixed_precision
    why = ("tp and pp of 1" if p.tp != 1 or p.pp != 1 else "program: pretrain" if cfg.program != "pretrain" else
           "generator.enabled: false" if cfg.generator.enabled else "no fp16 (bf16 or fp32)" if
           mp.param_dtype == "fp16" else "overlap_grad_reduce: false (FSDP2 overlaps by itself)" if
           p.overlap_grad_reduce else None)
    if why:
        raise LayoutError(f"parallel.sharding: params (ZeRO-3) runs with {why} so far (now tp={p.tp} pp={p.pp}, "
                          f"program={cfg.program}); use parallel.sharding=optimizer for this run")


def validate_layout(cfg: RunConfig) -> None:
    """Reject layouts Megatron cannot run, with the numbers in the message."""
    p, m, t = cfg.parallel, cfg.model, cfg.training
    if p.sync.local and (p.sharding != "none" or p.overlap_grad_reduce or cfg.program != "pretrain"):
        raise LayoutError(f"parallel.sync: periodic synchronisation (every {p.sync.every}) keeps whole replicas "
                          f"apart: it runs with parallel.sharding: none, overlap_grad_reduce: false and program: "
                          f"pretrain (now {p.sharding}, {str(p.overlap_grad_reduce).lower()}, {cfg.program})")
    if m.num_attention_heads % p.tp:
        raise LayoutError(f"parallel.tp: {p.tp} does not divide model.num_attention_heads = "
                          f"{m.num_attention_heads}; pick a tp that divides it")
    if p.bucket_size is not None and not p.overlap_grad_reduce:
        raise ConfigError(f"parallel.bucket_size: {p.bucket_size} is used only with parallel.overlap_grad_reduce: true "
                          "(without it the gradients are reduced in one piece); set both or drop bucket_size")
    if p.sharding == "params":
        _check_zero3(cfg)
    if m.query_groups % p.tp:
        raise LayoutError(f"parallel.tp: {p.tp} does not divide model.num_query_groups = {m.query_groups} "
                          "(each tensor-parallel rank holds whole key/value groups); pick a tp that divides it")
    if m.num_layers % p.pp:
        raise LayoutError(f"parallel.pp: {p.pp} does not divide model.num_layers = {m.num_layers}; "
                          "pick a pp that divides it")
    try:
        dims = cfg.dims
    except LayoutError as exc:
        raise LayoutError(f"trainer: {cfg.trainer.nodes} node(s) × {cfg.trainer.n_gpus_per_node} = "
                          f"{cfg.trainer.world_size} workers are not divisible by tp*pp = {p.tp * p.pp}") from exc
    if t.micro_batch_size != "auto" and t.global_batch_size % (t.micro_batch_size * dims.dp):
        raise LayoutError(f"training.global_batch_size: {t.global_batch_size} is not divisible by "
                          f"micro_batch_size × dp = {t.micro_batch_size} × {dims.dp} = {t.micro_batch_size * dims.dp}")
