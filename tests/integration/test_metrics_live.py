"""During a local toy run (real controller and worker processes), the controller's
Prometheus endpoint answers and carries the run's numbers."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers import LocalRun, scrape, wait_for

pytestmark = pytest.mark.timeout(120)
FAST = ["timeouts.heartbeat_interval_s=0.1", "timeouts.heartbeat_timeout_s=3", "timeouts.controller_lost_s=5"]


@pytest.fixture
def toy(local_runs: Callable[..., LocalRun]) -> Callable[..., LocalRun]:
    """``toy(*overrides)``: a toy run with FAST timeouts."""
    return lambda *overrides: local_runs("toy.yaml", *FAST, *overrides)


def _published(r: LocalRun) -> str | None:
    try:
        return str(json.loads((r.run.path / "metrics.json").read_text())["address"])
    except (FileNotFoundError, ValueError, KeyError):
        return None



def _value(samples: dict[str, list[Any]], name: str) -> float:
    return float(samples[name][0].value) if name in samples else 0.0


def test_endpoint_serves_the_live_run(toy) -> None:
    r = toy("trainer.steps=1000000")
    address = wait_for(lambda: _published(r), 30, f"{r.run.path}/metrics.json (is core.controller.metrics wired into the controller?)")
    assert address.startswith("http://127.0.0.1:")
    first = wait_for(lambda: (s := scrape(address)) and _value(s, "baton_step") >= 10 and s, 60,
                      "baton_step >= 10 on the endpoint")
    world = r.cfg.trainer.world_size
    ranks = {str(i) for i in range(world)}
    assert {s.labels["rank"] for s in first["baton_rank_step_time_seconds"]} == ranks
    assert {s.labels["rank"] for s in first["baton_straggler_score"]} == ranks
    assert {s.labels["rank"] for s in first["baton_heartbeat_lag_seconds"]} == ranks
    assert all(s.value > 0 for s in first["baton_rank_rss_bytes"])
    step = _value(first, "baton_step")
    # The histogram saw every step this controller ran; the scrape raced at most a few more.
    assert _value(first, "baton_step_time_seconds_count") >= step - 1
    train_calls = {s.labels["method"]: s.value for s in first["baton_dispatch_latency_seconds_count"]}
    assert train_calls.get("train_step", 0) >= step - 1 and train_calls.get("setup") == 1
    assert 0 < _value(first, "baton_goodput_ratio") <= 1
    # The loss on the endpoint is the loss of the step it reports done (metrics.jsonl has that
    # step's record before the gauges move; a scrape between the two gauges' updates retries).
    def consistent() -> tuple[float, float] | None:
        samples = scrape(address)
        done = int(_value(samples, "baton_step"))
        records = {rec["step"]: rec["loss"] for rec in map(json.loads, r.run.metrics.read_text().splitlines())}
        return (samples["baton_loss"][0].value, records[done - 1]) if done - 1 in records else None

    gauge, recorded = wait_for(lambda: (pair := consistent()) and pair[0] == pair[1] and pair, 30,
                               "baton_loss equal to the loss metrics.jsonl records for step baton_step - 1")
    assert gauge == recorded
    losses = [json.loads(line)["loss"] for line in r.run.metrics.read_text().splitlines() if line.strip()]
    assert losses[-1] < losses[0]  # the toy learns


def test_metrics_disabled_publishes_no_endpoint(toy) -> None:
    r = toy("trainer.steps=20", "metrics.enabled=false")
    wait_for(lambda: r.state().get("status") == "completed", 60, "the run to complete")
    assert not (r.run.path / "metrics.json").exists()
