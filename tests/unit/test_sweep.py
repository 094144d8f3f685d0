"""Sweeps: expansion, validation, run ids, the ledger, status and results (no Slurm)."""
from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.config import run as config_mod
from core.errors import ConfigError, UserError
from core.record.runfolder import RunFolder
from core.record.state import RunRecord, RunState, SlurmInfo, Status
from launcher import cli, cmd_sweep
from launcher import ledger as ledger_mod
from launcher import sweep as sweep_mod
from launcher.ledger import Entry, Ledger, PointStatus

REPO = Path(__file__).resolve().parents[2]
BASE = {"name": "toy", "trainer": {"n_gpus_per_node": 2, "steps": 4}, "model": {"kind": "toy"}}


def _write(tmp_path: Path, body: dict[str, Any], name: str = "sw.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"base": BASE, **body}, sort_keys=False))
    return path


def _load(tmp_path: Path, body: dict[str, Any], *overrides: str) -> sweep_mod.Sweep:
    return sweep_mod.load_sweep(_write(tmp_path, body), [f"runs_root={tmp_path / 'runs'}", *overrides])


def _params(sw: sweep_mod.Sweep) -> list[dict[str, Any]]:
    return [p.param_dict for p in sw.points]


# --- expansion ------------------------------------------------------------------------------


def test_grid_is_the_cartesian_product_first_key_slowest(tmp_path: Path) -> None:
    sw = _load(tmp_path, {"grid": {"optimizer.lr": [0.1, 0.2], "seed": [1, 2, 3]}})
    assert _params(sw) == [{"optimizer.lr": lr, "seed": s} for lr in (0.1, 0.2) for s in (1, 2, 3)]
    assert [p.index for p in sw.points] == list(range(6))
    assert sw.points[4].cfg.optimizer.lr == 0.2 and sw.points[4].cfg.seed == 2
    assert sw.sweep_dir == (tmp_path / "runs" / "sw").resolve()
    assert all(p.cfg.name == "sw" for p in sw.points)


def test_zip_group_varies_together_and_multiplies_with_the_grid(tmp_path: Path) -> None:
    sw = _load(tmp_path, {"grid": {"seed": [1, 2]},
                          "zip": [{"trainer.n_gpus_per_node": [1, 2], "training.global_batch_size": [8, 16]}]})
    assert _params(sw) == [
        {"seed": 1, "trainer.n_gpus_per_node": 1, "training.global_batch_size": 8},
        {"seed": 1, "trainer.n_gpus_per_node": 2, "training.global_batch_size": 16},
        {"seed": 2, "trainer.n_gpus_per_node": 1, "training.global_batch_size": 8},
        {"seed": 2, "trainer.n_gpus_per_node": 2, "training.global_batch_size": 16},
    ]


def test_exclude_removes_every_matching_point_and_include_adds_new_ones(tmp_path: Path) -> None:
    sw = _load(tmp_path, {"grid": {"optimizer.lr": [0.1, 0.2], "seed": [1, 2]},
                          "exclude": [{"optimizer.lr": 0.2}],
                          "include": [{"optimizer.lr": 0.3, "seed": 9}, {"optimizer.lr": 0.1, "seed": 1}]})
    assert _params(sw) == [{"optimizer.lr": 0.1, "seed": 1}, {"optimizer.lr": 0.1, "seed": 2},
                           {"optimizer.lr": 0.3, "seed": 9}]  # the duplicate include is dropped


def test_exclude_of_an_unswept_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"exclude\[0\]\.seed: not a swept key"):
        _load(tmp_path, {"grid": {"optimizer.lr": [0.1]}, "exclude": [{"seed": 1}]})


def test_unequal_zip_group_is_refused_naming_both_lengths(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, {"zip": [{"optimizer.lr": [0.1, 0.2, 0.3], "seed": [1, 2]}]})
    msg = str(err.value)
    assert "zip[0]" in msg and "optimizer.lr has 3" in msg and "seed has 2" in msg


@pytest.mark.parametrize(("body", "match"), [
    ({"grid": {"optimizer.lrr": [0.1]}}, r"grid\.optimizer\.lrr: unknown key; did you mean 'optimizer\.lr'"),
    ({"grid": {"runs_root": ["a", "b"]}}, r"grid\.runs_root: 'runs_root' cannot vary"),
    ({"grid": {"seed": []}}, r"grid\.seed: empty list"),
    ({"grid": {"seed": [1]}, "zip": [{"seed": [2]}]}, r"zip\[0\]\.seed: swept twice"),
    ({"grid": {"seed": [1]}, "max_running": 0}, r"max_running: 0 must be ≥ 1"),
    ({"grid": {"seed": [1]}, "mode": "best"}, r"mode: 'best' is not 'min' or 'max'"),
    ({"grid": {"seed": [1]}, "gird": {}}, r"gird: unknown key; did you mean 'grid'"),
    ({}, r"no points"),
])
def test_bad_sweep_files_are_one_line_config_errors(tmp_path: Path, body: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _load(tmp_path, body)


def test_override_of_a_swept_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="override seed: this key is swept"):
        _load(tmp_path, {"grid": {"seed": [1, 2]}}, "seed=3")


def test_base_path_is_relative_to_the_sweep_file(tmp_path: Path) -> None:
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "b.yaml").write_text(yaml.safe_dump(BASE))
    path = tmp_path / "exp" / "s.yaml"
    path.write_text(yaml.safe_dump({"base": "b.yaml", "grid": {"seed": [1, 2]}}))
    sw = sweep_mod.load_sweep(path, [f"runs_root={tmp_path}"])
    assert [p.cfg.trainer.n_gpus_per_node for p in sw.points] == [2, 2]
    path.write_text(yaml.safe_dump({"base": "missing.yaml", "grid": {"seed": [1]}}))
    with pytest.raises(ConfigError, match="base: .*missing.yaml: cannot read config"):
        sweep_mod.load_sweep(path)


def test_the_shipped_toy_sweep_is_a_valid_2x2_grid() -> None:
    sw = sweep_mod.load_sweep(REPO / "experiments" / "sweep_toy.yaml")
    assert len(sw.points) == 4 and {p.cfg.model.kind for p in sw.points} == {"toy"}


# --- invalid points -------------------------------------------------------------------------


def test_invalid_point_names_the_point_its_parameters_and_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, {"grid": {"optimizer.lr": [0.1, -1.0], "seed": [1, 2]}})
    msg = str(err.value)
    assert "point 2 (optimizer.lr=-1, seed=1)" in msg and "optimizer.lr: -1.0 must be > 0" in msg
    assert "and 1 more bad point" in msg and "nothing was submitted" in msg and "\n" not in msg


def test_submit_with_an_invalid_point_writes_nothing_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"grid": {"training.global_batch_size": [16, 0]}})
    code = cli.main(["sweep", "submit", str(path), "--backend", "local", f"runs_root={tmp_path / 'runs'}"])
    assert code == 2
    assert "point 1 (training.global_batch_size=0): training.global_batch_size: 0 must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


# --- run ids --------------------------------------------------------------------------------


def test_run_ids_are_deterministic_distinct_and_readable(tmp_path: Path) -> None:
    a = _load(tmp_path, {"grid": {"optimizer.lr": [3e-4, 0.1], "parallel.tp": [1]}})
    b = _load(tmp_path, {"grid": {"parallel.tp": [1], "optimizer.lr": ["3e-4", 0.1]}})  # other order, YAML string
    assert {p.run_id for p in a.points} == {p.run_id for p in b.points}
    assert len({p.run_id for p in a.points}) == 2
    assert a.points[0].run_id.startswith("lr0.0003_tp1-") and len(a.points[0].run_id.rsplit("-", 1)[1]) == 8
    assert sweep_mod.run_id({"seed": 1}) != sweep_mod.run_id({"seed": 2})


def test_two_points_resolving_to_the_same_parameters_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"point 1 \(optimizer.lr=0.0003\) is the same as point 0"):
        _load(tmp_path, {"grid": {"optimizer.lr": [0.0003]}, "include": [{"optimizer.lr": "3e-4"}]})


# --- heuristics -----------------------------------------------------------------------------


def test_auto_lr_follows_square_root_scaling_like_the_run_config() -> None:
    assert sweep_mod.auto_lr(1024) == pytest.approx(3e-6)
    assert sweep_mod.auto_lr(4096) == pytest.approx(6e-6)
    cfg = config_mod.from_data({"optimizer": {"lr": "auto"}, "training": {"global_batch_size": 256}})
    assert cfg.lr == pytest.approx(sweep_mod.auto_lr(256)) == pytest.approx(3e-6 * math.sqrt(0.25))


@pytest.mark.parametrize(("mem_mb", "batch"), [(81920, 16), (40960, 8), (7000, 2), (3499, 1), (24000, 4)])
def test_per_gpu_batch_is_memory_over_3500_rounded_down_to_a_power_of_two(mem_mb: int, batch: int) -> None:
    assert sweep_mod.per_gpu_batch(mem_mb) == batch


# --- max_running chains ---------------------------------------------------------------------


def test_chains_keep_at_most_max_running_points_at_once() -> None:
    assert sweep_mod.chain_waits(4, None, []) == [None] * 4
    assert sweep_mod.chain_waits(4, 1, []) == [None, 0, 1, 2]
    assert sweep_mod.chain_waits(5, 2, []) == [None, None, 0, 1, 2]
    assert sweep_mod.chain_waits(3, 2, ["77"]) == [None, "77", 0]  # one chain still busy
    assert sweep_mod.chain_waits(2, 1, ["77", "78"]) == ["77", "78"]


# --- the ledger -----------------------------------------------------------------------------


def _ledger(n: int = 3, **kw: Any) -> Ledger:
    points = tuple(Entry(index=i, params={"optimizer.lr": 0.1 * (i + 1), "seed": i}, run_id=f"p{i}",
                         run_dir=f"/nowhere/p{i}") for i in range(n))
    return Ledger(name="sw", sweep_file="/x/sw.yaml", created=1.0, backend="slurm", base=BASE,
                  points=points, **kw)  # type: ignore[arg-type]


def test_ledger_round_trips_atomically(tmp_path: Path) -> None:
    led = _ledger(max_running=2)
    led = led.with_entry(replace(led.points[1], job_id="42", state=ledger_mod.QUEUED, submissions=1))
    ledger_mod.write_ledger(tmp_path, led)
    back = ledger_mod.read_ledger(tmp_path)
    assert back == led
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.json", "sweep.lock"]  # no temporary left behind
    before = (tmp_path / "sweep.json").read_text()
    with pytest.raises(TypeError):  # a failed write leaves the old ledger whole
        ledger_mod.write_ledger(tmp_path, replace(led, base={"bad": object()}))
    assert (tmp_path / "sweep.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.json", "sweep.lock"]


def test_reading_a_folder_without_or_with_a_foreign_ledger_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not a sweep folder"):
        ledger_mod.read_ledger(tmp_path)
    (tmp_path / "sweep.json").write_text(json.dumps({"version": 99}))
    with pytest.raises(UserError, match="ledger version 99, this Baton reads version 1"):
        ledger_mod.read_ledger(tmp_path)


@pytest.mark.parametrize(("run_status", "job_state", "ledger_state", "want"), [
    ("completed", "CANCELLED", "queued", "completed"),   # the run's own word wins
    ("running", "RUNNING", "queued", "running"),
    (None, "PENDING", "queued", "queued"),
    ("running", "CANCELLED", "queued", "cancelled"),
    ("running", "COMPLETED", "queued", "failed"),        # the job ended, the run did not complete
    ("failed", "RUNNING", "queued", "failed"),
    ("running", None, "queued", "running"),              # Slurm silent: the run folder decides
    ("created", None, "queued", "queued"),
])
def test_point_state_combines_run_folder_and_slurm(run_status: str | None, job_state: str | None,
                                                   ledger_state: str, want: str) -> None:
    e = Entry(index=0, params={}, run_id="r", run_dir="/x", backend="slurm", job_id="5", state=ledger_state)
    assert ledger_mod.point_state(e, run_status, job_state, local_alive=None) == want


def test_a_local_point_whose_sweep_process_died_is_cancelled() -> None:
    e = Entry(index=0, params={}, run_id="r", run_dir="/x", backend="local", state="running",
              pid=2**22 + 12345, host=socket.gethostname())
    assert ledger_mod._local_alive(e) is False
    assert ledger_mod.point_state(e, "running", None, local_alive=False) == "cancelled"
    assert ledger_mod._local_alive(replace(e, pid=os.getpid())) is True
    assert ledger_mod.point_state(Entry(index=0, params={}, run_id="r", run_dir="/x"), None, None,
                                  local_alive=None) == "unsubmitted"


def test_refresh_reads_run_folders_and_survives_a_failing_slurm_lookup(tmp_path: Path) -> None:
    led = _ledger(2)
    led = replace(led, points=tuple(replace(e, run_dir=str(tmp_path / e.run_id), job_id=str(10 + e.index), backend="slurm",
                                            state="queued") for e in led.points))
    run0 = tmp_path / "p0"
    run0.mkdir()
    RunRecord(RunFolder(run0)).create(RunState(status=Status.COMPLETED, step=4, total_steps=4, last_loss=0.5,
                                               restarts=1))
    (run0 / "metrics.jsonl").write_text('{"step": 3, "loss": 0.5, "lr": 0.1}\n{"step": 4, "lo')  # partial line

    def broken(jobs: dict[str, Path]) -> dict[str, str]:
        raise RuntimeError("sacct: slurmdbd down")

    rows = ledger_mod.refresh(led, broken)
    assert [r.state for r in rows] == ["completed", "queued"]
    assert (rows[0].step, rows[0].total_steps, rows[0].last_loss, rows[0].restarts) == (4, 4, 0.5, 1)
    assert rows[0].metric == 0.5 and rows[0].metrics == {"step": 3.0, "loss": 0.5, "lr": 0.1}
    rows = ledger_mod.refresh(led, lambda ids: {"11": "RUNNING"})
    assert rows[1].state == "running"


def test_refresh_takes_the_job_id_the_run_folder_recorded_over_a_stale_ledger(tmp_path: Path) -> None:
    led = _ledger(1)
    led = replace(led, points=(replace(led.points[0], run_dir=str(tmp_path)),))  # interrupted before the ledger write
    RunRecord(RunFolder(tmp_path)).create(RunState(status=Status.SUBMITTED, slurm=SlurmInfo(job_id="77")))
    (row,) = ledger_mod.refresh(led, lambda jobs: {"77": "RUNNING"} if "77" in jobs else {})
    assert (row.entry.job_id, row.entry.backend, row.state) == ("77", "slurm", "running")


def test_refresh_reads_a_state_json_of_an_older_baton_and_survives_a_damaged_one(tmp_path: Path,
                                                                                 caplog: pytest.LogCaptureFixture) -> None:
    led = _ledger(2)
    led = replace(led, points=tuple(replace(e, run_dir=str(tmp_path / e.run_id)) for e in led.points))
    for e in led.points:
        Path(e.run_dir).mkdir()
    (tmp_path / "p0" / "state.json").write_text(json.dumps({"status": "failed", "step": 2, "reason": "boom",
                                                           "history": []}))  # version 1: untyped
    (tmp_path / "p1" / "state.json").write_text('{"status": ')
    (tmp_path / "p1" / "metrics.jsonl").write_text('{"step": 0, "loss": 2.0, "lr": 0.1}\n["not", "a record"]\n')
    rows = ledger_mod.refresh(led, None)
    assert [(r.state, r.step, r.total_steps, r.reason) for r in rows] == [("failed", 2, None, "boom"),
                                                                          ("unsubmitted", 0, None, None)]
    assert "state.json: not valid JSON" in caplog.text
    assert rows[1].metrics == {"step": 0.0, "loss": 2.0, "lr": 0.1}  # the last line that is a record


# --- status and results ---------------------------------------------------------------------


def _rows(led: Ledger, specs: list[tuple[str, float | None]]) -> list[PointStatus]:
    return [PointStatus(entry=e, state=s, step=4 if m is not None else 0, total_steps=4, last_loss=m,
                        metrics={} if m is None else {"loss": m, "grad_norm": 1.0}, metric=m)
            for e, (s, m) in zip(led.points, specs, strict=True)]


def test_ranking_puts_the_best_first_and_points_without_a_metric_last() -> None:
    led = _ledger(4)
    rows = _rows(led, [("completed", 0.3), ("running", 0.1), ("failed", None), ("completed", 0.2)])
    assert [r.entry.index for r in ledger_mod.ranked(rows, "min")] == [1, 3, 0, 2]
    assert [r.entry.index for r in ledger_mod.ranked(rows, "max")] == [0, 3, 1, 2]
    assert ledger_mod.best(rows, "min").entry.index == 1  # type: ignore[union-attr]
    assert ledger_mod.best(rows, "min", completed_only=True).entry.index == 3  # type: ignore[union-attr]
    assert ledger_mod.best(rows[2:3], "min") is None


def test_status_table_has_one_row_per_point_counts_and_the_best(tmp_path: Path) -> None:
    led = _ledger(3)
    rows = _rows(led, [("completed", 0.25), ("running", 0.125), ("cancelled", None)])
    text = ledger_mod.format_status(led, rows)
    lines = text.splitlines()
    assert lines[1].split() == ["point", "optimizer.lr", "seed", "state", "step", "loss", "restarts", "job"]
    assert lines[2].split() == ["0", "0.1", "0", "completed", "4/4", "0.25", "0", "-"]
    assert lines[4].split()[:5] == ["2", "0.3", "2", "cancelled", "0/4"]
    assert "states: 1 running, 1 completed, 1 cancelled (of 3)" in text
    assert "best so far: point 1 (optimizer.lr=0.2, seed=1) loss 0.125 [running]" in text


def test_results_sorted_best_first_with_csv(tmp_path: Path) -> None:
    led = _ledger(3)
    rows = _rows(led, [("completed", 0.25), ("completed", 0.125), ("failed", None)])
    text = ledger_mod.format_results(led, rows)
    body = text.splitlines()[2:5]
    assert [line.split()[:2] for line in body] == [["1", "1"], ["2", "0"], ["3", "2"]]
    assert "best: point 1 (optimizer.lr=0.2, seed=1) loss 0.125 [completed]" in text
    csv_lines = ledger_mod.results_csv(led, rows).splitlines()
    assert csv_lines[0] == "rank,point,run_id,optimizer.lr,seed,state,step,total_steps,loss,grad_norm,run_dir"
    assert csv_lines[1].startswith("1,1,p1,0.2,1,completed,4,4,0.125,1.0,")


# --- submit and resume through a fake Slurm seam (the process boundary) ---------------------


class FakeSlurm:
    """Records what cmd_sweep asks of launcher.slurm; job states are set by the test."""

    calls: list[tuple[str, ...]] = []
    states: dict[str, str] = {}
    bad_render: str | None = None  # a run id whose render fails

    def __init__(self) -> None:
        pass

    def preflight(self, cfg: Any) -> None:
        FakeSlurm.calls.append(("preflight", cfg.name))

    def render(self, run: Any, cfg: Any, *, after: str | None) -> str:
        if run.path.name == FakeSlurm.bad_render:
            raise ConfigError("slurm.workers.partition: 'nope' is not a partition (valid: cpu, gpu)")
        FakeSlurm.calls.append(("render", run.path.name))
        return "#!/bin/bash\n"

    def submit(self, run: Any, cfg: Any, *, epoch: int, after: str | None) -> str:
        job = str(100 + len(FakeSlurm.states))
        FakeSlurm.calls.append(("submit", run.path.name, str(epoch), str(after)))
        FakeSlurm.states[job] = "PENDING"
        return job

    def job_states(self, jobs: dict[str, Path]) -> dict[str, str]:
        return {j: FakeSlurm.states[j] for j in jobs if j in FakeSlurm.states}


@pytest.fixture
def fake_slurm(monkeypatch: pytest.MonkeyPatch) -> type[FakeSlurm]:
    monkeypatch.setattr(FakeSlurm, "calls", [])
    monkeypatch.setattr(FakeSlurm, "states", {})
    monkeypatch.setattr(FakeSlurm, "bad_render", None)
    monkeypatch.setattr(cmd_sweep, "SlurmBackend", FakeSlurm)
    return FakeSlurm


def test_slurm_submit_renders_every_point_first_then_chains_max_running(tmp_path: Path, fake_slurm: type[FakeSlurm]) -> None:
    path = _write(tmp_path, {"grid": {"optimizer.lr": [0.1, 0.2], "seed": [1, 2]}, "max_running": 2})
    assert cli.main(["sweep", "submit", str(path), "--backend", "slurm", f"runs_root={tmp_path / 'runs'}"]) == 0
    kinds = [c[0] for c in fake_slurm.calls]
    assert kinds == ["preflight", "render"] * 4 + ["submit"] * 4
    assert [c[3] for c in fake_slurm.calls if c[0] == "submit"] == ["None", "None", "100", "101"]
    led = ledger_mod.read_ledger(tmp_path / "runs" / "sw")
    assert [(e.job_id, e.after, e.state) for e in led.points] == [
        ("100", None, "queued"), ("101", None, "queued"), ("102", "100", "queued"), ("103", "101", "queued")]
    assert all((Path(e.run_dir) / "config.yaml").is_file() for e in led.points)


def test_slurm_render_failure_of_one_point_submits_and_writes_nothing(tmp_path: Path, fake_slurm: type[FakeSlurm],
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"grid": {"seed": [1, 2, 3]}})
    fake_slurm.bad_render = sweep_mod.run_id({"seed": 3})
    assert cli.main(["sweep", "submit", str(path), "--backend", "slurm", f"runs_root={tmp_path / 'runs'}"]) == 2
    assert "point 2 (seed=3): slurm.workers.partition: 'nope'" in capsys.readouterr().err
    assert not any(c[0] == "submit" for c in fake_slurm.calls) and not (tmp_path / "runs").exists()


def test_slurm_resume_resubmits_only_failed_cancelled_and_unsubmitted_points(tmp_path: Path,
                                                                          fake_slurm: type[FakeSlurm]) -> None:
    path = _write(tmp_path, {"grid": {"seed": [1, 2, 3, 4, 5]}, "max_running": 2})
    assert cli.main(["sweep", "submit", str(path), "--backend", "slurm", f"runs_root={tmp_path / 'runs'}"]) == 0
    sweep_dir = tmp_path / "runs" / "sw"
    led = ledger_mod.read_ledger(sweep_dir)
    done = Path(led.points[0].run_dir) / "state.json"
    done.write_text(json.dumps({**json.loads(done.read_text()), "status": "completed"}))
    fake_slurm.states.update({"100": "COMPLETED", "101": "RUNNING", "102": "CANCELLED", "103": "FAILED",
                              "104": "PENDING"})
    ledger_mod.write_ledger(sweep_dir, led.with_entry(replace(led.points[4], job_id=None, state="unsubmitted",
                                                              after=None, submissions=0)))
    fake_slurm.calls.clear()
    assert cli.main(["sweep", "resume", str(sweep_dir)]) == 0
    submits = [c for c in fake_slurm.calls if c[0] == "submit"]
    ids = [e.run_id for e in led.points]
    # point 1 (job 101) still runs: the resubmitted points fill the one free chain and chain after 101
    assert [(c[1], c[2], c[3]) for c in submits] == [(ids[2], "1", "None"), (ids[3], "1", "101"), (ids[4], "0", "105")]
    after = ledger_mod.read_ledger(sweep_dir)
    assert [e.submissions for e in after.points] == [1, 1, 2, 2, 1]
    assert json.loads(done.read_text())["status"] == "completed"


def test_the_default_name_from_an_odd_file_name_is_a_valid_run_name(tmp_path: Path) -> None:
    path = _write(tmp_path, {"grid": {"seed": [1]}}, name="lr+seed grid.yaml")
    sw = sweep_mod.load_sweep(path, [f"runs_root={tmp_path / 'runs'}"])
    assert sw.name == "lr-seed-grid" and sw.points[0].cfg.name == "lr-seed-grid"


def test_sweep_files_are_read_by_the_experiment_loader(tmp_path: Path) -> None:
    path = tmp_path / "sw.yaml"
    path.write_text("base: {name: toy, model: {kind: toy}}\ngrid:\n  seed: [1]\n  seed: [2]\n")
    with pytest.raises(ConfigError, match=r"sw.yaml: not valid YAML at line 4, column 3: duplicate key 'seed'"):
        sweep_mod.load_sweep(path)
    path.write_text("# later\n")
    with pytest.raises(ConfigError, match="sw.yaml: empty; a sweep file sets at least base: and grid:"):
        sweep_mod.load_sweep(path)
