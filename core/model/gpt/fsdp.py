"""``parallel.sharding: params`` (ZeRO-3): parameters, gradients and optimizer state sharded
over the data-parallel group with torch FSDP2, for tp = pp = 1.

The Megatron GPTModel is built as always, then ``fully_shard`` wraps every transformer
layer and the whole model on a one-dimensional device mesh of the data-parallel ranks, with
``MixedPrecisionPolicy(param_dtype, reduce_dtype)``: parameters stay stored in fp32 (sharded
on their first dimension), are gathered and computed in ``param_dtype`` and their gradients
reduce-scattered in ``reduce_dtype``. Megatron's schedule runs it unchanged: its
``no_sync_func`` holds the reduction back until the last micro-batch. The optimizer is
torch's AdamW with Megatron's parameter groups (no weight decay on biases and norms) and
its gradient clipping (``ShardedAdam``, Megatron's optimizer interface).

Checkpoints are ordinary Baton checkpoints: each rank's shard of a parameter is one box of
the global tensor under Megatron's global name (recorded from ``sharded_state_dict`` before
sharding: layers stacked on a leading axis), the Adam moments under ``optim.exp_avg.<name>``
and ``optim.exp_avg_sq.<name>`` with the same boxes; the fp32 parameters are the truth
(``main_params`` false). So a checkpoint of a sharded run loads into any layout and back.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from core.checkpoint.spec import TensorSlice
from core.config.run import RunConfig
from core.model.gpt.model import unwrap
from core.model.gpt.optim import lr_at
from core.model.gpt.state import LiveTensor, ReadFn, copy_box, param_parts

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def shard(gpt: torch.nn.Module, cfg: RunConfig, dp: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``gpt`` (a GPTModel, fp32) fully sharded over ``dp`` ranks; its parameters' global
    names (param name → (key, global shape, layer offset, layer axes)), taken before."""
    names: dict[str, Any] = {}
    by_id = {id(p): n for n, p in gpt.named_parameters()}
    for part in param_parts([gpt]):
        name = by_id[id(part.param)]
        if name not in names:  # a factory's first box (tp 1: its global tensor is the parameter)
            sh = part.sh
            names[name] = (sh.key, tuple(int(g) for g in sh.global_shape),
                           tuple(int(o) for o in sh.global_offset[:sh.prepend_axis_num]), sh.prepend_axis_num)
    param, reduce = cfg.training.mixed_precision.resolved(on_cuda=False)
    policy = MixedPrecisionPolicy(param_dtype=_DTYPES[param], reduce_dtype=_DTYPES[reduce])
    mesh = init_device_mesh("cpu", (dp,))
    for layer in unwrap(gpt).decoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(gpt, mesh=mesh, mp_policy=policy)
    gpt.config.no_sync_func = lambda: _no_sync(gpt)  # type: ignore[attr-defined]
    gpt.zero_grad_buffer = lambda: None  # type: ignore[attr-defined]  # Megatron DDP's interface: grads are .grad
    return gpt, names


@contextlib.contextmanager
def _no_sync(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class ShardedAdam:
    """torch AdamW over the sharded parameters behind Megatron's optimizer interface:
    ``step()`` clips the global gradient norm and returns (ok, norm, None)."""

    def __init__(self, model: torch.nn.Module, cfg: RunConfig) -> None:
        o = cfg.optimizer
        decay, plain = [], []
        for name, p in model.named_parameters():
            (plain if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
        self.params = decay + plain
        self.clip = cfg.training.grad_clip
        self.inner = torch.optim.AdamW(
            [{"params": decay, "wd_mult": 1.0}, {"params": plain, "wd_mult": 0.0}], lr=lr_at(0, cfg),
            betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
        self.param_groups = self.inner.param_groups

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)

    def step(self) -> tuple[bool, float, None]:
        grads = [p for p in self.params if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(grads, self.clip if self.clip > 0 else float("inf"), foreach=True)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.inner.step()
        return True, float(norm), None

    def reload_model_params(self) -> None:
        """The parameters are the fp32 truth: nothing to refresh."""

    def state_of(self, p: torch.nn.Parameter) -> dict[str, Any]:
        """``p``'s Adam state, created (zero, step 0) before the first step."""
        state = self.inner.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        return state


def _boxes(model: torch.nn.Module, names: dict[str, Any]) -> Iterator[tuple[TensorSlice, Any, str]]:
    """(this rank's box of a parameter's global tensor, the parameter, its global name)."""
    for name, p in model.named_parameters():
        key, global_shape, layer_offset, axes = names[name]
        local_shape, offset = compute_local_shape_and_global_offset(tuple(p.shape), p.device_mesh, p.placements)
        yield TensorSlice(name=key, global_shape=global_shape, offset=(*layer_offset, *map(int, offset)),
                          shape=(1,) * axes + tuple(int(s) for s in local_shape), dtype="float32"), p, key


def export_items(model: torch.nn.Module, names: dict[str, Any], optimizer: ShardedAdam) -> tuple[list[Any], Any]:
    """Every box this rank writes: its shards of the parameters and of their Adam moments."""
    items: list[Any] = []
    for box, p, key in _boxes(model, names):
        if not box.shape or 0 in box.shape:
            continue  # a rank past the end of a short first dimension holds nothing of it
        state = optimizer.state_of(p)
        items.append((box, LiveTensor(p.to_local(), box.shape)))
        for kind in ("exp_avg", "exp_avg_sq"):
            items.append((TensorSlice(name=f"optim.{kind}.{key}", global_shape=box.global_shape, offset=box.offset,
                                      shape=box.shape, dtype="float32"), LiveTensor(state[kind].to_local(), box.shape)))
    steps = [float(optimizer.state_of(p)["step"]) for p in optimizer.params[:1]]
    blob = {"steps": [[[None, steps[0] if steps else 0.0]] * len(optimizer.param_groups)], "loss_scaler": None,
            "main_params": False}
    return items, blob


def import_items(model: torch.nn.Module, names: dict[str, Any], optimizer: ShardedAdam, read: ReadFn,
                 saved_opt: dict[str, Any]) -> None:
    """This rank's boxes of a checkpoint (any layout) into the shards and their Adam moments."""
    has_main = bool(saved_opt["main_params"])
    step = next((s for leaf in saved_opt["steps"] for g in leaf for s in g[::-1] if s is not None), 0.0)
    with torch.no_grad():
        for box, p, key in _boxes(model, names):
            state = optimizer.state_of(p)
            state["step"] = torch.tensor(float(step))
            if not box.shape or 0 in box.shape:
                continue
            source = f"optim.main_param.{key}" if has_main else key
            p.to_local().copy_(_tensor(read(source, box.offset, box.shape), p.to_local()))
            for kind in ("exp_avg", "exp_avg_sq"):
                state[kind].to_local().copy_(_tensor(read(f"optim.{kind}.{key}", box.offset, box.shape),
                                                     state[kind].to_local()))


def _tensor(array: Any, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(array.copy()).reshape(like.shape).to(like.dtype)


def weight_boxes(model: torch.nn.Module, names: dict[str, Any]) -> list[tuple[TensorSlice, torch.Tensor]]:
    """This rank's boxes of the model weights and their local shards (nothing replicated)."""
    return [(box, p.to_local()) for box, p, _ in _boxes(model, names) if box.shape and 0 not in box.shape]


def load_weights(model: torch.nn.Module, names: dict[str, Any], read: ReadFn) -> None:
    """The model weights of a checkpoint (any layout) into this rank's shards."""
    with torch.no_grad():
        for box, local in weight_boxes(model, names):
            copy_box(read, box, local)
