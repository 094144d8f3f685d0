"""The RL calls' rows as arrays (core.wire.ragged): exact round trips through the real
protocol with the arrays as side frames, malformed payloads refused as one ProtocolError
naming the field, and the row operations the controller splits and gathers with."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from core.controller.generation import Responses
from core.errors import ProtocolError
from core.flows import calls as gen_calls
from core.wire import protocol, rl_calls
from core.wire.contract import Method
from core.wire.ragged import FLOATS, TOKENS, Ragged, gathered, joined
from tests.helpers import floats, ints

P = 3  # prompt_length
SEQUENCES = [(1, 2, 3, 7, 8), (0, 4, 5, 9), (6, 6, 6)]  # responses of 2, 1 and 0 tokens
RESPONSES = [(0.5, -1.25), (2.0,), ()]
AGG = rl_calls.LossAgg(tokens=3, rows=3, horizon=4)


def _policy(**change: Any) -> rl_calls.PolicyBatch:
    fields: dict[str, Any] = dict(step=2, agg=AGG, prompt_length=P, sequences=ints(SEQUENCES),
                                  advantages=floats(RESPONSES), old_logprobs=floats(RESPONSES),
                                  ref_logprobs=floats(RESPONSES), kl_coef=0.1, pads=(0, 1, 0))
    return rl_calls.PolicyBatch(**{**fields, **change})


def _wire(method: Method[Any, Any], request: Any) -> tuple[Any, list[Any]]:
    frames = protocol.encode(protocol.Call(method=method.name, kwargs=method.encode_request(request)))
    env = protocol.decode([bytes(f) for f in frames])
    assert isinstance(env.msg, protocol.Call)
    return method.decode_request(env.msg.kwargs), frames


@pytest.mark.parametrize(("method", "request_"), [
    (rl_calls.POLICY_STEP, _policy()),
    (rl_calls.POLICY_STEP, _policy(ref_logprobs=Ragged.empty(), pads=())),
    (rl_calls.SCORE_ROWS, rl_calls.ScoreRows(model="critic", prompt_length=P, sequences=ints(SEQUENCES), mini_batch=2)),
    (rl_calls.CRITIC_STEP, rl_calls.CriticBatch(step=1, agg=AGG, prompt_length=P, sequences=ints(SEQUENCES),
                                                returns=floats(RESPONSES), old_values=floats(RESPONSES))),
    (gen_calls.GENERATE, gen_calls.Generate(prompts=ints([(1, 2), (3, 4)]), max_new_tokens=4, eos=(9,), seed=5,
                                            indices=(4, 6), pads=(1, 0))),
], ids=["policy", "policy-no-ref", "score", "critic", "generate"])
def test_a_request_round_trips_exactly_with_its_rows_as_side_frames(method: Method[Any, Any], request_: Any) -> None:
    back, frames = _wire(method, request_)
    assert back == request_ and type(back) is type(request_)
    arrays = [v for v in vars(request_).values() if isinstance(v, Ragged)]
    assert len(frames) == 1 + 2 * len(arrays)  # each Ragged: its values and its lengths, no per-number encoding
    for got, sent in zip((v for v in vars(back).values() if isinstance(v, Ragged)), arrays, strict=True):
        assert got.values.dtype == sent.values.dtype and got.lengths.dtype == TOKENS


@pytest.mark.parametrize("result", [
    rl_calls.RowScores(logprobs=floats(RESPONSES), entropy_sum=1.5, tokens=3),
    rl_calls.RowScores(values=floats(RESPONSES), tokens=3),
    rl_calls.RowScores(),
    gen_calls.Generated(replica=1, version=7, tokens=ints([(4, 5), (6,)]), logprobs=floats([(-0.5, -1.0), (-2.0,)])),
    gen_calls.Generated(),
], ids=["actor", "critic", "not-an-owner", "generated", "empty"])
def test_a_result_round_trips_exactly(result: Any) -> None:
    method = rl_calls.SCORE_ROWS if isinstance(result, rl_calls.RowScores) else gen_calls.GENERATE
    frames = protocol.encode(protocol.Result(value=method.encode_result(result)))
    env = protocol.decode([bytes(f) for f in frames])
    assert isinstance(env.msg, protocol.Result) and method.decode_result(env.msg.value) == result


def test_the_header_does_not_grow_with_the_rows() -> None:
    big = [tuple(range(P + 4000))] * 64
    frames = protocol.encode(protocol.Call(method="policy_step", kwargs=rl_calls.POLICY_STEP.encode_request(
        _policy(sequences=ints(big), advantages=floats([np.ones(4000)] * 64), old_logprobs=floats([np.ones(4000)] * 64),
                ref_logprobs=Ragged.empty(), pads=()))))
    per_row = (P + 4000) * 4 + 2 * 4000 * 4 + 3 * 4  # int32 tokens, two float32 rows, three int32 lengths
    assert len(frames[0]) < 1024 and sum(len(memoryview(f).cast("B")) for f in frames[1:]) == 64 * per_row


def _kwargs(**fields: Any) -> dict[str, Any]:
    data = rl_calls.POLICY_STEP.encode_request(_policy())
    for name, value in fields.items():
        data[name] = value
    return data


def _ragged(values: Any, lengths: Any) -> dict[str, Any]:
    """A Ragged as it arrives (lengths given as a list: int32, as sent)."""
    return {"values": np.asarray(values), "lengths": np.asarray(lengths, dtype=None if isinstance(lengths, np.ndarray)
                                                                      else np.int32)}


@pytest.mark.parametrize(("field", "bad", "says"), [
    ("sequences", _ragged(np.arange(12, dtype=np.int64), [5, 4, 3]), "PolicyBatch.sequences: values must be int32, got int64"),
    ("advantages", _ragged(np.zeros(3), [2, 1, 0]), "PolicyBatch.advantages: values must be float32, got float64"),
    ("advantages", _ragged(np.zeros(3, np.float32), [1, 2, 0]),
     "PolicyBatch.advantages: row 0 has 1 values for 2 response tokens"),
    ("old_logprobs", _ragged(np.zeros(2, np.float32), np.array([2], np.int32)),
     "PolicyBatch.old_logprobs: 1 rows for 3"),
    ("ref_logprobs", _ragged(np.zeros(4, np.float32), np.array([2, 1, 0], np.int32)),
     "Ragged: the row lengths add up to 3, there are 4 values"),
    ("advantages", _ragged(np.zeros(3, np.float32), np.array([4, -1, 0], np.int32)), "Ragged: a negative row length -1"),
    ("advantages", _ragged(np.zeros(3, np.float32), np.array([2, 1, 0], np.int64)),
     "Ragged: lengths must be int32, got int64"),
    ("sequences", _ragged(np.zeros((3, 4), np.int32), np.array([4, 4, 4], np.int32)),
     "Ragged: values and lengths must be 1-D"),
    ("sequences", {"values": [1, 2], "lengths": np.array([2], np.int32)},
     "policy_step request.sequences.values: [1, 2] is not a numpy.ndarray"),
    ("advantages", ((0.5, -1.25), (2.0,), ()), "policy_step request.advantages: expected a mapping"),
    ("pads", (0, 1), "PolicyBatch.pads: 2 pad counts for 3 rows"),
    ("prompt_length", 4, "PolicyBatch.sequences: a row of 3 tokens, shorter than prompt_length = 4"),
])
def test_a_malformed_payload_is_one_protocol_error_naming_the_field(field: str, bad: Any, says: str) -> None:
    data = _kwargs(**{field: bad})
    with pytest.raises(ProtocolError) as info:
        rl_calls.POLICY_STEP.decode_request(data)
    message = str(info.value)
    assert message.startswith("policy_step request") and says in message and "\n" not in message, message


def test_a_malformed_result_is_refused_naming_the_field() -> None:
    data = gen_calls.GENERATE.encode_result(gen_calls.Generated(replica=0, version=1, tokens=ints([(4, 5)]),
                                                                logprobs=floats([(-0.5, -1.0)])))
    data["logprobs"] = _ragged(np.zeros(1, np.float32), np.array([1], np.int32))
    with pytest.raises(ProtocolError, match=r"^generate result: Generated.logprobs: row 0 has 1 values for 2 tokens$"):
        gen_calls.GENERATE.decode_result(data)
    with pytest.raises(ProtocolError, match=r"^Generate.pads: 1 for 2 prompts$"):
        gen_calls.Generate(prompts=ints([(1,), (2,)]), max_new_tokens=1, pads=(0,))


def test_a_frame_shorter_than_its_array_header_is_refused() -> None:
    frames = [bytes(f) for f in protocol.encode(protocol.Call(
        method="policy_step", kwargs=rl_calls.POLICY_STEP.encode_request(_policy())))]
    frames[1] = frames[1][:-4]
    with pytest.raises(ProtocolError, match="array frame 1 has"):
        protocol.decode(frames)


# --- the row operations ----------------------------------------------------------------------
def test_rows_split_by_replica_and_gathered_back_are_the_rows() -> None:
    whole = ints([(1, 2, 3), (4,), (), (5, 6), (7, 8, 9, 10)])
    for dp in (1, 2, 3, 5, 7):
        shares = [np.arange(len(whole))[d::dp] for d in range(dp)]
        parts = [whole.take(s) for s in shares]
        assert [p.tolist() for p in parts] == [whole.tolist()[d::dp] for d in range(dp)]
        assert gathered(parts, shares) == whole
    assert whole.take(slice(1, 3)).tolist() == [(4,), ()] and whole.take([4, 0]).tolist() == [(7, 8, 9, 10), (1, 2, 3)]
    assert len(whole.take([])) == 0 and whole.take([]).tolist() == [] and list(Ragged.empty()) == []
    with pytest.raises(ValueError, match="part 1 has 2 rows, it should hold 1"):
        gathered([whole.take([0]), whole.take([1, 2])], [[0], [1]])


def test_joined_rows_are_each_prompt_followed_by_its_response() -> None:
    prompts, responses = ints([(1, 2), (3, 4)]), ints([(9,), (8, 7, 6)])
    assert joined(prompts, responses).tolist() == [(1, 2, 9), (3, 4, 8, 7, 6)]
    assert joined(prompts, responses).values.dtype == TOKENS


def test_a_response_ends_at_its_first_stop_token_and_its_log_probs_with_it() -> None:
    done = Responses(ints([(5, 9, 6, 9), (5, 6, 7), (8, 1, 2)]),
                     floats([(-1.0, -2.0, -3.0, -4.0), (-1.0, -1.5, -2.5), (-0.5, 0.0, 0.0)]))
    cut = done.until((9, 8))
    assert cut.tokens.tolist() == [(5, 9), (5, 6, 7), (8,)]
    assert cut.logprobs.tolist() == [(-1.0, -2.0), (-1.0, -1.5, -2.5), (-0.5,)]
    assert cut.tokens.values.dtype == TOKENS and cut.logprobs.values.dtype == FLOATS
    assert done.until(()) is done


def test_the_numbers_are_the_float32_values_the_workers_computed_in_before() -> None:
    """The controller's float64 numbers (GRPO's advantages, GAE's returns) become float32 on
    the controller now, where the worker cast them before: the same values arrive."""
    rng = np.random.default_rng(0)
    numbers = rng.normal(size=50)
    before = np.zeros(50, np.float32)
    before[:] = tuple(float(x) for x in numbers)  # the worker's fill of a float32 array from a tuple
    assert np.array_equal(floats([numbers]).values, before)
    assert Ragged.of([np.float32([1.5, -2.25])], FLOATS).tolist() == [(1.5, -2.25)]  # exact as Python floats
