"""`baton doctor`'s rules on synthesized metrics records, and the command around them."""
from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from core.config.dims import Coords
from core.errors import UserError
from core.record import steps
from core.record.runfolder import RunFolder
from core.record.state import RankInfo, RunRecord, RunState, Status
from core.record.steps import StepRecord
from launcher import cmd_doctor, doctor

WORLD = 4
STATE = RunState(
    status=Status.COMPLETED, step=40, total_steps=40,
    ranks=tuple(RankInfo(rank=r, node=f"node{1 + r // 2}", host=f"host{1 + r // 2}", pid=100 + r,
                         coords=Coords(rank=r, tp=0, pp=0, dp=r)) for r in range(WORLD)),
)


def _records(n: int = 40, *, seed: int = 0, **per_step: Any) -> list[StepRecord]:
    """A healthy run: ~100 ms steps with a little jitter, steady memory, short data waits.

    ``per_step`` values are callables (step, rng) -> field value that replace or add a field.
    """
    rng = random.Random(seed)
    out = []
    for step in range(n):
        rank_times = [0.09 + rng.uniform(0, 0.01) for _ in range(WORLD)]
        rec: dict[str, Any] = {
            "step": step, "loss": 3.0 / (1 + step), "grad_norm": 1.0, "lr": 1e-3, "tokens": 4096,
            "step_time_s": max(rank_times) + 0.005, "rank_step_time_s": rank_times,
            "rss_mb": [2000.0 + rng.uniform(0, 8) for _ in range(WORLD)],
            "data_wait_s": [rng.uniform(0.001, 0.003) for _ in range(WORLD)],
            "grad_sync_s": [0.02] * WORLD, "time": 1.7e9 + step * 0.1,
        }
        for key, fn in per_step.items():
            rec[key] = fn(step, rng)
        out.append(steps.from_data(rec, f"step {step}"))
    return out


def _titles(findings: list[doctor.Finding]) -> list[str]:
    return [f.title for f in findings]


def test_healthy_run_has_no_findings() -> None:
    findings = doctor.diagnose(_records(), STATE)
    assert findings == []
    assert doctor.format_findings(findings) == "no findings"


def test_slow_data_loader_is_named_as_the_bottleneck() -> None:
    slow = _records(data_wait_s=lambda s, rng: [0.3 + rng.uniform(0, 0.02) for _ in range(WORLD)],
                    step_time_s=lambda s, rng: 0.42)
    findings = doctor.diagnose(slow, STATE)
    assert _titles(findings) == ["data loading is the bottleneck"]
    assert "baton data build" in findings[0].advice
    assert "compute share" in findings[0].evidence


def test_a_straggler_is_named_with_its_rank_and_node() -> None:
    def times(step: int, rng: random.Random) -> list[float]:
        t = [0.1 + rng.uniform(0, 0.005) for _ in range(WORLD)]
        t[3] = 0.25 if step % 5 else 0.1  # slow in 80% of the steps
        return t

    findings = doctor.diagnose(_records(rank_step_time_s=times), STATE)
    assert len(findings) == 1
    assert findings[0].title == "straggler: rank 3 (node node2, host host2)"
    assert re.search(r"was 2\.[3-5]x the median step time in 29 of 36 steps", findings[0].evidence)


def test_an_occasional_slow_step_is_not_a_straggler() -> None:
    def times(step: int, rng: random.Random) -> list[float]:
        return [0.3 if (step % 10 == 0 and r == 1) else 0.1 for r in range(WORLD)]

    assert doctor.diagnose(_records(rank_step_time_s=times), STATE) == []


def test_slow_gradient_sync_advises_bucket_size() -> None:
    findings = doctor.diagnose(_records(grad_sync_s=lambda s, rng: [0.6, 0.7, 0.65, 0.8]), STATE)
    assert _titles(findings) == ["gradient synchronisation is slow"]
    assert "bucket" in findings[0].advice
    assert "800 ms" in findings[0].evidence  # the worst step's slowest rank


def test_peers_waiting_in_the_reduction_for_a_straggler_are_not_a_slow_gradient_sync() -> None:
    def compute(step: int, rng: random.Random) -> list[float]:  # rank 3 computes 1 s longer every step
        return [0.09 + rng.uniform(0, 0.01) + (1.0 if r == 3 else 0.0) for r in range(WORLD)]

    def waits(step: int, rng: random.Random) -> list[float]:  # its peers wait for it; it arrives last
        return [0.02 if r == 3 else 1.0 + rng.uniform(0, 0.01) for r in range(WORLD)]

    findings = doctor.diagnose(_records(compute_s=compute, grad_sync_s=waits), STATE)
    assert _titles(findings) == ["straggler: rank 3 (node node2, host host2)"]


def test_memory_differing_across_ranks_points_at_uneven_micro_batches() -> None:
    findings = doctor.diagnose(_records(cuda_peak_mb=lambda s, rng: [10_000.0, 10_000.0, 16_000.0, 10_000.0]), STATE)
    assert _titles(findings) == ["memory varies strongly across ranks or steps"]
    assert "rank 2" in findings[0].evidence and "CUDA peak" in findings[0].evidence
    assert "uneven" in findings[0].advice


def test_memory_swinging_step_to_step_is_found_but_a_different_stage_is_not() -> None:
    swing = _records(cuda_peak_mb=lambda s, rng: [8000.0 + (4000.0 if s % 2 else 0.0)] * WORLD)
    assert _titles(doctor.diagnose(swing, STATE)) == ["memory varies strongly across ranks or steps"]
    # Two pipeline stages holding different layers differ in memory by design.
    staged = replace(STATE, ranks=tuple(replace(e, coords=Coords(rank=e.rank, tp=0, pp=e.rank // 2, dp=e.rank % 2))
                                        for e in STATE.ranks))
    by_stage = _records(cuda_peak_mb=lambda s, rng: [12_000.0, 12_000.0, 6_000.0, 6_000.0])
    assert doctor.diagnose(by_stage, staged) == []


def test_failed_run_is_an_error_finding_listed_first() -> None:
    state = replace(STATE, status=Status.FAILED, step=12, reason="lost 1 worker(s): rank 2 ...")
    slow = _records(grad_sync_s=lambda s, rng: [0.9] * WORLD)
    findings = doctor.diagnose(slow, state)
    assert [f.severity for f in findings] == ["error", "warning"]
    assert "rank 2" in findings[0].evidence


def test_records_without_optional_fields_trigger_nothing() -> None:
    bare = [StepRecord(step=s, loss=1.0, step_time_s=0.01) for s in range(30)]
    assert doctor.diagnose(bare, RunState()) == []
    assert doctor.diagnose([], RunState()) == []


def test_the_records_read_skip_a_half_written_last_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n" + json.dumps({"step": 1, "loss": 1.0}) + "\n"
                    + '{"step": 2, "lo')
    assert [r.step for r in steps.read(path)] == [0, 1]
    assert steps.read(tmp_path / "absent.jsonl") == []


def _run_folder(tmp_path: Path, records: list[StepRecord], state: RunState) -> Path:
    (tmp_path / "config.yaml").write_text("name: t\n")
    RunRecord(RunFolder(tmp_path)).create(state)
    for r in records:
        steps.append(tmp_path / "metrics.jsonl", r)
    return tmp_path


def _doctor(*argv: str) -> int:
    """``baton doctor ARGS`` in-process, through the command's own parser (cli.py wires it)."""
    parser = argparse.ArgumentParser()
    cmd_doctor.register(parser.add_subparsers())
    args = parser.parse_args(["doctor", *argv])
    return int(args.func(args))


def test_command_exits_0_on_warnings_and_1_on_a_failed_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slow = _records(data_wait_s=lambda s, rng: [0.3] * WORLD, step_time_s=lambda s, rng: 0.4)
    (tmp_path / "a").mkdir()
    assert _doctor(str(_run_folder(tmp_path / "a", slow, STATE))) == 0
    assert "[warning] data loading is the bottleneck" in capsys.readouterr().out
    (tmp_path / "b").mkdir()
    assert _doctor(str(_run_folder(tmp_path / "b", _records(), replace(STATE, status=Status.FAILED))), "--json") == 1
    assert [f["severity"] for f in json.loads(capsys.readouterr().out)] == ["error"]
    with pytest.raises(UserError, match="not a Baton run folder"):
        _doctor(str(tmp_path / "nowhere"))
