"""Token-budget micro-batches of different shapes through a pipeline (pp 2).

Real Megatron-core ranks (tests/integration/gpt_harness.py) of a GRPO run on two pipeline
stages score and update eight rows of 5 to 24 tokens with ``rl.max_tokens_per_micro_batch``
(micro-batches of 1 to 3 rows, each padded to its own longest row: the stages exchange each
activation's shape, Megatron's ``variable_seq_lengths``):

- SCORE_ROWS' log-probs and entropy are plain torch's on the model's logits of each row
  alone, unpadded (the reference: the pipeline's whole-vocabulary logits of one row, its
  log_softmax in float64);
- POLICY_STEP's gradient on every stage equals the one taken a row per micro-batch (1e-6 of
  its scale), and its first epoch's ratio, on the old log-probs scored with the same budget,
  is exactly 1.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from core.wire import rl_calls
from tests.helpers import as_rows, floats, ints
from tests.integration.gpt_harness import RankGroup, gpt_config, logits_on_rank

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]
P, HORIZON, T = 4, 24, 0.8
LENGTHS = (1, 7, 3, 12, 2, 20, 5, 9)  # response tokens per row
BUDGET = 24
_rng = np.random.default_rng(5)
SEQUENCES = tuple(tuple(int(t) for t in _rng.integers(0, 128, P + n)) for n in LENGTHS)
ADV = tuple(tuple(float(x) for x in _rng.normal(0, 1.0, n)) for n in LENGTHS)


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cfg = gpt_config(pp=2, world_size=2, generator={"enabled": True},
                     training={"global_batch_size": 16, "micro_batch_size": 1, "grad_clip": 1e6},
                     rl={"prompt_length": P, "max_response_length": HORIZON, "lr": 1e-3, "temperature": T,
                         "entropy_coef": 0.05, "kl": {"coef": 0}})
    cfg["program"] = "grpo"
    with RankGroup(cfg, world_size=2, run_dir=tmp_path_factory.mktemp("pp2")) as g:
        g.setup()
        yield g


def _set_budget(task: Any, budget: int) -> None:
    rank = task.rank
    rank.cfg = dataclasses.replace(rank.cfg, rl=dataclasses.replace(rank.cfg.rl, max_tokens_per_micro_batch=budget))
    rank.step = dataclasses.replace(rank.step, cfg=rank.cfg)


def _grads_and_restore(task: Any, saved: bool) -> list[np.ndarray]:
    """The actor's main grads of its last update; its weights back to the snapshot (taken
    first, with ``saved`` False)."""
    import torch

    role = task.role("actor")
    params = [p for c in role.chunks for p in c.parameters()]
    if not saved:
        task.__dict__["_saved"] = [p.detach().clone() for p in params]
        return []
    grads = [p.main_grad.detach().float().numpy().copy() for p in params]
    with torch.no_grad():
        for p, s in zip(params, task.__dict__["_saved"], strict=True):
            p.copy_(s)
    role.optimizer.reload_model_params()
    return grads


def _score(g: RankGroup) -> dict[str, Any]:
    req = rl_calls.SCORE_ROWS.encode_request(rl_calls.ScoreRows(model="actor", prompt_length=P, sequences=ints(SEQUENCES)))
    return as_rows(next(r for r in g.call("score_rows", **req) if r.get("tokens")))  # the loss owner


def test_scoring_with_a_token_budget_through_two_stages_is_each_row_alone(group: RankGroup) -> None:
    group.apply(_set_budget, budget=BUDGET)
    scored = _score(group)
    entropy = 0.0
    for i, row in enumerate(SEQUENCES):
        logits = next(x for x in group.apply(logits_on_rank, tokens=[list(row[:-1])]) if x is not None)
        z = logits[0].astype(np.float64) / T
        logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
        want = logp[np.arange(len(row) - 1), list(row[1:])][P - 1:]
        assert np.abs(np.asarray(scored["logprobs"][i]) - want).max() <= 1e-5, i
        entropy += float(-(np.exp(logp) * logp).sum(-1)[P - 1:].sum())
    assert scored["tokens"] == sum(LENGTHS)
    assert abs(scored["entropy_sum"] - entropy) <= 1e-5 * sum(LENGTHS)


def _step(g: RankGroup, old: Any) -> dict[str, Any]:
    agg = rl_calls.LossAgg(tokens=sum(LENGTHS), rows=len(LENGTHS), horizon=HORIZON)
    req = rl_calls.POLICY_STEP.encode_request(rl_calls.PolicyBatch(
        step=0, agg=agg, prompt_length=P, sequences=ints(SEQUENCES), advantages=floats(ADV), old_logprobs=floats(old)))
    return next(r for r in g.call("policy_step", **req) if "loss" in r)


def test_an_update_with_a_token_budget_through_two_stages_has_the_row_by_row_gradient(group: RankGroup) -> None:
    group.apply(_set_budget, budget=BUDGET)
    old = _score(group)["logprobs"]
    group.apply(_grads_and_restore, saved=False)
    by_tokens = _step(group, old)
    budget_grads = group.apply(_grads_and_restore, saved=True)
    assert by_tokens["ratio_max"] == 1.0 and by_tokens["clip_frac"] == 0.0, by_tokens
    group.apply(_set_budget, budget=0)  # training.micro_batch_size 1: a row per micro-batch
    by_rows = _step(group, old)
    row_grads = group.apply(_grads_and_restore, saved=True)
    assert abs(by_rows["loss"] - by_tokens["loss"]) <= 1e-6
    for stage, (mine, theirs) in enumerate(zip(budget_grads, row_grads, strict=True)):
        scale = max(float(np.abs(r).max()) for r in theirs)
        assert scale > 1e-4, stage
        assert max(float(np.abs(a - b).max()) for a, b in zip(mine, theirs, strict=True)) <= 1e-6 * scale, stage
