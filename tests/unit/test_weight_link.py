"""A weight sync that keeps the policy it sent, and one from that kept copy
(core.model.gpt.rollout ``WeightLink.sync``: ``SyncWeights(keep=True)`` / ``from_kept=True``),
on one rank that holds both ends, so that every piece of the plan is a local copy and no
process group is needed. The plan is core.flows.reshard's, executed by core.model.gpt.sync;
only what the rank holds is given here as the slices Megatron's ``sharded_state_dict`` would
name (the trainer's weight ``w`` as two row blocks, the generator's whole). Values are random
float32 bit patterns (NaN payloads, -0.0, subnormals): only a bit-exact copy compares equal.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from core.checkpoint.spec import TensorSlice
from core.flows import calls as gen_calls
from core.flows import reshard
from core.model.gpt.rollout import WeightLink

SHAPES = {"w": (4, 6), "b": (6,)}


def _slice(name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> TensorSlice:
    return TensorSlice(name=name, global_shape=SHAPES[name], offset=offset, shape=shape, dtype="float32")


def _bits(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(-2**31, 2**31, shape, generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)


class Link(WeightLink):
    """Rank 0 holding the trainer's slices (``sources``) and the generator's (``targets``)."""

    def __init__(self, seed: int) -> None:
        super().__init__(0, trainer_chunks=[], model=None)  # the chunks: what ``sources`` stands for
        gen = torch.Generator().manual_seed(seed)
        self.sources = [(_slice("w", (0, 0), (2, 6)), _bits(gen, (2, 6))), (_slice("w", (2, 0), (2, 6)),
                                                                            _bits(gen, (2, 6))),
                        (_slice("b", (0,), (6,)), _bits(gen, (6,)))]
        self.targets = [(_slice(name, (0,) * len(shape), shape), torch.zeros(shape)) for name, shape in SHAPES.items()]

    def _sources(self) -> list[tuple[Any, torch.Tensor]]:
        return self.sources

    def _targets(self) -> list[tuple[Any, torch.Tensor]]:
        return self.targets

    def global_sources(self) -> dict[str, torch.Tensor]:
        """The trainer's tensors as they are now, assembled (an independent copy)."""
        (_, w0), (_, w1), (_, b) = self.sources
        return {"w": torch.cat([w0, w1]).clone(), "b": b.clone()}

    def global_targets(self) -> dict[str, torch.Tensor]:
        return {s.name: t for s, t in self.targets}


def _pieces(link: Link) -> tuple[reshard.Piece, ...]:
    pieces = reshard.plan({0: [s for s, _ in link.sources]}, {0: [s for s, _ in link.targets]}, bucket_bytes=32)
    assert pieces and all(p.src == p.dst == 0 for p in pieces)  # local copies only
    return tuple(reshard.for_rank(pieces, 0))


def _same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)) for k in got)


def _train(link: Link, seed: int) -> None:
    """An optimizer step: every source parameter changes in place."""
    gen = torch.Generator().manual_seed(seed)
    for _, p in link.sources:
        p.copy_(_bits(gen, tuple(p.shape)))


def test_a_sync_from_the_kept_copy_sends_the_policy_of_the_keep_after_the_trainer_moved_on() -> None:
    link = Link(seed=1)
    pieces = _pieces(link)
    at_keep = link.global_sources()
    synced = link.sync(gen_calls.SyncWeights(pieces=pieces, version=30, keep=True))
    assert synced.version == 30 and _same_bits(link.global_targets(), at_keep)
    _train(link, seed=2)
    moved_on = link.global_sources()
    assert not _same_bits(moved_on, at_keep)
    for _, t in link.targets:  # a restarted generator: weights of its own until synced
        t.zero_()
    restored = link.sync(gen_calls.SyncWeights(pieces=pieces, version=30, from_kept=True))
    assert restored.version == 30 and link.version == 30
    assert _same_bits(link.global_targets(), at_keep)  # the kept policy, not the live parameters
    assert _same_bits(link.global_sources(), moved_on)  # which the sync left alone
    link.sync(gen_calls.SyncWeights(pieces=pieces, version=31))
    assert link.version == 31 and _same_bits(link.global_targets(), moved_on)
    again = link.sync(gen_calls.SyncWeights(pieces=pieces, version=31, from_kept=True))
    assert again.version == 31 and _same_bits(link.global_targets(), at_keep)  # a sync without keep kept nothing


def test_a_later_keep_replaces_the_kept_copy_in_the_same_host_buffers() -> None:
    link = Link(seed=3)
    pieces = _pieces(link)
    link.sync(gen_calls.SyncWeights(pieces=pieces, version=30, keep=True))
    assert link.kept is not None
    buffers = [t.data_ptr() for _, t in link.kept]
    assert all(t.device.type == "cpu" and t.data_ptr() != p.data_ptr()
               for (_, t), (_, p) in zip(link.kept, link.sources, strict=True))  # copies, not views
    _train(link, seed=4)
    second = link.global_sources()
    link.sync(gen_calls.SyncWeights(pieces=pieces, version=32, keep=True))
    assert [t.data_ptr() for _, t in link.kept] == buffers
    _train(link, seed=5)
    link.sync(gen_calls.SyncWeights(pieces=pieces, version=32, from_kept=True))
    assert _same_bits(link.global_targets(), second)


def test_a_sync_from_the_kept_copy_before_any_keep_fails_on_a_rank_holding_sources() -> None:
    link = Link(seed=6)
    with pytest.raises(RuntimeError, match="rank 0: a sync from the kept policy, but no sync kept one"):
        link.sync(gen_calls.SyncWeights(pieces=_pieces(link), version=30, from_kept=True))
    assert link.version == -1 and all(not t.any() for _, t in link.targets)  # nothing was sent
