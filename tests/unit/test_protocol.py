from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core import protocol as p
from core.errors import ProtocolError

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
    with pytest.raises(ProtocolError, match=r"peer speaks 99, this side speaks 2"):
        p.decode([header])


def test_a_protocol_1_peer_is_told_both_versions() -> None:
    """Protocol 1 sent its header as a map: such a peer still learns what we speak."""
    header = msgpack.packb({"v": 1, "k": "heartbeat", "id": 0, "e": 0, "p": {"seq": 1}})
    with pytest.raises(ProtocolError, match=r"peer speaks 1, this side speaks 2"):
        p.decode([header])


@pytest.mark.parametrize(
    "header, fragment",
    [
        ([2, "nope", 0, 0, {}], "unknown message kind"),
        ([2, ["call"], 0, 0, {}], "unknown message kind"),
        ([2, "call", 0, 0, {}], "missing field 'method'"),
        ([2, "call", 0, 0, {"method": 3}], "wrong type"),
        ([2, "call", "x", 0, {"method": "m"}], "request id"),
        ([2, "call", 0, 1.5, {"method": "m"}], "epoch"),
        ([2, "call", 0, 0, ["m"]], "payload is not a map"),
        ([2, "call", 0, 0, {"method": "m", "evil": 1}], "unknown fields"),
        ([1, 2, 3], "not a 5-item array"),
        ({"k": "call"}, "not a 5-item array"),
    ],
)
def test_malformed_headers_are_protocol_errors(header: object, fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment):
        p.decode([msgpack.packb(header)])


def test_array_header_pointing_past_the_frames_is_refused() -> None:
    ext = msgpack.ExtType(1, msgpack.packb([5, "<f4", [2]]))
    header = msgpack.packb([2, "result", 0, 0, {"value": ext}])
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
