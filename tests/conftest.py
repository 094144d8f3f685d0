"""Marks shared by the whole suite: a test marked ``megatron`` or ``slurm`` is also ``slow``,
so ``pytest -m "not slow"`` (make test-fast) never starts Megatron-core or a Slurm job."""
from __future__ import annotations

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
