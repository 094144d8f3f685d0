"""The generator's calls: what the controller asks of a generator group (and its trainer).

    GEN_SLICES    NoArgs      → HeldSlices   the trainer slices this rank owns, the generator slices it needs
    SYNC_WEIGHTS  SyncWeights → Synced       run this rank's pieces of a weight-sync plan; now at ``version``
    PROBE_BATCH   Probe       → LogProbs     the trainer's probe batch and its log-probs (one rank answers)
    SCORE         LogProbs    → LogProbs     the generator's log-probs of given tokens (teacher-forced)
    GENERATE      Generate    → Generated    continue the prompts of this rank's replica
    GEN_PROMPTS   Prompts     → PromptSet    prompts from the held-out data (asked of rank 0)
    POLICY_STEP   PolicyBatch → PolicyResult one actor update on the clipped policy objective (RL)
    SCORE_ROWS    ScoreRows   → RowScores    the actor's or the reference's log-probs of a rollout, or the
                                             critic's values (RL)
    CRITIC_STEP   CriticBatch → CriticResult one critic update on the clipped value loss (PPO)
    CRITIC_INIT   NoArgs      → None         the critic's transformer becomes the actor's (PPO's first RL step)

Split placement only (the generator on workers of its own, ranks after the trainer's):

    BRIDGE        Bridge      → None         join the process group of every worker that weight syncs run on

A plan is made by the controller (``core.flows.reshard.plan``) from every rank's
``HeldSlices`` and sent to each rank as its own pieces.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from core.checkpoint.spec import TensorSlice
from core.flows.reshard import Piece
from core.wire.contract import Collect, Dispatch, Method, NoArgs


@dataclass(frozen=True, kw_only=True)
class HeldSlices:
    sources: tuple[TensorSlice, ...] = ()  # trainer slices this rank owns (first replica only)
    targets: tuple[TensorSlice, ...] = ()  # generator slices this rank holds (all of them)


@dataclass(frozen=True, kw_only=True)
class SyncWeights:
    pieces: tuple[Piece, ...]  # this rank's, in plan order
    version: int  # the policy version the generator holds afterwards (the trainer's step)


@dataclass(frozen=True, kw_only=True)
class Synced:
    version: int
    bytes_received: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class Probe:
    step: int  # the probe batch is the held-out batch of this step


@dataclass(frozen=True, kw_only=True)
class Generate:
    prompts: tuple[tuple[int, ...], ...]  # one length
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    eos: int | None = None
    seed: int = 0  # with a prompt's index: the seed of the generator it samples from
    indices: tuple[int, ...] = ()  # each prompt's index in the run's prompt set (default 0, 1, ...)


@dataclass(frozen=True, kw_only=True)
class Generated:
    """On the first tensor-parallel rank of each generator replica; empty elsewhere."""

    replica: int = -1
    version: int = -1  # the policy version that generated
    tokens: tuple[tuple[int, ...], ...] = ()
    logprobs: tuple[tuple[float, ...], ...] = ()


@dataclass(frozen=True, kw_only=True)
class Prompts:
    count: int
    length: int


@dataclass(frozen=True, kw_only=True)
class PromptSet:
    prompts: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, kw_only=True)
class Bridge:
    """A process group over every worker (trainer ranks, then the generator's), rendezvous
    on the trainer's store (its rank 0's ``master_addr:master_port``) under ``name``."""

    master_addr: str
    master_port: int
    size: int
    name: str  # the store prefix: one per worker generation


@dataclass(frozen=True, kw_only=True)
class LogProbs:
    """Token rows, their labels and the per-token log-probs of the labels."""

    tokens: tuple[tuple[int, ...], ...] = ()
    labels: tuple[tuple[int, ...], ...] = ()
    logprobs: tuple[tuple[float, ...], ...] = ()


@dataclass(frozen=True, kw_only=True)
class PolicyBatch:
    """One optimizer step of the actor on this rank's data replica's share of a rollout:
    ``sequences`` prompt + response (prompts of ``prompt_length`` tokens), per response token
    its ``advantages``, the old policy's ``old_logprobs`` and (with a KL term, ``kl_coef`` > 0)
    the reference's ``ref_logprobs``."""

    step: int
    prompt_length: int
    sequences: tuple[tuple[int, ...], ...]
    advantages: tuple[tuple[float, ...], ...]
    old_logprobs: tuple[tuple[float, ...], ...]
    ref_logprobs: tuple[tuple[float, ...], ...] = ()
    kl_coef: float = 0.0


@dataclass(frozen=True, kw_only=True)
class ScoreRows:
    """Teacher-forced log-probs of the response tokens of rows (prompt + response, prompts
    of ``prompt_length``) under the ``actor`` (with the entropy) or the ``reference``; the
    ``critic``'s values (the value before each response token is drawn)."""

    model: Literal["actor", "reference", "critic"]
    prompt_length: int
    sequences: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, kw_only=True)
class RowScores:
    """On loss owners (one per data replica); empty elsewhere."""

    logprobs: tuple[tuple[float, ...], ...] = ()  # per row, its response tokens'
    values: tuple[tuple[float, ...], ...] = ()  # the critic's, per row, per response token
    entropy_sum: float = 0.0  # the actor's entropy summed over the response tokens
    tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class PolicyResult:
    """Every rank its time; loss owners (one per data replica) the replica's numbers."""

    step_time_s: float
    rss_mb: float = 0.0
    data_wait_s: float | None = None  # assembling this rank's micro-batches from the request
    grad_sync_s: float | None = None  # the data-parallel gradient reduction
    compute_s: float | None = None  # the rest of the update
    cuda_peak_mb: float | None = None
    rss_peak_mb: float | None = None
    loss: float | None = None  # the clipped policy loss (token mean)
    grad_norm: float | None = None
    lr: float | None = None
    tokens: int = 0  # response tokens of this replica
    clip_frac: float | None = None
    ratio_max: float | None = None  # the largest new/old probability ratio seen
    kl_loss: float | None = None  # the KL term's token mean before its coefficient


@dataclass(frozen=True, kw_only=True)
class CriticBatch:
    """One optimizer step of the critic on this rank's data replica's share of a rollout:
    per response token its GAE ``returns`` (the targets) and the ``old_values`` the clip is
    measured from."""

    step: int
    prompt_length: int
    sequences: tuple[tuple[int, ...], ...]
    returns: tuple[tuple[float, ...], ...]
    old_values: tuple[tuple[float, ...], ...]


@dataclass(frozen=True, kw_only=True)
class CriticResult:
    """Every rank its time; loss owners the replica's numbers."""

    step_time_s: float
    rss_mb: float = 0.0
    data_wait_s: float | None = None
    grad_sync_s: float | None = None
    compute_s: float | None = None
    cuda_peak_mb: float | None = None
    rss_peak_mb: float | None = None
    value_loss: float | None = None  # the clipped value loss (token mean)
    value_clip_frac: float | None = None  # fraction of tokens where the clipped term was taken
    grad_norm: float | None = None
    lr: float | None = None


GEN_PROMPTS = Method("gen_prompts", Prompts, PromptSet, collect=Collect.FIRST)  # rank 0's shard
GEN_SLICES = Method("gen_slices", NoArgs, HeldSlices)
SYNC_WEIGHTS = Method("sync_weights", SyncWeights, Synced, dispatch=Dispatch.EACH)  # each rank its pieces
GENERATE = Method("generate", Generate, Generated, dispatch=Dispatch.REPLICAS, collect=Collect.OWNERS)
BRIDGE = Method("bridge", Bridge, None)
PROBE_BATCH = Method("probe_batch", Probe, LogProbs, collect=Collect.OWNERS)  # replica 0's owner answers
SCORE = Method("score", LogProbs, LogProbs, dispatch=Dispatch.REPLICAS, collect=Collect.OWNERS)
POLICY_STEP = Method("policy_step", PolicyBatch, PolicyResult, dispatch=Dispatch.REPLICAS)
SCORE_ROWS = Method("score_rows", ScoreRows, RowScores, dispatch=Dispatch.REPLICAS, collect=Collect.OWNERS)
CRITIC_STEP = Method("critic_step", CriticBatch, CriticResult, dispatch=Dispatch.REPLICAS)
CRITIC_INIT = Method("critic_init", NoArgs, None)  # the critic's transformer := the actor's
