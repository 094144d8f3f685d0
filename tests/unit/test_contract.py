"""Typed call contracts (core.wire.contract): every method's request and result round-trip through
the real msgpack protocol, and a malformed one is a one-line error naming the method and the field."""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.checkpoint import calls as ckpt_calls
from core.errors import ProtocolError
from core.flows import calls as gen_calls
from core.model import toy
from core.wire import calls, protocol, rl_calls
from core.wire.contract import Method
from core.wire.ragged import FLOATS, TOKENS, Ragged

METHODS: list[Method[Any, Any]] = [
    calls.SETUP, calls.TRAIN_STEP, calls.EVAL_STEP, calls.LOAD_WEIGHTS, calls.SAVE_WEIGHTS,
    ckpt_calls.CKPT_SAVE, ckpt_calls.CKPT_POLL, ckpt_calls.CKPT_WAIT, ckpt_calls.CKPT_LOAD,
    toy.NOOP, toy.ECHO, toy.FAIL, toy.SLEEP, toy.PID, toy.GET_STATE, toy.SET_STATE,
    gen_calls.GENERATE, gen_calls.SCORE, rl_calls.POLICY_STEP, rl_calls.SCORE_ROWS, rl_calls.CRITIC_STEP,
    gen_calls.PROBE_BATCH, gen_calls.BRIDGE, gen_calls.GEN_PROMPTS,
]
_text = st.text(max_size=6)
_float = st.floats(allow_nan=False)


def values(tp: Any) -> st.SearchStrategy[Any]:
    """Values of the annotation ``tp`` (``Any`` fields get msgpack-plain values that compare with ==)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return st.none() | st.integers(-9, 9) | _text | st.lists(st.integers(0, 9), max_size=3)
    if origin in (Union, types.UnionType):
        return st.one_of([values(a) for a in args])
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is tuple:
        return st.lists(values(args[0]), max_size=3).map(tuple)
    if origin is dict:
        return st.dictionaries(_text, values(args[1]), max_size=3)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        if Ragged in hints.values():
            return _with_rows(tp)
        return st.builds(tp, **{f.name: values(hints[f.name]) for f in dataclasses.fields(tp)})
    return {int: st.integers(-2**40, 2**40), float: _float, str: _text, bool: st.booleans(),
            type(None): st.none()}[tp]


# The RL calls' rows (core.wire.ragged) agree with each other: token rows of prompt + response,
# per-token float32 rows of each response's length, one pad count and index per row.
_RESPONSE_FIELDS = {"advantages", "old_logprobs", "ref_logprobs", "returns", "old_values", "logprobs", "values"}


@st.composite
def _with_rows(draw: st.DrawFn, tp: Any) -> Any:
    """A message of ``tp`` whose ``Ragged`` fields are rows that agree (as its checks demand)."""
    hints = typing.get_type_hints(tp)
    rows = draw(st.integers(0, 3))
    prompt = draw(st.integers(0, 3))
    responses = draw(st.lists(st.integers(0, 4), min_size=rows, max_size=rows))
    token = st.integers(-2**31, 2**31 - 1)
    number = st.floats(allow_nan=False, width=32)

    def rows_of(element: st.SearchStrategy[Any], lengths: list[int], dtype: Any) -> Ragged:
        return Ragged.of([draw(st.lists(element, min_size=n, max_size=n)) for n in lengths], dtype)

    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(tp):
        if f.name == "prompt_length":
            kwargs[f.name] = prompt
        elif f.name in ("sequences", "prompts"):
            kwargs[f.name] = rows_of(token, [prompt + (n if f.name == "sequences" else 0) for n in responses], TOKENS)
        elif f.name == "tokens" and hints[f.name] is Ragged:
            kwargs[f.name] = rows_of(token, responses, TOKENS)
        elif f.name in _RESPONSE_FIELDS:
            kwargs[f.name] = rows_of(number, responses, FLOATS) if f.name != "ref_logprobs" or draw(st.booleans()) \
                else Ragged.empty()
        elif f.name in ("pads", "indices"):
            kwargs[f.name] = draw(st.sampled_from([(), tuple(range(rows))]))
        else:
            kwargs[f.name] = draw(values(hints[f.name]))
    return tp(**kwargs)


def sample(tp: Any) -> Any:
    """One plain, well-formed value of the annotation ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return sample(args[0])
    if origin is typing.Literal:
        return args[0]
    if origin is tuple:
        return (sample(args[0]),)
    if origin is dict:
        return {"k": sample(args[1])}
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        if Ragged in hints.values():  # one row: a prompt of 1 token (prompt_length 1), a response of 1
            return tp(**{f.name: _one_row(f.name) if hints[f.name] is Ragged else sample(hints[f.name])
                         for f in dataclasses.fields(tp)})
        return tp(**{f.name: sample(hints[f.name]) for f in dataclasses.fields(tp)})
    return {int: 1, float: 1.5, str: "s", bool: True, type(None): None}.get(tp, 3)


def _one_row(name: str) -> Ragged:
    if name in _RESPONSE_FIELDS:
        return Ragged.of([[1.5]], FLOATS)
    return Ragged.of([[3, 3] if name == "sequences" else [3]], TOKENS)


def _over_the_wire(frames: list[Any]) -> protocol.Envelope:
    return protocol.decode([bytes(f) if isinstance(f, memoryview) else f for f in frames])


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_request_and_result_round_trips_through_msgpack(method: Method[Any, Any], data: st.DataObject) -> None:
    request = data.draw(values(method.request))
    env = _over_the_wire(protocol.encode(protocol.Call(method=method.name, kwargs=method.encode_request(request))))
    assert isinstance(env.msg, protocol.Call) and method.decode_request(env.msg.kwargs) == request
    result = data.draw(values(method.result) if method.result is not None else st.none())
    env = _over_the_wire(protocol.encode(protocol.Result(value=method.encode_result(result))))
    assert isinstance(env.msg, protocol.Result) and method.decode_result(env.msg.value) == result


def _wrong(tp: Any) -> Any:
    """A value that is not of ``tp`` (None where ``tp`` takes anything)."""
    if tp is Any:
        return None
    if tp is str:
        return 5
    if typing.get_origin(tp) in (Union, types.UnionType) and str in typing.get_args(tp):
        return 5.5 if float not in typing.get_args(tp) else [5]
    return "not-a-number"


def _malformed_requests() -> list[tuple[Method[Any, Any], str, Any]]:
    out = []
    for m in METHODS:
        hints = typing.get_type_hints(m.request)
        for f in dataclasses.fields(m.request):
            if (bad := _wrong(hints[f.name])) is not None:
                out.append((m, f.name, bad))
    return out


@pytest.mark.parametrize(("method", "field", "bad"), _malformed_requests(),
                         ids=lambda x: x.name if isinstance(x, Method) else str(x))
def test_a_malformed_request_field_is_one_line_naming_the_method_and_the_field(method: Method[Any, Any],
                                                                               field: str, bad: Any) -> None:
    good = sample(method.request)
    kwargs = {**method.encode_request(good), field: bad}
    with pytest.raises(ProtocolError) as info:
        method.decode_request(kwargs)
    message = str(info.value)
    assert f"{method.name} request.{field}" in message and "\n" not in message


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_unknown_and_missing_request_fields_are_refused_by_name(method: Method[Any, Any]) -> None:
    good = method.encode_request(sample(method.request))
    with pytest.raises(ProtocolError, match=f"{method.name} request"):
        method.decode_request({**good, "evil": 1})
    required = [f.name for f in dataclasses.fields(method.request)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for name in required:
        with pytest.raises(ProtocolError, match=rf"{method.name} request\.{name}: missing"):
            method.decode_request({k: v for k, v in good.items() if k != name})


@pytest.mark.parametrize("method", [m for m in METHODS if m.result is not Any], ids=lambda m: m.name)
def test_a_malformed_result_is_one_line_naming_the_method(method: Method[Any, Any]) -> None:
    bad = "not-a-result" if method.result in (None, int, float) or dataclasses.is_dataclass(method.result) else 7
    with pytest.raises(ProtocolError) as info:
        method.decode_result(bad)
    assert info.value.args[0].startswith(f"{method.name} result") and "\n" not in str(info.value)


def test_a_malformed_field_deep_in_a_result_is_named_by_its_path() -> None:
    ack = sample(ckpt_calls.ShardAck)
    data = ckpt_calls.CKPT_WAIT.encode_result(ack)
    data["slices"][0]["offset"] = "x"
    with pytest.raises(ProtocolError, match=r"ckpt_wait result\.slices\[0\]\.offset: 'x' is not"):
        ckpt_calls.CKPT_WAIT.decode_result(data)


def test_a_request_of_another_type_is_refused_before_it_is_sent() -> None:
    with pytest.raises(TypeError, match="train_step: request must be a Step, got Sleep"):
        calls.TRAIN_STEP.encode_request(toy.Sleep(seconds=1.0))
