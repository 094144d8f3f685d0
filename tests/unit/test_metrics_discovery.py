"""Metrics reachable on a cluster: the ``run`` label on every series, ``metrics.bind: node``,
the file_sd target in ``metrics.sd_dir`` (written atomically, withdrawn at close), and the
login-node check of ``sd_dir``. Real HTTP scrapes parsed by prometheus_client; name
resolution is faked only where the case needs another host's DNS (a Debian 127.0.1.1 host)."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from core.config import run as config
from core.controller.metrics import Metrics
from core.errors import ConfigError, UserError
from core.job import netaddr
from core.record import discovery
from core.record.runfolder import RunFolder
from core.record.steps import StepRecord
from tests.helpers import baton, scrape


def _run(tmp_path: Path) -> RunFolder:
    path = tmp_path / "runs" / "tiny-gpt" / "20261206-053024-ab12"
    path.mkdir(parents=True)
    return RunFolder(path)


def _feed(m: Metrics) -> None:
    m.observe_step(StepRecord(step=0, loss=1.5, grad_norm=0.5, lr=1e-3, tokens=64, tokens_per_s=100.0,
                              step_time_s=0.1, rank_step_time_s=(0.1, 0.2), rss_mb=(10.0, 20.0)))
    m.observe_heartbeat_lag(1, 0.5)
    m.observe_dispatch("train_step", 0.01)
    m.observe_checkpoint(1.0, 10**6)
    m.observe_goodput(1.0, 2.0)


def test_every_served_series_carries_the_run_label_beside_its_own(tmp_path: Path) -> None:
    run = _run(tmp_path)
    m = Metrics()
    try:
        address = m.start(run, 0, bind="127.0.0.1")
        _feed(m)
        samples = [s for group in scrape(address).values() for s in group]
        assert len(samples) > 30
        assert {s.labels.get("run") for s in samples} == {"tiny-gpt/20261206-053024-ab12"}
        ranks = {s.labels["rank"] for s in samples if s.name == "baton_rank_step_time_seconds"}
        assert ranks == {"0", "1"}  # the metric's own labels stay
        assert json.loads((run.path / "metrics.json").read_text())["run"] == "tiny-gpt/20261206-053024-ab12"
    finally:
        m.close()


def test_sd_dir_gets_a_file_sd_target_that_scrapes_and_goes_at_close(tmp_path: Path) -> None:
    run, sd_dir = _run(tmp_path), tmp_path / "shared" / "prometheus" / "targets"  # created by the controller
    m = Metrics()
    try:
        m.start(run, 0, bind="127.0.0.1", sd_dir=str(sd_dir))
        assert sorted(p.name for p in sd_dir.iterdir()) == ["baton-tiny-gpt-20261206-053024-ab12.json"]  # no temp left
        (group,) = json.loads((sd_dir / "baton-tiny-gpt-20261206-053024-ab12.json").read_text())
        port = json.loads((run.path / "metrics.json").read_text())["port"]
        assert group == {"targets": [f"127.0.0.1:{port}"],
                         "labels": {"job": "baton", "run": "tiny-gpt/20261206-053024-ab12", "node": socket.gethostname()}}
        _feed(m)
        assert scrape(f"http://{group['targets'][0]}/metrics")["baton_loss"][0].value == 1.5
    finally:
        m.close()
    assert list(sd_dir.iterdir()) == []
    m.close()  # idempotent


def test_an_sd_dir_the_controller_cannot_write_leaves_the_endpoint_serving(tmp_path: Path) -> None:
    run, blocker = _run(tmp_path), tmp_path / "a-file"
    blocker.write_text("")
    m = Metrics()
    try:
        address = m.start(run, 0, bind="127.0.0.1", sd_dir=str(blocker / "targets"))
        assert json.loads((run.path / "metrics.json").read_text())["sd_file"] is None
        assert "baton_step" in scrape(address)
    finally:
        m.close()


def test_bind_node_listens_on_what_this_host_s_name_resolves_to(tmp_path: Path) -> None:
    run = _run(tmp_path)
    m = Metrics()
    try:
        address = m.start(run, 0, bind="node")
        published = json.loads((run.path / "metrics.json").read_text())
        resolved = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
        assert published["host"] in resolved and published["node"] == socket.gethostname()
        assert address == f"http://{published['host']}:{published['port']}/metrics"
        assert "baton_step" in scrape(address)
    finally:
        m.close()


def _resolving(table: dict[str, list[str]]) -> Any:
    real = socket.getaddrinfo

    def fake(host: str, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in table:
            return real(host, port, *args, **kwargs)
        if not table[host]:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port or 0))
                for ip in table[host]]
    return fake


def test_node_address_prefers_a_routable_address_then_the_route_to_the_submit_host(monkeypatch) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", _resolving({
        "gpu017": ["127.0.1.1", "10.3.0.17"], "debian-box": ["::1", "127.0.1.1"], "lost": []}))
    env = {"BATON_CONTROLLER_HOST": "gpu017"}
    assert netaddr.node_address(env) == netaddr.NodeAddress("gpu017", "10.3.0.17")
    # Only loopback: the interface toward the submit host (here this host: loopback again)
    assert netaddr.node_address({"BATON_CONTROLLER_HOST": "debian-box", "SLURM_SUBMIT_HOST": "127.0.0.1"}).ip == "127.0.0.1"
    assert netaddr.node_address({"BATON_CONTROLLER_HOST": "debian-box"}).ip == "127.0.1.1"  # IPv4 first
    # A local run's contact address is loopback, not a name: the host name is used.
    assert netaddr.node_name({"BATON_CONTROLLER_HOST": "127.0.0.1"}) == socket.gethostname()
    with pytest.raises(UserError, match=r"^metrics\.bind: node: this node's name 'lost' does not resolve .*0\.0\.0\.0"):
        netaddr.node_address({"BATON_CONTROLLER_HOST": "lost"})


def test_bind_accepts_node_or_an_ip_and_names_the_choices_otherwise() -> None:
    for value in ("node", "127.0.0.1", "0.0.0.0", "::", "10.3.0.17"):
        assert config.from_data({"metrics": {"bind": value}}).metrics.bind == value
    for value in ("nod", "gpu017", "127.0.0.1 x", ""):
        with pytest.raises(ConfigError, match=r"^metrics\.bind: .* use node .*127\.0\.0\.1 .*0\.0\.0\.0"):
            config.from_data({"metrics": {"bind": value}})
    with pytest.raises(ConfigError, match=r"^metrics\.sd_dir: empty"):
        config.from_data({"metrics": {"sd_dir": " "}})


def test_sd_dir_is_checked_on_the_login_node_and_stored_absolute(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert discovery.check_sd_dir("targets/baton") == str(tmp_path / "targets" / "baton")  # to be created
    assert not (tmp_path / "targets").exists()  # the check creates nothing
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=r"^metrics\.sd_dir: 'f/x': .*/f is not a folder"):
        discovery.check_sd_dir("f/x")
    if os.access("/proc/sys", os.W_OK):
        pytest.skip("/proc/sys is writable here: no unwritable folder to try")
    with pytest.raises(ConfigError, match=r"^metrics\.sd_dir: '/proc/sys/baton' cannot be created \(/proc/sys is not"):
        discovery.check_sd_dir("/proc/sys/baton")


def test_submit_refuses_an_sd_dir_it_cannot_create_before_writing_anything(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    res = baton("submit", "experiments/toy.yaml", f"runs_root={tmp_path / 'runs'}", f"metrics.sd_dir={tmp_path}/f/sd",
                "--backend", "local", timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.count("\n") == 1 and "metrics.sd_dir:" in res.stderr and "is not a folder" in res.stderr
    assert not (tmp_path / "runs").exists()
