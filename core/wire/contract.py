"""Typed call contracts: each worker method is a named constant with a request and a result type.

    TRAIN_STEP = Method("train_step", Step, StepResult)
    group.call(TRAIN_STEP, Step(step=s))              # the controller: typed in, typed out
    {TRAIN_STEP: self.train_step}                     # a task's handlers: train_step(req: Step)

On the wire a request is the ``Call``'s kwargs map and a result the ``Result``'s value,
both plain msgpack data (``core.config.schema.to_data``); numpy arrays travel as side frames.
The worker checks every request at the boundary (``decode_request``) and the controller
every result (``decode_result``); a malformed one raises a one-line ``ProtocolError``
naming the method and the field, which fails that call and nothing else: both sides keep
serving. Methods are plain values: no decorators, no reflection. A role defines its own
(``core.wire.calls`` the training ones, ``core.wire.rl_calls`` the RL programs',
``core.flows.calls`` the generator's, ``core.checkpoint.calls``, ``core.model.toy``);
a worker group serves whatever its task's handler table lists.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from core.config.schema import build, convert, to_data
from core.errors import ProtocolError

Req = TypeVar("Req")
Res = TypeVar("Res")


@dataclass(frozen=True, kw_only=True)
class NoArgs:
    """The request of a method that takes nothing."""


NO_ARGS = NoArgs()


class Dispatch(enum.Enum):
    """Which ranks of a worker group get a method's request (core.controller.roles)."""

    ALL = "all"  # every rank the same request: ``group.call(METHOD, request)``
    EACH = "each"  # every rank its own: ``group.call_each(METHOD, [one per rank])``
    REPLICAS = "replicas"  # every data-parallel replica its own, to all its ranks: ``call_each(METHOD, [one per replica])``


class Collect(enum.Enum):
    """Whose results a call of the method returns, as a list."""

    ALL = "all"  # every rank's, in the group's rank order
    OWNERS = "owners"  # one per data replica, in replica order: its last pipeline stage's first tp rank
    FIRST = "first"  # the group's rank 0's (a list of one)


@dataclass(frozen=True, eq=False)
class Method(Generic[Req, Res]):
    """One remote method: its name on the wire, its request dataclass, its result type, and
    how a call is spread over a group's ranks and gathered back (declared here, once).

    ``result`` is a type annotation: a dataclass, ``None``, a scalar type, or a union
    such as ``ShardAck | None``. Methods compare by identity and hash by name.
    """

    name: str
    request: type[Req]
    result: Any
    dispatch: Dispatch = Dispatch.ALL
    collect: Collect = Collect.ALL
    decode_request: Callable[[dict[str, Any]], Req] = dataclasses.field(init=False, repr=False)
    decode_result: Callable[[Any], Res] = dataclasses.field(init=False, repr=False)
    plain_result: bool = dataclasses.field(init=False, repr=False)  # a scalar or None: sent as it is

    def __post_init__(self) -> None:
        object.__setattr__(self, "decode_request", self._request_decoder())
        object.__setattr__(self, "decode_result", self._result_decoder())
        object.__setattr__(self, "plain_result", self.result in (None, type(None), int, float, str, bool))

    def __hash__(self) -> int:
        return hash(self.name)

    def encode_request(self, request: Req) -> dict[str, Any]:
        """The request as the Call's kwargs map."""
        if not isinstance(request, self.request):
            raise TypeError(f"{self.name}: request must be a {self.request.__name__}, got {type(request).__name__}")
        return to_data(request)  # type: ignore[no-any-return]

    def encode_result(self, result: Any) -> Any:
        """The result as the Result's value (plain data; arrays stay arrays)."""
        return result if self.plain_result else to_data(result)

    def _request_decoder(self) -> Callable[[dict[str, Any]], Req]:
        cls, where = self.request, f"{self.name} request"
        if not dataclasses.fields(cls):  # type: ignore[arg-type]
            empty = cls()

            def decode_empty(kwargs: dict[str, Any]) -> Req:
                if kwargs:
                    raise ProtocolError(f"{where}: takes no fields, got {sorted(map(str, kwargs))}")
                return empty

            return decode_empty

        def decode(kwargs: dict[str, Any]) -> Req:
            try:
                return build(cls, kwargs, where, error=ProtocolError)
            except ProtocolError as exc:  # a dataclass's own check (rows and lengths that disagree): say where
                if str(exc).startswith(where):
                    raise
                raise ProtocolError(f"{where}: {exc}") from None

        return decode

    def _result_decoder(self) -> Callable[[Any], Res]:
        tp, where = self.result, f"{self.name} result"
        if tp is None or tp is type(None):
            def decode_none(value: Any) -> Any:
                if value is not None:
                    raise ProtocolError(f"{where}: expected nothing, got {str(value)[:80]}")
                return None

            return decode_none

        def decode(value: Any) -> Res:
            try:
                return convert(tp, value, where, error=ProtocolError)  # type: ignore[no-any-return]
            except ProtocolError as exc:
                if str(exc).startswith(where):
                    raise
                raise ProtocolError(f"{where}: {exc}") from None

        return decode


Handlers = dict[Method[Any, Any], Callable[[Any], Any]]
