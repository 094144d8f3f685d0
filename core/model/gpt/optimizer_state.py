"""The optimizer's state of one rank as checkpoint slices, and back, exactly.

Per model parameter the optimizer holds an fp32 main weight (a copy of its own when the
model is bf16/fp16, else the parameter itself) and Adam's two fp32 moments. They are
written under ``optim.main_param.<name>``, ``optim.exp_avg.<name>`` and
``optim.exp_avg_sq.<name>`` with the parameter's global slicing, always as fp32 and read
back as fp32 (never through the model's dtype).

Megatron's distributed optimizer shards that state over the data-parallel group: each DP
rank owns one flat range of each parameter (possibly empty). Each rank writes its own
ranges, cut into rectangular boxes of the global tensor (``flat_range_boxes``), straight
from its shard buffers: no rank gathers or copies more than its shard. Loading reads
exactly the boxes of the ranges the loading rank owns in its own layout.

Step counters are kept per parameter group in both conventions (torch's per-parameter
``state["step"]``, the fused optimizers' ``param_groups[i]["step"]``); fp16's dynamic loss
scaler is saved with its trackers. The private Megatron methods this uses
(``_get_main_param_and_optimizer_states``, ``_get_model_param_range_map``) are confined to
this module and exercised by tests/integration/test_gpt_parallel.py.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.optimizer import ChainedOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

from core.checkpoint.spec import TensorSlice, flat_range_boxes
from core.errors import CheckpointError

MOMENTS = ("exp_avg", "exp_avg_sq")
ReadFn = Callable[[str, tuple[int, ...], tuple[int, ...]], np.ndarray]
Piece = tuple[TensorSlice, torch.Tensor]  # a global slice and the live tensor holding it


def _leaves(optimizer: Any) -> list[Any]:
    return list(optimizer.chained_optimizers) if isinstance(optimizer, ChainedOptimizer) else [optimizer]


def _main_param_map(leaf: Any) -> dict[int, torch.Tensor]:
    """id(model param) → the tensor the inner torch optimizer steps (non-distributed)."""
    if isinstance(leaf, FP32Optimizer):
        return {id(p): p for g in leaf.optimizer.param_groups for p in g["params"]}
    if isinstance(leaf, Float16OptimizerWithFloat16Params):
        out = {}
        for model_group, main_group in zip(leaf.float16_groups, leaf.fp32_from_float16_groups, strict=True):
            out.update({id(m): p for m, p in zip(model_group, main_group, strict=True)})
        out.update({id(p): p for g in leaf.fp32_from_fp32_groups for p in g})
        return out
    raise NotImplementedError(f"optimizer {type(leaf).__name__} is not supported by core.model.gpt.optimizer_state")


def _ensure_state(inner: Any, main: torch.Tensor) -> dict[str, Any]:
    state = inner.state[main]
    if not state:  # before the first step torch's Adam has no state yet
        state["step"] = torch.tensor(0.0)
        for k in MOMENTS:
            state[k] = torch.zeros_like(main, memory_format=torch.preserve_format)
    return state


def _optimizer_writer(sh: ShardedTensor) -> bool:
    """Distributed state: every DP rank writes its range, but one tensor-parallel replica only."""
    rid = sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,)
    return all(int(r) == 0 for r in rid[:-1])


def _slice(sh: ShardedTensor, name: str, offset: tuple[int, ...] = (), shape: tuple[int, ...] = ()) -> TensorSlice:
    full = (1,) * sh.prepend_axis_num + tuple(sh.data.shape)
    base = tuple(int(o) for o in sh.global_offset)
    return TensorSlice(name=name, global_shape=tuple(int(g) for g in sh.global_shape),
                       offset=tuple(b + o for b, o in zip(base, offset, strict=True)) if offset else base,
                       shape=shape or full, dtype="float32")


def _boxes(sh: ShardedTensor, r: Any, start: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """(offset in the box, shape, index in the held state tensor's flat view) of each
    rectangular piece of the box ``sh`` (``start``: its flat offset in the parameter) this
    rank holds state for: all of it, or what a distributed optimizer's range ``r`` (flat, in
    the parameter) covers of it, cut into boxes."""
    full = _slice(sh, "").shape
    numel = int(np.prod(full))
    if r is None:
        return [((0,) * len(full), full, start)]
    lo, hi = max(r.start, start), min(r.end, start + numel)
    if lo >= hi:
        return []
    return [(offset, shape, flat + start - r.start) for offset, shape, flat in flat_range_boxes(full, lo - start, hi - start)]


class OptimizerState:
    """This rank's main weights, moments, step counters and loss scaler, in checkpoint terms."""

    def __init__(self, optimizer: Any) -> None:
        self.leaves = _leaves(optimizer)
        self.distributed = any(isinstance(leaf, DistributedOptimizer) for leaf in self.leaves)
        self.main: dict[int, tuple[Any, torch.Tensor]] = {}
        self.owner: dict[int, DistributedOptimizer] = {}
        for leaf in self.leaves:
            if isinstance(leaf, DistributedOptimizer):
                self.owner.update({id(p): leaf for p in leaf.model_param_group_index_map})
            else:
                self.main.update({k: (leaf, v) for k, v in _main_param_map(leaf).items()})
        self.separate_main = any(isinstance(leaf, Float16OptimizerWithFloat16Params) for leaf in self.leaves) or any(
            isinstance(leaf, DistributedOptimizer) and (leaf.config.bf16 or leaf.config.fp16) for leaf in self.leaves)
        self.kinds = (*MOMENTS, "main_param") if self.separate_main else MOMENTS

    # --- tensors ----------------------------------------------------------------------------
    def _tensors(self, param: torch.nn.Parameter) -> tuple[dict[str, torch.Tensor], Any] | None:
        """{kind: tensor} this rank holds for ``param`` (flat shards when distributed) and the
        owner's range (None when not distributed); None when it holds no part of it."""
        if self.distributed:
            leaf = self.owner.get(id(param))
            if leaf is None:
                return None
            r = leaf._get_model_param_range_map(param)["param"]
            main = leaf._get_main_param_and_optimizer_states(param)["param"]
            state = _ensure_state(leaf.optimizer, main)
            return {"main_param": main, **{m: state[m] for m in MOMENTS}}, r
        leaf, main = self.main[id(param)]
        state = _ensure_state(leaf.optimizer, main)
        return {"main_param": main, **{m: state[m] for m in MOMENTS}}, None

    def pieces(self, sh: ShardedTensor, param: torch.nn.Parameter, writer: bool, start: int = 0) -> list[Piece]:
        """The optimizer slices this rank writes for the box ``sh`` of ``param`` (at flat
        offset ``start`` in it; ``writer``: it writes the box itself in a non-distributed run)."""
        held = self._tensors(param)
        if held is None or not (_optimizer_writer(sh) if self.distributed else writer):
            return []
        tensors, r = held
        out: list[Piece] = []
        for kind in self.kinds:
            name, t = f"optim.{kind}.{sh.key}", tensors[kind]
            for offset, shape, at in _boxes(sh, r, start):
                n = int(np.prod(shape))
                out.append((_slice(sh, name, offset, shape), t.view(-1)[at:at + n].view(shape)))
        return out

    def load(self, sh: ShardedTensor, param: torch.nn.Parameter, read: ReadFn, *, has_main: bool,
             start: int = 0) -> None:
        """Read this rank's part of the box ``sh`` of ``param``'s state, as fp32, into the optimizer."""
        held = self._tensors(param)
        if held is None:
            return  # no part of this param lives in this DP rank's shard
        tensors, r = held
        kinds = (*MOMENTS, "main_param") if self.separate_main else MOMENTS
        for kind in kinds:
            name = f"optim.{kind}.{sh.key}" if kind != "main_param" or has_main else sh.key
            dst = tensors[kind]
            for offset, shape, at in _boxes(sh, r, start):
                s = _slice(sh, name, offset, shape)
                data = read(name, s.offset, s.shape)
                if tuple(data.shape) != s.shape:
                    raise CheckpointError(f"{name}: read shape {tuple(data.shape)} at {s.offset}, expected {s.shape}")
                n = int(np.prod(shape))
                dst.view(-1)[at:at + n].copy_(torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).reshape(-1))

    # --- scalars ----------------------------------------------------------------------------
    def step_counters(self) -> list[list[list[float | None]]]:
        """Per leaf, per param group: [group's own step (fused optimizers), the params' step (torch)]."""
        out = []
        for leaf in self.leaves:
            inner = leaf.optimizer
            groups = []
            for g in inner.param_groups:
                steps = [float(inner.state[p]["step"]) for p in g["params"] if "step" in inner.state[p]]
                groups.append([float(g["step"]) if "step" in g else None, steps[0] if steps else None])
            out.append(groups)
        return out

    def set_step_counters(self, saved: list[list[list[float | None]]]) -> None:
        """Write saved counters back, group by group (the first group's to all, when the
        number of groups changed)."""
        for li, leaf in enumerate(self.leaves):
            inner = leaf.optimizer
            leaf_saved = saved[li] if li < len(saved) else saved[0]
            for gi, g in enumerate(inner.param_groups):
                group_step, state_step = leaf_saved[gi] if gi < len(leaf_saved) else leaf_saved[0]
                if group_step is not None or "step" in g:
                    g["step"] = group_step if group_step is not None else state_step
                for p in g["params"]:
                    st = _ensure_state(inner, p)
                    if state_step is not None:
                        st["step"] = torch.tensor(state_step, dtype=st["step"].dtype, device=st["step"].device)

    def loss_scaler(self) -> dict[str, float] | None:
        """fp16's dynamic loss scaler: scale and trackers (None without one)."""
        scaler = next((getattr(leaf, "grad_scaler", None) for leaf in self.leaves
                       if getattr(leaf, "grad_scaler", None) is not None), None)
        if scaler is None:
            return None
        state = scaler.state_dict()
        return {k: (float(v.item()) if torch.is_tensor(v) else float(v)) for k, v in state.items()}

    def set_loss_scaler(self, saved: dict[str, float] | None) -> None:
        for leaf in self.leaves:
            scaler = getattr(leaf, "grad_scaler", None)
            if scaler is None or saved is None:
                continue
            state = scaler.state_dict()
            scaler.load_state_dict({k: (torch.tensor([saved[k]], dtype=torch.float32) if torch.is_tensor(v)
                                        else type(v)(saved[k])) for k, v in state.items()})
