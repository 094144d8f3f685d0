"""The training calls: what the controller's program asks of every training task.

    SETUP        Setup       → SetupInfo    join the process group, build model, optimizer, data
    TRAIN_STEP   Step        → StepResult   one optimizer step on the global batch of ``step``
    EVAL_STEP    Step        → StepResult   forward only on the held-out batch of ``step``
    LOAD_WEIGHTS WeightsFile → None         this rank's slices of an .npz of global tensors
    SAVE_WEIGHTS WeightsFile → None         collective: rank 0 writes every global tensor
    AVERAGE      NoArgs      → StepResult   parallel.sync: the replicas average weights and Adam moments

Every step's result is a ``Timings`` (the RL updates' too: ``core.wire.rl_calls``, the RL
programs' calls). The checkpoint calls are ``core.checkpoint.calls``; the toy model's test
calls are in ``core.model.toy``. See ``core.wire.contract`` for how a call is checked.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.config.dims import Coords
from core.wire.contract import Dispatch, Method, NoArgs


@dataclass(frozen=True, kw_only=True)
class Setup:
    master_addr: str  # torch.distributed's rendezvous (rank 0's host and a free port there)
    master_port: int
    config_hash: str = ""  # the controller's config.yaml; a worker that read another refuses
    micro_batch_size: int | None = None  # the plan's; None: the workers resolve ``auto``


@dataclass(frozen=True, kw_only=True)
class SetupInfo:
    coords: Coords
    layers: tuple[int, ...] = ()  # global indices of the transformer layers this rank holds
    num_params: int = 0  # parameters on this rank
    device: str = "cpu"
    micro_batch_size: int | None = None  # what this rank trains with (``auto`` resolved)


@dataclass(frozen=True, kw_only=True)
class Step:
    step: int
    local: bool = False  # parallel.sync: no all-reduce of gradients (each replica its own)
    average: bool = False  # parallel.sync: after the update, the replicas average their state
    measure: bool = False  # also measure what this rank holds (StepResult.memory)


@dataclass(frozen=True, kw_only=True)
class Timings:
    """What every rank reports of a step or an update: its time and memory (the base of
    ``StepResult`` and the RL updates' results, ``core.wire.rl_calls``)."""

    step_time_s: float
    rss_mb: float = 0.0
    data_wait_s: float | None = None  # assembling this rank's micro-batches
    grad_sync_s: float | None = None  # the data-parallel gradient reduction
    compute_s: float | None = None  # the step less its data wait and gradient reduction
    cuda_peak_mb: float | None = None
    rss_peak_mb: float | None = None  # the process's peak resident memory during the step


@dataclass(frozen=True, kw_only=True)
class StepResult(Timings):
    """Every rank: its time and memory. Loss owners (last stage, tp rank 0: one per data
    replica) also the loss, gradient norm, learning rate and their replica's token count."""

    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    tokens: int = 0  # tokens this data-parallel replica trained on (the controller sums the loss owners')
    memory: tuple[float, ...] | None = None  # when measured: bytes of weights, gradients, optimizer, activations


@dataclass(frozen=True, kw_only=True)
class WeightsFile:
    path: str  # an .npz of global tensors (global name → full array)


SETUP = Method("setup", Setup, SetupInfo, dispatch=Dispatch.EACH)  # each group its own rendezvous
TRAIN_STEP = Method("train_step", Step, StepResult)
EVAL_STEP = Method("eval_step", Step, StepResult)
LOAD_WEIGHTS = Method("load_global_weights", WeightsFile, None)
SAVE_WEIGHTS = Method("save_global_weights", WeightsFile, None)
AVERAGE = Method("average_replicas", NoArgs, StepResult)  # parallel.sync: average now (before a checkpoint)
