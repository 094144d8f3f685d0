"""The contract between the controller and its supervisor, the process that starts things.

The supervisor is launcher/local.py locally and the batch script on Slurm. It starts the
controller and generation 0 of the workers; afterwards it acts only on what it is told:

``workers.json`` ``{"epoch": e, "generation": g, "exclude": [...], "reason": "...", "time": t}``
    written by the controller once it has declared workers lost and aborted the rest:
    "start generation g of the worker step of epoch e" (env ``BATON_GENERATION=g``). The
    supervisor first ends, by pid, whatever is left of the previous generation (a stopped
    process does not act on an abort), then starts the new one.

the controller's exit, read from ``state.json`` (exit codes do not survive every wrapper)
    status ``requeued`` (exit ``EXIT_REQUEUED``): start the next epoch (on Slurm the job was
    requeued; locally the supervisor relaunches with epoch + 1);
    ``completed`` / ``failed`` / ``stopped``: done; still ``running``: the controller died without a last
    word, so the supervisor requeues within ``recovery.max_retries`` (``after_controller``).

A supervisor says it honours ``workers.json`` by setting ``BATON_WORKER_RESTARTS=1`` in
the controller's environment; without it, a lost worker costs a requeue instead.

The retry budget (``state["recovery"]``, a ``Budget``) is shared by both sides: the
controller spends it on worker failures, the supervisor on controller deaths.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from core.record.runfolder import RunFolder, event, read_json, write_json

EXIT_REQUEUED = 85  # the controller checkpointed and asks for the next epoch
FINAL = ("completed", "failed", "stopped", "cancelled")


def request_path(run: RunFolder) -> Path:
    return run.path / "workers.json"


@dataclass(frozen=True, kw_only=True)
class WorkerRequest:
    """Start generation ``generation`` of epoch ``epoch``'s worker step."""

    epoch: int
    generation: int
    exclude: tuple[str, ...] = ()
    reason: str = ""
    time: float = 0.0


def request_workers(run: RunFolder, req: WorkerRequest) -> None:
    """The controller's side: ask for a (new) generation of workers."""
    write_json(request_path(run), {"epoch": req.epoch, "generation": req.generation, "exclude": list(req.exclude),
                                   "reason": req.reason, "time": req.time or time.time()})


def read_request(run: RunFolder) -> WorkerRequest | None:
    """The supervisor's side: the latest request, None when there is none (or it is unreadable)."""
    try:
        d = read_json(request_path(run))
        return WorkerRequest(epoch=int(d["epoch"]), generation=int(d["generation"]),
                             exclude=tuple(d.get("exclude", ())), reason=str(d.get("reason", "")),
                             time=float(d.get("time", 0.0)))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


# ----------------------------------------------------------------------------- the budget


@dataclass(frozen=True, kw_only=True)
class Budget:
    """Retries spent since the run last made durable progress, and failures per node.

    Stored in ``state["recovery"]`` so requeues keep it. It resets once a checkpoint newer
    than the last failure commits: a run that fails once a day is not a run that fails.
    """

    retries: int = 0
    node_failures: dict[str, int] = field(default_factory=dict)
    exclude: tuple[str, ...] = ()
    last_failure_step: int = -1

    @classmethod
    def of(cls, state: dict[str, Any]) -> Budget:
        d = state.get("recovery") or {}
        return cls(retries=int(d.get("retries", 0)), node_failures=dict(d.get("node_failures", {})),
                   exclude=tuple(d.get("exclude", ())), last_failure_step=int(d.get("last_failure_step", -1)))

    def store(self, state: dict[str, Any]) -> None:
        state["recovery"] = {"retries": self.retries, "node_failures": dict(self.node_failures),
                             "exclude": list(self.exclude), "last_failure_step": self.last_failure_step}

    def spend(self, *, nodes: tuple[str, ...], step: int, committed_step: int | None) -> Budget:
        """One more failure at ``step`` on ``nodes``; forgiven first if a newer checkpoint committed."""
        b = self
        if committed_step is not None and b.last_failure_step >= 0 and committed_step > b.last_failure_step:
            b = replace(b, retries=0, node_failures={})
        counts = dict(b.node_failures)
        for n in nodes:
            counts[n] = counts.get(n, 0) + 1
        return replace(b, retries=b.retries + 1, node_failures=counts, last_failure_step=step)


def after_controller(run: RunFolder, exit_code: int, *, max_retries: int, committed_step: int | None) -> str:
    """The supervisor's decision once the controller has exited: ``requeue`` or ``stop``.

    A controller that left status ``running`` died (killed, OOM, a crash before its
    handlers ran); that spends one retry, recorded in state.json with the exit code.
    """
    state = run.read_state()
    status = state.get("status")
    if status == "requeued":
        return "requeue"
    if status in FINAL or status is None:
        return "stop"
    budget = Budget.of(state).spend(nodes=(), step=int(state.get("step", 0)), committed_step=committed_step)
    budget.store(state)
    how = f"signal {-exit_code}" if exit_code < 0 else f"exit code {exit_code}"
    event(state, "controller_died", exit_code=exit_code, step=state.get("step", 0), epoch=state.get("epoch"),
          retry=budget.retries, max_retries=max_retries)
    if budget.retries > max_retries:
        reason = (f"the controller died ({how}) with no retries left ({max_retries} used, "
                  f"recovery.max_retries); see {run.controller_log}")
        state.update(status="failed", reason=reason)
        event(state, "failed", reason=reason, step=state.get("step", 0))
        run.write_state(state)
        return "stop"
    state.update(status="requeued")
    event(state, "requeued", by="supervisor", why=f"the controller died ({how})", step=state.get("step", 0))
    run.write_state(state)
    return "requeue"


def main(argv: list[str]) -> int:
    """``python -m core.supervisor.contract after-controller RUN_DIR EXIT_CODE``: for a batch script.

    Prints ``requeue`` or ``stop``; on Slurm a ``requeue`` of a controller that died is done
    here (the controller requeues itself otherwise). Exit 0 either way.
    """
    import os

    from core.checkpoint import manifest
    from core.job import slurmctl
    from core.spec import config as config_mod

    if len(argv) != 3 or argv[0] != "after-controller":
        print("usage: python -m core.supervisor.contract after-controller RUN_DIR EXIT_CODE", file=sys.stderr)
        return 2
    run = RunFolder.open(Path(argv[1]))
    cfg = config_mod.load(run.config)
    steps = manifest.committed_steps(run.checkpoints)
    before = run.read_state().get("status")
    decision = after_controller(run, int(argv[2]), max_retries=cfg.recovery.max_retries,
                                committed_step=steps[-1] if steps else None)
    job_id = os.environ.get("SLURM_JOB_ID")
    if decision == "requeue" and before == "running" and job_id:
        result = slurmctl.requeue(job_id)
        if not result.ok:
            print(f"baton: requeue failed: {result.detail}", file=sys.stderr)
    print(decision)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
