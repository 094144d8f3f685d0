"""The model's replicated weights are written by every data-parallel replica, each box by one
(core.model.gpt.spread), and such a checkpoint loads exactly as one written by replica 0 alone.

The reference for "exactly" is the same checkpoint rewritten the old way (every global tensor
in rank 0's file, the other ranks' files holding only their blobs): a resume in dp=1, dp=2 and
tp=2 from either folder gives the same tensors bit for bit and the same losses; the dp=2 resume
gives the uninterrupted run's losses. Each resume runs in fresh processes.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.checkpoint import manifest
from core.checkpoint.commit import commit, tmp_step_dir
from core.checkpoint.hdf5 import CheckpointReader, write_shard
from core.checkpoint.spec import TensorSlice
from tests.integration.gpt_harness import RankGroup, assert_state_is_the_checkpoints, export_on_rank, gpt_config

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(900)]  # megatron implies slow (tests/conftest.py)
STEPS, HALF = 8, 4


def _config(*, tp: int, dp: int) -> dict[str, Any]:
    return gpt_config(tp=tp, world_size=tp * dp, steps=STEPS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A dp=2 run of STEPS steps that saves at HALF; its losses, the checkpoint, each rank's
    exported state at the save, and the checkpoint rewritten with every tensor in rank 0's file."""
    root = tmp_path_factory.mktemp("spread")
    with RankGroup(_config(tp=1, dp=2), world_size=2, run_dir=root) as g:
        g.setup()
        first = g.train(range(HALF))
        exported = g.apply(export_on_rank, step=HALF)
        step_dir = g.save(root / "checkpoints", HALF)
        full = first + g.train(range(HALF, STEPS))
    return {"root": root, "full": full, "step_dir": step_dir, "exported": exported,
            "unsplit": _rewrite_on_rank_0(step_dir, root / "unsplit")}


def _rewrite_on_rank_0(step_dir: Path, root: Path) -> Path:
    """The checkpoint as replica 0 alone used to write it: whole tensors in rank 0's file."""
    tmp = tmp_step_dir(root, HALF)
    with CheckpointReader(step_dir) as reader:
        ranks = sorted(f.rank for f in reader.manifest.files)
        whole = []
        for name in reader.names():
            entry = reader.manifest.tensors[name]
            whole.append((TensorSlice(name=name, global_shape=entry.global_shape, offset=(0,) * len(entry.global_shape),
                                      shape=entry.global_shape, dtype=entry.dtype), reader.read(name)))
        acks = [write_shard(tmp / manifest.rank_file_name(r), whole if r == 0 else [], reader.blobs(r),
                            {"step": HALF, "rank": r, "layout": "harness", "config_hash": "harness"}) for r in ranks]
    return commit(root, HALF, tmp, acks, {"layout": "harness"}, world_size=len(ranks))


def test_each_model_box_is_written_once_and_the_replicas_share_the_writing(saved: dict[str, Any]) -> None:
    m = manifest.read_manifest(saved["step_dir"])
    model = {n: e for n, e in m.tensors.items() if not n.startswith(("optim.", "sync."))}
    per_file: dict[str, int] = {}
    for name, entry in model.items():
        count = np.zeros(entry.global_shape, dtype=np.int32)
        for s in entry.slices:
            count[tuple(slice(o, o + n) for o, n in zip(s.offset, s.shape, strict=True))] += 1
            per_file[s.file] = per_file.get(s.file, 0) + 4 * int(np.prod(s.shape))
        assert count.min() == count.max() == 1, f"{name}: its boxes are not written exactly once"
    assert sorted(per_file) == ["rank_00000.h5", "rank_00001.h5"], per_file
    assert min(per_file.values()) > 0.35 * max(per_file.values()), f"model bytes per file: {per_file}"
    # What the checkpoint holds is what each rank held at the save, bit for bit.
    with CheckpointReader(saved["step_dir"]) as reader:
        for rank, (items, _) in enumerate(saved["exported"]):
            for s, data in items:
                stored = reader.read(s.name, s.offset, s.shape)
                assert np.array_equal(stored.view(np.uint32), np.ascontiguousarray(data, np.float32).view(np.uint32)), \
                    f"rank {rank}: {s.name} at {s.offset}"


def _resume(cfg: dict[str, Any], world: int, root: Path, step_dir: Path) -> tuple[list[float], list[Any]]:
    with RankGroup(cfg, world_size=world, run_dir=root) as g:
        g.setup()
        g.load(step_dir)
        state = g.apply(export_on_rank, step=HALF)
        return g.train(range(HALF, STEPS)), state


def test_a_same_layout_resume_gives_the_uninterrupted_losses(saved: dict[str, Any]) -> None:
    with RankGroup(_config(tp=1, dp=2), world_size=2, run_dir=saved["root"]) as g:
        g.setup()
        g.load(saved["step_dir"])
        assert_state_is_the_checkpoints(g, saved["step_dir"], HALF)
        resumed = g.train(range(HALF, STEPS))
    assert resumed == saved["full"][HALF:]


@pytest.mark.parametrize(("tp", "dp"), [(1, 1), (1, 2), (2, 1)], ids=["dp1", "dp2", "tp2"])
def test_a_spread_checkpoint_loads_as_the_unsplit_one_in_any_layout(saved: dict[str, Any], tp: int, dp: int) -> None:
    cfg = _config(tp=tp, dp=dp)
    losses, state = _resume(cfg, tp * dp, saved["root"], saved["step_dir"])
    want_losses, want_state = _resume(cfg, tp * dp, saved["root"], saved["unsplit"])
    assert losses == want_losses
    for (items, _), (want, _) in zip(state, want_state, strict=True):
        for (s, a), (w, b) in zip(items, want, strict=True):
            assert s == w and np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{s.name} at {s.offset}"
    assert max(abs(a - b) for a, b in zip(losses, saved["full"][HALF:], strict=True)) < 1e-5  # the same training
