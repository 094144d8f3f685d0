"""Executing a weight-sync plan (core.flows.reshard) on one rank.

Each rank holds its source parameters (the trainer's, as global slices) and its target
parameters (the generator's). For every bucket of the plan it packs what it sends to each
peer into one flat buffer, posts the sends and the receives (point to point on the run's
process group: gloo on CPU, NCCL on GPU), and unpacks what arrived into the target
parameters; a piece whose source and target are this same rank is a local copy. Buffers
live for one bucket. The arithmetic is copies only: the target receives the source's
values bit for bit, in the target's dtype when the two differ.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from core.checkpoint.spec import TensorSlice
from core.flows.reshard import Piece

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Held:
    """A parameter this rank holds, as the global slice it is."""

    slice: TensorSlice
    param: torch.Tensor

    def box(self, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """A view of the global box ``offset``/``shape`` (inside this slice) of the parameter."""
        view = self.param.data.view(self.slice.shape)
        for axis, (o, s, mine) in enumerate(zip(offset, shape, self.slice.offset, strict=True)):
            view = view.narrow(axis, o - mine, s)
        return view


def _find(held: dict[str, list[Held]], p: Piece) -> Held:
    for h in held.get(p.name, ()):
        if all(m <= o and o + s <= m + n for o, s, m, n in zip(p.offset, p.shape, h.slice.offset, h.slice.shape,
                                                                   strict=True)):
            return h
    raise AssertionError(f"weight sync: this rank holds no slice of {p.name} around {p.offset}+{p.shape}")


def index(items: Sequence[tuple[TensorSlice, torch.Tensor]]) -> dict[str, list[Held]]:
    out: dict[str, list[Held]] = {}
    for s, param in items:
        out.setdefault(s.name, []).append(Held(s, param))
    return out


def run_plan(pieces: Sequence[Piece], rank: int, sources: dict[str, list[Held]], targets: dict[str, list[Held]],
             group: Any = None) -> int:
    """Move this rank's ``pieces`` (``reshard.for_rank``), bucket by bucket; the bytes received."""
    received = 0
    with torch.no_grad():
        for _, bucket in itertools.groupby(pieces, key=lambda p: p.bucket):
            received += _run_bucket(list(bucket), rank, sources, targets, group)
    return received


def _run_bucket(pieces: list[Piece], rank: int, sources: dict[str, list[Held]], targets: dict[str, list[Held]],
                group: Any) -> int:
    sends: dict[int, list[Piece]] = {}
    recvs: dict[int, list[Piece]] = {}
    for p in pieces:
        if p.src == rank and p.dst == rank:
            _find(targets, p).box(p.offset, p.shape).copy_(_find(sources, p).box(p.offset, p.shape))
        elif p.src == rank:
            sends.setdefault(p.dst, []).append(p)
        else:
            recvs.setdefault(p.src, []).append(p)
    ops, inbox = [], {}
    for peer, out in sends.items():
        buf = torch.cat([_find(sources, p).box(p.offset, p.shape).reshape(-1).to(DTYPES[p.dtype]) for p in out])
        ops.append(dist.P2POp(dist.isend, buf, peer, group))
    for peer, inc in recvs.items():
        like = _find(targets, inc[0]).param
        inbox[peer] = torch.empty(sum(_numel(p) for p in inc), dtype=DTYPES[inc[0].dtype], device=like.device)
        ops.append(dist.P2POp(dist.irecv, inbox[peer], peer, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for peer, inc in recvs.items():
        at = 0
        for p in inc:
            n = _numel(p)
            _find(targets, p).box(p.offset, p.shape).copy_(inbox[peer][at:at + n].view(p.shape))
            at += n
    return sum(buf.numel() * buf.element_size() for buf in inbox.values())


def _numel(p: Piece) -> int:
    n = 1
    for s in p.shape:
        n *= s
    return n
