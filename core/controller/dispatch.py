"""How a call is spread over a worker group's ranks and gathered back.

Each method declares both with itself (``core.wire.contract.Method``: ``dispatch`` and
``collect``); these pure functions carry the declaration out over a group's plan
(``core.config.roles.RolePlan``), in run ranks:

    requests(SCORE_ROWS, trainer_plan, [share_of_replica_0, share_of_replica_1])
    → {0: share_0, 1: share_0, 2: share_1, 3: share_1}        (tp2, dp2)
    collected(SCORE_ROWS, trainer_plan, {0: r0, 1: r1, 2: r2, 3: r3}) → [r0, r2]  (the owners)
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from core.config.roles import RolePlan
from core.wire.contract import Collect, Dispatch, Method

Req = TypeVar("Req")
Res = TypeVar("Res")


def requests(method: Method[Req, Res], plan: RolePlan, given: Req | Sequence[Req], *, each: bool) -> dict[int, Req]:
    """Run rank → its request. ``each``: ``given`` holds one request per rank (``EACH``) or
    per data replica (``REPLICAS``); otherwise it is the one request of an ``ALL`` method."""
    kind = method.dispatch
    if each != (kind is not Dispatch.ALL):
        how = "call_each" if kind is not Dispatch.ALL else "call"
        raise TypeError(f"{method.name} is dispatched {kind.value}: use {how}")
    if kind is Dispatch.ALL:
        return dict.fromkeys(plan.ranks, given)  # type: ignore[arg-type]
    assert isinstance(given, Sequence)
    want = plan.world_size if kind is Dispatch.EACH else plan.dims.dp
    if len(given) != want:
        unit = "rank" if kind is Dispatch.EACH else "data replica"
        raise ValueError(f"{method.name}: {len(given)} requests for the {plan.name}'s {want} ({unit} each)")
    if kind is Dispatch.EACH:
        return dict(zip(plan.ranks, given, strict=True))
    return {r: given[plan.replica_of(r)] for r in plan.ranks}


def collected(method: Method[Req, Res], plan: RolePlan, results: Mapping[int, Res]) -> list[Res]:
    """The results the method's ``collect`` keeps, as a list (see ``core.wire.contract.Collect``)."""
    kind = method.collect
    if kind is Collect.ALL:
        return [results[r] for r in plan.ranks]
    if kind is Collect.OWNERS:
        return [results[r] for r in plan.owners()]
    return [results[plan.first_rank]]


def owners_of(plan: RolePlan, results: Sequence[Res]) -> list[Res]:
    """From every rank's results (group order, as ``Collect.ALL`` returns them): one per data
    replica, its loss owner's, in replica order."""
    return [results[r - plan.first_rank] for r in plan.owners()]
