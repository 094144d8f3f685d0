"""The controller's Prometheus endpoint, scraped over real HTTP and parsed by prometheus_client."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from core.controller.metrics import Metrics
from core.errors import UserError
from core.record.runfolder import RunFolder
from core.record.steps import StepRecord
from tests.helpers import scrape

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "grafana" / "baton-dashboard.json"


def _record(step: int, **extra: Any) -> StepRecord:
    return StepRecord(**{
        "step": step, "loss": 2.0 - 0.1 * step, "grad_norm": 0.5, "lr": 1e-3, "tokens": 1024,
        "tokens_per_s": 5000.0, "step_time_s": 0.2, "rank_step_time_s": (0.1, 0.1, 0.3, 0.1),
        "rss_mb": (100.0, 110.0, 120.0, 130.0), "time": 1.7e9 + step, **extra,
    })


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Metrics, RunFolder, str]]:
    run = RunFolder(tmp_path)
    m = Metrics()
    address = m.start(run, 0, host="127.0.0.1", bind="127.0.0.1")
    yield m, run, address
    m.close()



def _by_rank(samples: list[Any]) -> dict[str, float]:
    return {s.labels["rank"]: s.value for s in samples}


def test_start_on_port_zero_publishes_a_reachable_address(served) -> None:
    m, run, address = served
    published = json.loads((run.path / "metrics.json").read_text())
    assert published["address"] == address
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", address) and published["port"] > 0
    assert scrape(address) is not None  # reachable before any step


def test_an_rl_step_record_becomes_rl_gauges_and_phase_times(served) -> None:
    m, _, address = served
    m.observe_step(replace(_record(0), reward_mean=0.75, kl=0.02, entropy=1.5, policy_version=31,
                                       phase_s={"generate": 0.5, "update": 0.25}, sync_bytes_sent_max=3 << 20,
                                       sync_bytes_sent_total=7 << 20))
    got = scrape(address)
    assert got["baton_weight_sync_bytes_sent_max"][0].value == 3 << 20
    assert got["baton_weight_sync_bytes_sent_total"][0].value == 7 << 20
    assert got["baton_rl_reward_mean"][0].value == 0.75 and got["baton_rl_kl"][0].value == 0.02
    assert got["baton_rl_entropy"][0].value == 1.5 and got["baton_rl_policy_version"][0].value == 31
    assert {s.labels["phase"]: s.value for s in got["baton_rl_phase_seconds"]} == {"generate": 0.5, "update": 0.25}


def test_a_validated_step_exports_its_validation_rewards_and_a_later_step_keeps_them(served) -> None:
    """val_reward_mean(_sampled) are set by the steps after which the policy was validated;
    the steps between leave the last validation's values (the gauge is not reset to 0)."""
    m, _, address = served
    m.observe_step(replace(_record(0), reward_mean=0.5))
    assert "baton_rl_val_reward_mean" not in {k for k, v in scrape(address).items() if v and v[0].value != 0}
    m.observe_step(replace(_record(1), reward_mean=0.5, val_reward_mean=0.625, val_reward_mean_sampled=0.375))
    m.observe_step(replace(_record(2), reward_mean=0.25))
    got = scrape(address)
    assert got["baton_rl_val_reward_mean"][0].value == 0.625
    assert got["baton_rl_val_reward_mean_sampled"][0].value == 0.375
    assert got["baton_rl_reward_mean"][0].value == 0.25


def test_step_record_becomes_gauges_with_the_values_fed(served) -> None:
    m, _, address = served
    for step in range(3):
        m.observe_step(_record(step, cuda_peak_mb=(1000.0, 1000.0, 2000.0, 1000.0), data_wait_s=(0.01, 0.02, 0.0, 0.05)))
    got = scrape(address)
    assert got["baton_step"][0].value == 3
    assert got["baton_loss"][0].value == pytest.approx(1.8)
    assert got["baton_learning_rate"][0].value == pytest.approx(1e-3)
    assert got["baton_grad_norm"][0].value == pytest.approx(0.5)
    assert got["baton_tokens_per_second"][0].value == pytest.approx(5000.0)
    assert got["baton_tokens_total"][0].value == 3 * 1024
    assert _by_rank(got["baton_rank_step_time_seconds"]) == pytest.approx({"0": 0.1, "1": 0.1, "2": 0.3, "3": 0.1})
    assert _by_rank(got["baton_straggler_score"]) == pytest.approx({"0": 1.0, "1": 1.0, "2": 3.0, "3": 1.0})
    assert _by_rank(got["baton_rank_rss_bytes"])["3"] == 130 * 2**20
    assert _by_rank(got["baton_rank_cuda_peak_bytes"])["2"] == 2000 * 2**20
    assert _by_rank(got["baton_rank_data_wait_seconds"])["3"] == pytest.approx(0.05)


def test_step_time_histogram_counts_every_step_into_its_bucket(served) -> None:
    m, _, address = served
    for step, wall in enumerate([0.003, 0.2, 0.2, 7.0]):
        m.observe_step(replace(_record(step), step_time_s=wall))
    got = scrape(address)
    assert got["baton_step_time_seconds_count"][0].value == 4
    assert got["baton_step_time_seconds_sum"][0].value == pytest.approx(7.403)
    buckets = {s.labels["le"]: s.value for s in got["baton_step_time_seconds_bucket"]}
    assert buckets["0.005"] == 1 and buckets["0.25"] == 3 and buckets["5.0"] == 3 and buckets["+Inf"] == 4


def test_optional_fields_absent_leave_their_series_empty(served) -> None:
    m, _, address = served
    m.observe_step(StepRecord(step=0, loss=1.0, grad_norm=None, rank_step_time_s=(0.0, 0.0), rss_mb=(0.0, 0.0)))
    got = scrape(address)
    assert "baton_rank_cuda_peak_bytes" not in got and "baton_rank_data_wait_seconds" not in got
    assert "baton_rank_rss_bytes" not in got  # 0 MiB means "not measured"
    assert _by_rank(got["baton_straggler_score"]) == {"0": 1.0, "1": 1.0}  # no timing: nobody straggles
    assert got["baton_grad_norm"][0].value == 0.0  # untouched, not crashed on None


def test_nan_and_infinite_values_neither_raise_nor_spoil_the_other_ranks(served) -> None:
    m, _, address = served
    nan = float("nan")
    m.observe_step(StepRecord(step=0, loss=nan, grad_norm=float("inf"), step_time_s=nan,
                              rank_step_time_s=(0.1, nan, 0.1, 0.3), rss_mb=(nan, 100.0)))
    got = scrape(address)
    assert got["baton_loss"][0].value != got["baton_loss"][0].value  # NaN, as recorded
    assert got["baton_step_time_seconds_count"][0].value == 0  # a NaN wall is no observation
    scores = _by_rank(got["baton_straggler_score"])
    assert (scores["0"], scores["2"], scores["3"]) == pytest.approx((1.0, 1.0, 3.0))  # median of the finite times
    assert _by_rank(got["baton_rank_rss_bytes"])["1"] == 100 * 2**20


def test_heartbeat_dispatch_checkpoint_restarts_and_goodput(served) -> None:
    m, _, address = served
    m.observe_heartbeat_lag(0, 0.05)
    m.observe_heartbeat_lag(1, 2.5)
    for seconds in (0.0002, 0.0004, 0.03):
        m.observe_dispatch("train_step", seconds)
    m.observe_dispatch("setup", 12.0)
    m.observe_checkpoint(2.0, 4_000_000_000)
    m.set_restarts(2)
    m.observe_goodput(90.0, 120.0)
    got = scrape(address)
    assert _by_rank(got["baton_heartbeat_lag_seconds"]) == pytest.approx({"0": 0.05, "1": 2.5})
    counts = {s.labels["method"]: s.value for s in got["baton_dispatch_latency_seconds_count"]}
    assert counts == {"train_step": 3, "setup": 1}
    assert got["baton_checkpoint_duration_seconds"][0].value == 2.0
    assert got["baton_checkpoint_gbps"][0].value == pytest.approx(2.0)
    assert got["baton_checkpoints_total"][0].value == 1
    assert got["baton_restarts"][0].value == 2
    assert got["baton_goodput_ratio"][0].value == pytest.approx(0.75)


def test_two_instances_in_one_process_do_not_collide(tmp_path: Path) -> None:
    a, b = Metrics(), Metrics()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    try:
        addr_a = a.start(RunFolder(tmp_path / "a"), 0, host="127.0.0.1", bind="127.0.0.1")
        addr_b = b.start(RunFolder(tmp_path / "b"), 0, host="127.0.0.1", bind="127.0.0.1")
        a.observe_step(_record(0))
        assert addr_a != addr_b
        assert scrape(addr_a)["baton_loss"][0].value == 2.0
        assert scrape(addr_b)["baton_loss"][0].value == 0.0
    finally:
        a.close()
        b.close()
    a.close()  # idempotent


def _dashboard_names() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("expr", "query", "definition") and isinstance(v, str):
                    exprs.append(v)
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(dash)
    return {name for e in exprs for name in re.findall(r"\bbaton_[a-z0-9_]+", e)}


def test_every_metric_the_dashboard_queries_is_exposed(served) -> None:
    m, _, address = served
    m.observe_step(_record(0, cuda_peak_mb=(1.0,) * 4, data_wait_s=(0.1,) * 4, grad_sync_s=(0.2,) * 4,
                           compute_s=(0.3,) * 4))
    m.observe_heartbeat_lag(0, 0.1)
    m.observe_dispatch("train_step", 0.001)
    m.observe_checkpoint(1.0, 10**9)
    m.set_restarts(0)
    m.observe_goodput(1.0, 2.0)
    names = _dashboard_names()
    assert len(names) >= 15, names  # the parse found the queries
    missing = sorted(names - set(scrape(address)))
    assert missing == [], f"dashboard queries metrics the endpoint does not expose: {missing}"


def test_a_port_in_use_is_a_user_error_naming_the_setting(served, tmp_path: Path) -> None:
    _, _, address = served
    port = int(address.rsplit(":", 1)[1].split("/")[0])
    other = Metrics()
    with pytest.raises(UserError, match=r"metrics\.port: cannot serve on 127\.0\.0\.1:\d+ .*metrics\.port=0"):
        other.start(RunFolder(tmp_path), port, host="127.0.0.1", bind="127.0.0.1")
    other.close()
