"""Who joins a worker group: registrations of the group's epoch and generation take their
ranks; the rest are refused by name (no sockets: core.controller.registration alone)."""
from __future__ import annotations

from core.config.run import TimeoutsConfig
from core.controller.registration import Registrations, refusal
from core.wire.protocol import Envelope, Register


def _env(rank: int = -1, *, epoch: int = 2, generation: int = 1, host: str = "h", pid: int = 7) -> Envelope:
    reg = Register(rank_hint=rank, host=host, node="n", pid=pid, generation=generation)
    return Envelope(msg=reg, req_id=0, epoch=epoch)


def _join(group: Registrations, identity: bytes, env: Envelope) -> str | int:
    reason = group.refusal(env)
    if reason is not None:
        return reason
    assert isinstance(env.msg, Register)
    return group.admit(identity, env.msg)


def test_another_epoch_or_generation_is_refused_by_name() -> None:
    assert refusal(_env(), epoch=2, generation=1) is None
    assert refusal(_env(epoch=1), epoch=2, generation=1) == "stale epoch 1: this run is at epoch 2"
    assert refusal(_env(generation=0), epoch=2, generation=1) == (
        "stale generation 0 of epoch 2: this run is at generation 1")
    assert refusal(_env(generation=3), epoch=2, generation=1) == (
        "unexpected generation 3 of epoch 2: this run is at generation 1")


def test_ranks_are_taken_as_hinted_or_the_lowest_free_and_the_rest_refused() -> None:
    group = Registrations(world_size=3, epoch=2, generation=1)
    assert _join(group, b"a", _env(1, pid=11, host="h1")) == 1
    assert _join(group, b"b", _env()) == 0
    assert _join(group, b"c", _env(1)) == "rank 1 already registered by pid 11 on h1"
    assert _join(group, b"d", _env(3)) == "rank 3 outside the group of 3"
    assert _join(group, b"e", _env(-2)) == "rank -2 outside the group of 3"
    assert _join(group, b"f", _env(epoch=0)) == "stale epoch 0: this run is at epoch 2"
    assert (len(group), group.missing()) == (2, [2])
    assert _join(group, b"g", _env()) == 2
    assert _join(group, b"h", _env()) == "rank -1 outside the group of 3"
    assert (len(group), group.missing()) == (3, [])


def test_a_group_restarted_alone_admits_only_the_ranks_it_restarts() -> None:
    """A split generator's ranks 2 and 3 restart while the trainer's 0 and 1 go on: only 2 and 3
    may register, a rank hint of -1 takes the lowest of those still missing, and the one
    welcomed first in rank order (2) is the rendezvous of the new workers."""
    group = Registrations(world_size=4, epoch=2, generation=1, ranks=[3, 2])
    assert (group.expected, len(group), group.missing()) == (2, 0, [2, 3])
    assert _join(group, b"a", _env(0)) == "rank 0 is not restarted in generation 1: it is still running"
    assert _join(group, b"b", _env(1)) == "rank 1 is not restarted in generation 1: it is still running"
    assert _join(group, b"c", _env(3, pid=13, host="h3")) == 3
    assert _join(group, b"d", _env(3)) == "rank 3 already registered by pid 13 on h3"
    assert _join(group, b"e", _env(generation=0)) == "stale generation 0 of epoch 2: this run is at generation 1"
    assert group.missing() == [2]
    assert _join(group, b"f", _env(host="h2")) == 2  # -1: not rank 0 (running), the lowest restarted one missing
    assert _join(group, b"g", _env()) == "rank -1 outside the group of 4"  # nothing left to take
    assert (len(group), group.missing()) == (2, [])
    welcomed = list(group.welcomed(1.0, TimeoutsConfig()))
    assert [(p.rank, p.identity) for p, _ in welcomed] == [(3, b"c"), (2, b"f")]
    assert {(w.world_size, w.master_addr) for _, w in welcomed} == {(4, "h2")}


def test_every_rank_is_expected_when_none_are_named() -> None:
    group = Registrations(world_size=3, epoch=0, generation=0)
    assert (group.expected, group.missing()) == (3, [0, 1, 2])
    assert Registrations(world_size=3, epoch=0, generation=0, ranks=()).missing() == [0, 1, 2]  # as workers.json


def test_each_worker_is_welcomed_in_registration_order_to_rank_zeros_rendezvous() -> None:
    group = Registrations(world_size=2, epoch=2, generation=1)
    group.admit(b"w1", Register(rank_hint=1, host="h1", node="n", pid=21, generation=1))
    group.admit(b"w0", Register(rank_hint=0, host="h0", node="n", pid=20, rendezvous_port=2900, generation=1))
    timeouts = TimeoutsConfig()
    welcomed = list(group.welcomed(5.0, timeouts))
    assert [(p.rank, p.identity, p.host, p.pid, p.last_seen, p.hb_identity) for p, _ in welcomed] == [
        (1, b"w1", "h1", 21, 5.0, b"w1/hb"), (0, b"w0", "h0", 20, 5.0, b"w0/hb")]
    assert [(w.rank, w.world_size, w.master_addr, w.master_port) for _, w in welcomed] == [
        (1, 2, "h0", 2900), (0, 2, "h0", 2900)]
    assert all(w.heartbeat_interval_s == timeouts.heartbeat_interval_s
               and w.controller_lost_s == timeouts.controller_lost_s for _, w in welcomed)
