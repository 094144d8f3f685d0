"""What the controller does when the run fails: restart the workers, requeue, or stop saying why.

    what went wrong (an exception out of Program.run_all)    what happens
    -------------------------------------------------------  -----------------------------------------
    a UserError (bad config, a checkpoint that cannot load)  fail at once (exit 2)
    RemoteError a worker flagged a user error                fail at once (exit 2)
      (core.errors.fault_class: a UserError)
    RemoteError, the same TypeError/ValueError/KeyError/...  fail at once: deterministic (a bug, a bad
      with the same message on every rank                      input: core.errors.PROGRAMMING_ERRORS)
    RemoteError, same rank/type/method/step as the last one  fail at once: a restart reproduced it
      (not a transient one)
    RemoteError transient on every failed rank (fault_class: a retry as below, whatever its signature:
      ENOSPC, EIO, ESTALE, a connection reset, a gloo/NCCL     only the budget ends it
      timeout), a storage fault in the controller's commit
    lost worker (exit, silence), missed deadline,            spend one retry (core.record.state.Budget), then
    registration timeout, any other RemoteError (a             retries spent            → fail, naming them
      RuntimeError of unknown cause, even on every rank)
                                                               its node drained/down    → requeue without it
                                                                 in Slurm's view
                                                               node failed twice, Slurm → requeue without it
                                                               supervisor restarts      → new generation
                                                                 workers here             after a backoff
                                                               else on Slurm            → requeue
                                                               else                     → fail, saying why
    the split generator's workers alone, lost while the      the same budget and policy; a restart restarts
      program waits for a rollout (restart_generator)          them alone, inside that wait: the trainer's
                                                               workers keep their state, nothing is undone
    a preemption signal while recovering                     requeue from the latest committed checkpoint
    Slurm requeued the job itself (a node set down:          checkpoint at the step boundary, name the
      SIGTERM with the job's Restarts past this epoch's)       nodes Slurm took (node_failed), exclude
                                                               those at recovery.node_failure_limit

A restart inside the allocation: abort the survivors, forget this generation, back off
(``recovery.backoff_s`` doubling per retry), ask the supervisor for the next generation
(core.supervisor.contract), then ``run_all`` again: register, setup, resume from the latest
committed checkpoint, train. Every decision is an event in the run's history.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from core.checkpoint import manifest
from core.controller.program import Program
from core.controller.stop import StopRequest
from core.errors import (
    PROGRAMMING_ERRORS,
    CallTimeoutError,
    ExitCode,
    RegistrationError,
    RemoteError,
    TransientIOError,
    UserError,
    WorkerLostError,
)
from core.job import slurmctl
from core.record import events as ev
from core.record.state import Budget, Status
from core.supervisor.contract import WorkerRequest, request_workers

log = logging.getLogger(__name__)

NODE_FAILURE_LIMIT = 2  # failures on one node before a requeue excludes it (Slurm)
MAX_BACKOFF_FACTOR = 8


@dataclass(frozen=True, kw_only=True)
class Failure:
    """One failure of the worker group, as recorded and counted."""

    kind: str  # "worker_lost" | "timeout" | "registration" | "remote_error" | "storage"
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    why: str  # one line
    step: int
    signature: tuple[object, ...] = ()  # a RemoteError's (rank, type, method, step)
    alone: bool = False  # a split generator's workers alone (restart_generator): a restart keeps the trainer's


@dataclass(frozen=True, kw_only=True)
class Decision:
    action: Literal["restart", "requeue", "fail"]
    reason: str
    backoff_s: float = 0.0
    exclude: tuple[str, ...] = ()
    down: tuple[str, ...] = ()  # of ``exclude``: the nodes Slurm has out of service


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """How the controller ends: completed, requeue (exit 85), stopped (checkpointed, Slurm is
    ending the job: not requeued) or failed (exit 1/2)."""

    status: Status  # COMPLETED, REQUEUED, STOPPED or FAILED
    reason: str = ""
    exit_code: ExitCode = ExitCode.OK
    exclude: tuple[str, ...] = ()
    readmit: tuple[str, ...] = ()  # earlier exclusions Slurm reports back in service: off the job's list
    clean: bool = True  # the workers are in a known state (shutdown) rather than to be aborted
    stop: StopRequest | None = None


class Decided(Exception):  # noqa: N818 - a decision, not an error
    """How the run ends, decided while the program was inside a call (``restart_generator``)."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.reason)
        self.outcome = outcome


def decide(failure: Failure, budget: Budget, *, max_retries: int, backoff_s: float,
           worker_restarts: bool, on_slurm: bool, node_failure_limit: int = NODE_FAILURE_LIMIT,
           out_of_service: tuple[str, ...] = ()) -> Decision:
    """The policy, pure: ``budget`` already counts this failure; ``out_of_service``: the
    failure's nodes that Slurm has drained or set down (no restart on them can help)."""
    by_node = ", ".join(f"{n}: {c}" for n, c in sorted(budget.node_failures.items())) or "none known"
    if budget.retries > max_retries:
        return Decision(action="fail", reason=(
            f"{failure.why}; gave up after {max_retries} retries (recovery.max_retries); "
            f"failures by node: {by_node}"))
    gone = [n for n in out_of_service if n not in budget.exclude]
    if on_slurm and gone:
        exclude = (*budget.exclude, *gone)
        return Decision(action="requeue", exclude=exclude, down=tuple(gone), reason=(
            f"node(s) {', '.join(gone)} drained or down in Slurm: requeue excluding {', '.join(exclude)}"))
    bad = [n for n, c in sorted(budget.node_failures.items()) if c >= node_failure_limit and n not in budget.exclude]
    if on_slurm and bad:
        exclude = (*budget.exclude, *bad)
        return Decision(action="requeue", exclude=exclude, reason=(
            f"node(s) {', '.join(bad)} failed {node_failure_limit}+ times (recovery.node_failure_limit): "
            f"requeue excluding {', '.join(exclude)}"))
    if worker_restarts:
        factor = min(2 ** (budget.retries - 1), MAX_BACKOFF_FACTOR)
        return Decision(action="restart", backoff_s=backoff_s * factor,
                        reason=f"retry {budget.retries} of {max_retries}: restarting the workers")
    if on_slurm:
        return Decision(action="requeue", exclude=budget.exclude,
                        reason=f"retry {budget.retries} of {max_retries}: requeue (this job script restarts no workers)")
    return Decision(action="fail", reason=(
        f"{failure.why}; not retried: nothing restarts workers here (BATON_WORKER_RESTARTS unset: "
        "no supervisor) and there is no Slurm job to requeue"))


def deterministic(exc: RemoteError, step: int, previous: tuple[object, ...]) -> str | None:
    """Why a remote error would only repeat on a retry, or None when a retry may help.
    ``previous``: the signature of the last remote error (``signature``), () if none.

    By cause, not by type: a transient fault (the storage, the network, a collective's
    timeout) is always worth a retry, bounded by the budget alone; the same exception on
    every rank is deterministic only when it names one cause (the same type and message)
    and its type names a bug (``PROGRAMMING_ERRORS``): a RuntimeError or OSError of unknown
    cause on every rank gets a retry, and the same-step rule ends it if it comes back.
    """
    if exc.transient:
        return None
    if exc.user_error:
        return f"{exc.exc_type} is a user error"
    if exc.same_on_all_ranks and exc.exc_type in PROGRAMMING_ERRORS:
        return f"every rank raised the same {exc.exc_type}: deterministic (a bug or a bad input)"
    if previous and previous == signature(exc, step):
        return "the same error came back at the same step after a restart"
    return None


def signature(exc: RemoteError, step: int) -> tuple[object, ...]:
    """What makes two remote errors the same one: rank, exception type, method, step."""
    return (exc.rank, exc.exc_type, exc.method, step)


def _less(nodes: tuple[str, ...], gone: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(n for n in nodes if n not in gone)


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


class Recovery:
    """Runs the program until it completes, stops for a requeue, or fails for good."""

    def __init__(self, program: Program, *, worker_restarts: bool, on_slurm: bool,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.program = program
        self.worker_restarts = worker_restarts
        self.on_slurm = on_slurm
        self._sleep = sleep
        self._last_signature: tuple[object, ...] = ()
        program.restart_generator = self.restart_generator

    def run(self) -> Outcome:
        while True:
            try:
                stop = self.program.run_all()
            except UserError as exc:
                return self._fail(f"{_first_line(exc)} (a user error: not retried)", ExitCode.USER_ERROR)
            except RemoteError as exc:
                step = self.program.step
                why_final = deterministic(exc, step, self._last_signature)
                if why_final is not None:
                    code = ExitCode.USER_ERROR if exc.user_error else ExitCode.FAILED
                    return self._fail(f"{_first_line(exc)}; not retried: {why_final}", code)
                self._last_signature = signature(exc, step)
                failure = self._failure("remote_error", (exc.rank,), _first_line(exc))
            except Decided as decided:  # restart_generator's decision, other than a restart
                return decided.outcome
            except WorkerLostError as exc:
                failure = self._failure("worker_lost", tuple(exc.ranks), _first_line(exc))
            except CallTimeoutError as exc:
                failure = self._failure("timeout", tuple(exc.missing), _first_line(exc))
            except RegistrationError as exc:
                failure = self._failure("registration", (), _first_line(exc))
            except TransientIOError as exc:  # the controller's own write (a commit) met a storage fault
                failure = self._failure("storage", (), _first_line(exc))
            else:
                return self._ended(stop)
            outcome = self._recover(failure)
            if outcome is not None:
                return outcome

    def _ended(self, stop: StopRequest | None) -> Outcome:
        step = self.program.step
        if stop is None:
            return Outcome(status=Status.COMPLETED)
        if stop.cause == "requeued":
            exclude, named = self._nodes_slurm_took()
            readmit = self._readmit(())  # the nodes Slurm took are not in service
            return Outcome(status=Status.REQUEUED, stop=stop, exclude=_less(exclude, readmit), readmit=readmit,
                           reason=f"Slurm requeued the job ({stop.detail}){named}")
        if stop.cause == "ending":
            return Outcome(status=Status.STOPPED, stop=stop, reason=(
                f"Slurm is ending the job ({stop.detail}; scancel or the time limit): checkpointed at "
                f"step {step}, not requeued; continue with `baton submit --resume`"))
        return Outcome(status=Status.REQUEUED, reason=f"{stop.cause} at step {step}", stop=stop,
                       readmit=self._readmit(()))

    # --- one failure ----------------------------------------------------------------------
    def _failure(self, kind: str, ranks: tuple[int, ...], why: str, *, alone: bool = False) -> Failure:
        peers = self.program.workers.peers
        nodes = tuple(sorted({peers[r].node for r in ranks if r in peers}))
        return Failure(kind=kind, ranks=ranks, nodes=nodes, why=why, step=self.program.step, alone=alone)

    def _recover(self, failure: Failure) -> Outcome | None:
        program, group, cfg = self.program, self.program.workers, self.program.cfg
        lost = []
        for r in failure.ranks or (-1,):
            peer = group.peers.get(r)
            lost.append(ev.WorkerLost(failure=failure.kind, rank=r if r >= 0 else None,
                                      node=peer.node if peer else None, pid=peer.pid if peer else None,
                                      why=(peer.lost if peer and peer.lost else failure.why), step=failure.step,
                                      epoch=group.epoch, generation=group.generation))
        program.record.append(*lost)
        log.error("failure at step %d (%s): %s", failure.step, failure.kind, failure.why)
        if program.stop.stop_requested():
            group.abort("controller: preempted while failing")
            exclude, named = self._nodes_slurm_took()
            readmit = self._readmit(())
            return Outcome(status=Status.REQUEUED, clean=False, exclude=_less(exclude, readmit), readmit=readmit, reason=(
                f"preempted during a failure ({failure.why}){named}; resuming from the latest checkpoint"))
        steps = manifest.committed_steps(program.run.checkpoints)
        down = slurmctl.unavailable_nodes(failure.nodes) if self.on_slurm else {}
        with program.record.update() as s:
            before = s.recovery.exclude
            budget = s.recovery.spend(nodes=failure.nodes, step=failure.step, committed_step=steps[-1] if steps else None)
            decision = decide(failure, budget, max_retries=cfg.recovery.max_retries, backoff_s=cfg.recovery.backoff_s,
                              worker_restarts=self.worker_restarts, on_slurm=self.on_slurm,
                              node_failure_limit=cfg.recovery.node_failure_limit, out_of_service=tuple(down))
            s.recovery = (replace(budget, exclude=decision.exclude, down=(*budget.down, *decision.down))
                          if decision.action == "requeue" else budget)
        program.record.append(*(ev.NodeFailed(node=n, state=st, why=why, step=failure.step,
                                              failures=budget.node_failures.get(n, 0)) for n, (st, why) in down.items()))
        if decision.action == "fail":
            return self._fail(decision.reason, ExitCode.FAILED)
        if decision.action == "requeue":
            readmit = self._readmit(tuple(n for n in decision.exclude if n not in before))
            decision = replace(decision, exclude=_less(decision.exclude, readmit))
            group.abort(f"controller: {decision.reason}")
            program.record.append(ev.RequeueDecided(reason=decision.reason, exclude=decision.exclude,
                                                    retry=budget.retries, max_retries=cfg.recovery.max_retries))
            return Outcome(status=Status.REQUEUED, reason=decision.reason, exclude=decision.exclude, readmit=readmit,
                           clean=False)
        if failure.alone:
            return self._restart_generator(decision, budget)
        return self._restart(decision, budget)

    def restart_generator(self, exc: WorkerLostError) -> tuple[int, ...]:
        """While the program waits for a rollout, workers of the split generator alone were lost
        (``exc``): recorded and counted as any lost worker; when the policy decides to restart,
        only the generator's workers restart, inside the call (the program goes on where it
        was: ``Program._generator_lost``); the ranks restarted. Any other decision (requeue,
        fail, a preemption meanwhile) raises ``Decided``, which ends ``run``."""
        assert self.program.generator is not None
        alone = set(self.program.generator.ranks)
        others = [p.rank for p in self.program.workers.lost() if p.rank not in alone]
        if others:  # lost with others (a host, a switch): every worker restarts
            raise WorkerLostError(f"{_first_line(exc)}; and ranks {others}", ranks=[*exc.ranks, *others]) from exc
        outcome = self._recover(self._failure("worker_lost", tuple(exc.ranks), _first_line(exc), alone=True))
        if outcome is not None:
            raise Decided(outcome)
        assert self.program.generator is not None
        return tuple(self.program.generator.ranks)

    def _nodes_slurm_took(self) -> tuple[tuple[str, ...], str]:
        """When a signal came with Slurm requeueing the job: the run's nodes Slurm has taken
        out of service (down, drained), each a failure of its node in the run's history; those
        at ``recovery.node_failure_limit`` are excluded from the requeued job. (Excluded nodes
        to add, a phrase naming the nodes for the reason.)"""
        program = self.program
        nodes = sorted({p.node for p in program.workers.peers.values() if p.node})
        down = slurmctl.unavailable_nodes(nodes) if self.on_slurm else {}
        if not down:
            return (), ""
        limit = program.cfg.recovery.node_failure_limit
        with program.record.update() as s:
            counts = dict(s.recovery.node_failures)
            for n in down:
                counts[n] = counts.get(n, 0) + 1
            bad = tuple(n for n in down if counts[n] >= limit and n not in s.recovery.exclude)
            s.recovery = replace(s.recovery, node_failures=counts, exclude=(*s.recovery.exclude, *bad),
                                 down=(*s.recovery.down, *bad))  # Slurm took them: readmitted once it gives them back
            exclude = s.recovery.exclude if bad else ()
        program.record.append(*(ev.NodeFailed(node=n, state=st, why=why, step=program.step, failures=counts[n])
                                for n, (st, why) in down.items()))
        named = "; ".join(f"node {n} is {st} in Slurm ({why or 'no reason given'})" for n, (st, why) in down.items())
        log.error("%s", named)
        if bad:
            named += f"; excluding {', '.join(exclude)} (recovery.node_failure_limit={limit})"
        return exclude, f": {named}"

    def _readmit(self, new: tuple[str, ...]) -> tuple[str, ...]:
        """At a requeue: Baton's exclusions from earlier requeues (not ``new``, this one's) made
        while Slurm had the node down or drained, that Slurm now reports back in service (idle,
        mixed, allocated), leave the run's exclusions; each keeps one failure less than
        ``recovery.node_failure_limit``, so that one more failure excludes it again. A node
        excluded for failures Slurm does not see (a GPU error, a hung NIC) looks idle to Slurm:
        it stays excluded. The user's own exclusions are not Baton's: never touched. Returns
        the readmitted nodes (events ``node_readmitted``)."""
        program = self.program
        recovery = program.record.read().recovery
        earlier = [n for n in recovery.exclude if n not in new and n in recovery.down]
        back = slurmctl.in_service(earlier) if self.on_slurm and earlier else set()
        if not back:
            return ()
        limit = program.cfg.recovery.node_failure_limit
        with program.record.update() as s:
            counts = {n: min(c, limit - 1) if n in back else c for n, c in s.recovery.node_failures.items()}
            s.recovery = replace(s.recovery, node_failures=counts,
                                 exclude=tuple(n for n in s.recovery.exclude if n not in back),
                                 down=tuple(n for n in s.recovery.down if n not in back))
        readmitted = tuple(n for n in earlier if n in back)
        program.record.append(*(ev.NodeReadmitted(node=n, step=program.step, failures=counts.get(n, 0))
                                for n in readmitted))
        log.warning("back in service in Slurm, no longer excluded: %s", ", ".join(readmitted))
        return readmitted

    def _restart(self, decision: Decision, budget: Budget) -> Outcome | None:
        """Abort what is left, back off, ask for the next generation; None: go round again."""
        program, group = self.program, self.program.workers
        group.abort(f"controller: {decision.reason}")
        program.checkpoints.forget()
        generation = group.generation + 1
        group.reset(generation)
        program.record.append(ev.RestartingWorkers(generation=generation, backoff_s=round(decision.backoff_s, 2),
                                                   retry=budget.retries, max_retries=program.cfg.recovery.max_retries,
                                                   step=program.step))
        log.warning("%s: generation %d after %.1f s", decision.reason, generation, decision.backoff_s)
        if self._back_off(decision.backoff_s):
            return Outcome(status=Status.REQUEUED, clean=False, reason="preempted while restarting the workers")
        request_workers(program.run, WorkerRequest(epoch=group.epoch, generation=generation,
                                                   exclude=budget.exclude, reason=decision.reason))
        return None

    def _restart_generator(self, decision: Decision, budget: Budget) -> Outcome | None:
        """Restart a split generator's workers alone: abort what is left of them, back off, ask
        the supervisor for the next generation of their ranks only; the trainer's workers keep
        their state and wait. The program then sets up the new ones and goes on. None: restarted."""
        program, group = self.program, self.program.workers
        assert program.generator is not None, "only a generator group restarts alone"
        ranks = tuple(program.generator.ranks)
        group.abort(f"controller: {decision.reason}", ranks=ranks)
        generation = group.generation + 1
        group.replace(ranks, generation)
        program.record.append(ev.RestartingWorkers(generation=generation, backoff_s=round(decision.backoff_s, 2),
                                                   retry=budget.retries, max_retries=program.cfg.recovery.max_retries,
                                                   step=program.step, ranks=ranks))
        log.warning("%s: the generator's ranks %s alone, generation %d after %.1f s", decision.reason, list(ranks),
                    generation, decision.backoff_s)
        if self._back_off(decision.backoff_s):
            return Outcome(status=Status.REQUEUED, clean=False, reason="preempted while restarting the generator")
        request_workers(program.run, WorkerRequest(epoch=group.epoch, generation=generation, ranks=ranks,
                                                   exclude=budget.exclude, reason=decision.reason))
        return None

    def _back_off(self, seconds: float) -> bool:
        """Wait ``seconds`` (sliced, so that a preemption cuts it short); whether one came."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.program.stop.stop_requested():
                return True
            self._sleep(min(0.1, deadline - time.monotonic()))
        return False

    def _fail(self, reason: str, code: ExitCode) -> Outcome:
        return Outcome(status=Status.FAILED, reason=reason, exit_code=code, clean=False)
