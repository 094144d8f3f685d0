"""core.controller.rollouts: the fixed schedule of rl.max_staleness (which step's rollout is
started when, from which policy) and the rollouts a checkpoint keeps (rollouts.npz).

The schedule is driven here the way RLStep._rollout drives it (a block's first step: wait for
the rollouts in flight, sync, start the next; every step: take its own) and checked against
the documented formula, written out independently: step s's rollout comes from policy w at the
RL phase's first step w, else from the last block start before s, w + k·⌊(s - w - 1) / k⌋.
The rollouts in flight stand in for the generator's group call (their ``wait`` gives the
responses); the responses themselves are real ``Responses`` of ``Ragged`` rows.
"""
from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from core.controller.generation import Responses
from core.controller.rollouts import ATTACHMENT, Rollout, Rollouts
from core.errors import CheckpointError, WorkerLostError
from core.wire.ragged import FLOATS, TOKENS, Ragged

WARM = 30  # the RL phase's first step (rl.warmup_steps of experiments/grpo_tiny.yaml)


def responses_of(step: int) -> Responses:
    """Step ``step``'s responses: rows of 0..9 tokens, any int32 token and any float32 bit
    pattern as a log-prob (NaN payloads, infinities, -0.0, subnormals), so that only a
    bit-exact copy compares equal."""
    rng = np.random.default_rng(step)
    lengths = rng.integers(0, 10, size=6).astype(TOKENS)
    lengths[2] = 0  # an empty row
    n = int(lengths.sum())
    tokens = rng.integers(np.iinfo(np.int32).min, np.iinfo(np.int32).max, size=n, dtype=np.int64).astype(TOKENS)
    logprobs = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32).view(FLOATS)
    return Responses(Ragged(values=tokens, lengths=lengths), Ragged(values=logprobs, lengths=lengths.copy()))


def same_bits(a: Responses, b: Responses) -> bool:
    return all(x.values.dtype == y.values.dtype and x.values.tobytes() == y.values.tobytes()
               and x.lengths.dtype == y.lengths.dtype and np.array_equal(x.lengths, y.lengths)
               for x, y in ((a.tokens, b.tokens), (a.logprobs, b.logprobs)))


class InFlight:
    """A rollout started on the generator: its responses once waited for."""

    def __init__(self, step: int) -> None:
        self.step, self.waits = step, 0

    def done(self) -> bool:
        return self.waits > 0

    def wait(self) -> Responses:
        self.waits += 1
        return responses_of(self.step)


@dataclass
class Trace:
    started: list[tuple[int, int, int]] = field(default_factory=list)  # (rollout's step, version, started at)
    trained: list[tuple[int, int, Responses]] = field(default_factory=list)  # (step, version, responses)
    synced: list[int] = field(default_factory=list)


def drive(rollouts: Rollouts, start: int, stop: int, total: int, trace: Trace) -> None:
    """Steps ``start`` .. ``stop - 1`` of a run of ``total`` steps, as RLStep._rollout runs them."""
    for step in range(start, stop):
        if rollouts.block_starts(step):
            rollouts.drain()
            assert all(r.pending is None and r.done is not None for r in rollouts.by_step.values())  # idle
            trace.synced.append(step)
            for ahead in rollouts.to_start(step, total):
                trace.started.append((ahead, step, step))
                rollouts.add(ahead, step, InFlight(ahead))  # type: ignore[arg-type]
        assert len(rollouts.by_step) <= rollouts.k + 1
        rollout = rollouts.take(step)
        assert step not in rollouts.by_step
        trace.trained.append((step, rollout.version, rollout.wait()))


def expected_version(step: int, k: int, w: int = WARM) -> int:
    return w if step == w else w + k * ((step - w - 1) // k)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("total", [WARM + 1, WARM + 2, WARM + 7, WARM + 9])
def test_every_rollout_is_started_once_at_a_block_start_from_that_steps_policy(k: int, total: int) -> None:
    trace = Trace()
    rollouts = Rollouts(k, WARM)
    drive(rollouts, WARM, total, total, trace)
    steps = range(WARM, total)
    assert sorted(s for s, _, _ in trace.started) == list(steps)  # each exactly once, none past the end
    blocks = [t for t in steps if (t - WARM) % k == 0]
    assert trace.synced == blocks
    for s, version, at in trace.started:
        assert at == version == expected_version(s, k) and at in blocks
        assert at <= s  # never started after its own step
    assert [(s, v) for s, v, _ in trace.trained] == [(s, expected_version(s, k)) for s in steps]
    staleness = [s - v for s, v, _ in trace.trained]
    assert max(staleness) <= k and staleness[0] == 0
    assert staleness[1:] == [1 + (s - WARM - 1) % k for s in steps[1:]]  # 1 .. k within a block
    assert all(same_bits(r, responses_of(s)) for s, _, r in trace.trained)
    assert rollouts.by_step == {} and rollouts.to_bytes() is None  # nothing left at the end


def test_one_step_off_policy_at_k_1_and_blocks_at_k_3() -> None:
    """The documented examples written out: k = 1, rollout s + 1 from policy s; k = 3, three
    rollouts per sync, started at the block's first step."""
    trace = Trace()
    drive(Rollouts(1, WARM), WARM, WARM + 4, WARM + 4, trace)
    assert trace.started == [(30, 30, 30), (31, 30, 30), (32, 31, 31), (33, 32, 32)]
    trace = Trace()
    drive(Rollouts(3, WARM), WARM, WARM + 8, WARM + 8, trace)
    assert trace.started == [(30, 30, 30), (31, 30, 30), (32, 30, 30), (33, 30, 30),
                             (34, 33, 33), (35, 33, 33), (36, 33, 33), (37, 36, 36)]
    assert [s - v for s, v, _ in trace.trained] == [0, 1, 2, 3, 1, 2, 3, 1]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_resume_at_any_step_trains_on_what_the_uninterrupted_run_did(k: int, tmp_path: Path) -> None:
    """A checkpoint after any step keeps the rollouts started and not yet trained on; a run
    restored from it (a new Rollouts, as a new controller has) starts the rest of the schedule
    and trains on the same responses from the same policies, bit for bit."""
    total = WARM + 8
    whole = Trace()
    drive(Rollouts(k, WARM), WARM, total, total, whole)
    where = tmp_path / "step_00000033" / ATTACHMENT
    for cut in range(WARM + 1, total):
        before, after = Trace(), Trace()
        first = Rollouts(k, WARM)
        drive(first, WARM, cut, total, before)
        kept = sorted(first.by_step)
        data = first.to_bytes()
        assert data is not None and kept and kept[0] == cut and len(kept) <= k  # steps cut .. cut + k - 1 at most
        resumed = Rollouts(k, WARM)
        resumed.restore(data, where=where)
        assert sorted(resumed.by_step) == kept
        assert all(r.pending is None and r.done is not None for r in resumed.by_step.values())  # complete
        drive(resumed, cut, total, total, after)
        assert before.started + after.started == whole.started, cut  # the rest started once, as before
        trained = before.trained + after.trained
        assert [(s, v) for s, v, _ in trained] == [(s, v) for s, v, _ in whole.trained], cut
        assert all(same_bits(a, b) for (_, _, a), (_, _, b) in zip(trained, whole.trained, strict=True)), cut


def test_the_rollouts_round_trip_bit_for_bit(tmp_path: Path) -> None:
    rollouts = Rollouts(2, WARM)
    rollouts.by_step = {36: Rollout(36, 34, done=responses_of(36)), 37: Rollout(37, 36, done=responses_of(37)),
                        38: Rollout(38, 36, pending=InFlight(38))}  # type: ignore[arg-type]
    data = rollouts.to_bytes()
    assert data is not None
    assert rollouts.by_step[38].done is not None  # the one in flight was waited for
    with np.load(io.BytesIO(data), allow_pickle=False) as z:  # what the file holds, read independently
        assert z["steps"].tolist() == [36, 37, 38] and z["versions"].tolist() == [34, 36, 36]
        assert z["37.tokens.values"].dtype == TOKENS and z["37.logprobs.values"].dtype == FLOATS
    back = Rollouts(2, WARM)
    back.restore(data, where=tmp_path / ATTACHMENT)
    assert sorted(back.by_step) == [36, 37, 38]
    for s, version in ((36, 34), (37, 36), (38, 36)):
        got = back.by_step[s]
        assert (got.step, got.version) == (s, version) and isinstance(got.step, int) and isinstance(got.version, int)
        assert got.done is not None and same_bits(got.done, responses_of(s))
        assert got.done.tokens == responses_of(s).tokens  # Ragged's own comparison agrees (no NaN in tokens)
    again = back.to_bytes()  # written again: the same arrays (the zip's timestamps aside)
    assert again is not None and _arrays(again) == _arrays(data)


def _arrays(data: bytes) -> dict[str, tuple[str, bytes]]:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {name: (z[name].dtype.str, z[name].tobytes()) for name in z.files}


def _npz(**arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _damaged() -> dict[str, bytes]:
    rollouts = Rollouts(1, WARM)
    rollouts.by_step = {31: Rollout(31, 30, done=responses_of(31))}
    good = rollouts.to_bytes()
    assert good is not None
    with np.load(io.BytesIO(good), allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files}
    flipped = bytearray(good)
    member = good.index(b"31.tokens.values.npy") + 200  # inside that member's data
    flipped[member] ^= 0xFF
    return {
        "truncated": good[: len(good) // 2],
        "a flipped byte": bytes(flipped),
        "not an npz": b"rollouts" * 16,
        "empty": b"",
        "a missing array": _npz(**{k: v for k, v in arrays.items() if k != "31.logprobs.values"}),
        "lengths that do not add up": _npz(**{**arrays, "31.tokens.lengths": arrays["31.tokens.lengths"] + 1}),
        "more versions than steps": _npz(**{**arrays, "versions": np.array([30, 30], dtype=np.int64)}),
        "int64 tokens": _npz(**{**arrays, "31.tokens.values": arrays["31.tokens.values"].astype(np.int64)}),
        "float64 log-probs": _npz(**{**arrays, "31.logprobs.values": arrays["31.logprobs.values"].astype(np.float64)}),
    }


@pytest.mark.parametrize("damage", list(_damaged()))
def test_a_damaged_rollouts_file_is_a_checkpoint_error_naming_it(damage: str, tmp_path: Path) -> None:
    where = tmp_path / "step_00000031" / ATTACHMENT
    rollouts = Rollouts(1, WARM)
    before = {40: Rollout(40, 39, done=responses_of(40))}
    rollouts.by_step = dict(before)
    with pytest.raises(CheckpointError) as err:
        rollouts.restore(_damaged()[damage], where=where)
    assert str(err.value).startswith(f"{where}: the rollouts the checkpoint kept cannot be read ("), err.value
    assert "\n" not in str(err.value)
    assert rollouts.by_step == before  # nothing half-restored


def test_the_flipped_byte_lands_in_a_member_the_restore_reads() -> None:
    """The damage above is real: the zip's own check sees it (independently of Baton)."""
    with zipfile.ZipFile(io.BytesIO(_damaged()["a flipped byte"])) as z:
        assert z.testzip() == "31.tokens.values.npy"


def test_kept_rollouts_of_other_settings_or_off_the_schedule_are_generated_again(tmp_path: Path,
                                                                                  caplog: pytest.LogCaptureFixture
                                                                                  ) -> None:
    """A resume that changed what the rollouts depend on (another key: the seed, the sampling,
    the lengths) or rl.max_staleness (their versions are not the new schedule's) keeps none
    of them, with a warning: the schedule then starts them again from the resumed step."""
    saved = Rollouts(2, WARM, key="abc")
    saved.by_step = {36: Rollout(36, 34, done=responses_of(36)), 37: Rollout(37, 36, done=responses_of(37))}
    data = saved.to_bytes()
    assert data is not None
    same = Rollouts(2, WARM, key="abc")
    same.restore(data, where=tmp_path / ATTACHMENT)
    assert sorted(same.by_step) == [36, 37]
    for changed in (Rollouts(2, WARM, key="xyz"), Rollouts(1, WARM, key="abc")):
        caplog.clear()
        changed.restore(data, where=tmp_path / ATTACHMENT)
        assert changed.by_step == {} and changed.block_starts(36)
        assert "generated again" in caplog.text and str(tmp_path / ATTACHMENT) in caplog.text
    assert "not rl.max_staleness = 1's" in caplog.text  # the second: versions 34, 36 are not k = 1's 35, 36


@pytest.mark.parametrize("k", [1, 2, 3])
def test_version_of_is_the_documented_formula(k: int) -> None:
    rollouts = Rollouts(k, WARM)
    assert [rollouts.version_of(s) for s in range(WARM, WARM + 10)] == [
        expected_version(s, k) for s in range(WARM, WARM + 10)]


def test_ready_says_whether_the_rollouts_in_flight_ended_within_the_time_given() -> None:
    rollouts = Rollouts(1, WARM)
    flight = InFlight(31)
    rollouts.by_step = {31: Rollout(31, 30, pending=flight)}  # type: ignore[arg-type]
    assert not rollouts.ready(0.0, poll_s=0.0)  # not answered: a stop would not wait for it
    flight.waits = 1  # its answers arrived
    assert rollouts.ready(0.0, poll_s=0.0)


class LostOnce(InFlight):
    """A rollout whose generator's workers were lost: its wait raises WorkerLostError."""

    def wait(self) -> Responses:
        self.waits += 1
        raise WorkerLostError("lost 1 worker(s): rank 2 (pid 9 on n1): process exited", ranks=[2])


def test_a_rollout_whose_generator_was_lost_is_started_again_and_waited_for() -> None:
    """``on_lost`` (RLStep: restart the generator alone) starts every rollout in flight again;
    the wait then goes on with the new one, and the rollout leaves the queue only once done."""
    seen: list[tuple[list[int], list[int]]] = []  # (the lost ranks, the steps queued meanwhile)

    def on_lost(exc: WorkerLostError) -> None:
        seen.append((exc.ranks, sorted(rollouts.by_step)))
        for r in rollouts.by_step.values():
            if r.done is None:
                r.pending = InFlight(r.step)  # type: ignore[assignment]

    rollouts = Rollouts(2, WARM, on_lost=on_lost)
    lost31, lost32 = LostOnce(31), LostOnce(32)
    rollouts.add(31, 30, lost31)  # type: ignore[arg-type]
    rollouts.add(32, 30, lost32)  # type: ignore[arg-type]
    rollout = rollouts.take(31)
    assert seen == [([2], [31, 32])]  # once, with step 31 still queued
    assert (rollout.step, rollout.version) == (31, 30) and same_bits(rollout.wait(), responses_of(31))
    assert sorted(rollouts.by_step) == [32] and lost31.waits == 1 and lost32.waits == 0
    assert same_bits(rollouts.take(32).wait(), responses_of(32))  # started again too: no second loss
    assert seen == [([2], [31, 32])] and rollouts.by_step == {}


def test_a_drain_waits_again_for_every_rollout_started_again() -> None:
    rollouts = Rollouts(2, WARM)
    rollouts.by_step = {31: Rollout(31, 30, pending=LostOnce(31)),  # type: ignore[arg-type]
                        32: Rollout(32, 30, pending=InFlight(32))}  # type: ignore[arg-type]
    losses: list[list[int]] = []

    def on_lost(exc: WorkerLostError) -> None:
        losses.append(exc.ranks)
        for r in rollouts.by_step.values():
            if r.done is None:
                r.pending = InFlight(r.step)  # type: ignore[assignment]

    rollouts.on_lost = on_lost
    rollouts.drain()
    assert losses == [[2]] and all(r.done is not None for r in rollouts.by_step.values())
    assert all(same_bits(rollouts.by_step[s].wait(), responses_of(s)) for s in (31, 32))


def test_without_on_lost_a_lost_generator_is_raised_and_the_rollout_stays_queued() -> None:
    rollouts = Rollouts(1, WARM)
    rollouts.add(31, 30, LostOnce(31))  # type: ignore[arg-type]
    with pytest.raises(WorkerLostError) as err:
        rollouts.take(31)
    assert err.value.ranks == [2]
    assert sorted(rollouts.by_step) == [31] and rollouts.by_step[31].done is None

    def decided(exc: WorkerLostError) -> None:  # recovery decided otherwise (core.controller.recovery.Decided)
        raise RuntimeError("the run fails") from exc

    rollouts.on_lost = decided
    with pytest.raises(RuntimeError, match="the run fails"):
        rollouts.take(31)  # LostOnce loses it again: on_lost's decision ends the wait
    assert sorted(rollouts.by_step) == [31]
