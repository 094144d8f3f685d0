"""Goodput across a requeue: a real GPT run (local backend) preempted mid-run, requeued and
resumed. The allocated time is every epoch's whole span, from its controller process's
start (start-up, setup and the resume's load included) to its last word (the final and the
preemption checkpoint included); the useful time is the completed steps' time. state.json's
goodput equals (completed step time) / (the epochs' wall time) within 5 %."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import Submitted

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_goodput_across_a_requeue_is_step_time_over_every_epoch_s_wall_time(tmp_path: Path) -> None:
    r = Submitted(tmp_path, ["trainer.steps=24", "checkpoint.interval_steps=0"], experiment="experiments/tiny_gpt.yaml",
                  common=())
    r.preempt_at(8, timeout=500)
    events = [json.loads(line) for line in (r.run_dir / "events.jsonl").read_text().splitlines()]
    starts = [e["started_at"] for e in events if e["event"] == "controller_started"]
    ends = [e["time"] for e in events if e["event"] in ("requeued", "completed")]
    assert len(starts) == len(ends) == 2 and all(a < b for a, b in zip(starts, ends, strict=True))
    wall = sum(b - a for a, b in zip(starts, ends, strict=True))
    steps = [json.loads(line) for line in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(24))
    goodput = json.loads((r.run_dir / "state.json").read_text())["goodput"]
    assert goodput["useful_s"] == pytest.approx(sum(s["step_time_s"] for s in steps), rel=1e-6)
    assert goodput["allocated_s"] == pytest.approx(wall, rel=0.05), (goodput, wall)
    ratio = goodput["useful_s"] / goodput["allocated_s"]
    assert ratio == pytest.approx(goodput["useful_s"] / wall, rel=0.05) and 0 < ratio < 1
