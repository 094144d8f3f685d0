"""The controller's worker groups by role: one typed group per ``RolePlan`` of plan.json.

A program holds ``trainer`` (and ``generator`` where the run has one) and calls methods on
them; each method declares how its request is spread and whose results come back
(``core.wire.contract.Method.dispatch`` / ``collect``), so a call site names only the
method and what to send:

    results = trainer.call(TRAIN_STEP, Step(step=s))              # list[StepResult], rank order
    scores = trainer.call_each(SCORE_ROWS, [share_0, share_1])     # one request per replica;
                                                                   # list[RowScores], one per replica
    synced = span.call_each(SYNC_WEIGHTS, {rank: pieces, ...})     # several groups' ranks at once
    rollout = generator.start_each(GENERATE, shares)              # a handle: the program goes on,
    ...                                                           # the trainer computes meanwhile
    parts = rollout.wait()                                         # then its results

Both sit on the one ``WorkerGroup`` (core.controller.group) that talks to every worker
process; what a rank holds and where it runs comes from the plan, never from arithmetic here.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Generic, TypeVar

from core.config.dims import ParallelDims
from core.config.roles import RolePlan
from core.controller import dispatch
from core.controller.group import WorkerGroup
from core.controller.pending import Pending
from core.wire.contract import NO_ARGS, Dispatch, Method

Req = TypeVar("Req")
Res = TypeVar("Res")


class RoleGroup:
    """The ranks of one worker group (trainer, generator) and the calls made of them."""

    def __init__(self, workers: WorkerGroup, plan: RolePlan) -> None:
        self.workers = workers
        self.plan = plan

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def dims(self) -> ParallelDims:
        return self.plan.dims

    @property
    def ranks(self) -> range:
        return self.plan.ranks

    @property
    def epoch(self) -> int:
        return self.workers.epoch

    @property
    def generation(self) -> int:
        return self.workers.generation

    def call(self, method: Method[Req, Res], request: Req = NO_ARGS, *,  # type: ignore[assignment]
             timeout_s: float | None = None) -> list[Res]:
        """``method`` (dispatched to all its ranks) with ``request``; the results it collects."""
        return self.start(method, request, timeout_s=timeout_s).wait()

    def call_each(self, method: Method[Req, Res], requests: Sequence[Req], *,
                  timeout_s: float | None = None) -> list[Res]:
        """``method`` with one request per rank (``Dispatch.EACH``) or per data replica
        (``Dispatch.REPLICAS``), in order; the results it collects."""
        return self.start_each(method, requests, timeout_s=timeout_s).wait()

    def start(self, method: Method[Req, Res], request: Req = NO_ARGS, *,  # type: ignore[assignment]
              timeout_s: float | None = None) -> Call[Res]:
        """``call`` without waiting: the call's handle (``wait()`` gives what ``call`` returns)."""
        per_rank = dispatch.requests(method, self.plan, request, each=False)
        return Call(self, self.workers.start_ranks(method, per_rank, timeout_s=timeout_s))

    def start_each(self, method: Method[Req, Res], requests: Sequence[Req], *,
                   timeout_s: float | None = None) -> Call[Res]:
        """``call_each`` without waiting: the call's handle."""
        per_rank = dispatch.requests(method, self.plan, requests, each=True)
        return Call(self, self.workers.start_ranks(method, per_rank, timeout_s=timeout_s))

    def owners(self, results: Sequence[Res]) -> list[Res]:
        """One result per data replica (its loss owner's) of every rank's results."""
        return dispatch.owners_of(self.plan, results)

    def rendezvous(self) -> tuple[str, int]:
        """The torch.distributed rendezvous of the group's first rank: its host, a free port there."""
        return self.workers.rendezvous_of(self.plan.first_rank)


class Call(Generic[Res]):
    """A group call in flight (``RoleGroup.start``): the program goes on and ``wait``s for its
    results when it needs them; meanwhile other groups' calls run. Its ranks serve their
    calls in the order they were sent."""

    def __init__(self, group: RoleGroup, pending: Pending) -> None:
        self.group, self.pending = group, pending

    def done(self) -> bool:
        """Every rank has answered, with a result or an error, or the call was abandoned by a
        reset: ``wait`` then returns (or raises) at once."""
        return self.group.workers.answered(self.pending)

    def wait(self) -> list[Res]:
        """The results the method collects, as ``RoleGroup.call`` returns them (or its error)."""
        method = self.pending.method
        return dispatch.collected(method, self.group.plan, self.group.workers.wait(self.pending))


class Span:
    """The ranks of several groups at once (a weight sync runs over the trainer's and the
    generator's): per-rank requests, results by rank. Colocated groups share their ranks."""

    def __init__(self, workers: WorkerGroup, *groups: RoleGroup) -> None:
        self.workers = workers
        self.ranks = tuple(sorted({r for g in groups for r in g.ranks}))

    def call(self, method: Method[Req, Res], request: Req = NO_ARGS, *,  # type: ignore[assignment]
             timeout_s: float | None = None) -> dict[int, Res]:
        """``method`` with the same ``request`` on every rank of the span; results by rank."""
        _check(method, Dispatch.ALL, "call")
        return self.workers.call_ranks(method, dict.fromkeys(self.ranks, request), timeout_s=timeout_s)

    def call_each(self, method: Method[Req, Res], requests: Mapping[int, Req], *,
                  timeout_s: float | None = None) -> dict[int, Res]:
        """``method`` with each rank's own request (one for every rank of the span); results by rank."""
        _check(method, Dispatch.EACH, "call_each")
        if sorted(requests) != list(self.ranks):
            raise ValueError(f"{method.name}: requests for ranks {sorted(requests)}, the span is {list(self.ranks)}")
        return self.workers.call_ranks(method, requests, timeout_s=timeout_s)


def _check(method: Method[Req, Res], kind: Dispatch, how: str) -> None:
    if method.dispatch is not kind:
        raise TypeError(f"{method.name} is dispatched {method.dispatch.value}: not with Span.{how}")
