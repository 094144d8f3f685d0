"""Validation answers held-out prompts in chunks of a training rollout's size: a set larger
than one chunk is asked chunk by chunk, each with a seed of its own keyed by the step, and
its responses come back in prompt order. The generator group is faked at its boundary (the
GENERATE calls to the workers): the controller's side is what this checks."""
from __future__ import annotations

from typing import Any

from core.config import run as config
from core.controller.generation import Responses
from core.controller.validation import Validation
from core.rl.tasks import Asked
from core.wire.ragged import FLOATS, TOKENS, Ragged


class _Generator:
    """Answers each prompt with its own first token twice; records the requests."""

    version = 7

    def __init__(self) -> None:
        self.asked: list[Any] = []

    def rollout(self, req: Any) -> Responses:
        self.asked.append(req)
        rows = [(int(p[0]), int(p[0])) for p in req.prompts.rows()]
        return Responses(Ragged.of(rows, TOKENS), Ragged.of([(-0.5, -0.25)] * len(rows), FLOATS))


def test_a_held_out_set_larger_than_a_rollout_is_answered_chunk_by_chunk() -> None:
    cfg = config.load("experiments/grpo_tiny.yaml", ["rl.prompts_per_step=1", "rl.n=2", "trainer.n_gpus_per_node=1",
                                                           "training.micro_batch_size=2", "training.global_batch_size=2"])  # chunks of 2
    held = [Asked(tokens=(i, 1, 2, 3), meta={}) for i in range(5)]
    gen = _Generator()
    val = Validation(cfg, gen, held, score=lambda asked, responses: [0.0] * len(asked),  # type: ignore[arg-type]
                     text=lambda tokens: "", stop=())
    for done in (7, 7):  # the same step twice: the same seeds
        out = val._answer(done, greedy=False)
        assert [tokens for tokens, _ in out] == [(i, i) for i in range(5)]
    sizes = [len(r.prompts) for r in gen.asked]
    assert sizes == [2, 2, 1, 2, 2, 1]
    seeds = [r.seed for r in gen.asked]
    assert seeds[:3] == seeds[3:] and len(set(seeds[:3])) == 3
    val._answer(8, greedy=False)
    assert not set(r.seed for r in gen.asked[6:]) & set(seeds)  # another step, other seeds
