"""Fixtures of the integration tests: the local Slurm cluster (tests/cluster/), runs started
from a test and ended by pid, and the session's reference runs that several modules compare with."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import ASYNC_GRPO, GENERATOR_RUN, LocalRun, baton, make_run, running_in_ci
from tests.integration import slurm_helpers

START_HINT = "start one with `bash tests/cluster/slurm-cluster.sh install && bash tests/cluster/slurm-cluster.sh start`"


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


@pytest.fixture
def local_runs(tmp_path: Path) -> Iterator[Callable[..., LocalRun]]:
    """``start(EXPERIMENT, *overrides, epoch=0, controller=True, workers=True)``: a run in
    tmp_path whose controller and workers are this test's child processes (tests.helpers.LocalRun);
    every one is ended by pid at teardown."""
    runs: list[LocalRun] = []

    def start(experiment: str, *overrides: str, epoch: int = 0, **kw: bool) -> LocalRun:
        r = make_run(tmp_path, experiment, list(overrides)).start(epoch=epoch, **kw)
        runs.append(r)
        return r

    yield start
    for r in runs:
        r.cleanup()


@pytest.fixture(scope="session")
def grpo_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """experiments/grpo_tiny.yaml as a newcomer runs it, on the local backend (once per
    session: the local GRPO tests and the Slurm one compare against it)."""
    root = tmp_path_factory.mktemp("grpo")
    res = baton("submit", "experiments/grpo_tiny.yaml", f"runs_root={root}", "--backend", "local", timeout=800)
    assert res.returncode == 0, res.stdout + res.stderr
    return next((root / "grpo-tiny").glob("*"))


@pytest.fixture(scope="session")
def async_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """experiments/grpo_tiny.yaml with ASYNC_GRPO (rl.max_staleness=1: rollout s + 1 from policy s
    while the trainer updates on rollout s), uninterrupted, on the local backend (once per
    session: the overlap's preempted, recovered and Slurm runs compare against it)."""
    root = tmp_path_factory.mktemp("grpo-async")
    res = baton("submit", "experiments/grpo_tiny.yaml", f"runs_root={root}", *ASYNC_GRPO, "--backend", "local",
                timeout=800)
    assert res.returncode == 0, res.stdout + res.stderr
    return next((root / "grpo-tiny").glob("*"))


@pytest.fixture(scope="session")
def grpo_varlen_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """experiments/grpo_varlen_tiny.yaml as a newcomer runs it, on the local backend (once per
    session: tests/integration/test_grpo_varlen.py's tests compare against it)."""
    root = tmp_path_factory.mktemp("grpo-varlen")
    res = baton("submit", "experiments/grpo_varlen_tiny.yaml", f"runs_root={root}", "--backend", "local", timeout=800)
    assert res.returncode == 0, res.stdout + res.stderr
    return next((root / "grpo-varlen-tiny").glob("*"))


@pytest.fixture(scope="session")
def generator_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """experiments/tiny_gpt_generate.yaml with GENERATOR_RUN, uninterrupted, its generator colocated:
    the run folder the split and the Slurm generator tests compare with (once per session)."""
    root = tmp_path_factory.mktemp("generator-reference")
    res = baton("submit", "experiments/tiny_gpt_generate.yaml", f"runs_root={root}", *GENERATOR_RUN,
                "--backend", "local", timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return next((root / "tiny-gpt-generate").glob("*"))
