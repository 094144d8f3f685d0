"""The controller's view of its workers: registration, calls with deadlines, liveness.

A ``WorkerGroup`` owns one ROUTER socket. Exactly one thread uses the socket at a time
(a lock): the program's thread while it is inside ``call``, otherwise a small pump thread
that records heartbeats and notices lost workers between calls. A call may be started
(``start_ranks``) and waited for later (``wait``): its answers are kept as they arrive, by
whichever thread holds the socket. Each worker connects
twice: its call socket (identity I) and its heartbeat socket (identity I + b"/hb"); the
controller's own heartbeats and aborts go to the latter. Liveness: a worker is
lost when its heartbeats stop for ``heartbeat_timeout_s`` (exit, SIGSTOP, a hung host all
look like this from here); when it runs on this host its pid is checked to say which.

Generations: after a loss the controller aborts the survivors, ``reset``s the group to
the next generation of the same epoch and waits for a new set of workers (started by the
supervisor, core.supervisor.contract). A worker of an older epoch or generation is refused by name;
who may join, at which rank, and what each is welcomed with is core.controller.registration.
The group knows ranks, not roles: the role groups (core.controller.roles) decide which ranks
a call goes to and which results come back.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Mapping
from typing import Any

from core.config.run import TimeoutsConfig
from core.controller.diagnose import diagnose, remote_error
from core.controller.liveness import Liveness
from core.controller.pending import Pending
from core.controller.registration import Peer, Registrations, refusal
from core.errors import CallTimeoutError, ProtocolError, RegistrationError, RemoteError, WorkerLostError
from core.job.signals import PreemptionFlag
from core.record.runfolder import RunFolder
from core.wire import protocol, transport
from core.wire.contract import Method, Req, Res

log = logging.getLogger(__name__)


class WorkerGroup(Liveness):
    """N workers that execute what the controller sends."""

    def __init__(
        self,
        sock: transport.ControllerSocket,
        *,
        world_size: int,
        epoch: int,
        timeouts: TimeoutsConfig,
        run: RunFolder,
        generation: int = 0,
        signals: PreemptionFlag | None = None,
    ) -> None:
        self.sock = sock
        self.world_size = world_size
        self.epoch = epoch
        self.generation = generation
        self.signals = signals  # a worker's preemption signal is relayed here (see Heartbeat.signal)
        self.timeouts = timeouts
        self.run = run
        self.peers: dict[int, Peer] = {}
        self._by_identity: dict[bytes, Peer] = {}
        self._lock = threading.Lock()
        self._next_req = 1
        self._inflight: dict[int, dict[int, Any]] = {}
        self._ranks_of: dict[int, tuple[int, ...]] = {}  # req → the ranks it was sent to
        self.restartable: frozenset[int] = frozenset()  # ranks that restart alone: lost, they fail only their calls
        self._errors: dict[int, dict[int, protocol.Error]] = {}  # req → rank → error
        self._next_beat = 0.0
        self._next_check = 0.0
        self._beat_seq = 0
        self._n_lost = 0
        # Workers only need our heartbeat to notice a dead controller: a few per limit do.
        self._beat_interval_s = max(timeouts.heartbeat_interval_s, timeouts.controller_lost_s / 5)
        self._stop = threading.Event()
        self._pump: threading.Thread | None = None
        self.heartbeats_handled = 0
        self._all_started = False

    # --- registration -------------------------------------------------------------------
    def wait_for_workers(self, timeout_s: float | None = None, *, ranks: Collection[int] | None = None) -> None:
        """Block until every rank (of ``ranks`` only, after ``replace``) has registered, then
        welcome them. The workers already in the group are served meanwhile: their heartbeats
        and answers are handled, and they get the controller's."""
        timeout_s = self.timeouts.register_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        pending = Registrations(world_size=self.world_size, epoch=self.epoch, generation=self.generation,
                                ranks=ranks)
        with self._lock:
            while pending.missing():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RegistrationError(
                        f"{len(pending)} of {pending.expected} workers registered within {timeout_s:.0f} s "
                        f"(epoch {self.epoch}, generation {self.generation}); missing ranks {pending.missing()}; "
                        f"see {self.run.logs}/worker_r*.log"
                    )
                self.sock.set_timeout(min(remaining, 0.5 if not self.peers else self.timeouts.heartbeat_interval_s))
                item = self.sock.recv()
                if self.peers:  # the workers that go on: served, and their own loss is not waited out
                    self._housekeeping()
                    self._raise_if_lost()
                    if self.signals is not None and self.signals.is_set:
                        raise RegistrationError(f"a preemption signal arrived while ranks {pending.missing()} "
                                                "were registering again")
                if item is None:
                    continue
                env = self._decode(*item)
                if env is not None and isinstance(env.msg, protocol.Register):  # not early heartbeats
                    self._admit(item[0], env, pending)
                elif self.peers:
                    self._handle(*item)
            for peer, welcome in pending.welcomed(time.monotonic(), self.timeouts):
                self.peers[peer.rank] = peer
                self._by_identity[peer.identity] = peer
                self._by_identity[peer.hb_identity] = peer
                self._send(peer, welcome)
        log.info("%d workers registered (epoch %d, generation %d)", pending.expected, self.epoch, self.generation)
        if self._pump is None:
            self._pump = threading.Thread(target=self._pump_loop, args=(self._stop,), name="baton-pump", daemon=True)
            self._pump.start()

    def rendezvous_of(self, rank: int = 0) -> tuple[str, int]:
        """The torch.distributed rendezvous ``rank`` offered: its host and a free port there."""
        return self.peers[rank].host, self.peers[rank].rendezvous_port

    def reset(self, generation: int) -> None:
        """Forget the current workers (lost or aborted) so that ``generation`` can register.

        Messages still arriving from the old workers are dropped (their identities are
        forgotten); a registration from an older generation is refused by name.
        """
        self._stop.set()
        if self._pump is not None:
            self._pump.join(timeout=2)
            self._pump = None
        with self._lock:
            self._stop = threading.Event()
            self.generation = generation
            self.peers = {}
            self._by_identity = {}
            self._n_lost = 0
            self._inflight.clear()
            self._ranks_of.clear()
            self._errors.clear()
            self._all_started = False

    def replace(self, ranks: Collection[int], generation: int) -> None:
        """Forget the workers of ``ranks`` alone (lost, or aborted with ``abort(ranks=)``) so
        that ``generation`` of them can register (``wait_for_workers(ranks=)``) while the
        others go on: a generator group restarted without its trainer. The calls in flight
        to any of ``ranks`` are abandoned (their ``wait`` raises WorkerLostError)."""
        gone = set(ranks)
        with self._lock:
            self.generation = generation
            for rank in gone:
                peer = self.peers.pop(rank, None)
                if peer is None:
                    continue
                self._by_identity.pop(peer.identity, None)
                self._by_identity.pop(peer.hb_identity, None)
                self._n_lost -= bool(peer.lost)
            for req in [r for r, sent in self._ranks_of.items() if gone.intersection(sent)]:
                self._forget(req)
            self._all_started = False

    def _admit(self, identity: bytes, env: protocol.Envelope, pending: Registrations) -> bool:
        reason = pending.refusal(env)
        if reason is not None:
            return self._refuse(identity, reason)
        reg = env.msg
        assert isinstance(reg, protocol.Register)
        rank = pending.admit(identity, reg)
        log.info("rank %d registered from %s pid %d", rank, reg.host, reg.pid)
        return True

    def _refuse(self, identity: bytes, reason: str) -> bool:
        log.warning("refused a worker (%s): %s", identity.decode(errors="replace"), reason)
        self.sock.send(identity, protocol.encode(protocol.Refuse(reason=reason), epoch=self.epoch))
        return False

    # --- calls --------------------------------------------------------------------------
    def call_ranks(self, method: Method[Req, Res], per_rank: Mapping[int, Req], *,
                   timeout_s: float | None = None) -> dict[int, Res]:
        """Run ``method`` on the ranks of ``per_rank``, each with its request; wait for every
        one; their typed results by rank.

        Raises RemoteError (a worker raised, or answered with a malformed result),
        WorkerLostError (heartbeats stopped) or CallTimeoutError (the deadline passed), each
        naming the ranks concerned.
        """
        return self.wait(self.start_ranks(method, per_rank, timeout_s=timeout_s))

    def start_ranks(self, method: Method[Req, Res], per_rank: Mapping[int, Req], *,
                    timeout_s: float | None = None) -> Pending:
        """Send ``method`` to the ranks of ``per_rank`` and return at once: the call's handle,
        which ``wait`` completes. Answers that arrive meanwhile are kept (by the pump thread or
        another call's wait), so calls to other ranks run while this one does; its deadline
        counts from now."""
        timeout_s = self.timeouts.call_s if timeout_s is None else timeout_s
        with self._lock:
            self._raise_if_lost(per_rank)
            req = self._next_req
            self._next_req += 1
            pending = Pending(req=req, method=method, ranks=tuple(per_rank), timeout_s=timeout_s,
                              deadline=time.monotonic() + timeout_s, results={})
            self._inflight[req] = pending.results
            self._ranks_of[req] = pending.ranks
            try:
                encoded: dict[int, list[Any]] = {}  # ranks handed the same request share its encoding
                send, peers = self.sock.send, self.peers
                for rank, rank_request in per_rank.items():
                    frames = encoded.get(id(rank_request))
                    if frames is None:
                        call = protocol.Call(method=method.name, kwargs=method.encode_request(rank_request))
                        frames = encoded[id(rank_request)] = protocol.encode(call, req_id=req, epoch=self.epoch)
                    peer = peers[rank]
                    if not send(peer.identity, frames):
                        self._declare_lost(peer, f"connection closed: {diagnose(peer.host, peer.pid, settle_s=2.0)}")
            except BaseException:
                self._forget(req)
                raise
        return pending

    def wait(self, pending: Pending) -> dict[int, Any]:
        """Every rank's typed result of a started call (see ``call_ranks`` for what it raises)."""
        with self._lock:
            try:
                if pending.req not in self._inflight:
                    raise WorkerLostError(f"{pending.method.name}: the call was abandoned when its workers were replaced "
                                          f"(generation {self.generation})", ranks=list(pending.ranks))
                self._wait(pending.req, pending.method.name, pending.results, pending.ranks, pending.timeout_s,
                           pending.deadline)
                if not self._all_started:
                    self._mark_started(pending.results)
                return self._typed(pending.req, pending.method, pending.results, len(pending.ranks))
            finally:
                self._forget(pending.req)

    def answered(self, pending: Pending) -> bool:
        """``wait`` on ``pending`` returns or raises without waiting for a worker: every rank has
        answered (a result or an error), or a reset abandoned the call. Answers arrive while
        nobody waits through the pump thread."""
        if pending.req not in self._inflight:
            return True
        return len(pending.results) + len(self._errors.get(pending.req, ())) >= len(pending.ranks)

    def _forget(self, req: int) -> None:
        self._inflight.pop(req, None)
        self._ranks_of.pop(req, None)
        self._errors.pop(req, None)

    def _mark_started(self, results: dict[int, Any]) -> None:
        for rank in results:
            self.peers[rank].started = True
        self._all_started = all(p.started for p in self.peers.values())

    def _typed(self, req: int, method: Method[Any, Any], results: dict[int, Any], n: int) -> dict[int, Any]:
        """Every rank's result checked against the method's result type; a malformed one
        fails the call like a remote error, naming the rank and the field."""
        if method.result is None and all(v is None for v in results.values()):
            return results  # the commonest answer (a no-op, a load) needs no decoding
        typed, decode = {}, method.decode_result
        for rank, value in results.items():
            try:
                typed[rank] = decode(value)
            except ProtocolError as exc:
                self._errors.setdefault(req, {})[rank] = protocol.Error(
                    exc_type="ProtocolError", message=f"malformed result: {exc}", traceback="")
        errors = self._errors.get(req)
        if errors:
            raise self._remote_error(method.name, errors, n)
        return typed

    def _wait(self, req: int, method: str, results: dict[int, Any], expected: tuple[int, ...], timeout_s: float,
              deadline: float) -> None:
        """Receive until every rank in ``expected`` answered ``req`` (or raise at ``deadline``,
        ``timeout_s`` after the call was sent)."""
        check = min(self.timeouts.heartbeat_interval_s, 0.1)
        n = len(expected)
        error_deadline: float | None = None
        late = False  # the queue was read once at the deadline

        def answered() -> int:
            return len(results) + len(self._errors.get(req, ()))

        # The control plane's hot path on this side: one pass per answer received.
        set_timeout, recv = self.sock.set_timeout, self.sock.recv
        handle, monotonic, errors_of = self._handle, time.monotonic, self._errors
        set_timeout(check)  # shortened below only when a deadline is nearer
        while True:
            errors = errors_of.get(req)
            if errors:
                # Give the other ranks a moment to answer too: the same exception from every
                # rank marks a deterministic error (a bug, a bad config), not a sick node; a
                # worker lost meanwhile is the cause (its peers' collectives fail first).
                if error_deadline is None:
                    error_deadline = min(deadline, monotonic() + self.timeouts.heartbeat_timeout_s + 2 * check)
                if answered() >= n or monotonic() >= error_deadline:
                    self._next_check = 0.0
                    self._housekeeping()
                    self._raise_if_lost(expected)
                    raise self._remote_error(method, errors, n)
            elif len(results) >= n:
                return
            now = monotonic()
            if now >= self._next_check:
                self._housekeeping()
            if self._n_lost:
                self._raise_if_lost(expected)
            if now >= deadline and not late:  # a late wait: the answers already queued count, once
                late = True
                self._drained(handle)
                continue
            if now >= deadline:
                missing = sorted(set(expected) - set(results) - set(errors_of.get(req, ())))
                raise CallTimeoutError(
                    f"{method}: ranks {missing} did not answer within {timeout_s:.1f} s "
                    f"({n - len(missing)} of {n} did); logs: "
                    + ", ".join(str(self.run.worker_log(r)) for r in missing[:4]),
                    missing=missing,
                )
            until = deadline if error_deadline is None else error_deadline
            # One blocking receive per answer, never a non-blocking one that raises when
            # the queue is empty.
            if until - now < check:
                set_timeout(until - now)
            item = recv()
            if item is not None:
                handle(*item)

    def _drained(self, handle: Any) -> None:
        """Handle every message already queued, without blocking."""
        while (item := self.sock.recv_nowait()) is not None:
            handle(*item)

    def _remote_error(self, method: str, errors: dict[int, protocol.Error], n: int) -> RemoteError:
        return remote_error(method, errors, n, self.run.worker_log)

    # --- message handling ---------------------------------------------------------------
    def _decode(self, identity: bytes, frames: list[Any]) -> protocol.Envelope | None:
        try:
            return protocol.decode(frames)
        except protocol.ProtocolError as exc:
            peer = self._by_identity.get(identity)
            who = f"rank {peer.rank}" if peer else identity.decode(errors="replace")
            log.warning("dropped a malformed message from %s: %s", who, exc)
            return None

    def _handle(self, identity: bytes, frames: list[Any]) -> None:
        answer = protocol.decode_result(frames)  # the lean path of the commonest message
        if answer is not None:
            peer = self._by_identity.get(identity)
            if peer is not None and answer[1] == self.epoch:
                peer.last_seen = time.monotonic()
                results = self._inflight.get(answer[0])
                if results is not None:
                    results[peer.rank] = answer[2]
                return
        try:
            env = protocol.decode(frames)
        except protocol.ProtocolError:
            self._decode(identity, frames)  # logs what was dropped
            return
        peer = self._by_identity.get(identity)
        msg = env.msg
        if peer is None:
            if isinstance(msg, protocol.Register):
                self._refuse(identity, refusal(env, epoch=self.epoch, generation=self.generation)
                             or f"the group of {self.world_size} is complete")
            return
        if env.epoch != self.epoch:
            log.warning("dropped a message of epoch %d from rank %d (run is at %d)", env.epoch, peer.rank, self.epoch)
            return
        peer.last_seen = time.monotonic()
        kind = type(msg)
        if kind is protocol.Result:
            results = self._inflight.get(env.req_id)
            if results is not None:
                results[peer.rank] = msg.value
        elif kind is protocol.Heartbeat:
            peer.busy, peer.rss_mb = msg.busy, msg.rss_mb
            self.heartbeats_handled += 1
            if msg.signal and self.signals is not None and not self.signals.is_set:
                self.signals.relay(msg.signal, f"rank {peer.rank} on {peer.node}")
        elif isinstance(msg, protocol.Error):
            if env.req_id in self._inflight:
                self._errors.setdefault(env.req_id, {})[peer.rank] = msg
        elif isinstance(msg, protocol.Log):
            log.log(msg.level, "[rank %d] %s", peer.rank, msg.message)
        else:
            log.warning("ignored a %s message from rank %d", type(msg).__name__, peer.rank)

    def _send(self, peer: Peer, msg: protocol.Message, req_id: int = 0) -> bool:
        return self.sock.send(peer.identity, protocol.encode(msg, req_id=req_id, epoch=self.epoch))

    # --- ending -------------------------------------------------------------------------
    def abort(self, reason: str, *, ranks: Collection[int] | None = None) -> None:
        """Tell every worker (of ``ranks``, when given) to stop at once (best effort; to the
        heartbeat socket, which is read even while a step runs)."""
        self._broadcast(protocol.Abort(reason=reason), heartbeat_socket=True, ranks=ranks)

    def shutdown(self, reason: str = "run finished") -> None:
        """Tell every worker to finish and exit (after any call it is executing)."""
        self._broadcast(protocol.Shutdown(reason=reason), heartbeat_socket=False)

    def _broadcast(self, msg: protocol.Message, *, heartbeat_socket: bool,
                   ranks: Collection[int] | None = None) -> None:
        frames = protocol.encode(msg, epoch=self.epoch)
        with self._lock:
            for peer in self.peers.values():
                if not peer.lost and (ranks is None or peer.rank in ranks):
                    self.sock.send(peer.hb_identity if heartbeat_socket else peer.identity, frames)

    def close(self) -> None:
        self._stop.set()
        if self._pump is not None:
            self._pump.join(timeout=2)
