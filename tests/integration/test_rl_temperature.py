"""Log-probs at the sampling temperature: rollout, old policy, entropy and update agree.

Real Megatron-core ranks (tests/integration/gpt_harness.py) of a GRPO run at
``rl.temperature`` 0.7 with top-k and top-p, its generator colocated and synced from the
actor as the controller syncs it. The reference is a plain torch computation on the actor's
full logits (one forward, the vocabulary gathered, in float64): log_softmax(logits / 0.7) of
each response token and the entropy of softmax(logits / 0.7), untruncated.

- GENERATE's per-token log-probs are that reference's (and not T = 1's: the check can
  fail); greedy ones are T = 1's.
- SCORE_ROWS (the old policy) gives the same log-probs and the same entropy.
- POLICY_STEP with those as the old log-probs: the first epoch's ratio is exactly 1 and
  nothing is clipped (the update's log-probs are score_rows' arithmetic).
- ``policy.logprobs_at`` (their one computation, in chunks of positions on this rank's
  vocabulary part) has plain torch's values and gradient, bit for bit the unchunked form's.

Layouts: tp1 (generator tp1), and an actor in tp2 (its vocabulary split: the entropy and
log-probs are vocab-parallel) with a generator in tp1 on two replicas.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from core.flows import calls as gen_calls
from core.flows import reshard
from core.wire import rl_calls
from core.wire.contract import NO_ARGS
from tests.helpers import as_rows, floats, ints
from tests.integration.gpt_harness import RankGroup, gpt_config

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]
T, TOP_K, TOP_P = 0.7, 20, 0.9
P, NEW = 4, 8  # prompt length, new tokens
_rng = np.random.default_rng(7)
PROMPTS = tuple(tuple(int(t) for t in _rng.integers(0, 128, P)) for _ in range(4))
TOL = 1e-5


@pytest.fixture(scope="module", params=[(1, 1), (2, 2)], ids=["tp1", "tp2-actor-tp1-generator"])
def group(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    world, tp = request.param
    cfg = gpt_config(tp=tp, world_size=world, generator={"enabled": True, "tp": 1},
                     rl={"prompt_length": P, "max_response_length": NEW, "temperature": T, "top_k": TOP_K,
                         "top_p": TOP_P, "lr": 1e-3, "kl": {"coef": 0}})
    cfg["program"] = "grpo"
    with RankGroup(cfg, world_size=world, run_dir=tmp_path_factory.mktemp("temp")) as g:
        g.setup()
        yield g


def _sync(g: RankGroup) -> None:
    """The actor's weights into the generator, as the controller syncs them."""
    held = [gen_calls.GEN_SLICES.decode_result(h)
            for h in g.call("gen_slices", **gen_calls.GEN_SLICES.encode_request(NO_ARGS))]
    pieces = reshard.plan({r: h.sources for r, h in enumerate(held)}, {r: h.targets for r, h in enumerate(held)},
                          bucket_bytes=1 << 20)
    g.call_each("sync_weights", [gen_calls.SYNC_WEIGHTS.encode_request(gen_calls.SyncWeights(
        pieces=tuple(reshard.for_rank(pieces, r)), version=0)) for r in range(g.world_size)])


def _rollout(g: RankGroup, temperature: float) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """Rows (prompt + response) and the rollout's per-token log-probs, from the synced generator."""
    _sync(g)
    req = gen_calls.GENERATE.encode_request(gen_calls.Generate(
        prompts=ints(PROMPTS), max_new_tokens=NEW, temperature=temperature, top_k=TOP_K, top_p=TOP_P, seed=11))
    answer = next(r for r in map(as_rows, g.call("generate", **req)) if r.get("tokens"))  # every replica answers alike
    rows = [p + tuple(t) for p, t in zip(PROMPTS, answer["tokens"], strict=True)]
    return rows, np.asarray(answer["logprobs"], dtype=np.float64)


def _plain(task: Any, rows: list[tuple[int, ...]], temperature: float) -> dict[str, Any]:
    """Plain torch on the actor's full logits: each response token's log_softmax(logits / T)
    and each response position's entropy of softmax(logits / T), in float64."""
    import torch

    gpt = task.role("actor").gpt
    seq = torch.tensor(rows, dtype=torch.long)
    tokens, labels = seq[:, :-1], seq[:, 1:]
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    gpt.eval()
    with torch.no_grad():
        logits = gpt(tokens, positions, None, runtime_gather_output=True).double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return {"logp": logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)[:, P - 1:].numpy(),
            "entropy_sum": float(entropy[:, P - 1:].sum())}


def _score(g: RankGroup, rows: list[tuple[int, ...]]) -> dict[str, Any]:
    req = rl_calls.SCORE_ROWS.encode_request(rl_calls.ScoreRows(model="actor", prompt_length=P,
                                                                sequences=ints(rows)))
    return next(r for r in map(as_rows, g.call("score_rows", **req)) if r.get("tokens"))  # the loss owner


def test_the_rollouts_log_probs_are_log_softmax_of_the_logits_over_the_temperature(group: RankGroup) -> None:
    rows, rollout = _rollout(group, T)
    plain = group.apply(_plain, rows=rows, temperature=T)[0]["logp"]
    assert rollout.shape == plain.shape == (len(PROMPTS), NEW)
    assert np.abs(rollout - plain).max() <= TOL
    at_one = group.apply(_plain, rows=rows, temperature=1.0)[0]["logp"]
    assert np.abs(rollout - at_one).max() > 1e-2  # T = 1 is another distribution: the check can fail
    rows, greedy = _rollout(group, 0.0)  # greedy: the log-probs of the untempered distribution
    assert np.abs(greedy - group.apply(_plain, rows=rows, temperature=1.0)[0]["logp"]).max() <= TOL


def test_the_old_policys_log_probs_and_entropy_are_at_the_temperature(group: RankGroup) -> None:
    rows, rollout = _rollout(group, T)
    plain = group.apply(_plain, rows=rows, temperature=T)[0]
    scored = _score(group, rows)
    old = np.asarray(scored["logprobs"], dtype=np.float64)
    assert np.abs(old - plain["logp"]).max() <= TOL and np.abs(old - rollout).max() <= TOL
    assert scored["tokens"] == len(PROMPTS) * NEW
    assert abs(scored["entropy_sum"] - plain["entropy_sum"]) <= TOL * scored["tokens"]
    at_one = group.apply(_plain, rows=rows, temperature=1.0)[0]["entropy_sum"]
    assert abs(scored["entropy_sum"] - at_one) > 1e-2 * scored["tokens"]  # the check can fail


def test_the_first_epochs_ratio_is_exactly_one(group: RankGroup) -> None:
    rows, _ = _rollout(group, T)
    old = _score(group, rows)["logprobs"]
    adv = tuple(tuple(float(a) for a in _rng.normal(size=NEW)) for _ in rows)
    req = rl_calls.POLICY_STEP.encode_request(rl_calls.PolicyBatch(
        step=0, agg=rl_calls.LossAgg(tokens=len(rows) * NEW, rows=len(rows), horizon=NEW), prompt_length=P,
        sequences=ints(rows), advantages=floats(adv), old_logprobs=floats(old)))
    owners = group.loss_owner_results(group.call("policy_step", **req))
    assert owners and all(o["ratio_max"] == 1.0 and o["clip_frac"] == 0.0 for o in owners), owners
    # A second epoch on the same old log-probs moves off 1: the ratio is measured, not assumed.
    later = group.loss_owner_results(group.call("policy_step", **req))
    assert all(o["ratio_max"] > 1.0 for o in later), later


def _logprobs_at_against_autograd(task: Any, temperature: float, chunk: int) -> tuple[float, float, float, bool]:
    """This rank's part of random logits through ``policy.logprobs_at`` with the entropy,
    ``chunk`` positions at a time, and the gradient of a weighted sum of both; (the largest
    log-prob gap, entropy gap, gradient gap) to plain torch autograd of log_softmax(logits /
    T) and its entropy over the whole vocabulary, and whether values and gradient are bit
    for bit those of the unchunked form (Megatron's vocab-parallel cross entropy and
    ``rl_loss.vocab_parallel_entropy`` on the whole tensor)."""
    import torch
    from megatron.core import parallel_state, tensor_parallel

    from core.model.gpt import rl_loss
    from core.model.gpt.policy import logprobs_at

    gen = torch.Generator().manual_seed(3)
    full = 3 * torch.randn(2, 5, 128, generator=gen)
    labels = torch.randint(0, 128, (2, 5), generator=gen)
    w_logp, w_ent = torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)
    rank, tp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    part = full.chunk(tp, dim=-1)[rank].clone().requires_grad_()
    logp, ent = logprobs_at(part * 1, labels, temperature, entropy=True, chunk=chunk)  # * 1: like a model's output
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    whole = full.chunk(tp, dim=-1)[rank].clone().requires_grad_()
    scaled = whole.float() / temperature
    old_ent = rl_loss.vocab_parallel_entropy(scaled, parallel_state.get_tensor_model_parallel_group())
    old = -tensor_parallel.vocab_parallel_cross_entropy(scaled, labels)
    ((old * w_logp).sum() + (old_ent * w_ent).sum()).backward()
    same = torch.equal(logp, old) and torch.equal(ent, old_ent) and torch.equal(part.grad, whole.grad)
    plain = full.double().requires_grad_()
    logp_all = torch.log_softmax(plain / temperature, dim=-1)
    ref = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp_all.exp() * logp_all).sum(dim=-1)
    ((ref * w_logp).sum() + (ref_ent * w_ent).sum()).backward()
    return (float((logp - ref).abs().max()), float((ent - ref_ent).abs().max()),
            float((part.grad - plain.grad.chunk(tp, dim=-1)[rank]).abs().max()), same)


@pytest.mark.parametrize("temperature", [T, 1.0])
def test_logprobs_at_has_plain_torchs_values_and_gradient(group: RankGroup, temperature: float) -> None:
    """The update's log-probs and entropy bonus: values and gradient (each rank its own
    part), in one chunk and in chunks of 3 positions, bit for bit the unchunked form's."""
    for chunk in (1024, 3):
        for logp_gap, ent_gap, grad_gap, same in group.apply(_logprobs_at_against_autograd, temperature=temperature,
                                                             chunk=chunk):
            assert logp_gap <= 1e-5 and ent_gap <= 1e-5 and grad_gap <= 1e-6, (chunk, logp_gap, ent_gap, grad_gap)
            assert same, chunk
