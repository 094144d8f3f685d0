"""Slurm's job states, once: Baton's word for each, and whether Slurm may still run the job.

``squeue -o %T`` and ``sacct -o State`` name a job's state in capitals; the first word is
the state (``CANCELLED by 0``), a trailing ``+`` marks more (``CANCELLED+``). `baton status`
and `baton cancel` (launcher.slurm_jobs) show the word and wait while a job is active; the
sweep ledger (launcher.ledger) derives a point's state from the word.

A state not here (a newer Slurm's) is ``unknown``, and not active.
"""
from __future__ import annotations

# Baton's words, and whether a job in that state may still run (or is running). The others
# are terminal: Slurm is done with the job unless someone requeues or resubmits it.
ACTIVE = frozenset({"pending", "held", "requeued", "suspended", "running", "ending"})
TERMINAL = frozenset({"completed", "cancelled", "failed", "timeout", "preempted"})

# Every job state of Slurm's squeue and sacct → Baton's word for it.
JOB_STATES: dict[str, str] = {
    "PENDING": "pending",
    "CONFIGURING": "pending",  # allocated, its nodes still booting: nothing runs yet
    "RESV_DEL_HOLD": "held",
    "REQUEUE_HOLD": "held",
    "REQUEUED": "requeued",
    "REQUEUE_FED": "requeued",
    "SUSPENDED": "suspended",
    "STOPPED": "suspended",
    "RUNNING": "running",
    "SIGNALING": "running",
    "RESIZING": "running",
    "COMPLETING": "ending",
    "STAGE_OUT": "ending",
    "COMPLETED": "completed",
    "CANCELLED": "cancelled",
    "REVOKED": "cancelled",  # a federated sibling removed: another cluster runs the job
    "FAILED": "failed",
    "BOOT_FAIL": "failed",
    "NODE_FAIL": "failed",
    "OUT_OF_MEMORY": "failed",
    "SPECIAL_EXIT": "failed",
    "TIMEOUT": "timeout",
    "DEADLINE": "timeout",
    # Ended by preemption. A job Slurm (PreemptMode=REQUEUE) or Baton requeues shows REQUEUED
    # and PENDING instead: PREEMPTED is what a job that will not run again says.
    "PREEMPTED": "preempted",
}


def word(slurm_state: str) -> str:
    """Baton's word for a Slurm state as squeue or sacct print it (``CANCELLED by 0`` → ``cancelled``)."""
    first = slurm_state.split()[0] if slurm_state.split() else ""
    return JOB_STATES.get(first.rstrip("+"), "unknown")


def active(slurm_state: str) -> bool:
    """Whether Slurm may still run (or is running) a job in ``slurm_state``."""
    return word(slurm_state) in ACTIVE
