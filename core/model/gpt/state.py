"""The full training state of one rank as global-name slices, and back in any layout.

``export_state`` lists every tensor this rank must write, each as a ``TensorSlice`` of a
global tensor (global name, global shape, this rank's offset and shape) with its data,
plus small JSON-able blobs (optimizer step count, RNG states, data position).
``import_state`` reads exactly the slices this rank owns in *its* layout through a
``read(name, offset, shape)`` callable, so a checkpoint saved as tp2pp2 loads as tp1pp4.

Names and slicing come from Megatron's ``sharded_state_dict()``: transformer layers are
stacked along a leading layer axis (``decoder.layers.self_attention...`` has global shape
``(num_layers, ...)``), TP shards split one axis, and ``replica_id`` marks copies (TP-
replicated norms, DP replicas): only the all-zeros replica is written. Adam's moments live
under ``optim.exp_avg.<name>`` / ``optim.exp_avg_sq.<name>`` with the param's slicing;
fp32 main weights, when the model itself is bf16/fp16, under ``optim.main_param.<name>``.

The distributed optimizer shards each param's state over the DP group as flat ranges.
Here each DP rank fills its range into a zero tensor of the local param's shape and the
group sums them (one all-reduce per state kind), so the dp-rank-0 replica (the one with
replica_id all zeros) holds and writes the whole state; on import each DP rank reads the
whole local slice and keeps its own range. Simple and layout-independent, at the cost of
one DP all-reduce of the state per save. The private Megatron methods this uses
(``_get_main_param_and_optimizer_states``, ``_get_model_param_range_map``) are confined
to this module and exercised by tests/integration/test_gpt_parallel.py.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.optimizer import ChainedOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

from core.checkpoint.spec import TensorSlice
from core.errors import CheckpointError
from core.model.gpt.model import unwrap

Items = list[tuple[TensorSlice, Any]]  # LiveTensor items on export
ReadFn = Callable[[str, tuple[int, ...], tuple[int, ...]], np.ndarray]
MOMENTS = ("exp_avg", "exp_avg_sq")
FORMAT = 1


# --- model tensors -------------------------------------------------------------------
def sharded_params(model_chunks: list[Any]) -> Iterator[tuple[ShardedTensor, torch.nn.Parameter]]:
    """Each local parameter with its ShardedTensor (global name, shape, offset), in order."""
    for chunk in model_chunks:
        gpt = unwrap(chunk)
        by_id = {id(p): p for p in gpt.parameters()}
        for sh in gpt.sharded_state_dict().values():
            if not isinstance(sh, ShardedTensor) or sh.key.endswith("_extra_state"):
                continue
            param = by_id.get(id(sh.data))
            if param is None:
                raise AssertionError(f"{sh.key}: sharded tensor is not a parameter of the model")
            if sh.flattened_range is not None:
                raise AssertionError(f"{sh.key}: flattened sharded tensors are not expected in a model")
            yield sh, param


def slice_of(sh: ShardedTensor, name: str | None = None, dtype: str = "float32") -> TensorSlice:
    """The global slice of ``sh`` (prepended layer axes included) under ``name``."""
    shape = (1,) * sh.prepend_axis_num + tuple(sh.data.shape)
    return TensorSlice(
        name=name or sh.key,
        global_shape=tuple(int(g) for g in sh.global_shape),
        offset=tuple(int(o) for o in sh.global_offset),
        shape=tuple(int(s) for s in shape),
        dtype=dtype,
    )


def is_writer(sh: ShardedTensor) -> bool:
    """Only the first replica writes: TP-replicated and DP copies are identical."""
    rid = sh.replica_id
    return all(int(r) == 0 for r in (rid if isinstance(rid, tuple) else (rid,)))


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A private fp32 host copy of ``t`` (one copy: the cast or transfer, or else a copy)."""
    out = t.detach().to("cpu", torch.float32)
    return out.numpy().copy() if out.data_ptr() == t.data_ptr() else out.numpy()


class LiveTensor:
    """A live tensor as a checkpoint item (core.checkpoint.spec.LiveArray), read at write time.

    ``snapshot_into`` casts and copies it (device to host too) into the writer's fp32
    buffer; torch's copy releases the GIL, so the writer thread does it beside training.
    On a GPU the copy runs on a side stream, after ``ready`` (an event recorded on the
    training stream at export), so it neither waits for nor holds up the next step's
    kernels. ``current`` is a zero-copy view for an fp32 host tensor, else an fp32 copy.
    """

    __slots__ = ("tensor", "shape", "ready")

    def __init__(self, tensor: torch.Tensor, shape: tuple[int, ...], ready: Any = None) -> None:
        if tensor.numel() != int(np.prod(shape, dtype=np.int64)):
            raise CheckpointError(f"tensor of shape {tuple(tensor.shape)} does not fill the slice shape {shape}")
        self.tensor = tensor.detach()
        self.shape = tuple(shape)
        self.ready = ready

    def snapshot_into(self, out: np.ndarray) -> None:
        t = self.tensor.reshape(out.shape)
        with torch.no_grad():
            if not t.is_cuda:
                torch.from_numpy(out).copy_(t)
                return
            stream = _side_stream(t.device)
            with torch.cuda.stream(stream):
                if self.ready is not None:
                    stream.wait_event(self.ready)
                torch.from_numpy(out).copy_(t)  # pageable host memory: returns once the data is there

    def current(self) -> np.ndarray:
        t = self.tensor
        if t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous():
            return t.numpy().reshape(self.shape)
        return _numpy(t).reshape(self.shape)


_SIDE_STREAMS: dict[Any, Any] = {}


def _side_stream(device: torch.device) -> Any:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def load_model_slices(model_chunks: list[Any], read: ReadFn) -> None:
    """Copy this rank's slice of every global parameter from ``read`` into the model."""
    with torch.no_grad():
        for sh, param in sharded_params(model_chunks):
            s = slice_of(sh)
            param.copy_(_as_tensor(read(s.name, s.offset, s.shape), s, param))


def _as_tensor(array: np.ndarray, s: TensorSlice, like: torch.Tensor) -> torch.Tensor:
    if tuple(array.shape) != s.shape:
        raise CheckpointError(f"{s.name}: read shape {tuple(array.shape)} at {s.offset}, expected {s.shape}")
    return torch.from_numpy(np.ascontiguousarray(array)).reshape(like.shape).to(like.device, like.dtype)


# --- optimizer state -----------------------------------------------------------------
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
    raise NotImplementedError(f"optimizer {type(leaf).__name__} is not supported by core.model.gpt.state")


class _OptimizerView:
    """Per model param: its main param and Adam moments, as full local-shaped tensors."""

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

    def _ensure_state(self, inner: Any, main: torch.Tensor) -> dict[str, Any]:
        state = inner.state[main]
        if not state:  # before the first step torch's Adam has no state yet
            state["step"] = torch.tensor(0.0)
            for k in MOMENTS:
                state[k] = torch.zeros_like(main, memory_format=torch.preserve_format)
        return state

    def get(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """{"param", "exp_avg", "exp_avg_sq"}: this rank's values, zeros outside its DP range."""
        if self.distributed:
            out = {k: torch.zeros(param.shape, dtype=torch.float32, device=param.device)
                   for k in ("param", *MOMENTS)}
            leaf = self.owner.get(id(param))
            if leaf is not None:
                r = leaf._get_model_param_range_map(param)["param"]
                main = leaf._get_main_param_and_optimizer_states(param)["param"]
                state = self._ensure_state(leaf.optimizer, main)
                for k, src in (("param", main), *((m, state[m]) for m in MOMENTS)):
                    out[k].view(-1)[r.start:r.end] = src.detach().float().view(-1)
            return out
        leaf, main = self.main[id(param)]
        state = self._ensure_state(leaf.optimizer, main)
        return {"param": main.detach().float(), **{k: state[k].detach().float() for k in MOMENTS}}

    def set(self, param: torch.nn.Parameter, values: dict[str, torch.Tensor], step: int) -> None:
        """Write full local-shaped ``values`` into this rank's optimizer state of ``param``."""
        if self.distributed:
            leaf = self.owner.get(id(param))
            if leaf is None:
                return  # no part of this param lives in this DP rank's shard
            r = leaf._get_model_param_range_map(param)["param"]
            main = leaf._get_main_param_and_optimizer_states(param)["param"]
            state = self._ensure_state(leaf.optimizer, main)
            targets = {"param": main, **{m: state[m] for m in MOMENTS}}
            for k, dst in targets.items():
                dst.copy_(values[k].reshape(-1)[r.start:r.end].to(dst.dtype))
        else:
            leaf, main = self.main[id(param)]
            state = self._ensure_state(leaf.optimizer, main)
            main.copy_(values["param"].to(main.dtype))
            for m in MOMENTS:
                state[m].copy_(values[m].to(state[m].dtype))
        state["step"] = torch.tensor(float(step), dtype=state["step"].dtype, device=state["step"].device)

    def step_count(self) -> int:
        for leaf in self.leaves:
            for state in leaf.optimizer.state.values():
                if "step" in state:
                    return int(state["step"])
        return 0

    @property
    def separate_main(self) -> bool:
        """Whether main params differ from model params (bf16/fp16 models)."""
        return any(isinstance(leaf, Float16OptimizerWithFloat16Params) for leaf in self.leaves) or any(
            isinstance(leaf, DistributedOptimizer) and (leaf.config.bf16 or leaf.config.fp16)
            for leaf in self.leaves
        )


def _gather_over_dp(tensors: list[torch.Tensor]) -> None:
    """Sum ``tensors`` in place over the DP group, as one flat buffer."""
    if not tensors or parallel_state.get_data_parallel_world_size() == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=parallel_state.get_data_parallel_group())
    i = 0
    for t in tensors:
        t.view(-1).copy_(flat[i:i + t.numel()])
        i += t.numel()


# --- RNG -------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """torch, numpy and Python RNG states as JSON-able lists and ints."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_version, list(py_internal), py_gauss],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


# --- the contract ------------------------------------------------------------------------
def export_state(model_chunks: list[Any], optimizer: Any, step: int) -> tuple[Items, dict[str, Any]]:
    """Every slice this rank writes for a checkpoint after ``step`` steps, and its blobs.

    The items are ``LiveTensor``s of the live state, not copies: valid until the next
    optimizer step or load (core.checkpoint.service's fence). The blobs are taken now.

    Collective over the DP group when the optimizer is distributed: every rank must call it.
    """
    view = _OptimizerView(optimizer)
    params = list(sharded_params(model_chunks))
    states = [view.get(p) for _, p in params]
    if view.distributed:
        _gather_over_dp([s[k] for s in states for k in ("param", *MOMENTS)])
    kinds = [*MOMENTS, "main_param"] if view.separate_main else list(MOMENTS)
    ready = None  # on a GPU: the point of the training stream the snapshot copies must follow
    if params and params[0][1].is_cuda:
        ready = torch.cuda.Event()
        ready.record()
    items: Items = []
    for (sh, param), state in zip(params, states, strict=True):
        if not is_writer(sh):
            continue
        s = slice_of(sh)
        # The array carries the slice's shape: stacked layers add a leading axis of 1.
        items.append((s, LiveTensor(param, s.shape, ready)))
        for kind in kinds:
            tensor = state["param" if kind == "main_param" else kind]
            items.append((slice_of(sh, f"optim.{kind}.{sh.key}"), LiveTensor(tensor, s.shape, ready)))
    blobs = {
        "format": FORMAT,
        "step": int(step),
        "optimizer_step": view.step_count(),
        "main_params": view.separate_main,
        "rng": rng_state(),
        "data": {"next_step": int(step)},
    }
    return items, blobs


def import_state(model_chunks: list[Any], optimizer: Any, read: ReadFn, blobs: dict[str, Any]) -> int:
    """Load this rank's slices (in its current layout) and blobs; returns the step."""
    if blobs.get("format") != FORMAT:
        raise CheckpointError(f"training state format {blobs.get('format')!r}, this Baton reads {FORMAT}")
    view = _OptimizerView(optimizer)
    has_main = bool(blobs.get("main_params"))
    opt_step = int(blobs["optimizer_step"])
    with torch.no_grad():
        for sh, param in sharded_params(model_chunks):
            s = slice_of(sh)
            values = {
                k: _as_tensor(read(f"optim.{k}.{sh.key}", s.offset, s.shape), s, param).float()
                for k in MOMENTS
            }
            main_name = f"optim.main_param.{sh.key}" if has_main else sh.key
            values["param"] = _as_tensor(read(main_name, s.offset, s.shape), s, param).float()
            # The fp32 main weight is the truth; the model param is its (rounded) copy.
            param.copy_(values["param"].to(param.dtype))
            view.set(param, values, opt_step)
    set_rng_state(blobs["rng"])
    return int(blobs["step"])
