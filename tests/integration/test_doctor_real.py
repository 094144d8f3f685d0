"""``baton doctor`` on real GPT runs (tiny GPT, two data-parallel workers, local backend): the
ranks measure their data wait, gradient reduction and compute time every step, and the
rules fire on what they measure. A slowed data loader is found as data loading; one rank's
delayed compute as a straggler naming that rank (its peers only wait for it in the
reduction); a healthy run has no finding. The faults come from ``BATON_FAULTS``
(core.job.faults), the one place Baton injects them."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers import baton

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
RUN = ("parallel.tp=1", "parallel.pp=1", "trainer.n_gpus_per_node=2", "trainer.steps=20",
       "checkpoint.interval_steps=0")
# Rank 1's delay per step: a step of the tiny GPT computes in ~40 ms, and on a busy machine
# (load ~10 on 2 cores) its scheduling noise stays well under half of this.
STRAGGLER_DELAY_S = 1.0


def _doctor(tmp_path: Path, faults: str | None) -> tuple[list[dict], list[dict]]:
    res = baton("submit", "experiments/tiny_gpt.yaml", f"runs_root={tmp_path}", *RUN, "--backend", "local",
                timeout=600, env={"BATON_FAULTS": faults} if faults else None)
    assert res.returncode == 0, res.stdout + res.stderr
    run = next((tmp_path / "tiny-gpt").glob("*"))
    out = baton("doctor", str(run), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return json.loads(out.stdout), records


def test_a_healthy_run_measures_every_step_and_has_no_finding(tmp_path: Path) -> None:
    findings, records = _doctor(tmp_path, None)
    assert findings == []
    assert [r["step"] for r in records] == list(range(20))
    for r in records:
        for key in ("data_wait_s", "grad_sync_s", "compute_s", "rank_step_time_s"):
            assert len(r[key]) == 2 and all(math.isfinite(v) and v >= 0 for v in r[key]), (key, r)
        assert r["tokens"] == 16 * 32  # the global batch, counted once over the two replicas


def test_a_slow_data_loader_is_found(tmp_path: Path) -> None:
    findings, records = _doctor(tmp_path, "data_delay_ms=300")
    assert [f["title"] for f in findings] == ["data loading is the bottleneck"], findings
    assert all(min(r["data_wait_s"]) >= 0.3 for r in records)


def test_a_delayed_rank_is_found_as_the_straggler_by_its_compute_time(tmp_path: Path) -> None:
    findings, records = _doctor(tmp_path, f"compute_delay_ms=1:{STRAGGLER_DELAY_S * 1000:.0f}")
    assert [f["title"].split(" (")[0] for f in findings] == ["straggler: rank 1"], findings
    assert "the median compute time" in findings[0]["evidence"], findings
    # Every step, rank 1 against its peer in that same step, half the delay the line between
    # carrying it and not: rank 1's compute holds the whole delay and rank 0's does not, and rank 0
    # waits for rank 1 in the reduction (half the delay longer than rank 1 waits there, at least).
    for r in records[2:]:
        (compute_0, compute_1), (sync_0, sync_1) = r["compute_s"], r["grad_sync_s"]
        assert compute_1 >= STRAGGLER_DELAY_S and compute_1 - compute_0 >= STRAGGLER_DELAY_S / 2, r
        assert sync_0 - sync_1 >= STRAGGLER_DELAY_S / 2, r
