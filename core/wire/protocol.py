"""The control protocol: typed, versioned msgpack messages with arrays as side frames.

Wire format (one ZeroMQ multipart message; the ROUTER adds the peer identity in front):

    frame 0   msgpack array  [PROTOCOL_VERSION, kind, request id, epoch, {payload fields}]
    frame 1.. raw array buffers, in order of appearance in the payload

The header is an array, not a map: decoding five positional items is a third of the cost
of a five-key map (no key strings to build), and this path runs for every call, result
and heartbeat. The payload stays a map of named fields. A peer of protocol 1 (a map
header) is still told which version it speaks. Version 3 added ``Error.user_error`` and ``Error.transient``.

A numpy array anywhere in the payload is replaced by msgpack ext type 1 holding
``[frame index, dtype str, shape]``; the receiver rebuilds it with ``np.frombuffer`` over
the frame (zero-copy, read-only). Nothing else is accepted: no pickle, no code.

``encode`` and ``decode`` are exact inverses. ``decode`` raises ``ProtocolError`` for
anything malformed (bad msgpack, wrong types, unknown kind, other protocol version) and
never anything else, so a receiver can log and drop a bad message.
"""
from __future__ import annotations

import dataclasses
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union, get_args, get_origin, get_type_hints

import msgpack
import numpy as np

from core.errors import ProtocolError

PROTOCOL_VERSION = 3
_ARRAY_EXT = 1
_MAX_DIMS = 32


@dataclass(kw_only=True, slots=True)
class Register:
    """Worker → controller: I exist; here is where I run."""

    rank_hint: int  # SLURM_PROCID / BATON_RANK, -1 when unknown
    host: str
    node: str
    pid: int
    rendezvous_port: int = 0  # a free port on this host, offered for torch.distributed
    generation: int = 0  # which start of the worker step within this epoch (restarts after a loss)


@dataclass(kw_only=True, slots=True)
class Welcome:
    """Controller → worker: your rank, the world, and the rendezvous of torch.distributed."""

    rank: int
    world_size: int
    heartbeat_interval_s: float
    controller_lost_s: float
    master_addr: str
    master_port: int


@dataclass(kw_only=True, slots=True)
class Refuse:
    """Controller → worker: you may not join (stale epoch or generation, duplicate rank, full group)."""

    reason: str


@dataclass(kw_only=True, slots=True)
class Call:
    method: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True, slots=True)
class Result:
    value: Any = None


@dataclass(kw_only=True, slots=True)
class Error:
    """A call raised on the worker (or its request was malformed); the controller re-raises
    it with the remote traceback. ``user_error``: the exception was bad input (a
    ``UserError``), which no retry can fix."""

    exc_type: str
    message: str
    traceback: str
    user_error: bool = False
    transient: bool = False  # a storage fault that passes (no space, an I/O error): worth a retry


@dataclass(kw_only=True, slots=True)
class Heartbeat:
    """Both ways: workers send it from their own thread; the controller answers in bulk."""

    seq: int
    busy: str = ""  # the method being executed, "" when idle
    rss_mb: float = 0.0
    signal: str = ""  # worker → controller: a preemption signal this worker received ("SIGUSR2")


@dataclass(kw_only=True, slots=True)
class Abort:
    """Controller → worker: stop now (the step is abandoned); exit without cleanup."""

    reason: str


@dataclass(kw_only=True, slots=True)
class Shutdown:
    """Controller → worker: finish, release resources, exit 0."""

    reason: str


@dataclass(kw_only=True, slots=True)
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


@dataclass(kw_only=True, slots=True)
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


@dataclass(frozen=True)
class _Spec:
    """What decode checks for one message kind (precomputed once)."""

    kind: str
    names: frozenset[str]
    required: frozenset[str]
    typed: tuple[tuple[str, tuple[type, ...]], ...]  # fields whose type is checked
    fields: tuple[str, ...]


def _spec(kind: str, cls: type) -> _Spec:
    hints = get_type_hints(cls)
    fields = dataclasses.fields(cls)
    typed = []
    for f in fields:
        c = _checker(hints[f.name])
        if c is not None:
            typed.append((f.name, c))
    return _Spec(
        kind=kind,
        names=frozenset(f.name for f in fields),
        required=frozenset(f.name for f in fields
                           if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING),
        typed=tuple(typed),
        fields=tuple(f.name for f in fields),
    )


_SPECS: dict[type, _Spec] = {cls: _spec(kind, cls) for kind, cls in KINDS.items()}


class _Packers(threading.local):
    """One reusable msgpack Packer per thread (a Packer is not thread-safe; building one
    per message costs as much as the packing)."""

    def __init__(self) -> None:
        self.pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack


_packers = _Packers()


def encode(msg: Message, *, req_id: int = 0, epoch: int = 0) -> list[bytes | memoryview]:
    """Message → frames. Arrays become side frames (no copy of their data)."""
    spec = _SPECS[type(msg)]
    header = [PROTOCOL_VERSION, spec.kind, req_id, epoch, {name: getattr(msg, name) for name in spec.fields}]
    try:
        return [_packers.pack(header)]  # the common case: no arrays, no numpy scalars
    except (TypeError, ValueError, OverflowError):
        pass
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
        raise ProtocolError(f"cannot send a {type(obj).__name__} in a {spec.kind} message")

    try:
        frames[0] = msgpack.packb(header, default=default, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode {spec.kind}: {exc}") from None
    return frames


# --- the hot path ------------------------------------------------------------------------
# Every call goes out as a Call and comes back as a Result. Each message meets cold caches
# (the process slept since the last one), where every Python frame and object costs
# microseconds, so these two kinds have lean paths beside the general ones: they accept
# exactly the well-formed one-frame messages that ``decode`` accepts (a test checks this),
# and hand anything else back (None) for ``decode`` to handle, errors included.

def result_encoder() -> Callable[[Any, int, int], list[bytes | memoryview]]:
    """``encode(Result(value=v), req_id=r, epoch=e)`` as ``f(v, r, e)``, with a Packer of
    its own: for one thread's use."""
    pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack

    def encode_result(value: Any, req_id: int, epoch: int) -> list[bytes | memoryview]:
        try:
            return [pack([PROTOCOL_VERSION, "result", req_id, epoch, {"value": value}])]
        except (TypeError, ValueError, OverflowError):
            return encode(Result(value=value), req_id=req_id, epoch=epoch)  # arrays: side frames

    return encode_result


def _lean_header(frames: Sequence[Any], kind: str) -> list[Any] | None:
    if len(frames) != 1:
        return None
    try:
        header = msgpack.unpackb(frames[0], ext_hook=_no_side_frames)
    except Exception:  # noqa: BLE001 - decode() will say what is wrong
        return None
    if (type(header) is not list or len(header) != 5 or header[0] != PROTOCOL_VERSION or header[1] != kind
            or type(header[2]) is not int or type(header[3]) is not int or type(header[4]) is not dict):
        return None
    return header


def decode_call(frames: Sequence[Any]) -> tuple[int, int, str, dict[str, Any]] | None:
    """(request id, epoch, method, kwargs) of a one-frame Call, or None: then ``decode``."""
    header = _lean_header(frames, "call")
    if header is None:
        return None
    payload = header[4]
    method = payload.get("method")
    if type(method) is not str:
        return None
    if len(payload) == 1:
        return header[2], header[3], method, {}
    kwargs = payload.get("kwargs")
    if len(payload) != 2 or type(kwargs) is not dict:
        return None
    return header[2], header[3], method, kwargs


def decode_result(frames: Sequence[Any]) -> tuple[int, int, Any] | None:
    """(request id, epoch, value) of a one-frame Result, or None: then ``decode``."""
    header = _lean_header(frames, "result")
    if header is None:
        return None
    payload = header[4]
    if len(payload) == 1 and "value" in payload:
        return header[2], header[3], payload["value"]
    if not payload:
        return header[2], header[3], None
    return None


def decode(frames: Sequence[Any]) -> Envelope:
    """Frames → Envelope; anything malformed raises ProtocolError (and nothing else)."""
    try:
        return _decode(frames)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types on garbage; normalise them
        raise ProtocolError(f"malformed message: {type(exc).__name__}: {exc}") from None


class _Arrays:
    """msgpack ext hook: rebuilds array references over the side frames, each used once."""

    __slots__ = ("buffers", "used")

    def __init__(self, frames: Sequence[Any]) -> None:
        self.buffers = [f if isinstance(f, bytes) else memoryview(f.buffer if hasattr(f, "buffer") else f)
                        for f in frames]
        self.used: set[int] = set()

    def __call__(self, code: int, data: bytes) -> Any:
        if code != _ARRAY_EXT:
            raise ProtocolError(f"unknown msgpack extension type {code}")
        meta = msgpack.unpackb(data)
        if not (isinstance(meta, list) and len(meta) == 3):
            raise ProtocolError("bad array header")
        index, dtype_str, shape = meta
        buffers = self.buffers
        if not (isinstance(index, int) and 1 <= index < len(buffers)) or index in self.used:
            raise ProtocolError(f"array frame index {index!r} invalid for {len(buffers)} frames")
        if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ProtocolError(f"bad array shape {shape!r}")
        dtype = np.dtype(dtype_str)
        if dtype.hasobject:
            raise ProtocolError("object arrays are refused")
        self.used.add(index)
        buf = buffers[index]
        expected = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        nbytes = len(memoryview(buf).cast("B"))
        if nbytes != expected:
            raise ProtocolError(f"array frame {index} has {nbytes} bytes, header says {expected}")
        return np.frombuffer(buf, dtype=dtype).reshape(shape)


def _no_side_frames(code: int, data: bytes) -> Any:
    """ext hook of a one-frame message: any array reference points past the end."""
    if code != _ARRAY_EXT:
        raise ProtocolError(f"unknown msgpack extension type {code}")
    meta = msgpack.unpackb(data)
    index = meta[0] if isinstance(meta, list) and meta else meta
    raise ProtocolError(f"array frame index {index!r} invalid for 1 frames")


def _decode(frames: Sequence[Any]) -> Envelope:
    if not frames:
        raise ProtocolError("empty message")
    if len(frames) == 1:
        first = frames[0]
        if not isinstance(first, bytes):
            first = memoryview(first.buffer if hasattr(first, "buffer") else first)
        arrays = None
        header = msgpack.unpackb(first, ext_hook=_no_side_frames)
    else:
        arrays = _Arrays(frames)
        header = msgpack.unpackb(arrays.buffers[0], ext_hook=arrays)
    if type(header) is not list or len(header) != 5:
        if type(header) is dict and "v" in header:  # protocol 1 sent a map
            header = [header["v"]]
        else:
            raise ProtocolError(f"header is a {type(header).__name__}, not a 5-item array")
    version = header[0]
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version mismatch: peer speaks {version!r}, this side speaks {PROTOCOL_VERSION}"
        )
    _, kind, req_id, epoch, payload = header
    cls = KINDS.get(kind) if type(kind) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    if type(req_id) is not int:
        raise ProtocolError(f"{kind}: request id {req_id!r} is not an integer")
    if type(epoch) is not int:
        raise ProtocolError(f"{kind}: epoch {epoch!r} is not an integer")
    if type(payload) is not dict:
        raise ProtocolError(f"{kind}: payload is not a map")
    spec = _SPECS[cls]
    keys = payload.keys()
    if not keys <= spec.names:
        raise ProtocolError(f"{kind}: unknown fields {sorted(map(str, keys - spec.names))}")
    if not spec.required <= keys:
        raise ProtocolError(f"{kind}: missing field {sorted(spec.required - keys)[0]!r}")
    for name, types_ in spec.typed:
        if name in payload:
            value = payload[name]
            if not isinstance(value, types_) or (value.__class__ is bool and bool not in types_):
                raise ProtocolError(f"{kind}.{name}: {value!r} has the wrong type")
    if arrays is not None and len(arrays.used) != len(arrays.buffers) - 1:
        raise ProtocolError(f"{kind}: {len(arrays.buffers) - 1 - len(arrays.used)} unreferenced array frames")
    return Envelope(msg=cls(**payload), req_id=req_id, epoch=epoch)
