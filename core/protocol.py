"""The control protocol: typed, versioned msgpack messages with arrays as side frames.

Wire format (one ZeroMQ multipart message; the ROUTER adds the peer identity in front):

    frame 0   msgpack map  {"v": PROTOCOL_VERSION, "k": kind, "id": request id,
                            "e": epoch, "p": {payload fields}}
    frame 1.. raw array buffers, in order of appearance in the payload

A numpy array anywhere in the payload is replaced by msgpack ext type 1 holding
``[frame index, dtype str, shape]``; the receiver rebuilds it with ``np.frombuffer`` over
the frame (zero-copy, read-only). Nothing else is accepted: no pickle, no code.

``encode`` and ``decode`` are exact inverses. ``decode`` raises ``ProtocolError`` for
anything malformed (bad msgpack, wrong types, unknown kind, other protocol version) and
never anything else, so a receiver can log and drop a bad message.
"""
from __future__ import annotations

import dataclasses
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union, get_args, get_origin, get_type_hints

import msgpack
import numpy as np

from core.errors import ProtocolError

PROTOCOL_VERSION = 1
_ARRAY_EXT = 1
_MAX_DIMS = 32


@dataclass(frozen=True, kw_only=True)
class Register:
    """Worker → controller: I exist; here is where I run."""

    rank_hint: int  # SLURM_PROCID / BATON_RANK, -1 when unknown
    host: str
    node: str
    pid: int
    rendezvous_port: int = 0  # a free port on this host, offered for torch.distributed
    generation: int = 0  # which start of the worker step within this epoch (restarts after a loss)


@dataclass(frozen=True, kw_only=True)
class Welcome:
    """Controller → worker: your rank, the world, and the rendezvous of torch.distributed."""

    rank: int
    world_size: int
    heartbeat_interval_s: float
    controller_lost_s: float
    master_addr: str
    master_port: int


@dataclass(frozen=True, kw_only=True)
class Refuse:
    """Controller → worker: you may not join (stale epoch or generation, duplicate rank, full group)."""

    reason: str


@dataclass(frozen=True, kw_only=True)
class Call:
    method: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Result:
    value: Any = None


@dataclass(frozen=True, kw_only=True)
class Error:
    """A call raised on the worker; the controller re-raises it with the remote traceback."""

    exc_type: str
    message: str
    traceback: str


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    """Both ways: workers send it from their own thread; the controller answers in bulk."""

    seq: int
    busy: str = ""  # the method being executed, "" when idle
    rss_mb: float = 0.0
    signal: str = ""  # worker → controller: a preemption signal this worker received ("SIGUSR2")


@dataclass(frozen=True, kw_only=True)
class Abort:
    """Controller → worker: stop now (the step is abandoned); exit without cleanup."""

    reason: str


@dataclass(frozen=True, kw_only=True)
class Shutdown:
    """Controller → worker: finish, release resources, exit 0."""

    reason: str


@dataclass(frozen=True, kw_only=True)
class Log:
    level: int
    message: str


Message = Register | Welcome | Refuse | Call | Result | Error | Heartbeat | Abort | Shutdown | Log

KINDS: dict[str, type] = {
    "register": Register,
    "welcome": Welcome,
    "refuse": Refuse,
    "call": Call,
    "result": Result,
    "error": Error,
    "heartbeat": Heartbeat,
    "abort": Abort,
    "shutdown": Shutdown,
    "log": Log,
}
KIND_OF: dict[type, str] = {cls: kind for kind, cls in KINDS.items()}


@dataclass(frozen=True, kw_only=True)
class Envelope:
    """A decoded message with its routing header."""

    msg: Message
    req_id: int
    epoch: int


def _checker(tp: Any) -> tuple[type, ...] | None:
    """isinstance types for a payload field; None means anything msgpack can carry."""
    if tp is Any:
        return None
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        out: list[type] = []
        for a in get_args(tp):
            c = _checker(a)
            if c is None:
                return None
            out.extend(c)
        return tuple(out)
    if origin is dict:
        return (dict,)
    if tp is float:
        return (float, int)
    return (tp,)


_FIELDS: dict[type, list[tuple[str, tuple[type, ...] | None, bool]]] = {
    cls: [
        (
            f.name,
            _checker(get_type_hints(cls)[f.name]),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
    ]
    for cls in KINDS.values()
}


def encode(msg: Message, *, req_id: int = 0, epoch: int = 0) -> list[bytes | memoryview]:
    """Message → frames. Arrays become side frames (no copy of their data)."""
    frames: list[bytes | memoryview] = [b""]

    def default(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            arr = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
            if arr.dtype.hasobject:
                raise ProtocolError("object arrays cannot be sent")
            frames.append(memoryview(arr).cast("B") if arr.size else b"")
            meta = msgpack.packb([len(frames) - 1, arr.dtype.str, list(arr.shape)])
            return msgpack.ExtType(_ARRAY_EXT, meta)
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, tuple):
            return list(obj)
        raise ProtocolError(f"cannot send a {type(obj).__name__} in a {KIND_OF[type(msg)]} message")

    payload = {name: getattr(msg, name) for name, _, _ in _FIELDS[type(msg)]}
    header = {"v": PROTOCOL_VERSION, "k": KIND_OF[type(msg)], "id": req_id, "e": epoch, "p": payload}
    try:
        frames[0] = msgpack.packb(header, default=default, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode {KIND_OF[type(msg)]}: {exc}") from None
    return frames


def decode(frames: Sequence[Any]) -> Envelope:
    """Frames → Envelope; anything malformed raises ProtocolError (and nothing else)."""
    try:
        return _decode(frames)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types on garbage; normalise them
        raise ProtocolError(f"malformed message: {type(exc).__name__}: {exc}") from None


def _decode(frames: Sequence[Any]) -> Envelope:
    if not frames:
        raise ProtocolError("empty message")
    buffers = [f if isinstance(f, bytes) else memoryview(f.buffer if hasattr(f, "buffer") else f) for f in frames]
    used: set[int] = set()

    def ext_hook(code: int, data: bytes) -> Any:
        if code != _ARRAY_EXT:
            raise ProtocolError(f"unknown msgpack extension type {code}")
        meta = msgpack.unpackb(data)
        if not (isinstance(meta, list) and len(meta) == 3):
            raise ProtocolError("bad array header")
        index, dtype_str, shape = meta
        if not (isinstance(index, int) and 1 <= index < len(buffers)) or index in used:
            raise ProtocolError(f"array frame index {index!r} invalid for {len(buffers)} frames")
        if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ProtocolError(f"bad array shape {shape!r}")
        dtype = np.dtype(dtype_str)
        if dtype.hasobject:
            raise ProtocolError("object arrays are refused")
        used.add(index)
        buf = buffers[index]
        expected = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if len(memoryview(buf).cast("B")) != expected:
            raise ProtocolError(f"array frame {index} has {len(memoryview(buf).cast('B'))} bytes, header says {expected}")
        return np.frombuffer(buf, dtype=dtype).reshape(shape)

    header = msgpack.unpackb(buffers[0], ext_hook=ext_hook, raw=False, strict_map_key=True)
    if not isinstance(header, dict):
        raise ProtocolError(f"header is a {type(header).__name__}, not a map")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version mismatch: peer speaks {version!r}, this side speaks {PROTOCOL_VERSION}"
        )
    kind, req_id, epoch, payload = header.get("k"), header.get("id"), header.get("e"), header.get("p")
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    if not isinstance(req_id, int) or isinstance(req_id, bool):
        raise ProtocolError(f"{kind}: request id {req_id!r} is not an integer")
    if not isinstance(epoch, int) or isinstance(epoch, bool):
        raise ProtocolError(f"{kind}: epoch {epoch!r} is not an integer")
    if not isinstance(payload, dict):
        raise ProtocolError(f"{kind}: payload is not a map")
    spec = _FIELDS[cls]
    names = {name for name, _, _ in spec}
    extra = set(payload) - names
    if extra:
        raise ProtocolError(f"{kind}: unknown fields {sorted(map(str, extra))}")
    kwargs = {}
    for name, types_, required in spec:
        if name not in payload:
            if required:
                raise ProtocolError(f"{kind}: missing field {name!r}")
            continue
        value = payload[name]
        if types_ is not None and (not isinstance(value, types_) or (isinstance(value, bool) and bool not in types_)):
            raise ProtocolError(f"{kind}.{name}: {value!r} has the wrong type")
        kwargs[name] = value
    if len(used) != len(buffers) - 1:
        raise ProtocolError(f"{kind}: {len(buffers) - 1 - len(used)} unreferenced array frames")
    return Envelope(msg=cls(**kwargs), req_id=req_id, epoch=epoch)
