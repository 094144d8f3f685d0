from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import ProtocolError
from core.wire import protocol as p

V = p.PROTOCOL_VERSION

EXAMPLES = [
    p.Register(rank_hint=3, host="h", node="node2", pid=12, rendezvous_port=29500),
    p.Welcome(rank=3, world_size=8, heartbeat_interval_s=0.25, controller_lost_s=10.0, master_addr="h", master_port=1),
    p.Refuse(reason="stale epoch"),
    p.Call(method="train_step", kwargs={"step": 7, "nested": {"a": [1, 2.5, None, "x"]}}),
    p.Result(value={"loss": 1.5, "ok": True}),
    p.Error(exc_type="RuntimeError", message="boom", traceback="Traceback ..."),
    p.Heartbeat(seq=9, busy="train_step", rss_mb=123.5),
    p.Abort(reason="lost rank 2"),
    p.Shutdown(reason="done"),
    p.Log(level=20, message="hello"),
]


def test_every_kind_is_exercised() -> None:
    assert {type(m) for m in EXAMPLES} == set(p.KINDS.values())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_every_kind(msg: p.Message) -> None:
    env = p.decode([bytes(f) for f in p.encode(msg, req_id=42, epoch=3)])
    assert env.msg == msg and env.req_id == 42 and env.epoch == 3


def test_arrays_travel_as_separate_zero_copy_frames() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.array([[1, 2]], dtype=np.int64).T  # not contiguous in C order after .T? made contiguous by encode
    frames = p.encode(p.Call(method="m", kwargs={"a": a, "b": b, "empty": np.zeros((0, 3))}))
    assert len(frames) == 4
    assert bytes(frames[1]) == a.tobytes()  # raw buffer, no msgpack wrapping
    out = p.decode(frames).msg.kwargs
    np.testing.assert_array_equal(out["a"], a)
    np.testing.assert_array_equal(out["b"], b)
    assert out["empty"].shape == (0, 3)
    assert out["a"].dtype == np.float32


def test_version_mismatch_names_both_versions() -> None:
    header = msgpack.packb([99, "heartbeat", 0, 0, {"seq": 1}])
    with pytest.raises(ProtocolError, match=rf"peer speaks 99, this side speaks {p.PROTOCOL_VERSION}"):
        p.decode([header])


def test_a_protocol_1_peer_is_told_both_versions() -> None:
    """Protocol 1 sent its header as a map: such a peer still learns what we speak."""
    header = msgpack.packb({"v": 1, "k": "heartbeat", "id": 0, "e": 0, "p": {"seq": 1}})
    with pytest.raises(ProtocolError, match=rf"peer speaks 1, this side speaks {p.PROTOCOL_VERSION}"):
        p.decode([header])


@pytest.mark.parametrize(
    "header, fragment",
    [
        ([V, "nope", 0, 0, {}], "unknown message kind"),
        ([V, ["call"], 0, 0, {}], "unknown message kind"),
        ([V, "call", 0, 0, {}], "missing field 'method'"),
        ([V, "call", 0, 0, {"method": 3}], "wrong type"),
        ([V, "call", "x", 0, {"method": "m"}], "request id"),
        ([V, "call", 0, 1.5, {"method": "m"}], "epoch"),
        ([V, "call", 0, 0, ["m"]], "payload is not a map"),
        ([V, "call", 0, 0, {"method": "m", "evil": 1}], "unknown fields"),
        ([1, 2, 3], "not a 5-item array"),
        ({"k": "call"}, "not a 5-item array"),
    ],
)
def test_malformed_headers_are_protocol_errors(header: object, fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment):
        p.decode([msgpack.packb(header)])


def test_array_header_pointing_past_the_frames_is_refused() -> None:
    ext = msgpack.ExtType(1, msgpack.packb([5, "<f4", [2]]))
    header = msgpack.packb([V, "result", 0, 0, {"value": ext}])
    with pytest.raises(ProtocolError, match="frame index"):
        p.decode([header])


def test_object_arrays_and_unknown_types_cannot_be_sent() -> None:
    with pytest.raises(ProtocolError):
        p.encode(p.Result(value=np.array([object()], dtype=object)))
    with pytest.raises(ProtocolError):
        p.encode(p.Result(value={1, 2}))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=4))
def test_decode_of_random_frames_only_raises_protocol_error(frames: list[bytes]) -> None:
    try:
        p.decode(frames)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(EXAMPLES), st.data())
def test_decode_of_truncated_or_flipped_frames_only_raises_protocol_error(msg: p.Message, data: st.DataObject) -> None:
    raw = bytearray(bytes(p.encode(msg)[0]))
    cut = data.draw(st.integers(min_value=0, max_value=len(raw)))
    mutated = raw[:cut]
    if mutated and data.draw(st.booleans()):
        i = data.draw(st.integers(min_value=0, max_value=len(mutated) - 1))
        mutated[i] ^= data.draw(st.integers(min_value=1, max_value=255))
    try:
        env = p.decode([bytes(mutated)])
    except ProtocolError:
        return
    assert type(env.msg) in p.KINDS.values()  # a lucky mutation may still be a valid message


# --- the lean paths of Call and Result ----------------------------------------------------
_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
_headers = st.tuples(
    st.sampled_from([V, 1, float(V), True, str(V)]),
    st.sampled_from(["call", "result", "heartbeat", 3]),
    st.integers(0, 2**40) | st.text(max_size=2) | st.none(),
    st.integers(0, 9) | st.floats(allow_nan=False),
    st.dictionaries(st.sampled_from(["method", "kwargs", "value", "evil"]),
                    _values | st.dictionaries(st.text(max_size=4), _values, max_size=3), max_size=3) | _values,
)


@settings(max_examples=500, deadline=None)
@given(_headers)
def test_lean_paths_accept_only_what_decode_accepts_and_agree_with_it(header: tuple) -> None:
    frames = [msgpack.packb(list(header))]
    try:
        env = p.decode(frames)
    except ProtocolError:
        env = None
    call, result = p.decode_call(frames), p.decode_result(frames)
    if call is not None:
        assert env is not None and type(env.msg) is p.Call
        assert call == (env.req_id, env.epoch, env.msg.method, env.msg.kwargs)
    if result is not None:
        assert env is not None and type(env.msg) is p.Result
        assert result == (env.req_id, env.epoch, env.msg.value)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=12), st.dictionaries(st.text(max_size=6), _values, max_size=4), _values,
       st.integers(0, 2**40), st.integers(0, 99))
def test_lean_paths_take_every_one_frame_call_and_result(method: str, kwargs: dict, value: object,
                                                          req_id: int, epoch: int) -> None:
    frames = p.encode(p.Call(method=method, kwargs=kwargs), req_id=req_id, epoch=epoch)
    assert p.decode_call(frames) == (req_id, epoch, method, kwargs)
    assert p.decode_result(frames) is None
    encode_result = p.result_encoder()
    frames = encode_result(value, req_id, epoch)
    assert frames == p.encode(p.Result(value=value), req_id=req_id, epoch=epoch)
    assert p.decode_result(frames) == (req_id, epoch, value)
    assert p.decode_call(frames) is None


def test_lean_paths_leave_arrays_and_garbage_to_decode() -> None:
    frames = p.encode(p.Call(method="m", kwargs={"a": np.arange(3)}))
    assert len(frames) == 2 and p.decode_call(frames) is None
    encode_result = p.result_encoder()
    frames = encode_result(np.arange(3), 1, 0)  # falls back to side frames
    assert len(frames) == 2 and p.decode_result(frames) is None
    np.testing.assert_array_equal(p.decode(frames).msg.value, np.arange(3))
    assert p.decode_call([b"\xc1"]) is None and p.decode_result([]) is None
