"""Marks shared by the whole suite: a test marked ``megatron`` or ``slurm`` is also ``slow``,
so ``pytest -m "not slow"`` (make test-fast) never starts Megatron-core or a Slurm job."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

IMPLY_SLOW = ("megatron", "slurm")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(name) for name in IMPLY_SLOW) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One small random Hugging Face model folder per family (tests.helpers.save_hf_model), for the session."""
    from tests.helpers import save_hf_model

    root = tmp_path_factory.mktemp("hf")
    return {family: save_hf_model(family, root / family) for family in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def noflock_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A real filesystem without flock or fcntl locks (every lock call answers ENOSYS, as on
    Lustre's ``noflock`` mount): tests/fuse_noflock.py mounted with FUSE for the session,
    unmounted after. Skips only where the kernel offers no FUSE (/dev/fuse absent)."""
    if not Path("/dev/fuse").exists():
        pytest.skip("no /dev/fuse on this machine: the mount without flock is a FUSE filesystem")
    try:
        from tests.fuse_noflock import mounted
    except (ImportError, OSError) as exc:  # mfusepy finds no libfuse.so.2
        why = f"no FUSE library ({exc}): apt-get install libfuse2"
        if os.environ.get("CI"):
            pytest.fail(f"{why} (.ci/run installs it)", pytrace=False)
        pytest.skip(why)

    root = tmp_path_factory.mktemp("noflock")
    with mounted(root / "backing", root / "mnt") as mountpoint:
        yield mountpoint
