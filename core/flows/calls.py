"""The generator's calls: what the controller asks of a generator group (and its trainer).

    GEN_SLICES    NoArgs      → HeldSlices   the trainer slices this rank holds, the generator slices it needs
    SYNC_WEIGHTS  SyncWeights → Synced       run this rank's pieces of a weight-sync plan; now at ``version``
                                             (``keep``: the sources' host copy kept; ``from_kept``: sent from it)
    PROBE_BATCH   Probe       → LogProbs     the trainer's probe batch and its log-probs (one rank answers)
    SCORE         LogProbs    → LogProbs     the generator's log-probs of given tokens (teacher-forced)
    GENERATE      Generate    → Generated    continue the prompts of this rank's replica
    GEN_PROMPTS   Prompts     → PromptSet    prompts from the held-out data (asked of rank 0)
    STAGE         Stage       → HeldSlices   ``generator.engine: vllm``: hold these tensors whole (a replica's
                                             first rank; the others hold none): the syncs' targets

Split placement only (the generator on workers of its own, ranks after the trainer's):

    BRIDGE        Bridge      → None         join the process group of every worker that weight syncs run on

A plan is made by the controller (``core.flows.reshard.plan``) from every rank's
``HeldSlices`` and sent to each rank as its own pieces. The RL programs' calls to the
trainer (its updates and scoring passes) are ``core.wire.rl_calls``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from core.checkpoint.spec import TensorSlice
from core.errors import ProtocolError
from core.flows.reshard import Piece
from core.wire.contract import Collect, Dispatch, Method, NoArgs
from core.wire.ragged import FLOATS, TOKENS, Ragged, matches


@dataclass(frozen=True, kw_only=True)
class HeldSlices:
    sources: tuple[TensorSlice, ...] = ()  # trainer slices this rank holds (every replica's: copies are equal)
    targets: tuple[TensorSlice, ...] = ()  # generator slices this rank holds (all of them)


@dataclass(frozen=True, kw_only=True)
class SyncWeights:
    pieces: tuple[Piece, ...]  # this rank's, in plan order
    version: int  # the policy version the generator holds afterwards (the trainer's step)
    # rl.max_staleness > 0: the trainer's ranks keep a host copy of what they send (``keep``), the
    # policy the rollouts in flight come from, so that a restarted generator is synced to that
    # same policy (``from_kept``) while the trainer's weights have moved on
    keep: bool = False
    from_kept: bool = False


@dataclass(frozen=True, kw_only=True)
class Synced:
    version: int
    bytes_received: int  # from other ranks (local copies not counted)
    seconds: float
    bytes_sent: int = 0  # to other ranks
    dtype: str = ""  # the generator's weights' dtype on this rank ("" where it holds none)


@dataclass(frozen=True, kw_only=True)
class Probe:
    step: int  # the probe batch is the held-out batch of this step
    next_token: bool = False  # each row's own next tokens only (s - 1 per row): what a vLLM engine scores


@dataclass(frozen=True, kw_only=True)
class Generate:
    prompts: Ragged  # int32 rows of one length (left-padded: ``pads``)
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    eos: tuple[int, ...] = ()  # stop ids: a response ends at the first of them (core.model.gpt.generate)
    seed: int = 0  # with a prompt's index: the seed of the generator it samples from
    indices: tuple[int, ...] = ()  # each prompt's index in the run's prompt set (default 0, 1, ...)
    pads: tuple[int, ...] = ()  # each prompt's leading pad tokens, masked out (default: none)
    step: int = -1  # an RL step's rollout: its step (logs, BATON_FAULTS' generate faults); -1 otherwise

    def __post_init__(self) -> None:
        self.prompts.expect(TOKENS, "Generate.prompts")
        for name, per_row in (("indices", self.indices), ("pads", self.pads)):
            if per_row and len(per_row) != len(self.prompts):
                raise ProtocolError(f"Generate.{name}: {len(per_row)} for {len(self.prompts)} prompts")


@dataclass(frozen=True, kw_only=True)
class Generated:
    """On the first tensor-parallel rank of each generator replica; empty elsewhere."""

    replica: int = -1
    version: int = -1  # the policy version that generated
    tokens: Ragged = field(default_factory=lambda: Ragged.empty(TOKENS))  # int32: per prompt, its response
    logprobs: Ragged = field(default_factory=Ragged.empty)  # float32, per token: at the sampling temperature,
    #                                                         untruncated (greedy: 1)
    kv_cache_bytes: int = 0  # this rank's part of the largest KV cache the call allocated (0: a vLLM engine's)

    def __post_init__(self) -> None:
        self.tokens.expect(TOKENS, "Generated.tokens")
        self.logprobs.expect(FLOATS, "Generated.logprobs")
        matches(self.logprobs, self.tokens.lengths, "Generated.logprobs", "tokens")


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
class Stage:
    tensors: tuple[TensorSlice, ...] = ()  # whole global tensors (offset 0, the global shape)


GEN_PROMPTS = Method("gen_prompts", Prompts, PromptSet, collect=Collect.FIRST)  # rank 0's shard
GEN_SLICES = Method("gen_slices", NoArgs, HeldSlices)
STAGE = Method("stage", Stage, HeldSlices)
SYNC_WEIGHTS = Method("sync_weights", SyncWeights, Synced, dispatch=Dispatch.EACH)  # each rank its pieces
GENERATE = Method("generate", Generate, Generated, dispatch=Dispatch.REPLICAS, collect=Collect.OWNERS)
BRIDGE = Method("bridge", Bridge, None)
PROBE_BATCH = Method("probe_batch", Probe, LogProbs, collect=Collect.OWNERS)  # replica 0's owner answers
SCORE = Method("score", LogProbs, LogProbs, dispatch=Dispatch.REPLICAS, collect=Collect.OWNERS)
