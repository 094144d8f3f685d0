"""A real Prometheus server (the Debian ``prometheus`` package; ``.ci/run`` installs it)
finds live local runs through file-based service discovery (``metrics.sd_dir``) and
scrapes their controllers: after a few scrape intervals every series Baton's controller
registers is in Prometheus (those that only a GPU or an RL program set aside), and every
panel query of grafana/baton-dashboard.json, filtered to one run, returns that run's data
through Prometheus's HTTP query API (the CUDA panel aside on a CPU)."""
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


def _panel_queries(run: str) -> list[tuple[str, str]]:
    board = json.loads((REPO / "grafana" / "baton-dashboard.json").read_text())
    return [(p["title"], t["expr"].replace("$job", ".*").replace("$instance", ".*").replace("$run", run))
            for p in board["panels"] for t in p.get("targets", []) if "cuda" not in t["expr"]]


def _start_prometheus(binary: str, tmp_path: Path, sd_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Prometheus as README's Metrics section configures it on a login node: file_sd over
    ``metrics.sd_dir`` (re-read every second here, on top of its file watch)."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                      f"  - job_name: baton\n    honor_labels: true\n    file_sd_configs:\n"
                      f"      - files: ['{sd_dir}/*.json']\n        refresh_interval: 1s\n")
    prom = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return prom, f"http://127.0.0.1:{port}"


def _targets(base: str) -> dict[str, str]:
    """{run label: health} of the targets Prometheus scrapes now ({} while it starts)."""
    try:
        active = _api(base, "targets", state="active")["activeTargets"]
    except OSError:
        return {}
    return {t["labels"].get("run", ""): t["health"] for t in active}


def test_a_real_prometheus_discovers_live_runs_and_every_panel_has_data_for_one(tmp_path: Path) -> None:
    """Two live runs (a GPT run and a slowed toy run), both ``metrics.bind=node`` and
    ``metrics.sd_dir`` in one folder: Prometheus finds both through file_sd, keeps them apart by
    their ``run`` label, and every dashboard panel filtered to the GPT run returns its data
    only; when the runs end, their targets leave the folder and Prometheus."""
    binary = _prometheus()
    sd_dir = tmp_path / "sd"
    sd_dir.mkdir()
    prom, base = _start_prometheus(binary, tmp_path, sd_dir)
    try:
        _two_runs_discovered(tmp_path, sd_dir, base)
    finally:
        prom.terminate()
        try:
            prom.wait(timeout=20)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()


def _two_runs_discovered(tmp_path: Path, sd_dir: Path, base: str) -> None:
    found = ["metrics.bind=node", f"metrics.sd_dir={sd_dir}"]
    gpt = Submitted(tmp_path / "runs", ["trainer.steps=100000", "checkpoint.interval_steps=20", "parallel.tp=1",
                                        "parallel.pp=1", "trainer.n_gpus_per_node=2", *found],
                    experiment="experiments/tiny_gpt.yaml", common=())
    toy = Submitted(tmp_path / "toy-runs", ["trainer.steps=100000", "trainer.n_gpus_per_node=1", *found],
                    env={"BATON_TOY_STEP_S": "0.05"})
    try:
        runs = {r: wait_for(lambda r=r: (p := r.run_dir / "metrics.json").exists() and json.loads(p.read_text()), 60,
                            f"{r.root}'s metrics.json")["run"] for r in (gpt, toy)}
        assert runs[gpt] == f"tiny-gpt/{gpt.run_dir.name}" and runs[toy] == f"toy/{toy.run_dir.name}"
        wait_for(lambda: _targets(base) == {runs[gpt]: "up", runs[toy]: "up"}, 60,
                 "both runs' file_sd targets up in Prometheus")
        # A few scrapes after the first checkpoint (checkpoint series) and some steps (rates).
        wait_for(lambda: _samples(base, runs[gpt]) >= 8 and gpt.state().get("step", 0) >= 25, 120,
                 "8 scrapes of the GPT run's baton_step and step 25 (a checkpoint) in Prometheus")
        stored = set(_api(base, "label/__name__/values"))
        assert _documented() - stored == set()
        answers = [(title, _api(base, "query", query=query)["result"]) for title, query in _panel_queries(runs[gpt])]
        assert [title for title, result in answers if not result] == []
        assert {r["metric"]["run"] for _, result in answers for r in result} == {runs[gpt]}
        up = _api(base, "query", query='up{job="baton"}')["result"]
        assert sorted((r["metric"]["run"], float(r["value"][1])) for r in up) == sorted([(runs[gpt], 1.0),
                                                                                        (runs[toy], 1.0)])
    finally:
        for r in (toy, gpt):
            r.cleanup()
    # each controller withdrew its target as it ended; Prometheus drops them
    wait_for(lambda: sorted(sd_dir.iterdir()) == [], 30, "the ended runs' file_sd targets withdrawn")
    wait_for(lambda: _api(base, "targets")["activeTargets"] == [], 30, "Prometheus to drop the ended runs' targets")


def _samples(base: str, run: str) -> int:
    try:
        result = _api(base, "query", query=f'count_over_time(baton_step{{run="{run}"}}[5m])')["result"]
    except OSError:  # Prometheus still starting
        return 0
    return int(float(result[0]["value"][1])) if result else 0
