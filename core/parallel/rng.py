"""The RNG streams of a training rank: derived from (seed, step, coordinates); captured and
restored exactly.

    default stream      torch's CPU generator, and on a GPU the CUDA default generator:
                        hidden dropout and everything outside tensor-parallel regions. The
                        same on every tensor-parallel rank of a replica (the activations it
                        masks are replicated there), different across pipeline stages and
                        data-parallel replicas.
    model-parallel      Megatron's tracker stream 'model-parallel-rng': attention dropout on
                        this rank's shard of heads, different on every tensor-parallel rank.
    data/expert         the tracker's other streams, seeded as Megatron seeds them.
    numpy, Python       unused by training (its data is a pure function of the step);
                        captured and restored all the same.

``seed_streams(seed, step, coords)`` derives every stream of a rank from a NumPy
``SeedSequence`` of (seed, step, pp, dp), plus tp for the model-parallel one: a run is
reproducible in every layout. A checkpoint holds each rank's ``capture()`` keyed by its
coordinates; a resume in the same layout ``restore``s them bit for bit, one in another
layout derives fresh streams for the new coordinates at the resumed step (the masks then
differ from the old layout's: a mask belongs to a stream, and streams belong to
coordinates).
"""
from __future__ import annotations

import base64
import logging
import random
from typing import Any

import numpy as np
import torch
from megatron.core import tensor_parallel

from core.config.dims import Coords
from core.parallel import cpu_shim

log = logging.getLogger(__name__)

MODEL_PARALLEL = "model-parallel-rng"
DATA_PARALLEL = "data-parallel-rng"
EXPERT_PARALLEL = "expert-parallel-rng"


def stream_seed(seed: int, step: int, pp: int, dp: int) -> int:
    """The default stream's seed of (pp, dp) at ``step`` (shared by the tp ranks of that pair)."""
    return int(np.random.SeedSequence([seed, step, pp, dp]).generate_state(1, dtype=np.uint32)[0])


def seed_all(base: int, tp: int, *, on_cuda: bool) -> None:
    """Seed every stream from ``base`` with Megatron's offsets: the default ones ``base``, the
    tracker's model-parallel stream ``base + 2718 + tp``, its expert stream ``base + 1024``.

    Before the model is built every rank seeds with the run's seed: with CPU initialisation
    Megatron draws each full weight and slices it, so every tensor-parallel layout agrees."""
    random.seed(base)
    np.random.seed(base % 2**32)
    torch.manual_seed(base)
    if on_cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(base, tp_rank=tp, ep_rank=0, etp_rank=0)
        return
    tracker = cpu_shim.install_cpu_rng_tracker()
    tracker.add(DATA_PARALLEL, base)
    tracker.add(MODEL_PARALLEL, base + 2718 + tp)
    tracker.add(EXPERT_PARALLEL, base + 1024)


def seed_streams(seed: int, step: int, coords: Coords, *, on_cuda: bool) -> None:
    """Every training stream of this rank as of ``step``, derived from its coordinates."""
    seed_all(stream_seed(seed, step, coords.pp, coords.dp), coords.tp, on_cuda=on_cuda)


def _pack(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode()


def _unpack(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture() -> dict[str, Any]:
    """Every stream's state, JSON-able (generator states as base64 strings)."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": _pack(torch.get_rng_state()),
        "cuda": _pack(torch.cuda.get_rng_state()) if torch.cuda.is_available() else None,
        "tracker": {name: _pack(s) for name, s in tracker.get_states().items()},
        "numpy": [np_state[0], base64.b64encode(np_state[1].astype("<u4").tobytes()).decode(), int(np_state[2]),
                  int(np_state[3]), float(np_state[4])],
        "python": [py_version, list(py_internal), py_gauss],
    }


def restore(state: dict[str, Any]) -> None:
    """Set every stream to ``capture()``'s output, bit for bit."""
    torch.set_rng_state(_unpack(state["torch"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unpack(state["cuda"]))
    tensor_parallel.get_cuda_rng_tracker().set_states({n: _unpack(s) for n, s in state["tracker"].items()})
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.frombuffer(base64.b64decode(keys), dtype="<u4").copy(), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
