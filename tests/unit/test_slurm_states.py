"""One table of Slurm job states (launcher.slurm_states), used by `baton status`/`cancel` and the sweep ledger."""
from __future__ import annotations

import pytest

from launcher import ledger, slurm_jobs, slurm_states
from launcher.ledger import Entry

# Every job state squeue and sacct name (Slurm's JOB STATE CODES): Baton's word, whether the
# job may still run, and the state of a sweep point whose job is in it.
EVERY_STATE = {
    "PENDING": ("pending", True, "queued"),
    "CONFIGURING": ("pending", True, "queued"),
    "RESV_DEL_HOLD": ("held", True, "queued"),
    "REQUEUE_HOLD": ("held", True, "queued"),
    "REQUEUED": ("requeued", True, "queued"),
    "REQUEUE_FED": ("requeued", True, "queued"),
    "RUNNING": ("running", True, "running"),
    "SIGNALING": ("running", True, "running"),
    "RESIZING": ("running", True, "running"),
    "SUSPENDED": ("suspended", True, "running"),
    "STOPPED": ("suspended", True, "running"),
    "COMPLETING": ("ending", True, "running"),
    "STAGE_OUT": ("ending", True, "running"),
    "COMPLETED": ("completed", False, "failed"),  # the job ended, its run did not complete
    "CANCELLED": ("cancelled", False, "cancelled"),
    "REVOKED": ("cancelled", False, "cancelled"),
    "FAILED": ("failed", False, "failed"),
    "BOOT_FAIL": ("failed", False, "failed"),
    "NODE_FAIL": ("failed", False, "failed"),
    "OUT_OF_MEMORY": ("failed", False, "failed"),
    "SPECIAL_EXIT": ("failed", False, "failed"),
    "TIMEOUT": ("timeout", False, "failed"),
    "DEADLINE": ("timeout", False, "failed"),
    "PREEMPTED": ("preempted", False, "failed"),  # ended by preemption: a requeued job says REQUEUED/PENDING
}


def test_the_table_names_every_slurm_job_state_and_nothing_else() -> None:
    assert set(slurm_states.JOB_STATES) == set(EVERY_STATE)
    assert set(slurm_states.JOB_STATES.values()) == slurm_states.ACTIVE | slurm_states.TERMINAL
    assert not slurm_states.ACTIVE & slurm_states.TERMINAL


@pytest.mark.parametrize("state", list(EVERY_STATE))
def test_each_state_has_one_word_one_activity_and_one_point_state(state: str) -> None:
    word, active, point = EVERY_STATE[state]
    assert slurm_states.word(state) == word and slurm_states.word(f"{state}+") == word
    assert slurm_states.active(state) is active
    assert (slurm_jobs.baton_state(state) in slurm_jobs.ACTIVE) is active  # baton status and cancel
    e = Entry(index=0, params={}, run_id="r", run_dir="/x", backend="slurm", job_id="5", state="queued")
    assert ledger.point_state(e, "running", state, local_alive=None) == point  # the sweep ledger


def test_a_state_slurm_adds_later_is_unknown_and_not_active() -> None:
    assert slurm_states.word("SOMETHING_NEW") == "unknown" and not slurm_states.active("SOMETHING_NEW")
    assert slurm_states.word("") == "unknown"
    assert slurm_states.word("CANCELLED by 1000") == "cancelled"
    e = Entry(index=0, params={}, run_id="r", run_dir="/x", backend="slurm", job_id="5", state="running")
    assert ledger.point_state(e, None, "SOMETHING_NEW", local_alive=None) == "running"  # the ledger's last word
