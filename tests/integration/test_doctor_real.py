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
    findings, records = _doctor(tmp_path, "compute_delay_ms=1:300")
    assert [f["title"].split(" (")[0] for f in findings] == ["straggler: rank 1"], findings
    # rank 0 waits for rank 1 in the reduction; its own compute stays short
    assert all(r["compute_s"][1] >= 0.3 > r["compute_s"][0] and r["grad_sync_s"][0] >= 0.25 for r in records[2:])
