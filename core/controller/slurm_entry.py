"""Component 0's task on Slurm, as submitit pickles it: by reference to this light module.

The login node imports this module to hand ``slurm_main`` to submitit, so it imports
nothing at module level; the controller is loaded only inside the job.
"""
from __future__ import annotations


def slurm_main(run_dir: str) -> int:
    """The controller role in component 0 of the het job (core.controller.main.run_on_slurm)."""
    from core.controller.main import run_on_slurm  # zmq and the controller: inside the job only

    return run_on_slurm(run_dir)
