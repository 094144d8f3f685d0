"""Executing a weight-sync plan (core.flows.reshard) on one rank.

Each rank holds its source parameters (the trainer's, as global slices) and its target
parameters (the generator's); ``prepare`` binds its pieces to views of them once per plan.
For every bucket it posts the sends and the receives to and from every peer at once (point to
point: batched on the default process group when both models share the processes, one
asynchronous message each on a bridge group over every worker when the generator runs on
its own, ``connect``; gloo on CPU, NCCL on GPU), copies the bucket's local pieces (a piece
whose source and target are this same rank) while they travel, then waits for them: a
piece the plan marks direct (contiguous on both ends) travels in place, the others of a
peer are packed into one flat buffer and unpacked into the target parameters. Buffers live
for one bucket. The arithmetic is copies only: the target receives the source's
values bit for bit, in the target's dtype when the two differ.
"""
from __future__ import annotations

import datetime
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

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


@dataclass
class _Bucket:
    local: list[tuple[torch.Tensor, torch.Tensor]]  # (target view, source view)
    sends: dict[int, tuple[list[tuple[torch.Tensor, bool]], torch.dtype]]  # peer → (source view, direct), dtype
    recvs: dict[int, tuple[list[tuple[torch.Tensor, bool]], torch.dtype]]  # peer → (target view, direct), dtype


def prepare(pieces: Sequence[Piece], rank: int, sources: dict[str, list[Held]],
            targets: dict[str, list[Held]]) -> list[_Bucket]:
    """This rank's ``pieces`` bound to views of its parameters, once per plan (views stay
    valid: parameters are updated in place)."""
    buckets: list[_Bucket] = []
    for _, group in itertools.groupby(pieces, key=lambda p: p.bucket):
        b = _Bucket(local=[], sends={}, recvs={})
        for p in group:
            if p.src == rank and p.dst == rank:
                b.local.append((_find(targets, p).box(p.offset, p.shape), _find(sources, p).box(p.offset, p.shape)))
            elif p.src == rank:
                b.sends.setdefault(p.dst, ([], DTYPES[p.dtype]))[0].append(
                    (_find(sources, p).box(p.offset, p.shape), p.direct))
            else:
                b.recvs.setdefault(p.src, ([], DTYPES[p.dtype]))[0].append(
                    (_find(targets, p).box(p.offset, p.shape), p.direct))
        buckets.append(b)
    return buckets


def connect(addr: str, port: int, *, name: str, rank: int, size: int, backend: str, timeout_s: float) -> Any:
    """A process group of ``size`` ranks outside the default world (which it may span), met
    on the TCP store at ``addr:port`` under the prefix ``name``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore(name, dist.TCPStore(addr, port, is_master=False, timeout=timeout,
                                                 wait_for_workers=False))
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class Moved(NamedTuple):
    """Bytes this rank received from and sent to other ranks (local copies not counted)."""

    received: int
    sent: int


def run_plan(plan: list[_Bucket], group: Any = None, *, link: Any = None) -> Moved:
    """Move a prepared plan, bucket by bucket. ``link``: a process group made by ``connect``
    (plan ranks are its ranks), else the default group's ``group``."""
    with torch.no_grad():
        for bucket in plan:
            if link is None:
                _run_bucket(bucket, group)
            else:
                _run_linked(bucket, link)
    return Moved(received=sum(_nbytes(b.recvs) for b in plan), sent=sum(_nbytes(b.sends) for b in plan))


def _nbytes(ends: dict[int, tuple[list[tuple[torch.Tensor, bool]], torch.dtype]]) -> int:
    """What travels: the target's dtype."""
    return sum(v.numel() * dtype.itemsize for views, dtype in ends.values() for v, _ in views)


def _run_linked(b: _Bucket, link: Any) -> None:
    """A bucket over a bridge group: its own send/recv (the group is not the default
    world's), every message posted in plan order, then waited for."""
    works, inbox = [], []
    for peer, (views, dtype) in b.sends.items():
        works += [link.send([v], peer, 0) for v, direct in views if direct]
        packed = [v for v, direct in views if not direct]
        if packed:
            works.append(link.send([torch.cat([v.reshape(-1).to(dtype) for v in packed])], peer, 0))
    for peer, (views, dtype) in b.recvs.items():
        works += [link.recv([v], peer, 0) for v, direct in views if direct]
        packed = [v for v, direct in views if not direct]
        if packed:
            buf = torch.empty(sum(v.numel() for v in packed), dtype=dtype, device=packed[0].device)
            works.append(link.recv([buf], peer, 0))
            inbox.append((buf, packed))
    _copy_local(b)
    for work in works:
        work.wait()
    _unpack(inbox)


def _copy_local(b: _Bucket) -> None:
    for dst, src in b.local:
        dst.copy_(src)


def _unpack(inbox: Sequence[tuple[torch.Tensor, list[torch.Tensor]]]) -> None:
    for buf, packed in inbox:
        at = 0
        for v in packed:
            n = v.numel()
            v.copy_(buf[at:at + n].view(v.shape))
            at += n


def _run_bucket(b: _Bucket, group: Any) -> None:
    """Pieces the plan marks direct travel as they are (no copy on either side); the others
    of a peer are packed into one buffer. Both ends post their messages in plan order."""
    ops, inbox = [], {}
    for peer, (views, dtype) in b.sends.items():
        ops += [dist.P2POp(dist.isend, v, peer, group) for v, direct in views if direct]
        packed = [v for v, direct in views if not direct]
        if packed:
            ops.append(dist.P2POp(dist.isend, torch.cat([v.reshape(-1).to(dtype) for v in packed]), peer, group))
    for peer, (views, dtype) in b.recvs.items():
        ops += [dist.P2POp(dist.irecv, v, peer, group) for v, direct in views if direct]
        packed = [v for v, direct in views if not direct]
        if packed:
            inbox[peer] = (torch.empty(sum(v.numel() for v in packed), dtype=dtype, device=packed[0].device), packed)
            ops.append(dist.P2POp(dist.irecv, inbox[peer][0], peer, group))
    works = dist.batch_isend_irecv(ops) if ops else []
    _copy_local(b)
    for work in works:
        work.wait()
    _unpack(list(inbox.values()))
