"""`baton status --watch`: the live view's lines, and its loop until the run ends (proposed tests/unit/test_watch.py)."""
from __future__ import annotations

import io
import json
from pathlib import Path

from core.record import steps
from core.record.runfolder import RunFolder
from core.record.state import RunRecord, RunState, Status
from core.record.steps import StepRecord, to_data
from launcher import cmd_watch


def _run_folder(tmp_path: Path, status: Status, steps: int, total: int = 100) -> Path:
    (tmp_path / "config.yaml").write_text("name: t\n")
    RunRecord(RunFolder(tmp_path)).create(RunState(status=status, step=steps, total_steps=total))
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps(to_data(StepRecord(step=s, loss=1.0 / (s + 1), tokens_per_s=1000.0, step_time_s=0.5,
                                      time=100.0 + s))) + "\n" for s in range(steps)) + '{"step": 99, "lo')  # a line still being written
    return tmp_path


def test_render_shows_progress_eta_rate_and_loss() -> None:
    recent = [StepRecord(step=s, loss=0.25, tokens_per_s=2000.0, step_time_s=0.5, time=10.0 + 2 * s) for s in range(40, 50)]
    header, bar, detail = cmd_watch.render("toy/r1", RunState(status=Status.RUNNING, step=48, total_steps=100),
                                           recent, width=10)
    assert header == "toy/r1  running  (restarts 0)"
    assert bar == "[#####-----]  50%  step 50/100  ETA 0:01:40"  # 2 s per step from the timestamps × 50 left
    assert detail.startswith("loss 0.25  tokens/s 2,000  step 0.500 s")


def test_watch_returns_when_the_run_ends_and_reads_only_whole_lines(tmp_path: Path) -> None:
    out = io.StringIO()
    assert cmd_watch.watch(_run_folder(tmp_path, Status.FAILED, 30), 0.0, stream=out, sleep=lambda s: None) == 1
    assert "failed" in out.getvalue() and "step 30/100" in out.getvalue()


def test_watch_stops_after_max_iterations_and_tails_incrementally(tmp_path: Path) -> None:
    run = _run_folder(tmp_path, Status.RUNNING, 10)
    out = io.StringIO()
    assert cmd_watch.watch(run, 0.0, stream=out, max_iterations=3, sleep=lambda s: None) == 0
    assert len(out.getvalue().splitlines()) == 3
    tail = cmd_watch.MetricsTail(run / "metrics.jsonl", keep=5)
    assert [r.step for r in tail.poll()] == [5, 6, 7, 8, 9]
    with (run / "metrics.jsonl").open("a") as f:
        f.write('ss": 1.0}\n')  # the half-written line completes: now it counts
    assert [r.step for r in tail.poll()] == [6, 7, 8, 9, 99]


def test_watch_shows_unknown_while_state_is_unreadable_and_skips_lines_that_are_not_records(tmp_path: Path) -> None:
    run = _run_folder(tmp_path, Status.RUNNING, 3)
    (run / "state.json").write_text('{"status": "runn')  # caught mid-replace
    with (run / "metrics.jsonl").open("a") as f:
        f.write('ss": 1.0}\n[1, 2]\n{"step": "x", "loss": 1.0}\n')
    out = io.StringIO()
    assert cmd_watch.watch(run, 0.0, stream=out, max_iterations=2, sleep=lambda s: None) == 0
    assert out.getvalue().splitlines()[0].startswith(f"{run.parent.name}/{run.name}  unknown  (restarts 0) | step 100/?")
    assert [r.step for r in cmd_watch.MetricsTail(run / "metrics.jsonl").poll()] == [0, 1, 2, 99]


def test_the_tail_drops_the_records_a_resume_redoes_at_its_marker(tmp_path: Path) -> None:
    run = _run_folder(tmp_path, Status.RUNNING, 8)
    tail = cmd_watch.MetricsTail(run / "metrics.jsonl", keep=5)
    assert [r.step for r in tail.poll()] == [3, 4, 5, 6, 7]
    steps.supersede(run / "metrics.jsonl", 5, epoch=1)
    steps.append(run / "metrics.jsonl", steps.StepRecord(step=5, loss=0.5))
    assert [r.step for r in tail.poll()] == [3, 4, 5]
