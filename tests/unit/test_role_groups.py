"""The controller's role groups: dispatch and collect as each method declares them, over the
ranks the plan gives the group; a failing rank's error reaches the caller unchanged.

The worker processes are replaced at the process boundary (``WorkerGroup.start_ranks`` and
``wait``): a fake that answers each rank with its rank and request, or raises as a worker
would, at the call's wait. Calls in flight over real sockets: tests/unit/test_group_calls.py.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from core.config.dims import ParallelDims
from core.config.roles import RolePlan
from core.controller.pending import Pending
from core.controller.roles import RoleGroup, Span
from core.errors import RemoteError
from core.wire.contract import Collect, Dispatch, Method


@dataclass(frozen=True, kw_only=True)
class Ask:
    v: int = 0


@dataclass(frozen=True, kw_only=True)
class Answer:
    rank: int
    v: int


ALL = Method("ask", Ask, Answer)
FIRST = Method("ask", Ask, Answer, collect=Collect.FIRST)
OWNERS = Method("ask", Ask, Answer, collect=Collect.OWNERS)
EACH = Method("ask", Ask, Answer, dispatch=Dispatch.EACH)
REPLICAS = Method("ask", Ask, Answer, dispatch=Dispatch.REPLICAS, collect=Collect.OWNERS)


class FakeWorkers:
    """Answers every rank at once; ``failing`` ranks raise as a remote error does."""

    epoch, generation = 0, 0

    def __init__(self, failing: tuple[int, ...] = ()) -> None:
        self.failing = failing
        self.sent: list[dict[int, Any]] = []

    def start_ranks(self, method: Method[Any, Any], per_rank: Mapping[int, Any], *,
                    timeout_s: float | None = None) -> Pending:
        self.sent.append(dict(per_rank))
        return Pending(req=len(self.sent) - 1, method=method, ranks=tuple(per_rank), timeout_s=timeout_s or 0.0,
                       deadline=0.0, results={})

    def wait(self, pending: Pending) -> dict[int, Any]:
        method, per_rank = pending.method, self.sent[pending.req]
        bad = [r for r in per_rank if r in self.failing]
        if bad:
            raise RemoteError(f"{method.name}: rank {bad[0]} raised RuntimeError: boom", bad[0], "RuntimeError",
                              "Traceback ...", method=method.name)
        return {r: Answer(rank=r, v=req.v) for r, req in per_rank.items()}

    def call_ranks(self, method: Method[Any, Any], per_rank: Mapping[int, Any], *,
                   timeout_s: float | None = None) -> dict[int, Any]:
        return self.wait(self.start_ranks(method, per_rank, timeout_s=timeout_s))

    def rendezvous_of(self, rank: int) -> tuple[str, int]:
        return f"host{rank}", 1000 + rank


def _plan(*, first: int = 0, tp: int = 1, pp: int = 1, dp: int = 1, name: str = "trainer") -> RolePlan:
    return RolePlan(name=name, first_rank=first, dims=ParallelDims(tp=tp, pp=pp, dp=dp),  # type: ignore[arg-type]
                    placement="own" if name == "trainer" else "split", component=1, nodes=1, models=("actor",))


def test_all_ranks_get_the_request_and_every_result_comes_back_in_rank_order() -> None:
    workers = FakeWorkers()
    g = RoleGroup(workers, _plan(tp=2, dp=2))  # type: ignore[arg-type]
    assert [a.rank for a in g.call(ALL, Ask(v=7))] == [0, 1, 2, 3]
    assert set(workers.sent[-1]) == {0, 1, 2, 3} and {r.v for r in workers.sent[-1].values()} == {7}
    assert g.call(FIRST, Ask(v=1)) == [Answer(rank=0, v=1)]


def test_owners_are_each_replicas_last_stage_first_tensor_rank() -> None:
    g = RoleGroup(FakeWorkers(), _plan(tp=2, pp=2, dp=2))  # type: ignore[arg-type]
    # Megatron's order: tp fastest, then dp, then pp: the last stage is ranks 4..7
    assert [a.rank for a in g.call(OWNERS, Ask())] == [4, 6]
    every = g.call(ALL, Ask())
    assert [a.rank for a in g.owners(every)] == [4, 6]


def test_replica_dispatch_hands_every_rank_of_a_replica_its_share() -> None:
    workers = FakeWorkers()
    g = RoleGroup(workers, _plan(tp=2, dp=3))  # type: ignore[arg-type]
    answers = g.call_each(REPLICAS, [Ask(v=10), Ask(v=11), Ask(v=12)])
    assert [(a.rank, a.v) for a in answers] == [(0, 10), (2, 11), (4, 12)]
    assert {r: q.v for r, q in workers.sent[-1].items()} == {0: 10, 1: 10, 2: 11, 3: 11, 4: 12, 5: 12}
    with pytest.raises(ValueError, match="2 requests for the trainer's 3 \\(data replica each\\)"):
        g.call_each(REPLICAS, [Ask(), Ask()])


def test_a_group_after_the_trainer_speaks_in_run_ranks() -> None:
    workers = FakeWorkers()
    gen = RoleGroup(workers, _plan(first=4, tp=2, dp=2, name="generator"))  # type: ignore[arg-type]
    assert [a.rank for a in gen.call_each(EACH, [Ask(v=i) for i in range(4)])] == [4, 5, 6, 7]
    assert [a.rank for a in gen.call(OWNERS, Ask())] == [4, 6]
    assert gen.rendezvous() == ("host4", 1004)


def test_the_dispatch_a_method_declares_is_the_only_way_to_call_it() -> None:
    g = RoleGroup(FakeWorkers(), _plan(dp=2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ask is dispatched each: use call_each"):
        g.call(EACH, Ask())
    with pytest.raises(TypeError, match="ask is dispatched all: use call"):
        g.call_each(ALL, [Ask(), Ask()])


def test_a_failing_rank_fails_the_call_naming_it() -> None:
    g = RoleGroup(FakeWorkers(failing=(1,)), _plan(dp=2))  # type: ignore[arg-type]
    with pytest.raises(RemoteError) as info:
        g.call(ALL, Ask())
    assert info.value.rank == 1 and info.value.method == "ask" and "rank 1 raised RuntimeError" in str(info.value)


def test_a_span_covers_colocated_groups_once_and_split_ones_side_by_side() -> None:
    workers = FakeWorkers()
    trainer = RoleGroup(workers, _plan(dp=4))  # type: ignore[arg-type]
    colocated = RoleGroup(workers, _plan(tp=2, dp=2, name="generator"))  # type: ignore[arg-type]
    assert Span(workers, trainer, colocated).ranks == (0, 1, 2, 3)  # type: ignore[arg-type]
    split = RoleGroup(workers, _plan(first=4, tp=2, name="generator"))  # type: ignore[arg-type]
    span = Span(workers, trainer, split)  # type: ignore[arg-type]
    assert span.ranks == (0, 1, 2, 3, 4, 5)
    assert sorted(span.call(ALL, Ask(v=3))) == [0, 1, 2, 3, 4, 5]
    assert span.call_each(EACH, {r: Ask(v=r) for r in span.ranks})[5] == Answer(rank=5, v=5)
    with pytest.raises(ValueError, match="requests for ranks \\[0\\]"):
        span.call_each(EACH, {0: Ask()})
