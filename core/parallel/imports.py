"""Import Megatron-core without paying for kernels this run never calls.

Megatron-core 0.16.1 decorates about twenty fusion kernels with ``torch.compile``
(``megatron.core.jit.jit_fuser``) while it imports. Decorating is cheap; it is
``torch.compile`` itself that imports TorchDynamo and Inductor (about 2.5 s of CPU per
process, a third of a worker's start-up), although Baton's models leave Megatron's fusions
off and never call those kernels.

``import_megatron`` imports ``megatron.core`` once, with ``torch.compile`` replaced for that
moment by a deferring decorator: the kernel is compiled by the real ``torch.compile`` on its
first call, exactly as it would have been (``torch.compile`` compiles lazily anyway), so
nothing changes but when TorchDynamo is imported. Modules (``nn.Module``) and calls that are
not plain decoration go to the real ``torch.compile`` at once.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch


def _deferring(real: Callable[..., Any]) -> Callable[..., Any]:
    def compile_on_first_call(model: Any = None, **options: Any) -> Any:
        if model is None:  # ``@torch.compile(mode=...)``: a decorator with options
            return lambda fn: compile_on_first_call(fn, **options)
        if not callable(model) or isinstance(model, torch.nn.Module):
            return real(model, **options)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
            return compiled(*args, **kwargs)

        return call

    return compile_on_first_call


def import_megatron() -> None:
    """Import ``megatron.core`` (idempotent); its ``jit_fuser`` compiles on first use."""
    if "megatron.core" in sys.modules:
        return
    real = torch.compile
    torch.compile = _deferring(real)
    try:
        import megatron.core  # noqa: F401  the one import this module exists for
    finally:
        torch.compile = real
