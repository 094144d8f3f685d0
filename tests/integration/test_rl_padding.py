"""Left-padded RL prompts: a prompt's numbers do not depend on its padding or its batch.

Real Megatron-core ranks (tests/integration/gpt_harness.py) of a PPO run (actor, critic and a
colocated generator). Prompts of 1 to 8 tokens, left-padded to 8 with a pad id used nowhere
else, go through the real calls with their pad counts: GENERATE (greedy and sampled, KV
cache), SCORE_ROWS (the actor's log-probs and entropy, the critic's values) and POLICY_STEP
(the gradient). The reference for each prompt is the same prompt alone, unpadded, through
the same calls: fp32, the same arithmetic but for sums over more (exactly zero) attention
weights, hence 1e-5 and not bit for bit. The same batch sent without its pad counts (the
pads seen, as before) differs: the check can fail.

Layouts: tp1 (learned positions), and a pp2 trainer with a tp2 generator on two ranks
(RoPE: Megatron rotates by the index in the row, which attention sees only as the distance
between query and key, so a shifted row scores the same).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from core.flows import calls as gen_calls
from core.wire import rl_calls
from tests.helpers import as_rows, floats, ints
from tests.integration.gpt_harness import RankGroup, gpt_config

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]
P, PAD = 8, 127  # the padded prompt length; the pad id (no prompt or response holds it)
_rng = np.random.default_rng(5)
REAL = tuple(tuple(int(t) for t in _rng.integers(0, 120, n)) for n in (3, 8, 5, 1))
RESPONSES = tuple(tuple(int(t) for t in _rng.integers(0, 120, n)) for n in (6, 8, 3, 7))
PADS = tuple(P - len(r) for r in REAL)
PADDED = tuple((PAD,) * pad + r for pad, r in zip(PADS, REAL, strict=True))
TOL = 1e-5


def _config(world_size: int, *, pp: int, gen_tp: int, position: str) -> dict[str, Any]:
    cfg = gpt_config(pp=pp, world_size=world_size, generator={"enabled": True, "tp": gen_tp},
                     model={"position_embedding": position},
                     rl={"prompt_length": P, "max_response_length": 8, "lr": 1e-3})
    cfg["program"] = "ppo"
    return cfg


@pytest.fixture(scope="module", params=[(1, 1, 1, "learned"), (2, 2, 2, "rope")],
                ids=["tp1-learned", "pp2-trainer-tp2-generator-rope"])
def group(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    world, pp, gen_tp, position = request.param
    with RankGroup(_config(world, pp=pp, gen_tp=gen_tp, position=position), world_size=world,
                   run_dir=tmp_path_factory.mktemp("pad")) as g:
        g.setup()
        yield g


def _generate(g: RankGroup, prompts: tuple[tuple[int, ...], ...], **kw: Any) -> dict[str, Any]:
    req = gen_calls.GENERATE.encode_request(gen_calls.Generate(prompts=ints(prompts), max_new_tokens=8, **kw))
    (answer,) = [r for r in map(as_rows, g.call("generate", **req)) if r.get("tokens")]  # one replica
    return answer


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_k": 50, "top_p": 0.95}],
                         ids=["greedy", "sampled"])
def test_a_left_padded_prompt_generates_what_it_generates_alone(group: RankGroup, sampling: dict[str, Any]) -> None:
    batch = _generate(group, PADDED, pads=PADS, seed=3, **sampling)
    for i, real in enumerate(REAL):
        alone = _generate(group, (real,), seed=3, indices=(i,), **sampling)
        assert batch["tokens"][i] == alone["tokens"][0], f"prompt {i} ({PADS[i]} pads)"
        gap = np.abs(np.subtract(batch["logprobs"][i], alone["logprobs"][0])).max()
        assert gap <= TOL, (i, gap)
    seen = _generate(group, PADDED, seed=3, **sampling)  # the pads not masked: another distribution
    gaps = [np.abs(np.subtract(seen["logprobs"][i], batch["logprobs"][i])).max() for i in range(len(REAL)) if PADS[i]]
    assert min(gaps) > 1e-3, gaps


def _score(g: RankGroup, model: str, prompt_length: int, rows: tuple[tuple[int, ...], ...],
           pads: tuple[int, ...] = ()) -> dict[str, Any]:
    req = rl_calls.SCORE_ROWS.encode_request(rl_calls.ScoreRows(model=model,  # type: ignore[arg-type]
                                                                prompt_length=prompt_length, sequences=ints(rows), pads=pads))
    (answer,) = [r for r in map(as_rows, g.call("score_rows", **req)) if r.get("tokens")]  # the loss owner
    return answer


@pytest.mark.parametrize("model", ["actor", "critic"])
def test_a_left_padded_row_scores_as_the_row_alone(group: RankGroup, model: str) -> None:
    key = "values" if model == "critic" else "logprobs"
    rows = tuple(p + r for p, r in zip(PADDED, RESPONSES, strict=True))
    batch = _score(group, model, P, rows, PADS)
    entropy = 0.0
    for i, (real, response) in enumerate(zip(REAL, RESPONSES, strict=True)):
        alone = _score(group, model, len(real), (real + response,))
        assert len(batch[key][i]) == len(response)
        gap = np.abs(np.subtract(batch[key][i], alone[key][0])).max()
        assert gap <= TOL, (model, i, gap)
        entropy += alone.get("entropy_sum", 0.0)
    assert abs(batch.get("entropy_sum", 0.0) - entropy) <= TOL * sum(map(len, RESPONSES))
    seen = _score(group, model, P, rows)  # the pads not masked
    assert max(np.abs(np.subtract(seen[key][i], batch[key][i])).max() for i in range(len(REAL)) if PADS[i]) > 1e-3


# --- the update: gradients of a padded row ------------------------------------------------------
def _snapshot(task: Any) -> None:
    task.__dict__["_saved"] = [p.detach().clone() for chunk in task.role("actor").chunks for p in chunk.parameters()]


def _grads_and_restore(task: Any) -> dict[str, np.ndarray]:
    """This rank's gradients of the last POLICY_STEP (Megatron's main grads, by name); the
    weights back to the snapshot (the update is undone, its gradient kept)."""
    import torch

    actor = task.role("actor")
    grads = {}
    with torch.no_grad():
        params = [(n, p) for chunk in actor.chunks for n, p in chunk.named_parameters()]
        for (name, p), saved in zip(params, task.__dict__["_saved"], strict=True):
            grads[name] = p.main_grad.detach().float().numpy().copy()
            p.copy_(saved)
    actor.optimizer.reload_model_params()
    return grads


def _policy_step(g: RankGroup, prompt_length: int, row: tuple[int, ...], pads: tuple[int, ...],
                 old: tuple[float, ...]) -> list[dict[str, np.ndarray]]:
    g.apply(_snapshot)
    n = len(old)
    req = rl_calls.POLICY_STEP.encode_request(rl_calls.PolicyBatch(
        step=0, agg=rl_calls.LossAgg(tokens=n, rows=1, horizon=8), prompt_length=prompt_length,
        sequences=ints([row]), advantages=floats([np.linspace(-1, 1, n)]),
        old_logprobs=floats([tuple(x - 0.1 for x in old)]), pads=pads))  # ratio e^0.1: inside the clip
    g.call("policy_step", **req)
    return g.apply(_grads_and_restore)


def test_a_padded_rows_policy_gradient_is_the_rows_alone_and_its_pads_get_none(group: RankGroup) -> None:
    i = 0  # three real prompt tokens behind five pads
    real, response = REAL[i], RESPONSES[i]
    old = tuple(_score(group, "actor", len(real), (real + response,))["logprobs"][0])
    padded = _policy_step(group, P, PADDED[i] + response, (PADS[i],), old)
    alone = _policy_step(group, len(real), real + response, (), old)
    for rank, (mine, ref) in enumerate(zip(padded, alone, strict=True)):
        for name, grad in mine.items():
            scale = max(float(np.abs(ref[name]).max()), 1e-3)
            assert np.abs(grad - ref[name]).max() <= TOL * scale, (rank, name)
            if name.endswith("word_embeddings.weight"):  # the pad id is only ever a pad: no gradient reaches it
                assert not grad[PAD].any() and grad[list(real)].any(), rank
