"""How the tensors a forward saves for backward are stored (``training.activation_storage``).

``int8``: every floating-point tensor the model's forward saves for backward that has at
least ``MIN_NUMEL`` elements and two dimensions is kept as int8 with one fp32 scale per row
of its last dimension (absmax / 127) and dequantised to its own dtype when backward reads
it. Parameters (leaves that require a gradient: a linear layer saves its weight) are never
touched. Only the model's own forward runs under the hooks (``storing``), so:

- with activation recompute, the recomputation in backward saves plainly (nothing is
  quantised to be read back at once: no double work), while the inputs the checkpoint keeps
  across the gap are int8;
- with pipeline parallelism, the tensors sent between stages and the schedule's own
  references are untouched; the loss function's (outside the model) too.

``measure`` counts the bytes stored for backward (int8 or plain; parameters, held anyway,
not counted), for tests, benchmarks and ``baton plan --check``: ``saved_bytes()`` in all
and ``peak_bytes()`` of the largest single forward since ``measure``.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

MIN_NUMEL = 1024
_counter = {"bytes": 0, "on": False, "forward": 0, "peak": 0}


def _quantisable(t: torch.Tensor) -> bool:
    return (t.is_floating_point() and t.dim() >= 2 and t.numel() >= MIN_NUMEL
            and not (t.is_leaf and t.requires_grad))


def _pack_int8(t: torch.Tensor) -> Any:
    if not _quantisable(t):
        _count(t)
        return t
    rows = t.detach().reshape(-1, t.shape[-1]).float()
    scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    q = torch.round(rows / scale).to(torch.int8)
    _add(q.numel() + scale.numel() * 4)
    return q, scale, t.dtype, t.shape


def _unpack_int8(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    q, scale, dtype, shape = packed
    return (q.float() * scale).to(dtype).reshape(shape)


def _pack_plain(t: torch.Tensor) -> torch.Tensor:
    _count(t)
    return t


def _count(t: torch.Tensor) -> None:
    """A tensor kept as it is: its bytes, unless it is a parameter (held anyway)."""
    if not isinstance(t, torch.nn.Parameter):
        _add(t.numel() * t.element_size())


def _add(n: int) -> None:
    if _counter["on"]:
        _counter["bytes"] += n
        _counter["forward"] += n


def storing(mode: str) -> AbstractContextManager[Any]:
    """The context a model's forward runs in: ``int8`` storage, or plain (counted when
    measuring, else no hooks at all)."""
    if mode == "int8":
        hooks: AbstractContextManager[Any] = torch.autograd.graph.saved_tensors_hooks(_pack_int8, _unpack_int8)
    elif _counter["on"]:
        hooks = torch.autograd.graph.saved_tensors_hooks(_pack_plain, lambda t: t)
    else:
        return nullcontext()
    return _forward(hooks) if _counter["on"] else hooks


@contextmanager
def _forward(hooks: AbstractContextManager[Any]) -> Iterator[None]:
    """One forward's saved bytes; the largest is ``peak_bytes``."""
    _counter["forward"] = 0
    with hooks:
        yield
    _counter["peak"] = max(_counter["peak"], _counter["forward"])


def measure(on: bool = True) -> None:
    """Count saved bytes from now (and reset the counts)."""
    _counter.update(on=on, bytes=0, forward=0, peak=0)


def saved_bytes() -> int:
    """Every byte saved for backward since ``measure``."""
    return int(_counter["bytes"])


def peak_bytes() -> int:
    """The most bytes one forward (one micro-batch through this rank's stage) saved."""
    return int(_counter["peak"])
