"""The weight-sync planner (core.flows.reshard): pure geometry, checked element by element."""
from __future__ import annotations

import math

import numpy as np
import pytest

from core.checkpoint.spec import TensorSlice
from core.errors import LayoutError
from core.flows import reshard


def _slices(name: str, shape: tuple[int, ...], axis: int, parts: int) -> list[TensorSlice]:
    step = shape[axis] // parts
    out = []
    for i in range(parts):
        offset = tuple(i * step if a == axis else 0 for a in range(len(shape)))
        size = tuple(step if a == axis else n for a, n in enumerate(shape))
        out.append(TensorSlice(name=name, global_shape=shape, offset=offset, shape=size, dtype="float32"))
    return out


def _apply(pieces: list[reshard.Piece], sources: dict[int, list[TensorSlice]], truth: np.ndarray,
           targets: dict[int, list[TensorSlice]]) -> dict[int, np.ndarray]:
    """Run a plan on numpy 'ranks': each target slice filled from the pieces sent to it."""
    got = {r: np.full([s.shape for s in ts][0], np.nan) for r, ts in targets.items()}
    for p in pieces:
        assert any(all(o <= x and x + n <= o + m for x, n, o, m in zip(p.offset, p.shape, s.offset, s.shape, strict=False))
                   for s in sources[p.src]), f"rank {p.src} sends {p.offset}+{p.shape}, which it does not own"
        t = targets[p.dst][0]
        box = tuple(slice(x, x + n) for x, n in zip(p.offset, p.shape, strict=False))
        local = tuple(slice(x - o, x - o + n) for x, n, o in zip(p.offset, p.shape, t.offset, strict=False))
        got[p.dst][local] = truth[box]
    return got


def test_tp2_rows_to_tp4_columns_moves_every_element_once_in_small_buckets() -> None:
    truth = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    sources = {r: [s] for r, s in enumerate(_slices("w", (8, 12), 0, 2))}
    targets = {10 + r: [s] for r, s in enumerate(_slices("w", (8, 12), 1, 4))}
    pieces = reshard.plan(sources, targets, bucket_bytes=40)
    got = _apply(pieces, sources, truth, targets)
    for r, t in targets.items():
        assert np.array_equal(got[r], truth[:, t[0].offset[1]:t[0].offset[1] + 3])
    assert sum(p.nbytes for p in pieces) == truth.nbytes  # nothing twice
    per_bucket: dict[int, int] = {}
    for p in pieces:
        per_bucket[p.bucket] = per_bucket.get(p.bucket, 0) + p.nbytes
    assert max(per_bucket.values()) <= 40 and len(per_bucket) > 1
    assert reshard.for_rank(pieces, 0) == [p for p in pieces if 0 in (p.src, p.dst)]


def test_every_replica_of_the_target_receives_the_whole_tensor() -> None:
    truth = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    sources = {0: [TensorSlice(name="w", global_shape=(6, 4), offset=(0, 0), shape=(6, 4), dtype="float32")]}
    targets = {r: [TensorSlice(name="w", global_shape=(6, 4), offset=(0, 0), shape=(6, 4), dtype="float32")]
               for r in (0, 1, 2)}
    pieces = reshard.plan(sources, targets, bucket_bytes=1 << 20)
    for got in _apply(pieces, sources, truth, targets).values():
        assert np.array_equal(got, truth)
    assert {p.dst for p in pieces} == {0, 1, 2} and {p.src for p in pieces} == {0}
    assert math.prod(pieces[0].shape) * 4 == pieces[0].nbytes


def test_a_slice_no_source_holds_or_another_shape_is_named() -> None:
    half = _slices("w", (4, 4), 0, 2)
    with pytest.raises(LayoutError, match=r"holds 8 of the 16 elements of w at \(0, 0\) that target rank 5 needs"):
        reshard.plan({0: [half[0]]}, {5: [TensorSlice(name="w", global_shape=(4, 4), offset=(0, 0), shape=(4, 4),
                                                       dtype="float32")]}, bucket_bytes=64)
    with pytest.raises(LayoutError, match="w is \\(4, 8\\) on target rank 1 but \\(4, 4\\) on source rank 0"):
        reshard.plan({0: half}, {1: _slices("w", (4, 8), 0, 1)}, bucket_bytes=64)
    with pytest.raises(LayoutError, match="target rank 1 needs v, which no source rank holds"):
        reshard.plan({0: half}, {1: _slices("v", (4, 4), 0, 1)}, bucket_bytes=64)
