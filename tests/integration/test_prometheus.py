"""A real Prometheus server (the Debian ``prometheus`` package; ``.ci/run`` installs it)
scrapes the controller of a live local GPT run: after a few scrape intervals every series
Baton's controller registers is in Prometheus (those that only a GPU or an RL program set
aside), and every panel query of grafana/baton-dashboard.json returns data through
Prometheus's HTTP query API (the CUDA panel aside on a CPU)."""
from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from core.job.process import free_port
from tests.helpers import REPO, Submitted, running_in_ci, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
# Set only on a GPU, or only by an RL program: absent from a CPU pretraining run by design.
CONDITIONAL = {"baton_rank_cuda_peak_bytes", "baton_rl_phase_seconds"}


def _prometheus() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        if running_in_ci():
            pytest.fail("no prometheus binary in CI; .ci/run installs the Debian package", pytrace=False)
        pytest.skip("no prometheus binary: apt-get install prometheus")
    return binary


def _api(base: str, path: str, **params: str) -> Any:
    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]


def _documented() -> set[str]:
    """Every series name the controller registers, as Prometheus stores it."""
    from core.controller.metrics import Metrics

    names: set[str] = set()
    for family in Metrics().registry.collect():
        if family.name in CONDITIONAL:
            continue
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}.get(family.type, ("",))
        names |= {family.name + s for s in suffixes}
    return names


def _panel_queries() -> list[tuple[str, str]]:
    board = json.loads((REPO / "grafana" / "baton-dashboard.json").read_text())
    return [(p["title"], t["expr"].replace("$job", ".*").replace("$instance", ".*"))
            for p in board["panels"] for t in p.get("targets", []) if "cuda" not in t["expr"]]


def test_a_real_prometheus_scrapes_every_documented_series_and_every_panel_has_data(tmp_path: Path) -> None:
    binary = _prometheus()
    run = Submitted(tmp_path / "runs", ["trainer.steps=100000", "checkpoint.interval_steps=20", "parallel.tp=1",
                                        "parallel.pp=1", "trainer.n_gpus_per_node=2"],
                    experiment="experiments/tiny_gpt.yaml", common=())
    prom: subprocess.Popen[bytes] | None = None
    try:
        target = wait_for(lambda: (p := run.run_dir / "metrics.json").exists() and json.loads(p.read_text()), 60,
                          "the controller's metrics.json")
        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                          f"  - job_name: baton\n    static_configs:\n      - targets: ['{target['host']}:{target['port']}']\n")
        prom = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        # A few scrapes after the first checkpoint (checkpoint series) and some steps (rates).
        wait_for(lambda: _samples(base) >= 8 and run.state().get("step", 0) >= 25, 120,
                 "8 scrapes of baton_step and step 25 (a checkpoint) in Prometheus")
        stored = set(_api(base, "label/__name__/values"))
        assert _documented() - stored == set()
        empty = [title for title, query in _panel_queries() if not _api(base, "query", query=query)["result"]]
        assert empty == []
        up = _api(base, "query", query='up{job="baton"}')["result"]
        assert [float(r["value"][1]) for r in up] == [1.0]
    finally:
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(timeout=20)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait()
        run.cleanup()


def _samples(base: str) -> int:
    try:
        result = _api(base, "query", query="count_over_time(baton_step[5m])")["result"]
    except OSError:  # Prometheus still starting
        return 0
    return int(float(result[0]["value"][1])) if result else 0
