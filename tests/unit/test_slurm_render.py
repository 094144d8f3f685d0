"""The Slurm backend without Slurm: the rendered het-job script, options, preflight, states.

Golden files: tests/unit/golden/hetjob_*.sbatch. Regenerate them (then review the diff) with

    BATON_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_slurm_render.py

Fakes only at the process boundary: recorded sinfo / squeue / sacct output.
"""
from __future__ import annotations

import argparse
import inspect
import math
import os
import shlex
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import submitit
from submitit.slurm import slurm as submitit_slurm

from core.config import run as config
from core.errors import UserError
from core.record.runfolder import RunFolder
from launcher import slurm, slurm_jobs

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"
REGEN = "BATON_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_slurm_render.py"
AWKWARD = Path("/runs/with space/it's \"quoted\"/toy/20260101-000000-abcd")
PYTHON = "/opt/baton venv/bin/python"
PYTHONPATH = "/src/baton"


def toy(*overrides: str) -> config.RunConfig:
    return config.load(REPO / "experiments" / "toy.yaml", ["trainer.steps=30", *overrides])


def cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    slurm.add_sbatch_arguments(parser)
    return parser.parse_args(list(argv))


def rendered(cfg: config.RunConfig, args: argparse.Namespace | None = None, path: Path = AWKWARD) -> str:
    return slurm.render(RunFolder(path), cfg, slurm.job_spec_for(cfg, args), python=PYTHON, pythonpath=PYTHONPATH)


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("BATON_REGEN_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"missing golden file {path}; create it with: {REGEN}"
    assert text == path.read_text(), f"rendered script differs from {path}; if intended, regenerate: {REGEN}"


# ------------------------------------------------------------------------------ golden


def test_default_script_matches_golden() -> None:
    cfg = toy("slurm.controller.partition=cpu", "slurm.workers.partition=gpu")
    check_golden("hetjob_default.sbatch", rendered(cfg))


def test_script_with_every_option_matches_golden() -> None:
    cfg = toy("trainer.nodes=2", "slurm.controller.partition=cpu", "slurm.controller.mem=2G",
              "slurm.controller.extra=['--mail-type=END']", "slurm.setup=['module load cuda/12', 'source \"/opt/my env/bin/activate\"']")
    args = cli("--partition", "gpu a100", "--account", "proj's", "--qos", "high", "--time", "1-02:03:04", "--nodes", "2",
               "--gpus-per-node", "8", "--cpus-per-task", "6", "--mem", "64G", "--constraint", "a100&ib",
               "--exclude", "node[3-4]", "--reservation", "r1", "--signal", "B:USR1@120",
               "--sbatch-extra=--exclusive", "--sbatch-extra=--comment-x=a b")
    check_golden("hetjob_all_options.sbatch", rendered(cfg, args))


def test_split_generator_is_a_third_component_with_its_own_worker_step() -> None:
    cfg = config.load(REPO / "experiments" / "tiny_gpt_generate.yaml", [
        "generator.placement=split", "generator.workers=2", "slurm.generator.partition=cpu", "slurm.generator.time='20'"])
    script = rendered(cfg)
    check_golden("hetjob_split_generator.sbatch", script)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    lines = script.splitlines()
    gen = lines[[i for i, line in enumerate(lines) if line == "#SBATCH hetjob"][1]:]
    assert [line for line in lines if line == "#SBATCH hetjob"] == ["#SBATCH hetjob"] * 2
    assert "#SBATCH --partition=cpu" in gen and "#SBATCH --ntasks-per-node=2" in gen and "#SBATCH --time=20" in gen
    assert "#SBATCH --gpus-per-node=2" in gen and "#SBATCH --nodes=1" in gen
    assert "baton_worker_step 1 0 worker &" in lines and "baton_worker_step 2 4 generator &" in lines


def test_a_vllm_generators_component_asks_for_its_engines_cpus_and_host_memory() -> None:
    """generator.engine=vllm: each task of component 2 gets 2 CPUs (the worker and its engine's
    core process) and the node the host memory of its workers, engines and weights: tp 2 on 4
    workers is two engines of a core and 2 workers each; without GPUs the KV cache too."""
    base = ["generator.placement=split", "slurm.generator.partition=cpu"]

    def gen(*overrides: str) -> list[str]:
        script = rendered(config.load(REPO / "experiments" / "grpo_vllm_tiny.yaml", [*base, *overrides]))
        return script.split("#SBATCH hetjob")[2].splitlines()

    # its parameters, counted by hand: per layer 2 norms of 64, q/k norms of 32, qkv 64x(2x32 + 2x32),
    # proj 64x64, fc1 2x128x64, fc2 128x64; the tied embedding 32x64 and the final norm
    params = 2 * (64 + 64 + 2 * 32 + 64 * 128 + 64 * 64 + 2 * 128 * 64 + 128 * 64) + 32 * 64 + 64
    weights_mb = 3 * 4 * params / 2**20  # fp32, three copies
    mb = 1024 + 1024 + weights_mb  # a worker, an engine's core process, the weights (the KV cache is on the GPU)
    assert "#SBATCH --cpus-per-task=2" in gen() and f"#SBATCH --mem={math.ceil(mb / 256) * 256}M" in gen()
    qkv2 = 2 * 64 * 32  # 2 key/value groups: one more key and value head per layer
    mb = 4 * 1024 + 2 * (3 * 1024 + 3 * 4 * (params + 2 * qkv2) / 2**20)
    assert f"#SBATCH --mem={math.ceil(mb / 256) * 256}M" in gen("generator.workers=4", "generator.tp=2", "model.num_query_groups=2")
    mb = 1024 + 1024 + weights_mb + 64  # no GPUs: the engine's KV cache (generator.kv_cache_mb) in host memory
    assert f"#SBATCH --mem={math.ceil(mb / 256) * 256}M" in gen("slurm.generator.gpus_per_node=0")
    # what the user sets stays
    assert {"#SBATCH --cpus-per-task=6", "#SBATCH --mem=9G"} <= set(
        gen("slurm.generator.cpus_per_task=6", "slurm.generator.mem=9G"))
    megatron = gen("generator.engine=megatron")
    assert not any(line.startswith(("#SBATCH --mem", "#SBATCH --cpus-per-task")) for line in megatron)


def test_split_generator_nodes_must_divide_its_workers() -> None:
    cfg = config.load(REPO / "experiments" / "tiny_gpt_generate.yaml", [
        "generator.placement=split", "generator.workers=3", "slurm.generator.nodes=2"])
    with pytest.raises(UserError, match=r"^slurm.generator.nodes: 2 do not divide the generator's 3 workers"):
        slurm.job_spec_for(cfg)


def test_rendered_script_is_valid_bash_and_quotes_awkward_paths() -> None:
    script = rendered(toy())
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    exports = [line for line in script.splitlines() if line.startswith("export BATON_RUN_DIR=")]
    out = subprocess.run(["bash", "-c", exports[0] + '; printf %s "$BATON_RUN_DIR"'], capture_output=True, text=True)
    assert out.stdout == str(AWKWARD)
    comment = next(line for line in script.splitlines() if line.startswith("#SBATCH --comment="))
    assert shlex.split(comment.partition("=")[2]) == [str(AWKWARD)]  # sbatch unquotes #SBATCH values the same way


def test_hetjob_separates_controller_flags_from_worker_flags() -> None:
    lines = rendered(toy("slurm.controller.partition=cpu", "slurm.workers.partition=gpu")).splitlines()
    split = lines.index("#SBATCH hetjob")
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert split < first_command and all(not line.startswith("#SBATCH") for line in lines[first_command:])
    assert "#SBATCH --partition=cpu" in lines[:split] and "#SBATCH --ntasks-per-node=1" in lines[:split]
    assert "#SBATCH --partition=gpu" in lines[split:] and "#SBATCH --ntasks-per-node=4" in lines[split:]
    assert lines[:split].count("#SBATCH --signal=USR2@90") == 1 and lines[split:].count("#SBATCH --signal=USR2@90") == 1
    assert "#SBATCH --requeue" in lines[:split]
    assert "baton_worker_step 1 0 worker &" in lines and not any("baton_worker_step 2" in line for line in lines)
    worker_output = next(line for line in lines if "--output=" in line and "_%t" in line)
    assert "${SLURM_JOB_ID}" in worker_output and "%j" not in worker_output  # %j = leader + 1 in component 1
    assert "--het-group=0" in lines[lines.index("export SUBMITIT_EXECUTOR=slurm") + 1]


# ----------------------------------------------------------------- submitit's private seam


def test_submitit_private_seam_is_unchanged(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fails loudly when submitit changes what HetJobExecutor relies on (checked on 1.5.4)."""
    seam = submitit_slurm.SlurmExecutor._make_submission_file_text
    assert list(inspect.signature(seam).parameters) == ["self", "command", "uid"], submitit.__version__
    params = inspect.signature(submitit_slurm._make_sbatch_string).parameters
    for name in ("command", "folder", "job_name", "partition", "time", "nodes", "ntasks_per_node", "cpus_per_task",
                 "gpus_per_node", "qos", "mem", "comment", "constraint", "exclude", "account", "wckey",
                 "stderr_to_stdout", "additional_parameters", "srun_args", "setup"):
        assert name in params, f"submitit {submitit.__version__}: _make_sbatch_string lost {name!r}"
    # Build a real executor without srun on PATH: affinity() is submitit's srun probe.
    monkeypatch.setattr(submitit_slurm.SlurmExecutor, "affinity", classmethod(lambda cls: 1))
    cfg = toy("slurm.controller.partition=cpu", "slurm.workers.partition=gpu")
    run = RunFolder(tmp_path / "it's a run")
    spec = slurm.job_spec_for(cfg)
    expected = slurm.render(run, cfg, spec, python=PYTHON)
    py = shlex.quote(PYTHON)
    ex = slurm.HetJobExecutor(run, cfg, spec, expected=expected, python=PYTHON)
    assert ex._submitit_command_str == slurm.controller_command(slurm_jobs.submitit_folder(run), py)
    assert ex._make_submission_file_text(ex._submitit_command_str, "uid") == expected


def test_compose_refuses_a_submitit_text_of_another_shape() -> None:
    with pytest.raises(RuntimeError, match="changed shape"):
        slurm.compose("#!/bin/bash\n#SBATCH --x=1\npython -m submitit.core._submit f\n", {})


def test_fill_template_repeats_list_lines_and_rejects_unknown_names() -> None:
    assert slurm.fill_template("a\n#X {{xs}}\nb {{y}}", {"xs": ["1", "2"], "y": "z"}) == "a\n#X 1\n#X 2\nb z"
    assert slurm.fill_template("a\n{{xs}}\nb", {"xs": []}) == "a\nb"
    with pytest.raises(KeyError, match="no value"):
        slurm.fill_template("{{nope}}", {})
    with pytest.raises(KeyError, match="unused"):
        slurm.fill_template("x", {"spare": "1"})


# ------------------------------------------------------------------------------ options


def test_cli_flags_apply_to_the_workers_and_every_component_gets_the_signal() -> None:
    spec = slurm.job_spec_for(toy("slurm.controller.partition=cpu"), cli("--partition", "gpu", "--time", "90"))
    ctl, wrk = spec.controller, spec.workers
    assert (ctl.partition, wrk.partition) == ("cpu", "gpu")
    assert wrk.time_min == 90 and ctl.time_min == 90  # the controller inherits the workers' walltime
    assert ctl.signal == wrk.signal == "USR2@90"
    assert (wrk.nodes, wrk.ntasks_per_node, wrk.gpus_per_node) == (1, 4, 4)
    assert (ctl.nodes, ctl.ntasks_per_node, ctl.gpus_per_node) == (1, 1, None)


def test_nodes_flag_that_contradicts_trainer_nodes_is_a_user_error() -> None:
    with pytest.raises(UserError, match="set trainer.nodes=2"):
        slurm.job_spec_for(toy(), cli("--nodes", "2"))


@pytest.mark.parametrize("text, minutes", [("30", 30), ("1:30", 2), ("2:00:00", 120), ("1-0", 1440),
                                           ("1-02:03", 1563), ("0-00:00:59", 1)])
def test_slurm_time_formats_become_minutes(text: str, minutes: int) -> None:
    assert slurm.parse_time_min(text, "t") == minutes


@pytest.mark.parametrize("argv, message", [(("--time", "soon"),  "not a Slurm time"),
                                           (("--signal", "usr2 now"), "not an sbatch --signal"),
                                           (("--sbatch-extra", "mail=x"), "not a raw sbatch flag")])
def test_bad_sbatch_values_are_one_line_user_errors(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(UserError, match=message):
        slurm.job_spec_for(toy(), cli(*argv))


# ---------------------------------------------------------------------------- preflight

SINFO = "cpu*|node1|(null)|4|infinite\ngpu|node2|gpu:8(S:0)|16|infinite\nshort|node2|gpu:8|16|10:00\n"


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Answers Slurm commands from recorded output; counts the calls."""
    answers: dict[str, Any] = {"sinfo": SINFO, "squeue": "", "sacct": "", "calls": []}

    def fake(args: list[str]) -> subprocess.CompletedProcess[str]:
        answers["calls"].append(args[0])
        out = answers[args[0]]
        return subprocess.CompletedProcess(args, 1 if out is None else 0, out or "", "")

    monkeypatch.setattr(slurm_jobs, "run_cli", fake)
    return answers


def preflight(tmp_path: Path, *overrides: str, argv: tuple[str, ...] = ()) -> None:
    slurm.preflight(slurm.job_spec_for(toy(*overrides), cli(*argv)), tmp_path / "runs")


def test_preflight_passes_on_a_cluster_that_fits(recorded: dict[str, Any], tmp_path: Path) -> None:
    preflight(tmp_path, argv=("--partition", "gpu"))
    assert recorded["calls"] == ["sinfo"]


@pytest.mark.parametrize("overrides, argv, message", [
    ((), ("--partition", "nosuch"), "partition 'nosuch' does not exist; choose one of"),
    (("trainer.n_gpus_per_node=16",), ("--partition", "gpu"), "at most 8 GPU"),
    ((), ("--partition", "gpu", "--cpus-per-task", "5"), "20 CPU"),
    ((), ("--partition", "gpu", "--time", "4"), "at least 5 min"),
    ((), ("--partition", "short", "--time", "20"), "limit of 10 min"),
    (("slurm.controller.time='10'",), ("--partition", "gpu", "--time", "20"), "must outlive them"),
    (("slurm.controller.signal=USR2@300",), ("--partition", "gpu", "--time", "6"),
     r"slurm.controller.signal: USR2@300 may come 360 s before the end of a 6 min job, while it starts; ask for at "
     r"least 7 min"),
])
def test_failed_preflight_names_the_check(recorded: dict[str, Any], tmp_path: Path, overrides: tuple[str, ...],
                                          argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(UserError, match=message):
        preflight(tmp_path, *overrides, argv=argv)


def test_preflight_refuses_a_runs_root_it_cannot_write(recorded: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    spec = slurm.job_spec_for(toy(), cli("--partition", "gpu"))
    with pytest.raises(UserError, match="not a writable folder"):
        slurm.preflight(spec, tmp_path / "file" / "runs")


def test_job_level_flags_go_to_component_0_and_are_checked() -> None:
    spec = slurm.job_spec_for(toy())
    assert spec.with_job_flags([]) is spec
    chained = spec.with_job_flags(["--dependency=afterany:7"])
    assert chained.controller.extra == ("--dependency=afterany:7",) and chained.workers == spec.workers
    with pytest.raises(UserError, match="extra_sbatch: 'dependency=7' is not a raw sbatch flag"):
        spec.with_job_flags(["dependency=7"])


def test_one_spec_is_what_render_preflight_and_submit_consume(recorded: dict[str, Any], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = toy()  # no partitions in the YAML: from the config alone the workers land on 'cpu', which has no GPUs
    with pytest.raises(UserError, match="at most 0 GPU"):
        slurm.preflight(slurm.job_spec_for(cfg), tmp_path / "runs")
    spec = slurm.job_spec_for(cfg, cli("--partition", "gpu", "--time", "20")).with_job_flags(["--dependency=afterany:7"])

    def recomputed(*args: object, **kwargs: object) -> None:
        raise AssertionError("the job spec was computed again from the config")

    monkeypatch.setattr(slurm, "job_spec", recomputed)
    monkeypatch.setattr(slurm, "job_spec_for", recomputed)
    run = RunFolder.create(tmp_path / "runs", cfg.name)
    script = slurm.render(run, cfg, spec, python=PYTHON)
    lines = script.splitlines()
    split = lines.index("#SBATCH hetjob")
    assert "#SBATCH --dependency=afterany:7" in lines[:split] and "#SBATCH --time=20" in lines[:split]
    assert "#SBATCH --partition=gpu" in lines[split:] and "#SBATCH --time=20" in lines[split:]
    slurm.preflight(spec, tmp_path / "runs")  # the spec's partition and walltime, not the config's
    assert recorded["calls"] == ["sinfo", "sinfo"]

    def sbatch(self: slurm.HetJobExecutor, fn: object, *args: object) -> SimpleNamespace:
        self._make_submission_file_text(self._submitit_command_str, "uid")  # raises unless it is render()'s text
        return SimpleNamespace(job_id="42")

    monkeypatch.setattr(submitit_slurm.SlurmExecutor, "affinity", classmethod(lambda cls: 1))
    monkeypatch.setattr(slurm.HetJobExecutor, "submit", sbatch)
    assert slurm.submit(run, cfg, spec, python=PYTHON) == "42"
    assert run.sbatch.read_text() == script


# ------------------------------------------------------------------------------- states


def test_every_mapped_slurm_state_has_a_baton_state() -> None:
    assert set(slurm_jobs.SLURM_TO_BATON.values()) - {"completed", "cancelled", "failed", "timeout", "preempted"} == slurm_jobs.ACTIVE
    assert slurm_jobs.baton_state("CANCELLED by 0") == "cancelled"
    assert slurm_jobs.baton_state("WEIRD") == "unknown"


def test_job_states_reads_both_components_and_answers_from_the_cache(recorded: dict[str, Any], tmp_path: Path) -> None:
    recorded["squeue"] = "7+0 RUNNING\n7+1 COMPLETING\n"
    cache = tmp_path / ".slurm_states.json"
    assert slurm_jobs.job_states("7", cache) == {"7+0": "RUNNING", "7+1": "COMPLETING"}
    recorded["squeue"] = "7+0 COMPLETED\n"
    assert slurm_jobs.job_states("7", cache) == {"7+0": "RUNNING", "7+1": "COMPLETING"}  # fresh cache: no squeue
    assert recorded["calls"] == ["squeue"]


def test_job_states_falls_back_to_sacct_once_squeue_forgets_the_job(recorded: dict[str, Any]) -> None:
    recorded["squeue"] = None  # squeue exits 1: "Invalid job id specified"
    recorded["sacct"] = "7+0|COMPLETED\n7+1|CANCELLED by 0\n"
    assert slurm_jobs.job_states("7") == {"7+0": "COMPLETED", "7+1": "CANCELLED"}


def test_status_target_may_be_a_run_folder_path(tmp_path: Path) -> None:
    run = tmp_path / "a run"
    run.mkdir()
    (run / "config.yaml").write_text("name: x\n")
    assert slurm_jobs.resolve_status_target(str(run)).path == run.resolve()
    with pytest.raises(UserError, match="not a Baton run folder"):
        slurm_jobs.resolve_status_target(str(tmp_path / "missing"))


def test_status_target_job_id_resolves_from_sacct_workdir_despite_its_quote_mangling(
        recorded: dict[str, Any], tmp_path: Path) -> None:
    run = tmp_path / 'it\'s "here"'
    run.mkdir()
    (run / "config.yaml").write_text("name: x\n")
    recorded["squeue"] = ""  # Slurm has forgotten the job; the accounting database stores '"' as '`'
    recorded["sacct"] = f"{str(run).replace(chr(34), '`')}\n"
    assert slurm_jobs.resolve_status_target("7").path == run
    recorded["sacct"] = ""
    with pytest.raises(UserError, match="job 7: no Baton run folder found"):
        slurm_jobs.resolve_status_target("7+1")
