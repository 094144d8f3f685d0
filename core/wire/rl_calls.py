"""The RL programs' calls: what GRPO and PPO ask of the trainer's ranks (core.controller.rl_program).

    POLICY_STEP   PolicyBatch → PolicyResult one actor update on the clipped policy objective
    SCORE_ROWS    ScoreRows   → RowScores    the actor's or the reference's log-probs of a rollout, or the
                                             critic's values
    CRITIC_STEP   CriticBatch → CriticResult one critic update on the clipped value loss (PPO)
    CRITIC_INIT   NoArgs      → None         the critic's transformer becomes the actor's (PPO's first RL step)

Both updates report ``core.wire.calls.Timings`` as a training step does. Rows and their
per-token numbers travel as arrays (``core.wire.ragged.Ragged``): ``sequences`` int32 rows of
prompt + response, every per-response-token field (advantages, log-probs, values, returns)
float32 rows of each row's response length, which the request checks when it is built (on
the worker: when it is decoded; a mismatch is a ``ProtocolError`` naming the field). A
prompt shorter than ``prompt_length`` is left-padded: ``pads`` gives each row's pad count,
and the model never sees those tokens (core.model.gpt.padding). The generator's
calls are ``core.flows.calls``; the workers' side is ``core.model.gpt.roles`` (actor, critic).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from core.errors import ProtocolError
from core.wire.calls import Timings
from core.wire.contract import Collect, Dispatch, Method, NoArgs
from core.wire.ragged import FLOATS, TOKENS, Ragged, matches


@dataclass(frozen=True, kw_only=True)
class LossAgg:
    """How an update's per-token terms become one loss (``rl.loss_agg_mode``,
    core.model.gpt.rl_loss.aggregate), with the counts of the whole mini-batch the optimizer
    step is taken on (every data replica's share together): its response ``tokens``, its
    ``rows`` (responses) and ``horizon``, ``seq-mean-token-sum-norm``'s per-row divisor
    (``rl.max_response_length``), each at least 1. The controller counts them; no worker
    sees the whole."""

    mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    tokens: int
    rows: int
    horizon: int


@dataclass(frozen=True, kw_only=True)
class PolicyBatch:
    """One optimizer step of the actor on this rank's data replica's share of a mini-batch
    of a rollout: ``sequences`` prompt + response (prompts of ``prompt_length`` tokens), per
    response token its ``advantages``, the old policy's ``old_logprobs`` and (with a KL term,
    ``kl_coef`` > 0) the reference's ``ref_logprobs``; ``agg`` the whole mini-batch's counts."""

    step: int
    agg: LossAgg
    prompt_length: int
    sequences: Ragged  # int32 rows
    advantages: Ragged  # float32, per response token
    old_logprobs: Ragged  # float32, per response token
    ref_logprobs: Ragged = field(default_factory=Ragged.empty)  # float32, per response token; no rows: none
    kl_coef: float = 0.0
    pads: tuple[int, ...] = ()  # per row, its prompt's leading pad tokens (masked out); () none

    def __post_init__(self) -> None:
        responses = checked_rows("PolicyBatch", self.sequences, self.prompt_length, self.pads)
        per_token("PolicyBatch", responses, advantages=self.advantages, old_logprobs=self.old_logprobs,
                  ref_logprobs=self.ref_logprobs or None)


@dataclass(frozen=True, kw_only=True)
class ScoreRows:
    """Teacher-forced log-probs of the response tokens of rows (prompt + response, prompts
    of ``prompt_length``) under the ``actor`` (with the entropy) or the ``reference``, both
    at ``rl.temperature``; the ``critic``'s values (the value before each response token is drawn)."""

    model: Literal["actor", "reference", "critic"]
    prompt_length: int
    sequences: Ragged  # int32 rows
    pads: tuple[int, ...] = ()  # per row, its prompt's leading pad tokens (masked out); () none
    mini_batch: int = 0  # rows of each update mini-batch in this share (0: all): micro-batched as the update is

    def __post_init__(self) -> None:
        checked_rows("ScoreRows", self.sequences, self.prompt_length, self.pads)


@dataclass(frozen=True, kw_only=True)
class RowScores:
    """On loss owners (one per data replica); empty elsewhere."""

    logprobs: Ragged = field(default_factory=Ragged.empty)  # float32: per row, its response tokens'
    values: Ragged = field(default_factory=Ragged.empty)  # float32: the critic's, per row, per response token
    entropy_sum: float = 0.0  # the actor's entropy summed over the response tokens
    tokens: int = 0

    def __post_init__(self) -> None:
        self.logprobs.expect(FLOATS, "RowScores.logprobs")
        self.values.expect(FLOATS, "RowScores.values")


@dataclass(frozen=True, kw_only=True)
class PolicyResult(Timings):
    """Every rank its time (the data wait: assembling its micro-batches from the request);
    loss owners (one per data replica) the mini-batch's numbers (every replica's together,
    aggregated as the loss is: the same on every owner)."""

    loss: float | None = None  # the clipped policy loss, aggregated (rl.loss_agg_mode)
    grad_norm: float | None = None
    lr: float | None = None
    tokens: int = 0  # response tokens of this replica
    clip_frac: float | None = None  # the fraction of the mini-batch's response tokens where the clip bound
    ratio_max: float | None = None  # the largest new/old probability ratio seen
    kl: float | None = None  # with reference log-probs: the KL estimate's token mean over the mini-batch (the
    #                          loss aggregates it by rl.loss_agg_mode; the adaptive KL controller reads this)


@dataclass(frozen=True, kw_only=True)
class CriticBatch:
    """One optimizer step of the critic on this rank's data replica's share of a mini-batch
    of a rollout: per response token its GAE ``returns`` (the targets) and the ``old_values``
    the clip is measured from; ``agg`` the whole mini-batch's counts."""

    step: int
    agg: LossAgg
    prompt_length: int
    sequences: Ragged  # int32 rows
    returns: Ragged  # float32, per response token
    old_values: Ragged  # float32, per response token
    pads: tuple[int, ...] = ()  # per row, its prompt's leading pad tokens (masked out); () none

    def __post_init__(self) -> None:
        responses = checked_rows("CriticBatch", self.sequences, self.prompt_length, self.pads)
        per_token("CriticBatch", responses, returns=self.returns, old_values=self.old_values)


@dataclass(frozen=True, kw_only=True)
class CriticResult(Timings):
    """Every rank its time; loss owners the replica's numbers."""

    value_loss: float | None = None  # the clipped value loss, aggregated (rl.loss_agg_mode) over the mini-batch
    value_clip_frac: float | None = None  # fraction of the mini-batch's tokens where the clipped term was taken
    grad_norm: float | None = None
    lr: float | None = None


def checked_rows(where: str, sequences: Ragged, prompt_length: int, pads: tuple[int, ...]) -> np.ndarray:
    """Refuse (``ProtocolError`` naming the field) rows that are not int32, shorter than a
    prompt, or whose pad counts do not match; each row's response length."""
    sequences.expect(TOKENS, f"{where}.sequences")
    if pads and len(pads) != len(sequences):
        raise ProtocolError(f"{where}.pads: {len(pads)} pad counts for {len(sequences)} rows")
    if len(sequences) and int(sequences.lengths.min()) < prompt_length:
        raise ProtocolError(f"{where}.sequences: a row of {int(sequences.lengths.min())} tokens, shorter than "
                            f"prompt_length = {prompt_length}")
    return sequences.lengths - np.int32(prompt_length)  # type: ignore[no-any-return]


def per_token(where: str, responses: np.ndarray, **fields: Ragged | None) -> None:
    """Refuse per-response-token ``fields`` that are not float32 rows of the ``responses``' lengths."""
    for name, rows in fields.items():
        if rows is not None:
            rows.expect(FLOATS, f"{where}.{name}")
            matches(rows, responses, f"{where}.{name}", "response tokens")


POLICY_STEP = Method("policy_step", PolicyBatch, PolicyResult, dispatch=Dispatch.REPLICAS)
SCORE_ROWS = Method("score_rows", ScoreRows, RowScores, dispatch=Dispatch.REPLICAS, collect=Collect.OWNERS)
CRITIC_STEP = Method("critic_step", CriticBatch, CriticResult, dispatch=Dispatch.REPLICAS)
CRITIC_INIT = Method("critic_init", NoArgs, None)  # the critic's transformer := the actor's
