"""What one rank holds, measured from its tensors (``baton plan --check`` compares it with
the plan's estimate): weights (the model's parameters, plus the optimizer's separate fp32
main weights), gradients (the DDP buffers, or FSDP2's sharded grads), optimizer state (Adam's
moments) and activations (the bytes one micro-batch's forward saves for backward on this
rank, core.model.gpt.activations, times the micro-batches in flight on its pipeline stage).
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state

from core.model.gpt import activations
from core.model.gpt.optimizer_state import OptimizerState
from core.model.gpt.step import StepContext


def _bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of distinct storages (views of one buffer counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measured(ctx: StepContext, num_micro: int) -> tuple[float, float, float, float]:
    """(weights, gradients, optimizer, activations) bytes of this rank after a measured step."""
    params = [p for chunk in ctx.model_chunks for p in chunk.parameters()]
    grads = [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
    weights, moments = list(params), []
    if hasattr(ctx.optimizer, "state_of"):  # ZeRO-3 (core.model.gpt.fsdp)
        moments = [ctx.optimizer.state_of(p)[k] for p in params for k in ("exp_avg", "exp_avg_sq")]
    else:
        opt = OptimizerState(ctx.optimizer)
        for p in params:
            held = opt._tensors(p)
            if held is None:
                continue
            moments += [held[0]["exp_avg"], held[0]["exp_avg_sq"]]
            if opt.separate_main:
                weights.append(held[0]["main_param"])
    in_flight = min(parallel_state.get_pipeline_model_parallel_world_size()
                    - parallel_state.get_pipeline_model_parallel_rank(), num_micro)
    return (float(_bytes(weights)), float(_bytes(grads)), float(_bytes(moments)),
            float(activations.peak_bytes() * in_flight))
