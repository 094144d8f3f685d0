"""Checkpoint/resume of the tiny GPT through the real controller and Megatron workers."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from core.checkpoint import manifest
from core.checkpoint.hdf5 import CheckpointReader
from tests.helpers import baton, history, losses, submit_local

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]
# A constant schedule, so a run of 10 steps and one of 20 share the learning rate of every step.
BASE = ["optimizer.schedule=constant", "optimizer.warmup_steps=0"]


def _resume(run: Path, *overrides: str) -> None:
    """Resume a run whose step-20 checkpoint was removed: the record knows it was committed, so
    the resume goes on from step 10 only with --from-scratch (otherwise refused, exit 2)."""
    res = baton("submit", "--resume", str(run), "--from-scratch", *overrides, "--backend", "local")
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One run of 20 steps that checkpoints at 10 and 20; its copies resume from step 10."""
    root = tmp_path_factory.mktemp("gpt")
    full = submit_local("experiments/tiny_gpt.yaml", f"runs_root={root}/full", "trainer.steps=20",
                   "checkpoint.interval_steps=10", *BASE)
    return {"full": full, "root": root}


def _copy_half(runs: dict[str, Path], name: str) -> Path:
    """The run as it stood after step 10: its step-20 checkpoint removed (the records of steps
    10-19 are superseded by the resume, which redoes them)."""
    dst = runs["root"] / name / runs["full"].name
    shutil.copytree(runs["full"], dst)
    shutil.rmtree(dst / "checkpoints" / manifest.step_dir_name(20))
    (dst / "checkpoints" / "latest").write_text(manifest.step_dir_name(10) + "\n")
    return dst


def test_resume_is_exact_in_the_same_layout(runs: dict[str, Path]) -> None:
    run = _copy_half(runs, "same")
    assert manifest.committed_steps(run / "checkpoints") == [10]
    _resume(run, "trainer.steps=20")
    full, resumed = losses(runs["full"]), losses(run)
    assert len(resumed) == 20
    assert max(abs(a - b) for a, b in zip(full, resumed, strict=True)) <= 1e-7, list(zip(full, resumed, strict=True))[10:]


@pytest.mark.parametrize("layout", [("1", "4"), ("1", "1")], ids=["tp1pp4", "tp1pp1"])
def test_resume_in_another_layout_continues_the_curve(runs: dict[str, Path], layout: tuple[str, str]) -> None:
    tp, pp = layout
    run = _copy_half(runs, f"tp{tp}pp{pp}")
    workers = str(int(tp) * int(pp))
    _resume(run, "trainer.steps=20", f"parallel.tp={tp}", f"parallel.pp={pp}", f"trainer.n_gpus_per_node={workers}")
    full, resumed = losses(runs["full"]), losses(run)
    assert len(resumed) == 20
    assert max(abs(a - b) for a, b in zip(full[10:], resumed[10:], strict=True)) <= 1e-6, list(zip(full, resumed, strict=True))[10:]
    resumed_ev = history(run, "resumed")[-1]
    assert resumed_ev["saved_layout"] == "tp2pp2dp1" and resumed_ev["layout"] == f"tp{tp}pp{pp}dp1"


def test_async_checkpoints_taken_while_training_goes_on_hold_the_state_of_their_step(runs: dict[str, Path]) -> None:
    """The async snapshot is read on the writer thread during the next step: its fence must
    hold the optimizer step until the copy is done, or step 10's file would hold step 11."""
    run = submit_local("experiments/tiny_gpt.yaml", f"runs_root={runs['root']}/async", "trainer.steps=20", *BASE,
                  "checkpoint.interval_steps=5", "checkpoint.keep_last=4", "checkpoint.async=true")
    assert manifest.committed_steps(run / "checkpoints") == [5, 10, 15, 20]
    assert losses(run) == losses(runs["full"])  # training itself is unchanged by the saves beside it
    sync, overlapped = runs["full"] / "checkpoints" / "step_00000010", run / "checkpoints" / "step_00000010"
    with CheckpointReader(sync) as want, CheckpointReader(overlapped) as got:
        assert got.names() == want.names()
        diffs = {n: float(np.max(np.abs(got.read(n) - want.read(n)))) for n in want.names()}
        assert max(diffs.values()) == 0.0, {n: d for n, d in diffs.items() if d}
        counters = [got.blobs(r)["optimizer"]["steps"] for r in range(4)]  # per leaf, per group: [group, params]
        assert {s for leaves in counters for groups in leaves for _, s in groups} == {10.0}
    assert manifest.verify(overlapped) == []
