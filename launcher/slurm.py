"""The Slurm backend: a run is ONE heterogeneous job, submitted through submitit.

    component 0  the controller: 1 task on ``slurm.controller.partition``; the batch script
                 runs here and starts it with submitit's own command (a pickled call of
                 ``core.controller.slurm_entry.slurm_main``: job-side code, in core)
    component 1  the workers: ``trainer.nodes`` x ``trainer.n_gpus_per_node`` tasks on
                 ``slurm.workers.partition``, started with ``srun --het-group=1``

Steps, in order: ``job_spec_for`` (YAML + CLI flags → one ``core.config.jobspec.HetJobSpec``,
built once and passed to every later step), ``render`` (pure: the exact script, for
``--dry-run`` and golden tests), ``preflight`` (checks against ``sinfo`` and the file system;
nothing is submitted when one fails), ``submit`` (the one side effect). Then
``launcher.slurm_jobs``: states, status lines, cancel.

submitit has no heterogeneous jobs. Its private seam ``_make_submission_file_text`` is
overridden here and only here (``HetJobExecutor``); tests/unit/test_slurm_render.py fails
loudly if submitit changes it. This is submitit's only home module (tests/unit/test_layering.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from submitit.core import utils as submitit_utils
from submitit.slurm import slurm as submitit_slurm

from core.config.inputs import arg_number, arg_text
from core.config.jobspec import Component, HetJobSpec, SlurmComponentConfig, job_spec, parse_time_min, signal_lead_s
from core.config.roles import plan_roles
from core.config.run import RunConfig
from core.controller.slurm_entry import slurm_main
from core.errors import UserError
from core.record import events as ev
from core.record.runfolder import RunFolder, write_atomic, write_json
from core.record.state import RunRecord
from launcher import slurm_jobs

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "slurm_templates" / "hetjob.sbatch.tmpl"
# The walltime must hold startup, one step and one checkpoint. Neither is known before the
# run, so the floor is conservative: 2 min to start (queue-to-register, imports), 1 min for a
# step, 2 min to write and commit a checkpoint.
MIN_WALLTIME_MIN = 2 + 1 + 2
TOY_MIN_WALLTIME_MIN = 1  # the toy model (numpy, no torch) starts in seconds; steps and saves take ms


def min_walltime_min(cfg: RunConfig) -> int:
    """The shortest walltime preflight accepts for this run's model."""
    return TOY_MIN_WALLTIME_MIN if cfg.model.kind == "toy" else MIN_WALLTIME_MIN
SIGNAL_START_S = 30  # the walltime warning may not come sooner after the start
WORKERS_GRACE_S = 30.0  # after the controller exits, on top of timeouts.controller_lost_s
_CLI_OPTIONS = ("partition", "account", "qos", "time", "nodes", "gpus_per_node", "cpus_per_task", "mem",
                "constraint", "exclude", "reservation", "signal")

# ------------------------------------------------------------------------------- options


def add_sbatch_arguments(parser: argparse.ArgumentParser) -> None:
    """sbatch's own flags, for the workers component (YAML ``slurm.controller.*`` for the controller)."""
    g = parser.add_argument_group("Slurm (the workers component; the controller's options: slurm.controller.* in YAML)")
    ranges = {f.name: f.metadata.get("range") for f in dataclasses.fields(SlurmComponentConfig)}
    for name in _CLI_OPTIONS:  # the numbers in the YAML's ranges; no text with a control character
        rng = ranges[name]
        kind = arg_text if rng is None else arg_number(int, gt=rng.gt, ge=rng.ge, le=rng.le)
        g.add_argument("--" + name.replace("_", "-"), dest=f"slurm_{name}", type=kind, default=None,
                       help=f"sbatch --{name.replace('_', '-')} (default: slurm.workers.{name})")
    g.add_argument("--sbatch-extra", dest="slurm_extra", action="append", default=[], metavar="--FLAG[=VALUE]",
                   type=arg_text, help="a raw sbatch flag for the workers component (repeatable)")


def cli_overrides(args: argparse.Namespace | None) -> SlurmComponentConfig | None:
    """The workers' sbatch options given on the command line (unset ones are None)."""
    if args is None:
        return None
    given = {k: getattr(args, f"slurm_{k}", None) for k in _CLI_OPTIONS}
    return SlurmComponentConfig(**given, extra=list(getattr(args, "slurm_extra", None) or []))


def job_spec_for(cfg: RunConfig, args: argparse.Namespace | None = None) -> HetJobSpec:
    """The run's het job: ``cfg``'s YAML with the command line's sbatch flags over the workers'."""
    return job_spec(cfg, plan_roles(cfg), cli_overrides(args))


# -------------------------------------------------------------------------------- render


def _flag(key: str, value: Any) -> str:
    """``--key=value`` with the value quoted for the shell (sbatch unquotes #SBATCH lines)."""
    name = key.replace("_", "-")
    return f"--{name}" if value is True else f"--{name}={shlex.quote(str(value))}"


def _raw_flag(raw: str) -> tuple[str, Any]:
    key, sep, value = raw[2:].partition("=")
    return key, (value if sep else True)


def controller_command(folder: Path, python: str) -> str:
    """What submitit passes to ``_make_submission_file_text`` (its ``_submitit_command_str``)."""
    return " ".join([python, "-u -m submitit.core._submit", shlex.quote(str(folder))])


def _submitit_parameters(run: RunFolder, spec: HetJobSpec) -> dict[str, Any]:
    """Component 0, in submitit's parameter names (its builder writes those #SBATCH lines)."""
    ctl = spec.controller
    extra: dict[str, Any] = {"signal": ctl.signal, "requeue": True, "chdir": str(run.path)}
    if ctl.reservation:
        extra["reservation"] = ctl.reservation
    extra.update(_raw_flag(x) for x in ctl.extra)
    params: dict[str, Any] = {
        "job_name": spec.name, "time": ctl.time_min, "nodes": 1, "ntasks_per_node": 1,
        "comment": str(run.path),  # `baton status JOB_ID` finds the run folder from it
        "stderr_to_stdout": True, "wckey": None, "srun_args": ["--het-group=0"], "additional_parameters": extra,
    }
    for key in ("partition", "account", "qos", "cpus_per_task", "gpus_per_node", "mem", "constraint", "exclude"):
        if getattr(ctl, key) is not None:
            params[key] = getattr(ctl, key)
    return params


def _sbatch_options(c: Component) -> list[tuple[str, Any]]:
    """The set options of ``c`` under sbatch's names, in the order the script lists them."""
    options = [("partition", c.partition), ("account", c.account), ("qos", c.qos), ("time", c.time_min),
               ("nodes", c.nodes), ("ntasks_per_node", c.ntasks_per_node), ("gpus_per_node", c.gpus_per_node),
               ("cpus_per_task", c.cpus_per_task), ("mem", c.mem), ("constraint", c.constraint),
               ("exclude", c.exclude), ("reservation", c.reservation), ("signal", c.signal)]
    return [(key, value) for key, value in options if value is not None]


def _component_flags(spec: HetJobSpec, c: Component) -> list[str]:
    flags = [_flag("job_name", spec.name)] + [_flag(k, v) for k, v in _sbatch_options(c)]
    return flags + [_flag(*_raw_flag(x)) for x in c.extra]


_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def fill_template(text: str, values: dict[str, Any]) -> str:
    """Replace each ``{{name}}``; a line holding a list placeholder is repeated per item."""
    used: set[str] = set()
    out: list[str] = []
    for line in text.split("\n"):
        names = _PLACEHOLDER.findall(line)
        missing = [n for n in names if n not in values]
        if missing:
            raise KeyError(f"{TEMPLATE.name}: no value for {missing}")
        used.update(names)
        lists = [n for n in names if isinstance(values[n], list)]
        if lists and len(names) > 1:
            raise KeyError(f"{TEMPLATE.name}: list placeholder {lists[0]} must be alone on its line")
        if lists:
            out.extend(line.replace("{{" + lists[0] + "}}", item) for item in values[lists[0]])
        else:
            out.append(_PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), line))
    if set(values) - used:
        raise KeyError(f"{TEMPLATE.name}: unused values {sorted(set(values) - used)}")
    return "\n".join(out)


def compose(submitit_text: str, fields: dict[str, str | list[str]]) -> str:
    """submitit's component-0 script → the het-job script: its #SBATCH header and its
    command, with component 1 and the Baton body from the template around them."""
    lines = submitit_text.split("\n")
    flags = [i for i, line in enumerate(lines) if line.startswith("#SBATCH ")]
    try:
        command = lines[lines.index("export SUBMITIT_EXECUTOR=slurm") + 1]
    except (ValueError, IndexError):
        command = ""
    if lines[0] != "#!/bin/bash" or not flags or not command.startswith("srun ") or "# setup" in lines:
        raise RuntimeError("submitit's sbatch text changed shape (shebang, #SBATCH lines, then "
                           "'export SUBMITIT_EXECUTOR=slurm' and the srun command); update launcher/slurm.compose")
    values = dict(fields, component0="\n".join(lines[: flags[-1] + 1]), controller_command=command)
    return fill_template(TEMPLATE.read_text(), values)


def _fields(run: RunFolder, cfg: RunConfig, spec: HetJobSpec, python: str, pythonpath: str,
            epoch: int = 0) -> dict[str, Any]:
    return {
        "epoch_base": str(int(epoch)),
        "component1_flags": _component_flags(spec, spec.workers), "setup": list(spec.setup),
        "component2_lines": [] if spec.generator is None else
        ["#SBATCH hetjob"] + ["#SBATCH " + f for f in _component_flags(spec, spec.generator)],
        "generator_step": [] if spec.generator is None else
        [f"baton_worker_step 2 {spec.generator.first_rank} generator &", "baton_workers=\"$baton_workers $!\""],
        "run_dir": shlex.quote(str(run.path)), "pythonpath": shlex.quote(pythonpath), "python": python,
        "world_size": str(cfg.trainer.world_size), "nodes": str(cfg.trainer.nodes),
        "tasks_per_node": str(cfg.trainer.n_gpus_per_node),
        "workers_grace_s": str(int(cfg.timeouts.controller_lost_s + WORKERS_GRACE_S)),
        "signal_lead_s": str(signal_lead_s(spec.controller.signal)),
    }


def _shell_python(python: str | None) -> str:
    """The interpreter as one shell word (submitit puts it into the command unquoted)."""
    return shlex.quote(python or sys.executable)


def render(run: RunFolder, cfg: RunConfig, spec: HetJobSpec, *, epoch: int = 0, python: str | None = None,
           pythonpath: str | None = None) -> str:
    """The exact script ``submit`` would hand to sbatch (pure; the run folder need not exist).

    ``spec`` is the run's het job (``job_spec_for``; job-level flags such as a dependency:
    ``spec.with_job_flags``). ``epoch`` is the run's epoch at submit (0, or the next one on
    resume): the job's BATON_EPOCH is it plus SLURM_RESTART_COUNT. ``python`` is the
    interpreter path (default: this one), ``pythonpath`` the folder that holds ``core`` and
    ``launcher`` (default: this checkout).
    """
    py = _shell_python(python)
    folder = slurm_jobs.submitit_folder(run)
    text = submitit_slurm._make_sbatch_string(command=controller_command(folder, py), folder=folder,
                                              **_submitit_parameters(run, spec))
    return compose(text, _fields(run, cfg, spec, py, pythonpath or str(REPO), epoch))


class HetJobExecutor(submitit_slurm.SlurmExecutor):
    """submitit's SlurmExecutor, writing a heterogeneous job: its own text for component 0
    (from ``spec.controller``), then ``#SBATCH hetjob``, the workers' flags and Baton's body
    (``compose``).

    ``expected`` is the script ``render`` gave for the same arguments; a different text is
    refused before sbatch runs, so ``--dry-run`` always shows what is submitted.
    """

    def __init__(self, run: RunFolder, cfg: RunConfig, spec: HetJobSpec, *, expected: str, epoch: int = 0,
                 python: str | None = None, pythonpath: str | None = None) -> None:
        py = _shell_python(python)
        super().__init__(slurm_jobs.submitit_folder(run), python=py)
        self._fields = _fields(run, cfg, spec, py, pythonpath or str(REPO), epoch)
        self._expected = expected
        self.update_parameters(**_submitit_parameters(run, spec))

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        text = compose(super()._make_submission_file_text(command, uid), self._fields)
        if text != self._expected:
            raise RuntimeError("the script submitit would submit differs from render(); nothing submitted")
        return text


# ------------------------------------------------------------------------------ preflight


def _gpus(gres: str) -> int:
    gres = re.sub(r"\([^)]*\)", "", gres)  # gpu:a100:4(S:0-1) → gpu:a100:4
    return sum(int(n) for n in re.findall(r"(?:^|,)gpu(?::[^:,]+)?:(\d+)", gres))


def _limit_min(text: str) -> int | None:
    return None if text.strip().lower() in ("infinite", "unlimited", "n/a", "") else parse_time_min(text, "sinfo")


def _check_signal_fits(role: str, c: Component) -> None:
    """The walltime warning (``--signal``; Slurm may send it up to a minute early) must come
    after start-up (SIGNAL_START_S), not while the controller is still installing its handler."""
    lead = signal_lead_s(c.signal) + 60
    if c.time_min * 60 < lead + SIGNAL_START_S:
        raise UserError(f"preflight: slurm.{role}.signal: {c.signal} may come {lead} s before the end of a "
                        f"{c.time_min} min job, while it starts; ask for at least "
                        f"{-(-(lead + SIGNAL_START_S) // 60)} min or a shorter lead (e.g. slurm.{role}.signal=USR2@30)")


def preflight(spec: HetJobSpec, runs_root: Path, *, min_time_min: int = MIN_WALLTIME_MIN) -> None:
    """Checks that ``spec`` can start; the first failure raises UserError naming it.

    Partitions exist (``sinfo``); some partition nodes hold the workers' GPUs and CPUs;
    ``runs_root`` is writable; each walltime holds one step plus one checkpoint
    (MIN_WALLTIME_MIN, conservative) and fits the partition's limit; the controller's
    walltime is not shorter than the workers'.
    """
    proc = slurm_jobs.run_cli(["sinfo", "-h", "-N", "-o", "%P|%N|%G|%c|%l"])
    if proc.returncode != 0:
        raise UserError(f"preflight: sinfo failed: {proc.stderr.strip() or proc.stdout.strip()}")
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.count("|") == 4]
    default = next((p.rstrip("*") for p, *_ in rows if p.endswith("*")), None)
    partitions = sorted({p.rstrip("*") for p, *_ in rows})
    for c in spec.components:
        role, part = c.role, c.partition or default
        where = f"slurm.{role}.partition" + (" / --partition" if role == "workers" else "")
        if part is None:
            raise UserError(f"preflight: {where}: not set and the cluster has no default partition; set one of {partitions}")
        nodes = [r for r in rows if r[0].rstrip("*") == part]
        if not nodes:
            raise UserError(f"preflight: {where}: partition {part!r} does not exist; choose one of {partitions}")
        gpus, cpus = c.gpus_per_node or 0, c.ntasks_per_node * (c.cpus_per_task or 1)
        fit = [r for r in nodes if _gpus(r[2]) >= gpus and int(r[3]) >= cpus]
        if len(fit) < c.nodes:
            most = max(_gpus(r[2]) for r in nodes)
            raise UserError(
                f"preflight: {role} ask {c.nodes} node(s) with {gpus} GPU(s) and {cpus} CPU(s) each on partition "
                f"{part!r}, but only {len(fit)} of its nodes fit (at most {most} GPU(s) per node); lower "
                f"trainer.n_gpus_per_node / --gpus-per-node / --cpus-per-task or pick another partition")
        limits = [_limit_min(r[4]) for r in nodes]
        limit = None if None in limits else max(x for x in limits if x is not None)
        if limit is not None and c.time_min > limit:
            raise UserError(f"preflight: slurm.{role}.time: {c.time_min} min exceeds partition {part!r}'s limit "
                            f"of {limit} min; ask for less")
        if c.time_min < min_time_min:
            raise UserError(f"preflight: slurm.{role}.time: {c.time_min} min cannot hold startup, one step and one "
                            f"checkpoint; ask for at least {min_time_min} min")
        _check_signal_fits(role, c)
    for c in spec.components[1:]:
        if spec.controller.time_min < c.time_min:
            raise UserError(f"preflight: slurm.controller.time: {spec.controller.time_min} min is shorter than the "
                            f"{c.role} component's {c.time_min} min; the controller must outlive them")
    existing = next(p for p in [runs_root, *runs_root.parents] if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"preflight: runs_root {runs_root}: {existing} is not a writable folder; set runs_root=...")


# --------------------------------------------------------------------------------- submit


def submit(run: RunFolder, cfg: RunConfig, spec: HetJobSpec, *, epoch: int = 0, python: str | None = None) -> str:
    """Write job.sbatch (the exact script of ``render``), submit it through submitit, record the job id.

    ``spec`` and ``epoch``: as in ``render``. Returns the leader's job id.
    """
    script = render(run, cfg, spec, epoch=epoch, python=python)
    write_atomic(run.sbatch, script)
    executor = HetJobExecutor(run, cfg, spec, expected=script, epoch=epoch, python=python)
    try:
        job = executor.submit(slurm_main, str(run.path))
    except (submitit_utils.FailedJobError, submitit_utils.FailedSubmissionError) as exc:
        reason = (str(exc).strip().splitlines() or ["no output"])[-1]
        RunRecord(run).append(ev.SubmitFailed(reason=reason))
        raise UserError(f"sbatch refused the job: {reason}") from None
    job_id = str(job.job_id)
    write_json(slurm_jobs.job_record(run), {"job_id": job_id, "backend": "slurm", "submitted": time.time(),
                                 "components": {"controller": f"{job_id}+0", "workers": f"{job_id}+1"}})
    RunRecord(run).append(ev.Submitted(backend="slurm", job_id=job_id, epoch=epoch))
    log.debug("submitted job %s for %s", job_id, run.path)
    return job_id
