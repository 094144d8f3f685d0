"""The weight-sync planner (core.flows.reshard): pure geometry, checked element by element."""
from __future__ import annotations

import math

import numpy as np
import pytest

from core.checkpoint.spec import TensorSlice
from core.config.dims import ParallelDims
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


def _per_bucket_and_rank(pieces: list[reshard.Piece]) -> dict[tuple[int, int], int]:
    out: dict[tuple[int, int], int] = {}
    for p in pieces:
        if p.src != p.dst:
            for r in (p.src, p.dst):
                out[p.bucket, r] = out.get((p.bucket, r), 0) + p.nbytes
    return out


def test_tp2_rows_to_tp4_columns_moves_every_element_once_in_small_buckets() -> None:
    truth = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    sources = {r: [s] for r, s in enumerate(_slices("w", (8, 12), 0, 2))}
    targets = {10 + r: [s] for r, s in enumerate(_slices("w", (8, 12), 1, 4))}
    pieces = reshard.plan(sources, targets, bucket_bytes=40)
    got = _apply(pieces, sources, truth, targets)
    for r, t in targets.items():
        assert np.array_equal(got[r], truth[:, t[0].offset[1]:t[0].offset[1] + 3])
    assert sum(p.nbytes for p in pieces) == truth.nbytes  # nothing twice
    per_rank = _per_bucket_and_rank(pieces)  # what each rank sends and receives in each bucket
    assert max(per_rank.values()) <= 40 and len({b for b, _ in per_rank}) > 1
    assert all(len({p.dst for p in pieces if p.bucket == b}) > 1 for b in range(2))  # targets served together
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


# --- every trainer replica a source: a small GPT's boxes in Megatron's layouts -------------------
V, H, L = 16, 8, 4
SHAPES = {"emb": (V, H), "qkv": (L, 3 * H, H), "proj": (L, H, H), "norm": (L, H), "out": (V, H)}
SPLIT = {"emb": 0, "qkv": 1, "proj": 2, "out": 0}  # the tensor-parallel axis; norm: a copy on every tp rank
MODEL_BYTES = 4 * sum(math.prod(s) for s in SHAPES.values())


def _gpt(dims: ParallelDims, first: int = 0) -> dict[int, list[TensorSlice]]:
    """Rank (``first`` on) → the boxes it holds of the model in layout ``dims``: layers stacked
    on the first axis, one box per layer, each pipeline stage its layers, the embedding on
    the first stage and the output layer on the last; every data-parallel replica all of it."""
    out: dict[int, list[TensorSlice]] = {}
    for rank in range(dims.world_size):
        c, mine = dims.coords(rank), []
        per_stage = L // dims.pp
        for name, shape in SHAPES.items():
            layered = len(shape) == 3 or name == "norm"
            if not layered and not (name == "emb" and c.pp == 0 or name == "out" and c.pp == dims.pp - 1):
                continue
            offset, size = [0] * len(shape), list(shape)
            if name in SPLIT:
                size[SPLIT[name]] //= dims.tp
                offset[SPLIT[name]] = c.tp * size[SPLIT[name]]
            for layer in range(c.pp * per_stage, (c.pp + 1) * per_stage) if layered else [None]:
                if layer is not None:
                    offset[0], size[0] = layer, 1
                mine.append(TensorSlice(name=name, global_shape=shape, offset=tuple(offset), shape=tuple(size),
                                        dtype="float32"))
        out[first + rank] = mine
    return out


def _check_moves_every_element_once(pieces: list[reshard.Piece], sources: dict[int, list[TensorSlice]],
                                    targets: dict[int, list[TensorSlice]]) -> None:
    """Each target element written exactly once, by a rank that holds it, with the truth."""
    truth = {n: np.random.default_rng(len(n)).standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    got = {(r, n): np.full(s, np.nan, np.float32) for r in targets for n, s in SHAPES.items()}
    count = {k: np.zeros(v.shape, np.int64) for k, v in got.items()}
    for p in pieces:
        box = tuple(slice(x, x + n) for x, n in zip(p.offset, p.shape, strict=True))
        assert any(s.name == p.name and reshard._inside((p.offset, p.shape), (s.offset, s.shape)) for s in sources[p.src])
        got[p.dst, p.name][box] = truth[p.name][box]
        count[p.dst, p.name][box] += 1
    for r, slices in targets.items():
        for n in SHAPES:
            need = np.zeros(SHAPES[n], np.int64)
            for s in (s for s in slices if s.name == n):
                need[tuple(slice(o, o + k) for o, k in zip(s.offset, s.shape, strict=True))] += 1
            assert np.array_equal(count[r, n], need), (r, n)
            assert np.array_equal(got[r, n][need == 1], truth[n][need == 1])


def test_colocated_replicas_copy_locally_and_send_nothing() -> None:
    sources = _gpt(ParallelDims.from_world(world_size=4, tp=1, pp=1))
    pieces = reshard.plan(sources, _gpt(ParallelDims.from_world(world_size=4, tp=1, pp=1)), bucket_bytes=256)
    _check_moves_every_element_once(pieces, sources, sources)
    assert reshard.sent_by(pieces) == {} and all(p.src == p.dst for p in pieces)


def test_split_replicas_each_serve_one_generator_replica() -> None:
    sources = _gpt(ParallelDims.from_world(world_size=4, tp=1, pp=1))
    targets = _gpt(ParallelDims.from_world(world_size=4, tp=1, pp=1), first=4)
    pieces = reshard.plan(sources, targets, bucket_bytes=256)
    _check_moves_every_element_once(pieces, sources, targets)
    assert reshard.sent_by(pieces) == dict.fromkeys(range(4), MODEL_BYTES)  # model bytes / 1 target each
    assert {(p.src, p.dst) for p in pieces} == {(j, 4 + j) for j in range(4)}
    assert max(_per_bucket_and_rank(pieces).values()) <= 256
    assert {p.dst for p in pieces if p.bucket == 0} == {4, 5, 6, 7}  # the four transfers run together


@pytest.mark.parametrize(("tp", "pp", "first"), [(2, 1, 0), (2, 2, 0), (2, 1, 4), (1, 2, 4)])
def test_every_source_replica_shares_the_sending(tp: int, pp: int, first: int) -> None:
    """tp2dp2 and tp2pp2 trainers into a tp1dp4 generator, colocated (first 0) or split:
    the most any rank sends is the model over the trainer's replicas and one bucket, and a
    rank that holds a box of its target copies it locally."""
    dims = ParallelDims.from_world(world_size=4, tp=tp, pp=pp)
    sources, targets = _gpt(dims), _gpt(ParallelDims.from_world(world_size=4, tp=1, pp=1), first=first)
    pieces = reshard.plan(sources, targets, bucket_bytes=256)
    _check_moves_every_element_once(pieces, sources, targets)
    sent = reshard.sent_by(pieces)
    remote = len(targets) * MODEL_BYTES - sum(p.nbytes for p in pieces if p.src == p.dst)
    assert sum(sent.values()) == remote and max(sent.values()) <= remote // len(sources) + 256  # even to a bucket
    if not first:  # the generator on the trainer's ranks: each rank sends at most its replica's share
        assert max(sent.values()) <= MODEL_BYTES // dims.dp + 256
    for p in pieces:  # no box travels that its target's own rank holds
        assert p.src == p.dst or not any(s.name == p.name and reshard._inside((p.offset, p.shape), (s.offset, s.shape))
                                         for s in sources.get(p.dst, ()))
    assert max(_per_bucket_and_rank(pieces).values()) <= 256
    again = reshard.plan(dict(reversed(list(sources.items()))), dict(reversed(list(targets.items()))),
                         bucket_bytes=256)
    assert again == pieces  # a function of the slices alone
