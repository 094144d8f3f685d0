"""`baton report`: PNGs from a run's metrics.jsonl, one comparison plot for a sweep."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from core.errors import UserError
from core.record import steps
from core.record.runfolder import RunFolder
from core.record.state import RunRecord, RunState, Status
from core.record.steps import StepRecord
from launcher import cmd_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib is not installed (the `plots` extra): pip install 'baton[plots]'")


def _run_folder(path: Path, *, n: int = 30, lr: float = 0.1, world: int = 4, requeued_at: int | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("name: t\n")
    RunRecord(RunFolder(path)).create(RunState(status=Status.COMPLETED, step=n, total_steps=n))
    (path / "metrics.jsonl").touch()
    done: list[int] = list(range(n))
    if requeued_at is not None:  # a requeue from a checkpoint re-runs the steps after it
        done = list(range(n)) + list(range(requeued_at, n))
    for step in done:
        steps.append(path / "metrics.jsonl", StepRecord(
            step=step, loss=4.0 * (1 - lr) ** step + 0.01, tokens_per_s=1000.0 + step,
            step_time_s=0.1, rank_step_time_s=tuple(0.09 + 0.001 * r for r in range(world)),
            rss_mb=tuple(500.0 + r for r in range(world)), time=1.7e9 + step,
        ))
    return path


def _report(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    cmd_report.register(parser.add_subparsers())
    args = parser.parse_args(["report", *argv])
    return int(args.func(args))


def _assert_pngs(paths: list[Path]) -> None:
    for p in paths:
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000, p


@needs_matplotlib
def test_run_report_writes_the_plots_into_the_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run_folder(tmp_path / "toy" / "r1")
    assert _report(str(run)) == 0
    report = run / "report"
    names = sorted(p.name for p in report.glob("*.png"))
    assert names == ["loss.png", "memory.png", "rank_step_time.png", "tokens_per_s.png"]
    _assert_pngs(list(report.glob("*.png")))
    assert capsys.readouterr().out.split() == [str(report / n) for n in
                                               ("loss.png", "tokens_per_s.png", "rank_step_time.png", "memory.png")]


@needs_matplotlib
def test_out_option_chooses_the_folder(tmp_path: Path) -> None:
    run = _run_folder(tmp_path / "r1")
    written = cmd_report.report_run(run, tmp_path / "elsewhere")
    assert {p.parent for p in written} == {tmp_path / "elsewhere"}
    assert not (run / "report").exists()


@needs_matplotlib
def test_sweep_report_compares_every_point_from_the_ledger(tmp_path: Path) -> None:
    sweep = tmp_path / "toy-lr"
    a = _run_folder(sweep / "lr0.05-aaaa", lr=0.05)
    b = _run_folder(sweep / "lr0.2-bbbb", lr=0.2)
    ledger = {"version": 1, "name": "toy-lr", "points": [
        {"index": 0, "params": {"optimizer.lr": 0.05}, "run_id": a.name, "run_dir": str(a)},
        {"index": 1, "params": {"optimizer.lr": 0.2}, "run_id": b.name, "run_dir": str(b)},
        {"index": 2, "params": {"optimizer.lr": 0.4}, "run_id": "never", "run_dir": str(sweep / "never")},
    ]}
    (sweep / "sweep.json").write_text(json.dumps(ledger))
    assert cmd_report.is_sweep(sweep) and not cmd_report.is_sweep(a)
    assert [label for label, _ in cmd_report.sweep_points(sweep)][:2] == ["optimizer.lr=0.05", "optimizer.lr=0.2"]
    assert _report(str(sweep)) == 0
    _assert_pngs([sweep / "report" / "sweep_loss.png"])


@needs_matplotlib
def test_a_folder_of_several_runs_without_a_ledger_is_a_sweep(tmp_path: Path) -> None:
    _run_folder(tmp_path / "x" / "one")
    _run_folder(tmp_path / "x" / "two")
    assert cmd_report.is_sweep(tmp_path / "x")
    _assert_pngs(cmd_report.report_sweep(tmp_path / "x"))


def test_requeued_steps_are_plotted_once_with_the_last_record() -> None:
    recs = [StepRecord(step=0, loss=3.0), StepRecord(step=1, loss=2.0), StepRecord(step=1, loss=1.5),
            StepRecord(step=2, loss=1.0)]
    assert [r.loss for r in cmd_report.by_step(recs)] == [3.0, 1.5, 1.0]


def test_run_without_steps_is_a_one_line_user_error(tmp_path: Path) -> None:
    run = _run_folder(tmp_path / "r", n=0)
    with pytest.raises(UserError, match="no step recorded yet"):
        cmd_report.report_run(run)
    with pytest.raises(UserError, match="no such folder"):
        _report(str(tmp_path / "absent"))


def test_missing_matplotlib_is_a_user_error_naming_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run_folder(tmp_path / "r")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(UserError) as exc:
        cmd_report.report_run(run)
    assert str(exc.value) == "matplotlib is not installed: pip install 'baton[plots]'"


@needs_matplotlib
def test_the_run_s_interruptions_are_marked_on_its_curves(tmp_path: Path) -> None:
    """Checkpoints, a preemption, its requeue and the resume: the report finds them in the
    history at their steps and draws them (the same curve without them is another image)."""
    from core.record import events as ev

    plain, marked = _run_folder(tmp_path / "a" / "r"), _run_folder(tmp_path / "b" / "r", requeued_at=10)
    RunRecord(RunFolder(marked)).append(
        ev.CheckpointCommitted(step=10, folder="checkpoints/step_00000010", seconds=0.1, bytes=1),
        ev.Preempted(step=12, cause="preempted", signal="SIGUSR2", detail="test"),
        ev.Requeued(step=12, reason="preempted", epoch=0, backend="local"),
        ev.Resumed(step=10, checkpoint="checkpoints/step_00000010", saved_layout="tp1pp1dp4", layout="tp1pp1dp4",
                   seconds=0.1))
    assert cmd_report.run_marks(RunFolder(marked)) == [(10, "checkpoint_committed"), (12, "preempted"),
                                                       (12, "requeued"), (10, "resumed")]
    assert cmd_report.run_marks(RunFolder(plain)) == []
    for run in (plain, marked):
        assert _report(str(run)) == 0
    assert (plain / "report" / "loss.png").read_bytes() != (marked / "report" / "loss.png").read_bytes()


@needs_matplotlib
def test_superseded_shows_the_records_of_the_steps_a_resume_redid_faded(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    run = _run_folder(tmp_path / "r", n=20)
    assert steps.supersede(run / "metrics.jsonl", 12, epoch=1)  # the resume from step 12: 12..19 are redone
    for step in range(12, 20):
        steps.append(run / "metrics.jsonl", StepRecord(step=step, loss=0.5, time=1.8e9 + step))
    assert _report(str(run), "--out", str(tmp_path / "plain")) == 0
    assert _report(str(run), "--superseded", "--out", str(tmp_path / "both")) == 0
    out = capsys.readouterr().out
    assert "superseded records of 8 redone steps (12..19)" in out
    assert (tmp_path / "plain" / "loss.png").read_bytes() != (tmp_path / "both" / "loss.png").read_bytes()
    assert cmd_report.superseded_line(RunFolder(_run_folder(tmp_path / "q"))).endswith("no superseded records "
                                                                                       "(no resume redid a step)")


@needs_matplotlib
def test_the_reward_plot_draws_the_validation_rewards_at_the_validated_steps(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """reward.png: the training reward's mean and band, and each validation's greedy and
    sampled mean reward at the steps whose records carry them (the others have none)."""
    run = _run_folder(tmp_path / "r", n=6)
    (run / "metrics.jsonl").write_text("")
    for step in range(6):
        val = {"val_reward_mean": step / 10, "val_reward_mean_sampled": step / 20} if step % 2 else {}
        steps.append(run / "metrics.jsonl", StepRecord(step=step, loss=1.0, reward_mean=0.5, reward_std=0.25, **val))
    drawn: dict[str, list[tuple[str, list[int], list[float]]]] = {}
    real = cmd_report._plot

    def spy(figure, path, title, ylabel, lines, **kw):  # type: ignore[no-untyped-def]
        drawn[Path(path).name] = lines
        return real(figure, path, title, ylabel, lines, **kw)

    monkeypatch.setattr(cmd_report, "_plot", spy)
    assert _report(str(run)) == 0
    lines = {label: (xs, ys) for label, xs, ys in drawn["reward.png"]}
    assert lines["validation, greedy"] == ([1, 3, 5], [0.1, 0.3, 0.5])
    assert lines["validation, sampled"] == ([1, 3, 5], [0.05, 0.15, 0.25])
    assert lines["mean"] == (list(range(6)), [0.5] * 6) and lines["mean + std"][1] == [0.75] * 6
    _assert_pngs([run / "report" / "reward.png"])
