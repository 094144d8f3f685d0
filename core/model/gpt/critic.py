"""PPO's critic on the trainer's ranks: the actor's transformer under a value head.

The value model is a Megatron-core GPTModel in the actor's layout (same tp, pp, dp and
precision) whose output layer is ``ValueHead``, one output per position, not split over
tensor parallelism: the final hidden states are whole on every tensor-parallel rank, so
each computes the same values and the same head gradient (Megatron counts the replicated
head once in the gradient norm). It has its own DDP wrapper and optimizer. Its state is in
every checkpoint under ``critic.`` names (``critic.decoder...``, its optimizer's
``optim.exp_avg.critic...``; step counters and loss scaler in the ``critic`` blob), so it
loads into another layout as the actor does; a load of the actor's weights alone
(``init_from``, the reference) never reads them.

``copy_from_actor`` (CRITIC_INIT, when the RL phase begins) gives the critic the actor's
transformer; the head keeps its initialisation (normal(0, init_method_std) from the run's
seed, bias 0), never tied to the embeddings. ``critic_step`` is one optimizer step on one
mini-batch of the clipped value loss through the same pipeline schedule as the actor's
update, aggregated as the actor's loss is (``rl.loss_agg_mode`` over the whole mini-batch), in
the actor's micro-batches (core.model.gpt.microbatch: each padded to its own longest row).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state

from core.model.gpt import rl_loss
from core.model.gpt.model import unwrap
from core.model.gpt.policy import fill_row, optimizer_step, pad_counts
from core.model.gpt.state import ReadFn, export_items, import_items, optimizer_blob, sharded_params
from core.model.gpt.step import StepContext, is_loss_owner
from core.wire import rl_calls

PREFIX = "critic."
HEAD = "output_layer."


class ValueHead(torch.nn.Linear):
    """hidden → 1, called as Megatron calls its output layer (``(output, bias)``)."""

    def __init__(self, hidden: int, *, std: float, dtype: torch.dtype, seed: int) -> None:
        super().__init__(hidden, 1, bias=True, dtype=dtype)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=gen) * std)
            self.bias.zero_()
        self.sequence_parallel = False  # read by GPTModel's inference paths

    def forward(self, input_: torch.Tensor, weight: Any = None,  # type: ignore[override]
                runtime_gather_output: Any = None) -> tuple[torch.Tensor, None]:
        return super().forward(input_), None


def attach_head(gpt: torch.nn.Module, *, seed: int) -> None:
    """Replace the last stage's vocabulary output layer of ``gpt`` by a value head (``gpt``
    built untied: the critic role's model never ties its embeddings)."""
    if not parallel_state.is_pipeline_last_stage():
        return
    model = unwrap(gpt)
    old = model.output_layer
    head = ValueHead(model.config.hidden_size, std=model.config.init_method_std, dtype=old.weight.dtype, seed=seed)
    model.output_layer = head.to(old.weight.device)


def copy_from_actor(actor: list[Any], critic: list[Any], optimizer: Any) -> None:
    """The critic's transformer and embeddings := the actor's (same layout: local slices)."""
    mine = {(sh.key, sh.global_offset): p for sh, p in sharded_params(actor)}
    with torch.no_grad():
        for sh, param in sharded_params(critic):
            if not sh.key.startswith(HEAD):
                param.copy_(mine[sh.key, sh.global_offset])
    optimizer.reload_model_params()


def critic_step(ctx: StepContext, batch: rl_calls.CriticBatch,
                before_update: Callable[[], None] | None = None) -> dict[str, Any]:
    """One optimizer step of the critic (``ctx``: its model and optimizer) on this replica's
    share of a mini-batch; this rank's metrics (loss owners: the mini-batch's)."""
    rows, p, width = len(batch.sequences), batch.prompt_length, int(batch.sequences.lengths.max()) - 1
    arrays = {k: np.zeros((rows, width), dtype=np.int64) for k in ("tokens", "labels")}
    arrays.update({k: np.zeros((rows, width), dtype=np.float32) for k in ("mask", "ret", "oldv")})
    arrays["pads"], arrays["lengths"] = pad_counts(batch.pads, rows), np.zeros(rows, dtype=np.int64)
    for i, (row, ret, old) in enumerate(zip(batch.sequences.rows(), batch.returns.rows(), batch.old_values.rows(),
                                            strict=True)):
        n = fill_row(arrays, i, row, p)
        arrays["ret"][i, p - 1:n], arrays["oldv"][i, p - 1:n] = ret, old
    clip, agg = ctx.cfg.rl.critic.value_clip, batch.agg

    def loss_of(_model: torch.nn.Module, output: torch.Tensor,
                mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        terms, clipped = rl_loss.value_loss(output[..., 0].float(), mb["oldv"], mb["ret"], clip=clip)
        loss = rl_loss.aggregate(terms, mb["mask"], agg)
        return loss, {"vf": loss.detach(), "clipped": (clipped * mb["mask"]).sum().detach()}

    rl = ctx.cfg.rl
    out, numbers = optimizer_step(ctx, arrays, batch.step, rl.critic.lr or rl.lr, loss_of, before_update=before_update)
    if numbers is not None and is_loss_owner():
        out.update(value_loss=numbers["vf"], value_clip_frac=numbers["clipped"] / agg.tokens)
    out.pop("tokens", None)
    return out


def export(chunks: list[Any], optimizer: Any) -> tuple[list[Any], dict[str, Any]]:
    """The critic's checkpoint slices and its blob."""
    items, opt = export_items(chunks, optimizer, PREFIX)
    return items, optimizer_blob(opt)


def restore(chunks: list[Any], optimizer: Any, read: ReadFn, blob: dict[str, Any]) -> None:
    import_items(chunks, optimizer, read, blob, PREFIX)
