"""Fixtures for integration tests that need the local Slurm cluster (tests/cluster/)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # works under any --import-mode
    sys.path.insert(0, _HERE)

import slurm_helpers  # noqa: E402

START_HINT = "start one with `bash tests/cluster/slurm-cluster.sh install && bash tests/cluster/slurm-cluster.sh start`"


def running_in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


@pytest.fixture(scope="session")
def slurm_cluster() -> str:
    """Ensures the local Slurm cluster answers (node1 and node2; the multi-node tests check node3 and node4); returns its cluster name.

    Skips the test without a cluster, except in CI (CI=true) where that is a failure.
    """
    problem = slurm_helpers.cluster_problem(("node1", "node2"))
    if problem is not None:
        if running_in_ci():
            pytest.fail(f"no local Slurm cluster in CI ({problem}); {START_HINT}", pytrace=False)
        pytest.skip(f"no local Slurm cluster: {START_HINT} ({problem})")
    return "baton"


@pytest.fixture
def slurm_jobs() -> Iterator[list[int]]:
    """A list to append submitted job ids to; every one is scancelled at teardown."""
    jobs: list[int] = []
    yield jobs
    slurm_helpers.scancel(jobs)


@pytest.fixture
def shared_tmp(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh folder under /tmp that the jobs (root, either node) can write to.

    Removed after a passing test; kept (and its path printed) after a failure.
    """
    path = Path(tempfile.mkdtemp(prefix="baton-slurm-test-", dir="/tmp"))
    path.chmod(0o777)
    yield path
    report = getattr(request.node, "_baton_call_report", None)
    if report is not None and report.passed:
        shutil.rmtree(path, ignore_errors=True)
    else:
        print(f"kept job output folder: {path}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    # Lets shared_tmp know whether the test body passed (scoped to this folder's tests).
    report = yield
    if report.when == "call":
        item._baton_call_report = report  # type: ignore[attr-defined]
    return report


# experiments/tiny_gpt_generate.yaml for 30 steps, the generator synced and sampling every 10:
# the uninterrupted colocated run that the split and Slurm generator tests compare with.
GENERATOR_RUN = ("trainer.steps=30", "generator.sync_interval_steps=10", "checkpoint.interval_steps=10",
                 "recovery.backoff_s=0.2", "timeouts.heartbeat_interval_s=0.1", "timeouts.heartbeat_timeout_s=3",
                 "timeouts.controller_lost_s=6")


@pytest.fixture(scope="session")
def grpo_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """experiments/grpo_tiny.yaml as a newcomer runs it, on the local backend (once per
    session: the local GRPO tests and the Slurm one compare against it)."""
    from tests.helpers import baton

    root = tmp_path_factory.mktemp("grpo")
    res = baton("submit", "experiments/grpo_tiny.yaml", f"runs_root={root}", "--backend", "local", timeout=800)
    assert res.returncode == 0, res.stdout + res.stderr
    return next((root / "grpo-tiny").glob("*"))


@pytest.fixture(scope="session")
def generator_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run folder of that reference run (once per session: both generator tests use it)."""
    from tests.helpers import baton

    root = tmp_path_factory.mktemp("generator-reference")
    res = baton("submit", "experiments/tiny_gpt_generate.yaml", f"runs_root={root}", *GENERATOR_RUN,
                "--backend", "local", timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return next((root / "tiny-gpt-generate").glob("*"))
