"""The full training state of one rank as global-name slices, and back in any layout.

``export_state`` lists every tensor this rank must write, each as a ``TensorSlice`` of a
global tensor (global name, global shape, this rank's offset and shape) with its live
data, plus small JSON-able blobs (step counters, the loss scaler, RNG streams, the data
position). ``import_state`` reads exactly the slices this rank owns in *its* layout through
a ``read(name, offset, shape)`` callable, so a checkpoint saved as tp2pp2 loads as tp1pp4.

Names and slicing come from Megatron's ``sharded_state_dict()``: transformer layers are
stacked along a leading layer axis (``decoder.layers.self_attention...`` has global shape
``(num_layers, ...)``), TP shards split one axis, and ``replica_id`` marks copies (TP-
replicated norms, DP replicas): one replica writes each model box, chosen by
core.model.gpt.spread so that the data-parallel replicas share the writing. The
optimizer's fp32 state is core.model.gpt.optimizer_state's; the RNG streams are
core.parallel.rng's, kept with the coordinates they belong to.

Blobs (format 2): ``step``, ``optimizer`` (per-group step counters, the loss scaler, whether
main weights are separate), ``rng`` (coords, dims and every stream), ``data``. A format-1
checkpoint (one step counter, rank-keyed RNG) still loads; its RNG is derived afresh.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from core.checkpoint.spec import TensorSlice
from core.config.dims import Coords, ParallelDims
from core.errors import CheckpointError
from core.model.gpt import spread
from core.model.gpt.model import unwrap
from core.model.gpt.optimizer_state import OptimizerState
from core.parallel import rng

log = logging.getLogger(__name__)

Items = list[tuple[TensorSlice, Any]]  # LiveTensor items on export
ReadFn = Callable[[str, tuple[int, ...], tuple[int, ...]], np.ndarray]  # may offer read_into: copy_box
FORMAT = 2
READS = (1, 2)


# --- model tensors -------------------------------------------------------------------
class Part(NamedTuple):
    """One rectangular box of a global tensor held by one parameter: the parameter itself,
    or a piece of it (``start``: the piece's flat offset in it)."""

    sh: ShardedTensor
    tensor: torch.Tensor
    param: torch.nn.Parameter
    start: int


def param_parts(model_chunks: list[Any], prefix: str = "") -> Iterator[Part]:
    """Each local parameter's boxes of global tensors, in order; ``prefix`` before every name
    (a second model of the run: ``critic.``). A parameter is one box, except where Megatron
    describes it by a factory: SwiGLU's fc1 holds this rank's gate rows then its up rows,
    two boxes of a global ``[gates; ups]`` tensor (layout-independent)."""
    for chunk in model_chunks:
        gpt = unwrap(chunk)
        by_id = {id(p): p for p in gpt.parameters()}
        for sh in gpt.sharded_state_dict(prefix=prefix).values():
            if sh.key.endswith("_extra_state") or not isinstance(sh, (ShardedTensor, ShardedTensorFactory)):
                continue
            param = by_id.get(id(sh.data))
            if param is None:
                raise AssertionError(f"{sh.key}: sharded tensor is not a parameter of the model")
            if sh.flattened_range is not None:
                raise AssertionError(f"{sh.key}: flattened sharded tensors are not expected in a model")
            if isinstance(sh, ShardedTensor):
                yield Part(sh, param, param, 0)
                continue
            for sub in sh.build():
                start = (sub.data.data_ptr() - param.data_ptr()) // param.element_size()
                if not sub.data.is_contiguous() or not 0 <= start <= param.numel() - sub.data.numel():
                    raise AssertionError(f"{sh.key}: a factory's piece is not a contiguous part of its parameter")
                yield Part(sub, sub.data, param, start)


def sharded_params(model_chunks: list[Any], prefix: str = "") -> Iterator[tuple[ShardedTensor, torch.Tensor]]:
    """Each box of a global tensor this rank's parameters hold, with its tensor (a parameter
    or a view of part of one: ``param_parts``)."""
    for part in param_parts(model_chunks, prefix):
        yield part.sh, part.tensor


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
    kernels. ``current`` is a zero-copy view for an fp32 host tensor (``host_view``), else an
    fp32 copy; ``snapshot_flat_into`` copies a piece (core.checkpoint.stream).
    """

    __slots__ = ("tensor", "shape", "ready")

    def __init__(self, tensor: torch.Tensor, shape: tuple[int, ...], ready: Any = None) -> None:
        if tensor.numel() != int(np.prod(shape, dtype=np.int64)):
            raise CheckpointError(f"tensor of shape {tuple(tensor.shape)} does not fill the slice shape {shape}")
        self.tensor = tensor.detach()
        self.shape = tuple(shape)
        self.ready = ready

    def snapshot_into(self, out: np.ndarray) -> None:
        self._copy(self.tensor.reshape(out.shape), out)

    def snapshot_flat_into(self, start: int, out: np.ndarray) -> None:
        """Copy the flat elements ``[start, start + out.size)`` into ``out``: a synchronous save
        streams a tensor to its file this way, one bounded piece at a time."""
        self._copy(self.tensor.reshape(-1)[start:start + out.size].reshape(out.shape), out)

    def _copy(self, t: torch.Tensor, out: np.ndarray) -> None:
        with torch.no_grad():
            if not t.is_cuda:
                torch.from_numpy(out).copy_(t)
                return
            stream = _side_stream(t.device)
            with torch.cuda.stream(stream):
                if self.ready is not None:
                    stream.wait_event(self.ready)
                torch.from_numpy(out).copy_(t)  # pageable host memory: returns once the data is there

    def host_view(self) -> np.ndarray | None:
        """The tensor as an fp32 host array without a copy (an fp32 CPU tensor), else None."""
        t = self.tensor
        if t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous():
            return t.numpy().reshape(self.shape)
        return None

    def current(self) -> np.ndarray:
        view = self.host_view()
        return view if view is not None else _numpy(self.tensor).reshape(self.shape)


_SIDE_STREAMS: dict[Any, Any] = {}


def _side_stream(device: torch.device) -> Any:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def load_model_slices(model_chunks: list[Any], read: ReadFn) -> None:
    """Copy this rank's slice of every global parameter from ``read`` into the model."""
    with torch.no_grad():
        for sh, param in sharded_params(model_chunks):
            copy_box(read, slice_of(sh), param)


def copy_box(read: ReadFn, s: TensorSlice, dest: torch.Tensor) -> None:
    """The box ``s`` from ``read`` into ``dest`` (a parameter or a contiguous piece of one).

    A source that offers ``read.read_into(name, offset, shape, out)`` (core.hf.reader's)
    writes straight into ``dest``, cast once from its own dtype; any other gives the fp32
    array ``read(name, offset, shape)``, rounded once to ``dest``'s dtype."""
    into = getattr(read, "read_into", None)
    if into is None or not dest.is_contiguous():
        dest.copy_(_as_tensor(read(s.name, s.offset, s.shape), s, dest))
        return
    if dest.numel() != int(np.prod(s.shape, dtype=np.int64)):
        raise CheckpointError(f"{s.name}: a box of shape {s.shape} at {s.offset} for a tensor of shape "
                              f"{tuple(dest.shape)}")
    with torch.no_grad():
        into(s.name, s.offset, s.shape, dest.view(s.shape))


def _as_tensor(array: np.ndarray, s: TensorSlice, like: torch.Tensor) -> torch.Tensor:
    """``array`` (fp32 as saved) shaped and placed like ``like``: one rounding, to its dtype."""
    if tuple(array.shape) != s.shape:
        raise CheckpointError(f"{s.name}: read shape {tuple(array.shape)} at {s.offset}, expected {s.shape}")
    return torch.from_numpy(np.ascontiguousarray(array)).reshape(like.shape).to(like.device, like.dtype)


# --- the contract ------------------------------------------------------------------------
def export_state(model_chunks: list[Any], optimizer: Any, step: int, coords: Coords, dims: ParallelDims, *,
                 items: tuple[Items, dict[str, Any]] | None = None) -> tuple[Items, dict[str, Any]]:
    """Every slice this rank writes for a checkpoint after ``step`` steps, and its blobs.

    The items are ``LiveTensor``s of the live state, not copies: valid until the next
    optimizer step or load (core.checkpoint.service's fence). The blobs are taken now.
    No collective: each rank writes what it holds (a distributed optimizer's own ranges).
    """
    if items is None:  # Megatron's model and optimizer (else: ZeRO-3's own, core.model.gpt.fsdp)
        mine, opt = export_items(model_chunks, optimizer)
        items = mine, optimizer_blob(opt)
    slices, opt_blob = items
    blobs = {
        "format": FORMAT,
        "step": int(step),
        "optimizer": opt_blob,
        "rng": {"coords": [coords.tp, coords.pp, coords.dp], "dims": [dims.tp, dims.pp, dims.dp], **rng.capture()},
        "data": {"next_step": int(step)},
    }
    return slices, blobs


def export_items(model_chunks: list[Any], optimizer: Any, prefix: str = "") -> tuple[Items, OptimizerState]:
    """The model's and its optimizer's slices this rank writes (names after ``prefix``)."""
    opt = OptimizerState(optimizer)
    parts = list(param_parts(model_chunks, prefix))
    ready = None  # on a GPU: the point of the training stream the snapshot copies must follow
    if parts and parts[0].param.is_cuda:
        ready = torch.cuda.Event()
        ready.record()
    items: Items = []
    writes = spread.writers([p.sh for p in parts], follows=0 if opt.distributed else len(opt.kinds))
    for sh, tensor, param, start in parts:
        writer = writes(sh)  # one DP replica per box, the bytes balanced over the replicas
        s = slice_of(sh)
        if writer:  # the array carries the slice's shape: stacked layers add a leading axis of 1
            items.append((s, LiveTensor(tensor, s.shape, ready)))
        items += [(piece, LiveTensor(t, piece.shape, ready)) for piece, t in opt.pieces(sh, param, writer, start)]
    return items, opt


def optimizer_blob(opt: OptimizerState) -> dict[str, Any]:
    return {"steps": opt.step_counters(), "loss_scaler": opt.loss_scaler(), "main_params": opt.separate_main}


def import_items(model_chunks: list[Any], optimizer: Any, read: ReadFn, saved_opt: dict[str, Any],
                 prefix: str = "") -> None:
    """Read this rank's slices of the model and its optimizer (names after ``prefix``)."""
    opt = OptimizerState(optimizer)
    has_main = bool(saved_opt["main_params"])
    with torch.no_grad():
        for sh, tensor, param, start in param_parts(model_chunks, prefix):
            s = slice_of(sh)
            source = f"optim.main_param.{sh.key}" if has_main else sh.key  # the fp32 truth
            tensor.copy_(_as_tensor(read(source, s.offset, s.shape), s, tensor))
            opt.load(sh, param, read, has_main=has_main, start=start)
    opt.set_step_counters(saved_opt["steps"])
    opt.set_loss_scaler(saved_opt["loss_scaler"])


def import_state(model_chunks: list[Any], optimizer: Any, read: ReadFn, blobs: dict[str, Any], *, seed: int,
                 coords: Coords, dims: ParallelDims, on_cuda: bool,
                 importer: Callable[[ReadFn, dict[str, Any]], None] | None = None) -> int:
    """Load this rank's slices (in its current layout) and blobs; returns the step.

    Everything fp32 is read as fp32; the model's (bf16/fp16) weights are the rounded fp32
    main weights, as after any optimizer step. The RNG streams are restored when the
    checkpoint holds this rank's coordinates in this layout, else derived for them.
    """
    version = blobs.get("format")
    if version not in READS:
        raise CheckpointError(f"training state format {version!r}, this Baton reads {', '.join(map(str, READS))}")
    saved_opt = blobs["optimizer"] if version == 2 else {
        "steps": [[[None, float(blobs["optimizer_step"])]]], "loss_scaler": None, "main_params": blobs["main_params"]}
    if importer is None:
        import_items(model_chunks, optimizer, read, saved_opt)
    else:  # ZeRO-3's own (core.model.gpt.fsdp)
        importer(read, saved_opt)
    step = int(blobs["step"])
    saved = blobs.get("rng", {})
    if version == 2 and saved.get("coords") == [coords.tp, coords.pp, coords.dp] \
            and saved.get("dims") == [dims.tp, dims.pp, dims.dp]:
        rng.restore(saved)
    else:
        log.info("checkpoint of layout %s resumed as %s: RNG streams derived for coordinates %s at step %d",
                 saved.get("dims"), dims.describe(), coords, step)
        rng.seed_streams(seed, step, coords, on_cuda=on_cuda)
    return step


def assemble(items: list[tuple[TensorSlice, np.ndarray]]) -> dict[str, np.ndarray]:
    """Global arrays from slices that cover them (each element written once)."""
    out: dict[str, np.ndarray] = {}
    for s, part in items:
        full = out.setdefault(s.name, np.zeros(s.global_shape, dtype=part.dtype))
        full[tuple(slice(o, o + n) for o, n in zip(s.offset, s.shape, strict=True))] = part.reshape(s.shape)
    return out
