"""The RL updates' loss is aggregated over the whole mini-batch: its gradient is that of one
loss over every row, whatever the micro-batches or the data-parallel replicas.

Real Megatron-core ranks (tests/integration/gpt_harness.py) of a PPO run (actor and critic)
take POLICY_STEP and CRITIC_STEP on eight rows whose responses have 1 to 20 tokens, at
micro-batch sizes 1, 2 and 4 and with a token budget (``rl.max_tokens_per_micro_batch``:
rows grouped by length, each micro-batch padded to its own longest row), on one rank (dp 1) and on two (dp 2: each replica every other
row, as the controller splits them), for each ``rl.loss_agg_mode``. The reference is
written out here in plain torch, verl's formulas over the whole batch at once: the model's
logits of all eight rows in one forward (no schedule, no DDP), log-softmax, the clipped
policy objective with the log-ratio clamped, k3 KL and the entropy bonus (or the clipped
value loss), each aggregated by its mode over all rows, and ``torch.autograd.grad`` of
that. Megatron's gradient (every parameter's ``main_grad`` after the step, reduced over the
replicas) equals it within 1e-6 of the gradient's scale; the reported loss, KL and clip
fraction equal the reference's numbers (the KL reported as its token mean under every mode:
the adaptive KL controller reads it). Old log-probs are the current ones shifted by
noise, so some ratios leave the clip range (and the check covers the clipped branch).

A mini-batch test: the first of two optimizer steps on halves of a batch scored by the
policy itself sees every ratio exactly 1 (dropout off, the old log-probs the update's own
arithmetic), the second, after the first changed the weights, sees clipped tokens. With
dropout in the model the update still sees the scored policy (dropout off): every ratio 1.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from core.wire import rl_calls
from tests.helpers import as_rows, floats, ints
from tests.integration.gpt_harness import RankGroup, gpt_config

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]
P, HORIZON, ROWS = 4, 24, 8
LENGTHS = (1, 7, 3, 12, 2, 20, 5, 9)  # response tokens per row
BUDGET = 24  # rl.max_tokens_per_micro_batch: micro-batches of 1 to 3 rows, 5 to 23 wide
KL_COEF, ENTROPY_COEF, CLIP_LOW, CLIP_HIGH, CLIP_C, VALUE_CLIP = 0.5, 0.05, 0.2, 0.28, 3.0, 0.2
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
TOL = 1e-6
TIE = 1e-5  # the critic's clip indicator: a gap within this is a rounding tie
_rng = np.random.default_rng(11)
SEQUENCES = tuple(tuple(int(t) for t in _rng.integers(0, 128, P + n)) for n in LENGTHS)


def _noise(scale: float) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(float(x) for x in _rng.normal(0, scale, n)) for n in LENGTHS)


ADV, OLD_SHIFT, REF_SHIFT, RETURNS, VALUE_SHIFT = _noise(1.0), _noise(0.3), _noise(0.3), _noise(1.0), _noise(0.3)


def _config(world_size: int) -> dict[str, Any]:
    cfg = gpt_config(world_size=world_size, generator={"enabled": True},
                     training={"global_batch_size": 16, "micro_batch_size": 4, "grad_clip": 1e6},
                     rl={"prompt_length": P, "max_response_length": HORIZON, "lr": 1e-3, "entropy_coef": ENTROPY_COEF,
                         "clip_low": CLIP_LOW, "clip_high": CLIP_HIGH, "clip_c": CLIP_C,
                         "critic": {"value_clip": VALUE_CLIP}})
    cfg["program"] = "ppo"
    return cfg


@pytest.fixture(scope="module", params=[1, 2], ids=["dp1", "dp2"])
def group(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with RankGroup(_config(request.param), world_size=request.param, run_dir=tmp_path_factory.mktemp("agg")) as g:
        g.setup()
        yield g


# --- on the ranks --------------------------------------------------------------------------------
def _chunks(task: Any, model: str) -> list[Any]:
    return task.role(model).chunks


def _set_micro(task: Any, micro: int, budget: int = 0) -> None:
    """The updates' micro-batch size and rl.max_tokens_per_micro_batch of this rank (the
    actor's and the critic's context)."""
    from core.model.gpt import sizing

    rank = task.rank
    rank.cfg = sizing.with_micro_batch(rank.cfg, micro)
    rank.cfg = dataclasses.replace(rank.cfg, rl=dataclasses.replace(rank.cfg.rl, max_tokens_per_micro_batch=budget))
    rank.step = dataclasses.replace(rank.step, cfg=rank.cfg)
    critic = task.role("critic")
    critic.ctx = dataclasses.replace(critic.ctx, cfg=rank.cfg)


def _snapshot(task: Any) -> None:
    task.__dict__["_saved"] = {m: [p.detach().clone() for c in _chunks(task, m) for p in c.parameters()]
                               for m in ("actor", "critic")}


def _grads_and_restore(task: Any, model: str) -> list[np.ndarray]:
    """``model``'s gradients of its last update (Megatron's main grads, reduced over the
    replicas); its weights back to the snapshot."""
    import torch

    role = task.role(model)
    params = [p for c in role.chunks for p in c.parameters()]
    grads = [p.main_grad.detach().float().numpy().copy() for p in params]
    with torch.no_grad():
        for p, saved in zip(params, task.__dict__["_saved"][model], strict=True):
            p.copy_(saved)
    role.optimizer.reload_model_params()
    return grads


def _batch_tensors(rows: tuple[tuple[int, ...], ...], seq: int) -> tuple[Any, Any, Any]:
    import torch

    tokens = torch.zeros(len(rows), seq, dtype=torch.long)
    labels = torch.zeros(len(rows), seq, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, :len(row) - 1], labels[i, :len(row) - 1] = torch.tensor(row[:-1]), torch.tensor(row[1:])
    return tokens, labels, torch.arange(seq).unsqueeze(0).expand(len(rows), seq)


def _aggregate(per_row: list[Any], mode: str) -> Any:
    """verl's agg_loss over every row at once (``per_row``: each row's per-token terms)."""
    import torch

    if mode == "token-mean":
        return torch.cat(per_row).sum() / sum(len(r) for r in per_row)
    if mode == "seq-mean-token-mean":
        return torch.stack([r.mean() for r in per_row]).mean()
    return torch.stack([r.sum() for r in per_row]).sum() / (len(per_row) * HORIZON)


def _reference(task: Any, model: str, mode: str, old: Any = None, ref: Any = None) -> dict[str, Any]:
    """The plain-torch loss over the whole batch and its gradient, on this rank's full copy
    of ``model`` (tp 1, pp 1): {"grads": per parameter, and the loss's parts}."""
    import torch

    from core.model.gpt.model import unwrap

    chunk = _chunks(task, model)[0]
    gpt = unwrap(chunk)
    tokens, labels, positions = _batch_tensors(SEQUENCES, task.cfg.model.seq_length)
    out = gpt(tokens, positions, None).float()  # [b, s, v] logits, or [b, s, 1] values
    spans = [slice(P - 1, P - 1 + n) for n in LENGTHS]
    parts: dict[str, Any] = {}
    if model == "actor":
        logsm = torch.log_softmax(out, dim=-1)
        logp = logsm.gather(-1, labels.unsqueeze(-1))[..., 0]
        entropy = -(logsm.exp() * logsm).sum(-1)
        pg, kl, ent, clipped = [], [], [], 0.0
        for i, span in enumerate(spans):
            lp, o, r = logp[i, span], torch.tensor(old[i]), torch.tensor(ref[i])
            a = torch.tensor(ADV[i])
            ratio = torch.exp(torch.clamp(lp - o, -20, 20))
            plain, bounded = -a * ratio, -a * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
            worst = torch.maximum(plain, bounded)
            pg.append(torch.where(a < 0, torch.minimum(worst, -a * CLIP_C), worst))
            clipped += float((bounded > plain).sum())
            d = r - lp
            kl.append(torch.clamp(torch.exp(d) - d - 1, -10, 10))
            ent.append(entropy[i, span])
        parts = {"loss": _aggregate(pg, mode), "kl": _aggregate(kl, "token-mean")}  # kl: reported, a token mean
        total = parts["loss"] + KL_COEF * _aggregate(kl, mode) - ENTROPY_COEF * _aggregate(ent, mode)
        parts["clip_frac"] = clipped / sum(LENGTHS)
    else:
        vf, clipped, tied = [], 0.0, 0.0
        for i, span in enumerate(spans):
            v, o, ret = out[i, span, 0], torch.tensor(old[i]), torch.tensor(RETURNS[i])
            vc = o + torch.clamp(v - o, -VALUE_CLIP, VALUE_CLIP)
            vf.append(0.5 * torch.maximum((v - ret) ** 2, (vc - ret) ** 2))
            # Unclipped, vc is v up to rounding (o + (v - o)): which term is larger is then a
            # tie that another GEMM shape may break the other way; counted apart.
            gap = (vc - ret) ** 2 - (v - ret) ** 2
            clipped += float((gap > TIE).sum())
            tied += float((gap.abs() <= TIE).sum())
        parts = {"loss": _aggregate(vf, mode), "clip_frac": clipped / sum(LENGTHS),
                 "clip_frac_tied": (clipped + tied) / sum(LENGTHS)}
        total = parts["loss"]
    params = [p for p in chunk.parameters()]
    grads = torch.autograd.grad(total, params, allow_unused=True)
    return {"grads": [np.zeros(tuple(p.shape), np.float32) if g is None else g.numpy() for p, g in
                      zip(params, grads, strict=True)], **{k: float(v) for k, v in parts.items()}}


# --- from the test process -----------------------------------------------------------------------
def _scores(g: RankGroup, model: str, mini_batch: int = 0) -> list[tuple[float, ...]]:
    """The current model's per-token log-probs (the critic: values) of every row, in order
    (``mini_batch``: the rows of each update mini-batch, as the controller says it)."""
    dp = g.world_size
    shares = [rl_calls.SCORE_ROWS.encode_request(rl_calls.ScoreRows(
        model=model, prompt_length=P, sequences=ints(SEQUENCES[d::dp]), mini_batch=mini_batch // dp))  # type: ignore[arg-type]
        for d in range(dp)]
    answers = [as_rows(a) for a in g.call_each("score_rows", shares)]
    out: list[tuple[float, ...]] = [()] * ROWS
    for d in range(dp):
        out[d::dp] = answers[d]["values" if model == "critic" else "logprobs"]
    return out


def _shift(base: list[tuple[float, ...]], by: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(x + y for x, y in zip(b, s, strict=True)) for b, s in zip(base, by, strict=True))


def _step(g: RankGroup, model: str, mode: str, old: Any, ref: Any) -> list[dict[str, Any]]:
    dp, agg = g.world_size, rl_calls.LossAgg(mode=mode, tokens=sum(LENGTHS), rows=ROWS, horizon=HORIZON)
    if model == "actor":
        shares = [rl_calls.POLICY_STEP.encode_request(rl_calls.PolicyBatch(
            step=0, agg=agg, prompt_length=P, sequences=ints(SEQUENCES[d::dp]), advantages=floats(ADV[d::dp]),
            old_logprobs=floats(old[d::dp]), ref_logprobs=floats(ref[d::dp]), kl_coef=KL_COEF)) for d in range(dp)]
        return g.call_each("policy_step", shares)
    shares = [rl_calls.CRITIC_STEP.encode_request(rl_calls.CriticBatch(
        step=0, agg=agg, prompt_length=P, sequences=ints(SEQUENCES[d::dp]), returns=floats(RETURNS[d::dp]),
        old_values=floats(old[d::dp]))) for d in range(dp)]
    return g.call_each("critic_step", shares)


@pytest.mark.parametrize("model", ["actor", "critic"])
@pytest.mark.parametrize("mode", MODES)
def test_the_update_gradient_is_the_whole_batch_loss_gradient_at_every_micro_batch_size(
        group: RankGroup, mode: str, model: str) -> None:
    current = _scores(group, model)
    old = _shift(current, OLD_SHIFT if model == "actor" else VALUE_SHIFT)
    ref = _shift(current, REF_SHIFT) if model == "actor" else None
    reference = group.apply(_reference, model=model, mode=mode, old=old, ref=ref)
    assert reference[0]["clip_frac"] > 0.05  # the clipped branch is in the batch
    for micro, budget in ((1, 0), (2, 0), (4, 0), (4, BUDGET)):
        group.apply(_set_micro, micro=micro, budget=budget)
        group.apply(_snapshot)
        results = _step(group, model, mode, old, ref)
        grads = group.apply(_grads_and_restore, model=model)
        for rank, (mine, theirs) in enumerate(zip(grads, reference, strict=True)):
            scale = max(float(np.abs(r).max()) for r in theirs["grads"])
            assert scale > 1e-4, (rank, scale)
            gaps = [float(np.abs(a - b).max()) for a, b in zip(mine, theirs["grads"], strict=True)]
            assert max(gaps) <= TOL * scale, (micro, budget, rank, max(gaps), scale)
        owners = [r for r in results if ("value_loss" if model == "critic" else "loss") in r]
        assert len(owners) == group.world_size
        want = reference[0]
        for o in owners:
            if model == "actor":
                assert abs(o["loss"] - want["loss"]) <= TOL and abs(o["kl"] - want["kl"]) <= TOL, (micro, o)
                assert abs(o["clip_frac"] - want["clip_frac"]) <= 1e-9
            else:
                assert abs(o["value_loss"] - want["loss"]) <= TOL, (micro, o)
                assert want["clip_frac"] - 1e-9 <= o["value_clip_frac"] <= want["clip_frac_tied"] + 1e-9, (micro, o)


def _adam_steps(task: Any) -> int:
    """How many optimizer steps the actor's Adam has taken (its state's step counter)."""
    state = task.role("actor").optimizer.optimizer.state
    return max(int(s["step"]) for s in state.values()) if state else 0


def _actor_weights(task: Any) -> list[np.ndarray]:
    return [p.detach().float().numpy().copy() for c in _chunks(task, "actor") for p in c.parameters()]


def test_two_mini_batches_take_two_optimizer_steps_and_the_second_is_clipped(group: RankGroup) -> None:
    """An epoch of two mini-batches, as the controller sends it: the first step sees its
    ratios exactly 1 (nothing clipped), changes the weights; the second, taken at the new
    weights against the same old log-probs, clips (at rl.lr 1e-1 the policy moved far).
    At micro_batch_size 8 (as ``auto`` may resolve to), larger than a mini-batch's share:
    the update takes micro-batches of its mini-batch's rows, and scoring takes the same."""
    group.apply(_set_micro, micro=8)
    group.apply(_snapshot)
    dp, half = group.world_size, ROWS // 2
    old = tuple(_scores(group, "actor", mini_batch=half))
    steps_before = group.apply(_adam_steps)[0]
    weights = [group.apply(_actor_weights)[0]]
    results = []
    for part in (slice(0, half), slice(half, ROWS)):
        seqs, adv, olds = SEQUENCES[part], ADV[part], old[part]
        agg = rl_calls.LossAgg(tokens=sum(LENGTHS[part]), rows=half, horizon=HORIZON)
        shares = [rl_calls.POLICY_STEP.encode_request(rl_calls.PolicyBatch(
            step=0, agg=agg, prompt_length=P, sequences=ints(seqs[d::dp]), advantages=floats(adv[d::dp]),
            old_logprobs=floats(olds[d::dp]))) for d in range(dp)]
        group.apply(_set_lr, lr=0.1)
        results.append([r for r in group.call_each("policy_step", shares) if "loss" in r][0])
        weights.append(group.apply(_actor_weights)[0])
    group.apply(_set_lr, lr=None)
    group.apply(_grads_and_restore, model="actor")
    assert group.apply(_adam_steps)[0] == steps_before + 2
    assert all(any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
               for before, after in zip(weights, weights[1:], strict=False))  # each step changed the weights
    assert results[0]["ratio_max"] == 1.0 and results[0]["clip_frac"] == 0.0, results[0]
    assert results[1]["clip_frac"] > 0.0 and results[1]["ratio_max"] > 1.0, results[1]


def _set_lr(task: Any, lr: float | None) -> None:
    """rl.lr of this rank's updates (None: the run's)."""
    rank = task.rank
    rl = dataclasses.replace(rank.cfg.rl, lr=lr if lr is not None else 1e-3)
    rank.cfg = dataclasses.replace(rank.cfg, rl=rl)
    rank.step = dataclasses.replace(rank.step, cfg=rank.cfg)


def _weights_changed(task: Any) -> bool:
    saved = task.__dict__["_saved"]["actor"]
    return any(not np.array_equal(p.detach().numpy(), s.numpy())
               for p, s in zip((p for c in _chunks(task, "actor") for p in c.parameters()), saved, strict=True))


def test_with_dropout_the_first_epoch_sees_every_ratio_exactly_1(tmp_path: Any) -> None:
    """model.hidden_dropout and attention_dropout 0.3: the update's forward runs with dropout
    off, so the policy scored before the update (the old log-probs) is the policy the update
    sees: every ratio is exactly 1 and nothing is clipped, and the update still changes the
    weights (the gradient flows in eval mode)."""
    cfg = _config(1)
    cfg["model"] = {**cfg["model"], "hidden_dropout": 0.3, "attention_dropout": 0.3}
    with RankGroup(cfg, world_size=1, run_dir=tmp_path) as g:
        g.setup()
        old = tuple(_scores(g, "actor"))
        g.apply(_snapshot)
        agg = rl_calls.LossAgg(tokens=sum(LENGTHS), rows=ROWS, horizon=HORIZON)
        (result,) = g.call("policy_step", **rl_calls.POLICY_STEP.encode_request(rl_calls.PolicyBatch(
            step=0, agg=agg, prompt_length=P, sequences=ints(SEQUENCES), advantages=floats(ADV),
            old_logprobs=floats(old))))
        assert result["ratio_max"] == 1.0 and result["clip_frac"] == 0.0, result
        assert g.apply(_weights_changed) == [True]


def _record_micro_batches(task: Any, on: bool) -> list[list[tuple[int, ...]]]:
    """With ``on``: record each micro-batch this rank's passes take (the first input token of
    each of its rows, and its width); else stop recording. The micro-batches recorded until now."""
    from core.model.gpt import microbatch

    seen = task.__dict__.setdefault("_micro_seen", [])
    plain = task.__dict__.setdefault("_micro_plain", microbatch.batches)

    def recording(arrays: Any, groups: Any, device: Any) -> Any:
        for mb in plain(arrays, groups, device):
            seen.append((*(int(t) for t in mb["tokens"][:, 0]), -mb["tokens"].shape[1]))
            yield mb

    microbatch.batches = recording if on else plain  # type: ignore[assignment]
    out = [list(seen)]
    seen.clear()
    return out


@pytest.mark.parametrize("budget", [0, 8], ids=["rows", "tokens"])
def test_scoring_micro_batches_the_rows_the_update_micro_batches_together(group: RankGroup, budget: int) -> None:
    """At micro_batch_size 8 (as ``auto`` may resolve to: the submit check sees no number),
    larger than a mini-batch's rows, or with a token budget: each update micro-batch is one
    of scoring's, its rows and its width, so the first epoch's log-probs are computed on the
    same rows with the same shapes as the old ones (on GPU, other shapes may pick other
    kernels), and its ratio is exactly 1."""
    group.apply(_set_micro, micro=8, budget=budget)
    dp, half = group.world_size, ROWS // 2
    group.apply(_record_micro_batches, on=True)
    old = tuple(_scores(group, "actor", mini_batch=half))
    scored = group.apply(_record_micro_batches, on=True)
    group.apply(_snapshot)
    agg = rl_calls.LossAgg(tokens=sum(LENGTHS[:half]), rows=half, horizon=HORIZON)
    results = group.call_each("policy_step", [rl_calls.POLICY_STEP.encode_request(rl_calls.PolicyBatch(
        step=0, agg=agg, prompt_length=P, sequences=ints(SEQUENCES[:half][d::dp]),
        advantages=floats(ADV[:half][d::dp]), old_logprobs=floats(old[:half][d::dp]))) for d in range(dp)])
    updated = group.apply(_record_micro_batches, on=False)
    group.apply(_grads_and_restore, model="actor")
    group.apply(_set_micro, micro=8)
    for rank in range(dp):
        assert updated[rank][0] and set(updated[rank][0]) <= set(scored[rank][0]), (rank, updated, scored)
        if budget:  # by tokens: several micro-batches of different widths
            assert len(updated[rank][0]) > 1 and len({mb[-1] for mb in updated[rank][0]}) > 1, updated[rank]
        else:  # the micro-batch is the replica's whole share of the mini-batch
            assert len(updated[rank][0][0]) - 1 == half // dp
    owners = [r for r in results if "loss" in r]
    assert owners and all(o["ratio_max"] == 1.0 and o["clip_frac"] == 0.0 for o in owners), owners
