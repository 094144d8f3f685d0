"""Hostile input through the real CLI: every case is refused the way the CLI promises.

One table per class of bad input (non-finite numbers, values out of their domain, empty
files, duplicate keys, files that are not UTF-8, control characters, syntax and argument
errors, out-of-range options, the new config keys, sweep files). Each case runs
``python -m launcher.cli`` in a subprocess, in a folder of its own, and checks the promise:
exit code 2, exactly one non-empty line on stderr that names the key or the file, no
traceback, and nothing created or changed on disk (no run folder, no sweep folder, the
input files as they were).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import baton

# A GPT (the default model) that `baton plan` can plan: config checks that must not start a run.
PLAN_BASE = "name: hostile\ntrainer:\n  steps: 2\n"
# The toy model: what `baton submit --backend local` would run, were the input not refused.
TOY_BASE = "name: hostile\nmodel:\n  kind: toy\ntrainer:\n  steps: 2\n"
SWEEP_OK = "base: exp.yaml\ngrid:\n  seed: [1, 2]\n"
U16 = "name: hostile\ntrainer:\n  steps: 2\n"


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under ``root``."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def refused(tmp_path: Path, argv: list[str], named: str | list[str], *,
            files: dict[str, str | bytes] | None = None) -> str:
    """Write ``files``, run ``baton *argv`` in ``tmp_path`` and check the promise; returns the line."""
    for name, content in {"exp.yaml": PLAN_BASE, "toy.yaml": TOY_BASE, **(files or {})}.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    before = _snapshot(tmp_path)
    res = baton(*argv, cwd=tmp_path, timeout=60)
    line = res.stderr.strip()
    assert res.returncode == 2, f"exit {res.returncode}; stdout: {res.stdout!r}; stderr: {res.stderr!r}"
    assert line and "\n" not in line, f"not one line: {res.stderr!r}"
    assert "Traceback" not in res.stderr + res.stdout and "usage:" not in res.stderr, res.stderr
    for word in [named] if isinstance(named, str) else named:
        assert word in line, f"{word!r} not named in {line!r}"
    assert _snapshot(tmp_path) == before, "something was created or changed"
    assert not (tmp_path / "runs").exists()
    return line


def _plan(*overrides: str) -> list[str]:
    return ["plan", "exp.yaml", "runs_root=runs", *overrides]


def _submit_argv(*args: str) -> list[str]:
    return ["submit", "toy.yaml", "--backend", "local", "runs_root=runs", *args]


# --- 1. non-finite numbers, in any float key ---------------------------------------------------

NON_FINITE = [
    (["optimizer.lr=nan"], "optimizer.lr"),
    (["optimizer.lr=.nan"], "optimizer.lr"),
    (["optimizer.min_lr=-.inf"], "optimizer.min_lr"),
    (["timeouts.step_s=1e999"], "timeouts.step_s"),
    (["model.init_method_std=NaN"], "model.init_method_std"),
    (["model.hidden_dropout=nan"], "model.hidden_dropout"),
    (["training.grad_clip=Infinity"], "training.grad_clip"),
    (["training.mixed_precision.initial_loss_scale=1" + "0" * 400], "training.mixed_precision.initial_loss_scale"),
]


@pytest.mark.parametrize(("overrides", "key"), NON_FINITE)
def test_non_finite_numbers_are_refused(tmp_path: Path, overrides: list[str], key: str) -> None:
    line = refused(tmp_path, _plan(*overrides), key)
    assert "not a finite number" in line


@pytest.mark.parametrize("body", ["optimizer:\n  eps: .nan\n", "optimizer:\n  weight_decay: 1" + "0" * 400 + "\n"])
def test_non_finite_numbers_in_a_file_are_refused(tmp_path: Path, body: str) -> None:
    refused(tmp_path, ["plan", "bad.yaml"], "not a finite number", files={"bad.yaml": PLAN_BASE + body})


# --- 2. values outside their domain --------------------------------------------------------------

OUT_OF_DOMAIN = [
    (["seed=-1"], "seed"),
    ([f"seed={2**63}"], "seed"),
    (["metrics.port=65536"], "metrics.port"),
    (["data.kind=hdf5", "data.path=missing.h5"], "data.path"),
    (["data.kind=hdf5", "data.path=."], "data.path"),
    (["trainer.nodes=100001"], "trainer.nodes"),
    (["trainer.n_gpus_per_node=1025"], "trainer.n_gpus_per_node"),
    (["trainer.nodes=2048", "trainer.n_gpus_per_node=1024"], "trainer"),
    (["trainer.steps=1000000000001"], "trainer.steps"),
    (["model.num_layers=100001"], "model.num_layers"),
    ([f"model.hidden_size={2**20 + 4}"], "model.hidden_size"),
    ([f"model.vocab_size={2**26 + 1}"], "model.vocab_size"),
    ([f"model.seq_length={2**24 + 1}"], "model.seq_length"),
    ([f"model.ffn_hidden_size={2**22 + 1}"], "model.ffn_hidden_size"),
    (["model.ffn_hidden_size=-4"], "model.ffn_hidden_size"),
    ([f"training.global_batch_size={2**31 + 16}"], "training.global_batch_size"),
    (["checkpoint.keep_last=1000001"], "checkpoint.keep_last"),
    (["recovery.max_retries=1000001"], "recovery.max_retries"),
    (["timeouts.register_s=1e8"], "timeouts.register_s"),
    (["optimizer.beta2=1.5"], "optimizer.beta2"),
    (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay"),
    ([f"parallel.tp={2**21}"], "parallel.tp"),
    (["slurm.workers.nodes=0"], "slurm.workers.nodes"),
    (["slurm.workers.gpus_per_node=5000"], "slurm.workers.gpus_per_node"),
]


@pytest.mark.parametrize(("overrides", "key"), OUT_OF_DOMAIN)
def test_values_outside_their_domain_are_refused(tmp_path: Path, overrides: list[str], key: str) -> None:
    refused(tmp_path, _plan(*overrides), f"{key}:")


def test_a_missing_token_file_suggests_building_one(tmp_path: Path) -> None:
    line = refused(tmp_path, _submit_argv("data.kind=hdf5", "data.path=tokens.h5"), "data.path")
    assert "'tokens.h5' does not exist" in line and "baton data build" in line


# --- 3. empty experiment and sweep files ---------------------------------------------------------

EMPTY = ["", "# only a comment\n# and another\n", "---\n", "{}\n", "\n  \n\n", "trainer: {}\nmodel:\n"]


@pytest.mark.parametrize("text", EMPTY)
def test_an_empty_experiment_is_refused(tmp_path: Path, text: str) -> None:
    line = refused(tmp_path, ["submit", "empty.yaml", "--backend", "local", "runs_root=runs"], "empty.yaml",
                   files={"empty.yaml": text})
    assert "empty" in line and "an experiment sets at least" in line


@pytest.mark.parametrize("text", ["", "# a sweep, some day\n"])
def test_an_empty_sweep_file_is_refused(tmp_path: Path, text: str) -> None:
    line = refused(tmp_path, ["sweep", "submit", "sw.yaml", "--backend", "local", "runs_root=runs"], "sw.yaml",
                   files={"sw.yaml": text})
    assert "empty" in line and "base:" in line


# --- 4. duplicate keys, at any depth ----------------------------------------------------------

DUPLICATES = [
    ("name: a\ntrainer:\n  steps: 2\nname: b\n", "'name'", "line 4"),
    ("trainer:\n  steps: 2\nmodel:\n  kind: gpt\ntrainer:\n  nodes: 1\n", "'trainer'", "line 5"),
    ("trainer:\n  steps: 2\n  steps: 3\n", "'steps'", "line 3"),
    ("training:\n  mixed_precision:\n    param_dtype: bf16\n    param_dtype: fp32\n", "'param_dtype'", "line 4"),
    ("model: {kind: gpt, kind: toy}\n", "'kind'", "line 1"),
]


@pytest.mark.parametrize(("text", "key", "line"), DUPLICATES)
def test_duplicate_keys_are_refused_naming_key_line_and_file(tmp_path: Path, text: str, key: str, line: str) -> None:
    refused(tmp_path, ["plan", "dup.yaml"], ["dup.yaml", key, line], files={"dup.yaml": text})


def test_a_duplicate_key_in_an_override_value_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, _plan("trainer={steps: 1, steps: 2}"), ["override trainer", "'steps'"])


def test_a_yaml_merge_key_is_not_a_duplicate(tmp_path: Path) -> None:
    ok = "x: &d {steps: 2}\n"  # refused for the unknown key x, not for `<<` then steps
    refused(tmp_path, ["plan", "m.yaml"], "x: unknown key", files={"m.yaml": ok + "trainer:\n  <<: *d\n  steps: 3\n"})


# --- 5. files that are not UTF-8 -------------------------------------------------------------

NOT_UTF8 = [
    ("latin1", "name: tést\n".encode("latin-1")),
    ("utf16-bom", U16.encode("utf-16")),
    ("utf16-no-bom", U16.encode("utf-16-le")),
    ("utf32", U16.encode("utf-32")),
    ("nul", b"name: hostile\x00\ntrainer:\n  steps: 2\n"),
    ("binary", bytes(range(256))),
]


@pytest.mark.parametrize(("label", "raw"), NOT_UTF8, ids=[c[0] for c in NOT_UTF8])
def test_a_file_that_is_not_utf8_is_one_line(tmp_path: Path, label: str, raw: bytes) -> None:
    line = refused(tmp_path, ["plan", "enc.yaml"], "enc.yaml", files={"enc.yaml": raw})
    assert "not UTF-8" in line


@pytest.mark.parametrize("raw", [SWEEP_OK.encode("utf-16"), b"base: exp.yaml\ngrid:\n  seed: [1]\n  # \xe9\n"])
def test_a_sweep_file_that_is_not_utf8_is_one_line(tmp_path: Path, raw: bytes) -> None:
    refused(tmp_path, ["sweep", "submit", "sw.yaml", "--backend", "local", "runs_root=runs"], ["sw.yaml", "UTF-8"],
            files={"sw.yaml": raw})


# --- 6. control characters and unsafe names ----------------------------------------------------

CONTROL = [
    ('name: "a\\nb"\n', "name"),
    ('name: "a\\u2028b"\n', "name"),
    ("name: a b\n", "name"),
    ("name: .hidden\n", "name"),
    ("name: a/b\n", "name"),
    (f"name: {'x' * 129}\n", "name"),
    ("name: ''\n", "name"),
    ('runs_root: "runs\\nrm -rf ~"\n', "runs_root"),
    ('slurm:\n  setup: ["module load a", "ok\\nrm -rf ~"]\n', "slurm.setup[1]"),
    ('slurm:\n  workers:\n    partition: "gpu\\x00"\n', "slurm.workers.partition"),
    ('slurm:\n  controller:\n    account: "\\e[31mred"\n', "slurm.controller.account"),
    ('slurm:\n  workers:\n    extra: ["--mail-user=a\\r\\n#SBATCH --x"]\n', "slurm.workers.extra[0]"),
    ('data:\n  kind: hdf5\n  path: "t\\n.h5"\n', "data.path"),
    ('metrics:\n  bind: "127.0.0.1\\n"\n', "metrics.bind"),
]


@pytest.mark.parametrize(("body", "key"), CONTROL)
def test_control_characters_and_unsafe_names_are_refused(tmp_path: Path, body: str, key: str) -> None:
    root = [] if key == "runs_root" else ["runs_root=runs"]  # an override would replace the bad value
    refused(tmp_path, ["submit", "c.yaml", "--backend", "local", *root], f"{key}:",
            files={"c.yaml": TOY_BASE.replace("name: hostile\n", "") + body})


CONTROL_ARGS = [
    (["name=a\nb"], "override 'name'"),
    (["runs_root=runs\r"], "override 'runs_root'"),
    (["slurm.workers.qos=\x07"], "override 'slurm.workers.qos'"),
    (["--partition", "gpu\n#SBATCH --x"], "--partition"),
    (["--sbatch-extra=--x=1\n"], "--sbatch-extra"),
    (["--constraint", "a\x1bb"], "--constraint"),
]


@pytest.mark.parametrize(("args", "named"), CONTROL_ARGS)
def test_control_characters_in_arguments_are_refused(tmp_path: Path, args: list[str], named: str) -> None:
    refused(tmp_path, _submit_argv(*args), named)


def test_the_slurm_backend_refuses_control_characters_before_rendering(tmp_path: Path) -> None:
    body = 'slurm:\n  workers:\n    reservation: "r\\u2029x"\n'
    refused(tmp_path, ["submit", "c.yaml", "--backend", "slurm", "--dry-run", "runs_root=runs"],
            "slurm.workers.reservation", files={"c.yaml": TOY_BASE + body})


# --- 7. syntax errors and argument errors: one line ---------------------------------------------

SYNTAX = [
    "trainer: [1, 2\n",
    "trainer:\n  steps: 2\n nodes: 1\n",
    "trainer:\n\tsteps: 2\n",
    "name: a: b\n",
    'name: "unclosed\n',
    "x: !!python/object/apply:os.system [echo hi]\n",
    "name: a\n---\nname: b\n",
    "name: a\x01\n",
    "a: " + "[" * 3000 + "]" * 3000 + "\n",
    "seed: " + "9" * 5000 + "\n",
]


@pytest.mark.parametrize("text", SYNTAX)
def test_yaml_syntax_errors_are_one_line(tmp_path: Path, text: str) -> None:
    refused(tmp_path, ["plan", "syn.yaml"], ["syn.yaml", "not valid YAML"], files={"syn.yaml": text})


ARGPARSE = [
    (["plan", "exp.yaml", "--nope"], "see baton plan --help"),
    ([], "see baton --help"),
    (["nope"], "see baton --help"),
    (["sweep"], "see baton sweep --help"),
    (["submit", "toy.yaml", "--backend", "nowhere"], "see baton submit --help"),
    (["logs"], "see baton logs --help"),
    (["data", "build", "x.txt"], "see baton data build --help"),
]


@pytest.mark.parametrize(("argv", "hint"), ARGPARSE)
def test_argument_errors_are_one_line_with_the_help_hint(tmp_path: Path, argv: list[str], hint: str) -> None:
    line = refused(tmp_path, argv, hint)
    assert line.startswith("baton: error: ") and line.endswith("--help")


@pytest.mark.parametrize("command", [["plan", "exp.yaml"], ["submit", "toy.yaml", "--backend", "local"]])
def test_an_override_without_equals_reads_the_same_before_and_after_the_options(
        tmp_path: Path, command: list[str]) -> None:
    options = ["--json"] if command[0] == "plan" else ["--partition", "gpu"]
    before = refused(tmp_path, [*command[:2], "tp", *command[2:], *options], "override 'tp'")
    after = refused(tmp_path, [*command, *options, "tp"], "override 'tp'")
    assert before == after and "expected key=value" in before


# --- 8. options out of range -------------------------------------------------------------------

OPTIONS = [
    (["logs", "nowhere", "--tail", "-1"], "--tail"),
    (["logs", "nowhere", "--rank", "-1"], "--rank"),
    (["plan", "exp.yaml", "--gpu-mem-gb", "-80"], "--gpu-mem-gb"),
    (["plan", "exp.yaml", "--gpu-mem-gb", "nan"], "--gpu-mem-gb"),
    (["plan", "exp.yaml", "--gpu-mem-gb", "inf"], "--gpu-mem-gb"),
    (["status", "nowhere", "--watch", "--interval", "0"], "--interval"),
    (["status", "nowhere", "--watch", "--interval", "nan"], "--interval"),
    (["cancel", "nowhere", "--timeout", "0"], "--timeout"),
    (["cancel", "nowhere", "--timeout", "inf"], "--timeout"),
    (_submit_argv("--nodes", "0"), "--nodes"),
    (_submit_argv("--gpus-per-node", "5000"), "--gpus-per-node"),
    (_submit_argv("--cpus-per-task", "0"), "--cpus-per-task"),
]


@pytest.mark.parametrize(("argv", "option"), OPTIONS)
def test_options_out_of_range_are_refused(tmp_path: Path, argv: list[str], option: str) -> None:
    line = refused(tmp_path, argv, f"argument {option}")
    assert "gpu_mem_gb" not in line


# --- 9. the new keys: metrics.bind and timeouts.startup_heartbeat_timeout_s ------------------------

NEW_KEYS = [
    (["metrics.bind="], "metrics.bind"),
    (["metrics.bind=127.0.0.1 x"], "metrics.bind"),
    (["timeouts.startup_heartbeat_timeout_s=1"], "timeouts.startup_heartbeat_timeout_s"),
    (["timeouts.heartbeat_timeout_s=300"], "timeouts.startup_heartbeat_timeout_s"),
    (["timeouts.startup_heartbeat_timeout_s=1e8"], "timeouts.startup_heartbeat_timeout_s"),
]


@pytest.mark.parametrize(("overrides", "key"), NEW_KEYS)
def test_the_new_keys_are_validated(tmp_path: Path, overrides: list[str], key: str) -> None:
    refused(tmp_path, _plan(*overrides), f"{key}:")


# --- sweep files ---------------------------------------------------------------------------------

SWEEPS = [
    ("base: exp.yaml\ngrid:\n  seed: [1]\n  seed: [2]\n", {}, ["sw.yaml", "'seed'", "line 4"]),
    ("base: exp.yaml\ngrid:\n  seed: [1]\nbase: toy.yaml\n", {}, ["sw.yaml", "'base'"]),
    ("base: exp.yaml\ngrid:\n  seed: [1]\ninclude:\n  - {seed: 3, seed: 4}\n", {}, ["sw.yaml", "'seed'"]),
    ("base: exp.yaml\ngrid:\n  optimizer.lr: [0.1, .nan]\n", {}, ["sw.yaml", "optimizer.lr", "finite"]),
    ("base: {}\ngrid:\n  seed: [1]\n", {}, ["sw.yaml", "base"]),
    ("base: empty.yaml\ngrid:\n  seed: [1]\n", {"empty.yaml": "# nothing yet\n"}, ["empty.yaml", "empty"]),
    ("base: dup.yaml\ngrid:\n  seed: [1]\n", {"dup.yaml": "seed: 1\nseed: 2\n"}, ["dup.yaml", "'seed'"]),
    ("base: l1.yaml\ngrid:\n  seed: [1]\n", {"l1.yaml": "name: caf\xe9\n".encode("latin-1")}, ["l1.yaml", "UTF-8"]),
    ('name: "a\\nb"\nbase: exp.yaml\ngrid:\n  seed: [1]\n', {}, ["sw.yaml", "name"]),
    ("name: ../up\nbase: exp.yaml\ngrid:\n  seed: [1]\n", {}, ["sw.yaml", "name"]),
    ("base: exp.yaml\ngrid:\n  seed: [1]\nmax_running: 100000000\n", {}, ["sw.yaml", "max_running"]),
    ("base: exp.yaml\ngrid:\n  seed: " + str(list(range(101))) + "\n  optimizer.lr: "
     + str([0.001 * (i + 1) for i in range(100)]) + "\n", {}, ["sw.yaml", "points"]),
    ("base: exp.yaml\ngrid:\n  slurm.setup: [[\"ok\"], [\"a\\nb\"]]\n", {}, ["sw.yaml", "slurm.setup[0]"]),
    ("base: exp.yaml\ngrid: [1, 2\n", {}, ["sw.yaml", "not valid YAML"]),
]


@pytest.mark.parametrize(("text", "extra", "named"), SWEEPS)
def test_bad_sweep_files_are_refused_before_anything_is_written(
        tmp_path: Path, text: str, extra: dict[str, str | bytes], named: list[str]) -> None:
    refused(tmp_path, ["sweep", "submit", "sw.yaml", "--backend", "local", "runs_root=runs"], named,
            files={"sw.yaml": text, **extra})


# --- submit refuses each class before anything starts ----------------------------------------

SUBMIT = [
    (["optimizer.lr=nan"], "optimizer.lr"),
    (["seed=-5"], "seed"),
    (["metrics.port=99999"], "metrics.port"),
    (["trainer.n_gpus_per_node=4096"], "trainer.n_gpus_per_node"),
    (["name=../../etc"], "name"),
]


@pytest.mark.parametrize(("overrides", "key"), SUBMIT)
def test_submit_refuses_bad_values_before_anything_starts(tmp_path: Path, overrides: list[str], key: str) -> None:
    refused(tmp_path, _submit_argv(*overrides), f"{key}:")


def test_init_from_is_checked_on_the_login_node(tmp_path: Path) -> None:
    """``init_from`` must name a committed checkpoint of a run with the same model; nothing is
    written when it does not."""
    (tmp_path / "toy.yaml").write_text(TOY_BASE)
    res = baton("submit", "toy.yaml", "--backend", "local", "runs_root=src", cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    src = next((tmp_path / "src" / "hostile").glob("*"))
    gpt = ["submit", "exp.yaml", "--backend", "local", "runs_root=runs"]
    refused(tmp_path, [*gpt, f"init_from={tmp_path / 'nowhere'}"], ["init_from:", "nowhere", "RUN_DIR:STEP"])
    refused(tmp_path, [*gpt, f"init_from={src}:7"], ["init_from:", "step_00000007", "committed steps: 2"])
    refused(tmp_path, [*gpt, f"init_from={src}"], ["init_from:", "another model"])  # a toy's checkpoint
    refused(tmp_path, _submit_argv(f"init_from={src}"), ["init_from:", "model.kind 'toy'", "model.kind: gpt"])


# --- layouts a run would get wrong silently -----------------------------------------------------

def test_local_sgd_with_pipeline_stages_and_tied_embeddings_is_refused_at_submit(tmp_path: Path) -> None:
    """The averaging of replicas skips Megatron's embedding all-reduce: with pp > 1 and tied
    embeddings the first and last stages' copies would drift apart. Refused by a dry run."""
    line = refused(tmp_path, ["submit", "exp.yaml", "--backend", "slurm", "--dry-run", "runs_root=runs",
                              "trainer.n_gpus_per_node=4", "parallel.pp=2", "model.tie_embeddings=true",
                              "parallel.sync.every=4"],
                   ["parallel.sync", "model.tie_embeddings", "parallel.pp: 2"])
    assert "parallel.pp=1" in line  # the fix
    allowed = baton("submit", "exp.yaml", "--backend", "slurm", "--dry-run", "runs_root=runs",
                    "trainer.n_gpus_per_node=4", "parallel.pp=2", "model.tie_embeddings=false", "parallel.sync.every=4",
                    cwd=tmp_path, timeout=60)
    assert allowed.returncode == 0, allowed.stderr  # untied: the averaging covers every weight
