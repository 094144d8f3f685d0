"""Run Megatron-core on a CPU-only torch build: every CUDA assumption, answered here.

Megatron-core 0.16.1 creates tensors with ``device="cuda"`` or
``device=torch.cuda.current_device()``, calls ``tensor.cuda()`` and
``torch.cuda.synchronize()``, pins memory, and asserts
``tensor.type() == "torch.cuda.FloatTensor"`` in about 29 places (p2p buffers, DDP
buffers, schedules, grad clipping, the distributed optimizer). On a build without CUDA
each of those raises "Torch not compiled with CUDA enabled".

This module is the single home of that workaround: a ``TorchFunctionMode`` that maps
CUDA devices to the CPU, a few ``torch.cuda`` functions replaced by no-ops, the CUDA
RNG save/restore of activation recompute (``megatron.core.tensor_parallel.random``), and
Megatron's RNG tracker over the CPU generator (``CpuRNGStatesTracker``: the
tensor-parallel stream attention dropout forks into). It is
entered once per process, only when CUDA is unavailable; on a GPU machine
``activate_if_needed`` does nothing. A torch function mode is thread-local: it covers the
thread that activated it, which is where Baton's worker runs every task call. The guard is ``tests/integration/test_gpt_parallel.py``:
real Megatron steps in every layout run under it, so a Megatron upgrade that adds a CUDA
call fails there loudly.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.variable import Variable
from torch.overrides import TorchFunctionMode

from core.parallel.imports import import_megatron

import_megatron()  # megatron.core through its one door (its torch.compile deferred), before the line below

from megatron.core.tensor_parallel import random as megatron_random  # noqa: E402  patched when activated

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")
_active_mode: _CudaToCpuMode | None = None

# ``Tensor.type()`` without arguments: Megatron asserts CUDA type names.
_CPU_TO_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    # ``torch.cuda.current_device()`` returns 0 here; an int device means a CUDA ordinal.
    return isinstance(value, int) and not isinstance(value, bool)


def _map_device(value: Any) -> Any:
    return _CPU if _is_cuda_device(value) else value


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for every torch function call."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            return self._backward(func, args, kwargs)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CPU_TO_CUDA_TYPE.get(name, name)
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinning needs a CUDA driver
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


    def _backward(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # Dispatch pops this mode for the whole call, so a plain ``func(...)`` would run
        # the backward pass (activation recompute, custom backward functions, which
        # create CUDA tensors too) without it. Run the autograd engine directly, as
        # Megatron's own ``custom_backward`` does, with the mode pushed again.
        bound = inspect.signature(func).bind(*args, **kwargs).arguments
        if func is torch.Tensor.backward:
            tensors, grads = (bound["self"],), (bound.get("gradient"),)
        else:
            tensors, grads = bound["tensors"], bound.get("grad_tensors")
            tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
            if grads is None or isinstance(grads, torch.Tensor):
                grads = (grads,) * len(tensors) if grads is None else (grads,)
        grads = tuple(
            torch.ones_like(t, memory_format=torch.preserve_format) if g is None else g
            for t, g in zip(tensors, grads, strict=True)
        )
        create_graph = bool(bound.get("create_graph", False))
        retain_graph = bound.get("retain_graph")
        inputs = bound.get("inputs")
        inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        with self:
            Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
                tensors=tensors,
                grad_tensors=grads,
                keep_graph=create_graph if retain_graph is None else bool(retain_graph),
                create_graph=create_graph,
                inputs=inputs,
                allow_unreachable=True,
                accumulate_grad=True,
            )


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


def _no_cuda_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)  # there is no CUDA generator to save


def _patch_megatron_rng() -> None:
    # Activation recompute saves and restores "the CUDA RNG state" around every layer;
    # restoring goes through torch.cuda._lazy_call, which on a CPU build queues the
    # callback (with a formatted stack) forever: a leak per layer per step. Nothing is
    # there to restore, so drop it. Megatron binds the name at import: patch its copy.
    megatron_random._lazy_call = _noop


class CpuRNGStatesTracker:
    """Megatron's RNG tracker (``CudaRNGStatesTracker``'s interface) over the CPU generator.

    Named streams are CPU generator states; ``fork`` swaps one in for a block and saves it
    back after, so attention dropout in tensor-parallel regions draws from a stream of its
    own, as on a GPU, while activation recompute saves and restores every stream (through
    ``get_states``/``set_states``) exactly.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if name in self.states_ or seed in self.seeds_:
            raise ValueError(f"RNG stream {name!r} or seed {seed} already added")
        self._is_initialized = True
        self.seeds_.add(seed)
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG stream {name!r} was never added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def install_cpu_rng_tracker() -> CpuRNGStatesTracker:
    """Make ``CpuRNGStatesTracker`` Megatron's tracker (``get_cuda_rng_tracker()``) in this process."""
    tracker = CpuRNGStatesTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return tracker


def is_active() -> bool:
    """Whether this process runs Megatron on the CPU through the shim."""
    return _active_mode is not None


def activate_if_needed() -> bool:
    """Enter the CUDA→CPU mode once per process when CUDA is unavailable.

    Returns True when the shim is active (now or from an earlier call), False on a CUDA
    machine, where nothing is changed. Also pins torch to one intra-op thread on CPU: with
    several ranks per core, more threads make every step several times slower.
    """
    global _active_mode
    if torch.cuda.is_available():
        return False
    if _active_mode is not None:
        return True
    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    torch.cuda.synchronize = _noop  # type: ignore[assignment]
    torch.cuda.empty_cache = _noop  # type: ignore[assignment]
    torch.cuda.random.get_rng_state = _no_cuda_rng_state  # type: ignore[assignment]
    torch.cuda.get_rng_state = _no_cuda_rng_state  # type: ignore[assignment]
    _patch_megatron_rng()
    mode = _CudaToCpuMode()
    # Entered for the life of the process, never exited: every later call is Megatron's.
    mode.__enter__()
    _active_mode = mode
    log.info("CUDA unavailable: Megatron runs on CPU through the CUDA→CPU shim")
    return True
