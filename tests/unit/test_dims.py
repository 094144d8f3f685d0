from __future__ import annotations

import pytest

from core.config.dims import ParallelDims
from core.errors import LayoutError


def test_rank_coordinates_follow_megatron_order() -> None:
    d = ParallelDims(tp=2, pp=2, dp=2)
    assert [(c.tp, c.dp, c.pp) for c in map(d.coords, range(8))] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    for r in range(8):
        c = d.coords(r)
        assert d.rank(tp=c.tp, pp=c.pp, dp=c.dp) == r


def test_groups_partition_the_world() -> None:
    d = ParallelDims(tp=2, pp=2, dp=2)
    assert d.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.loss_owners() == [4, 6]
    for groups in (d.tp_groups(), d.pp_groups(), d.dp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(8))


def test_from_world_derives_dp_and_rejects_bad_counts() -> None:
    assert ParallelDims.from_world(world_size=8, tp=2, pp=2).dp == 2
    with pytest.raises(LayoutError, match="6 workers are not divisible by tp\\*pp = 2\\*2 = 4"):
        ParallelDims.from_world(world_size=6, tp=2, pp=2)
    with pytest.raises(LayoutError, match="parallel.tp: 0"):
        ParallelDims(tp=0)
