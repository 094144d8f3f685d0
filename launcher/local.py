"""The local backend: the controller and N workers as processes on this machine, supervised.

Same entry point and environment contract as the Slurm backend (core.job.env); CPU and
gloo. This module is the local supervisor of core.supervisor.contract:

- an epoch starts the controller and generation 0 of the workers; when the controller
  asks for generation g (``workers.json``, after it declared workers lost), whatever is
  left of the previous generation is killed by pid (a stopped process ignores the abort)
  and generation g is started with ``BATON_GENERATION=g`` (only the ranks the request names,
  when it names some: a split generator restarted while the trainer's workers go on);
- when the controller exits, ``core.supervisor.contract.after_controller`` reads its last word:
  requeued (ExitCode.REQUEUED) → the next epoch, the local analogue of Slurm's requeue; died
  without one → the next epoch within ``recovery.max_retries``; completed, failed → done.

Every process started here is ended here, by pid, also on Ctrl-C, SIGTERM or SIGHUP (a
closed terminal, a ``timeout`` wrapper, ``baton cancel``): the controller gets SIGTERM first,
which it answers like a preemption (checkpoint, then exit), then whatever is left of each
child's process group is killed; the run is recorded stopped and the launcher exits with
128 + the signal's number. A second signal meanwhile does not cut that short. The processes
are on record in the run folder (``launcher.localrun``: local.json) for ``baton cancel``.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from core.checkpoint import manifest
from core.config import run as config_mod
from core.config.run import RunConfig
from core.config.runplan import read_plan
from core.record import events as ev
from core.record.runfolder import RunFolder
from core.record.state import RunRecord, Status
from core.supervisor import contract
from launcher import localrun

log = logging.getLogger(__name__)

_GRACE_S = 10.0
_POLL_S = 0.05  # how often the supervisor looks at the controller and workers.json
MAX_EPOCHS = 1000  # a guard against a requeue loop (Slurm has MaxBatchRequeue)

Proc = subprocess.Popen[bytes]
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A stop signal reached the local supervisor: end the run as Ctrl-C does."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupted(code: int) -> bool:
    """``run_local``'s exit code says a stop signal ended the run (128 + its number)."""
    return code in {128 + s for s in STOP_SIGNALS}


def child_env(run: RunFolder, *, epoch: int, rank: int | None, generation: int = 0,
              supervised: bool = False) -> dict[str, str]:
    """The environment contract for one process (see core.job.env)."""
    env = dict(os.environ)
    env.update(
        BATON_RUN_DIR=str(run.path),
        BATON_EPOCH=str(epoch),
        BATON_GENERATION=str(generation),
        BATON_NODE="local",
        BATON_CONTROLLER_HOST="127.0.0.1",
        OMP_NUM_THREADS="1",  # one thread per process: oversubscription ruins CPU steps
        PYTHONUNBUFFERED="1",
    )
    env.pop("BATON_RANK", None)
    env.pop("BATON_WORKER_RESTARTS", None)
    if rank is not None:
        env["BATON_RANK"] = str(rank)
    if supervised:  # this supervisor honours workers.json (core.supervisor.contract)
        env["BATON_WORKER_RESTARTS"] = "1"
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _spawn(run: RunFolder, role: str, *, epoch: int, rank: int | None, generation: int = 0,
           supervised: bool = False) -> Proc:
    name = "controller" if rank is None else f"worker_r{rank:05d}"
    out = open(run.logs / f"{name}.out", "ab")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "core.entrypoint", role],
            env=child_env(run, epoch=epoch, rank=rank, generation=generation, supervised=supervised),
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches only us; we end the children in order
        )
    finally:
        out.close()


def _spawn_workers(run: RunFolder, *, epoch: int, generation: int,
                   ranks: Collection[int] | None = None) -> dict[int, Proc]:
    """Every worker process of the plan (of ``ranks`` only, when given), by rank: the
    trainer's, then a split generator's."""
    written = config_mod.load(run.config)  # the run folder's (submit resolves init_from into it)
    return {r: _spawn(run, "worker", epoch=epoch, rank=r, generation=generation)
            for r in range(read_plan(run.plan, written).workers) if ranks is None or r in ranks}


def _kill(procs: list[Proc], why: str) -> None:
    """SIGKILL whatever is still running of ``procs`` and of their process groups (ours: each
    child leads its own, and while it is not reaped its pid cannot be reused) and reap it."""
    for p in procs:
        if p.poll() is None:
            log.warning("ending pid %d: %s", p.pid, why)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _end(controller: Proc, workers: list[Proc], grace_s: float) -> None:
    """The controller gets SIGTERM (it checkpoints and releases its workers), then grace_s;
    workers ignore SIGTERM by design, so what remains of everything is SIGKILLed."""
    if controller.poll() is None:
        controller.send_signal(signal.SIGTERM)
        try:
            controller.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + min(grace_s, 2.0)
    for w in workers:
        try:
            w.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _kill([controller, *workers], "still running as the local run ends")


Spawned = list[tuple[Proc, list[Proc]]]  # each epoch's controller and every worker it had


def _run_epoch(run: RunFolder, cfg: RunConfig, epoch: int, tick: Callable[[], None], spawned: Spawned) -> int:
    """One epoch: the controller and its worker generations; the controller's exit code.
    ``tick`` runs at every look (the foreground's live progress); ``spawned`` gets the processes."""
    controller = _spawn(run, "controller", epoch=epoch, rank=None, supervised=True)
    generation = 0
    started: list[Proc] = []
    spawned.append((controller, started))
    workers = _spawn_workers(run, epoch=epoch, generation=generation)
    started += workers.values()
    _on_record(run, controller, started)
    try:
        while True:
            try:
                code = controller.wait(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            tick()
            req = contract.read_request(run)
            if req is not None and req.epoch == epoch and req.generation > generation:
                ended = [r for r in workers if req.restarts(r)]
                _kill([workers[r] for r in ended], f"a worker of generation {generation}, still running after the "
                      "controller's abort")
                generation = req.generation
                log.info("starting generation %d of the workers (epoch %d; ranks %s): %s", generation, epoch,
                         ended if req.ranks else "all", req.reason)
                new = _spawn_workers(run, epoch=epoch, generation=generation, ranks=ended)
                workers.update(new)
                started += new.values()
                _on_record(run, controller, started)
        if RunRecord(run).read().status is Status.RUNNING:  # the controller died: its workers are of no use
            _kill(list(workers.values()), f"the controller exited ({code}) without a last word")
        # Workers exit on the controller's shutdown/abort, or by themselves once it is silent.
        deadline = time.monotonic() + cfg.timeouts.controller_lost_s + _GRACE_S
        for w in workers.values():
            try:
                w.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker pid %d still running after the controller exited; ending it", w.pid)
        return code
    finally:
        _end(controller, started, _GRACE_S)


def _on_record(run: RunFolder, controller: Proc, started: list[Proc]) -> None:
    """local.json: this supervisor and the processes it started that may still run."""
    localrun.record(run, [(controller.pid, "controller"), *((w.pid, "worker") for w in started if w.poll() is None)])


def run_local(run: RunFolder, cfg: RunConfig, *, epoch: int = 0, tick: Callable[[], None] = lambda: None) -> int:
    """Run epochs until the controller completes, fails or stops; its last exit code, or
    128 + the number of a stop signal (Ctrl-C, SIGTERM, SIGHUP) that ended it.
    ``tick`` runs whenever the supervisor looks at its processes."""
    old = _install_stop_handlers()
    spawned: Spawned = []
    try:
        return _run_epochs(run, cfg, epoch, tick, spawned)
    except KeyboardInterrupt as exc:  # Interrupted, or Ctrl-C where no handler could be installed
        signum = getattr(exc, "signum", signal.SIGINT)
        for controller, workers in spawned:  # normally ended already (_run_epoch's finally)
            _end(controller, workers, _GRACE_S)
        _record_stopped(run, signal.Signals(signum).name)
        return 128 + signum
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)


def _run_epochs(run: RunFolder, cfg: RunConfig, epoch: int, tick: Callable[[], None], spawned: Spawned) -> int:
    first = epoch
    while True:
        code = _run_epoch(run, cfg, epoch, tick, spawned)
        steps = manifest.committed_steps(run.checkpoints)
        status = contract.after_controller(run, code, max_retries=cfg.recovery.max_retries,
                                           committed_step=steps[-1] if steps else None)
        if status is not Status.REQUEUED:
            return code
        if epoch + 1 - first >= MAX_EPOCHS:
            log.error("%d epochs in one local run: giving up", MAX_EPOCHS)
            return code
        epoch += 1
        log.info("requeued: starting epoch %d", epoch)


def _install_stop_handlers() -> dict[int, object]:
    """SIGINT, SIGTERM and SIGHUP raise ``Interrupted`` once; a later one is logged and
    ignored, so that the ending of the children is not cut short. Returns the old handlers
    (none installed off the main thread, where Python allows no handler)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    seen: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if seen:
            log.warning("%s: already ending the run (after %s)", signal.Signals(signum).name,
                        signal.Signals(seen[0]).name)
            return
        seen.append(signum)
        raise Interrupted(signum)

    return {s: signal.signal(s, handler) for s in STOP_SIGNALS}


def _record_stopped(run: RunFolder, name: str) -> None:
    """After a stop signal ended the run's processes: the run is stopped, unless it ended."""
    log.warning("%s: the controller and workers were ended", name)
    state = RunRecord(run).read()
    if not state.status.final:
        RunRecord(run).append(ev.Stopped(step=state.step, reason=(
            f"{name} to the local supervisor (baton submit): the controller was asked to checkpoint, then every "
            f"process of the run was ended; continue with `baton submit --resume {run.path}`")))
