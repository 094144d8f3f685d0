"""core.rl (advantages, the KL coefficient, rewards) and core.model.gpt.rl_loss, against the
formulas written out by hand."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from core.errors import ConfigError, UserError
from core.model.gpt import rl_loss
from core.rl import advantages as adv
from core.rl import rewards
from core.wire import rl_calls


def test_grpo_normalises_each_group_by_its_own_mean_and_sample_std() -> None:
    scores, groups = [1.0, 0.0, 0.5, 0.5, 0.2], [0, 0, 1, 1, 2]
    got = adv.grpo(scores, groups)
    std0 = np.std([1.0, 0.0], ddof=1)
    assert got[0] == pytest.approx(0.5 / (std0 + 1e-6)) and got[1] == pytest.approx(-0.5 / (std0 + 1e-6))
    assert got[2] == got[3] == 0.0  # a group that all scored the same teaches nothing
    assert got[4] == pytest.approx(0.2 / (1 + 1e-6))  # a group of one: mean 0, std 1
    assert list(adv.grpo(scores, groups, norm_by_std=False)[:2]) == [0.5, -0.5]
    assert adv.per_token(np.array([2.0, -1.0]), np.array([[1, 1, 0], [1, 0, 0]])).tolist() == [[2, 2, 0], [-1, 0, 0]]
    with pytest.raises(ValueError, match="equal 1-D"):
        adv.grpo([1.0], [0, 1])


def _gae_reference(r: list[float], v: list[float], gamma: float, lam: float) -> list[float]:
    out, last = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        nxt = v[t + 1] if t + 1 < len(r) else 0.0
        last = r[t] + gamma * nxt - v[t] + gamma * lam * last
        out[t] = last
    return out


def test_gae_follows_the_recursion_and_skips_padding() -> None:
    rng = np.random.default_rng(0)
    r, v = rng.normal(size=(1, 5)), rng.normal(size=(1, 5))
    a, ret = adv.gae(r, v, np.ones((1, 5)), gamma=0.9, lam=0.8, whiten=False)
    assert a[0] == pytest.approx(_gae_reference(list(r[0]), list(v[0]), 0.9, 0.8))
    assert ret[0] == pytest.approx(a[0] + v[0])
    padded_r, padded_v = np.concatenate([r, [[7.0, 7.0]]], axis=1), np.concatenate([v, [[3.0, 3.0]]], axis=1)
    mask = np.array([[1, 1, 1, 1, 1, 0, 0]])
    pa, _ = adv.gae(padded_r, padded_v, mask, gamma=0.9, lam=0.8, whiten=False)
    assert pa[0, :5] == pytest.approx(a[0]) and list(pa[0, 5:]) == [0.0, 0.0]
    w, _ = adv.gae(padded_r, padded_v, mask, gamma=0.9, lam=0.8)
    assert w[0, :5].mean() == pytest.approx(0.0, abs=1e-12) and w[0, :5].std(ddof=1) == pytest.approx(1.0, rel=1e-6)


def test_adaptive_kl_moves_towards_its_target_at_most_20_percent_per_horizon() -> None:
    k = adv.AdaptiveKL(value=0.1, target=0.01, horizon=100)
    assert k.update(current_kl=1.0, n_samples=100) == pytest.approx(0.12)  # error clipped to +0.2
    assert k.update(current_kl=0.005, n_samples=50) == pytest.approx(0.12 * (1 - 0.2 * 0.5))  # -0.5 clipped
    fixed = adv.AdaptiveKL(value=0.1)
    assert fixed.update(current_kl=5.0, n_samples=100) == 0.1


def test_auto_kl_coef_is_the_clamped_heuristic() -> None:
    assert adv.auto_kl_coef(500_000_000) == 1e-3  # 0.02 ln 0.5 < 0: clamped
    assert adv.auto_kl_coef(7_000_000_000) == pytest.approx(0.02 * math.log(7))


def test_the_counting_reward_is_an_exact_match_of_the_continued_count() -> None:
    assert rewards.counting((5, 6, 7, 8), (9, 10, 11, 12), {}) == 1.0
    assert rewards.counting((5, 6, 7, 8), (9, 10, 12, 13), {}) == 0.0
    assert rewards.counting((5, 6, 7, 8), (1, 10, 11, 12), {}) == 0.0
    assert rewards.counting((30, 31), (0, 1), {"vocab_size": 32}) == 1.0  # counts on modulo the vocabulary
    assert rewards.counting((), (1,), {}) == 0.0


def user_reward(prompt, response, metadata) -> float:  # noqa: ANN001 - a user's function, as users write it
    if metadata.get("boom"):
        raise KeyError("answer")
    return metadata.get("value", float(len(response)))


def test_a_user_reward_is_module_function_and_its_failures_name_the_prompt() -> None:
    fn = rewards.load(f"{__name__}:user_reward")
    assert rewards.score(fn, (1, 2), (3, 4, 5), {}, index=0) == 3.0
    with pytest.raises(UserError, match=r"raised KeyError: 'answer' on prompt 7 \(\[1, 2\]\)"):
        rewards.score(fn, (1, 2), (3,), {"boom": True}, index=7)
    for bad in (float("nan"), float("inf"), "1.0", None, np.float64("nan")):
        with pytest.raises(UserError, match=r"on prompt 3 \(\[1\]\): a reward must be a finite number"):
            rewards.score(fn, (1,), (2,), {"value": bad}, index=3)
    # ``return pred == truth``: a bool (Python's or numpy's) is 1.0 or 0.0; numpy's numbers are floats
    for value, want in ((True, 1.0), (False, 0.0), (np.bool_(True), 1.0), (np.bool_(False), 0.0),
                        (np.float32(0.5), 0.5), (np.int64(2), 2.0), (3, 3.0)):
        got = rewards.score(fn, (1,), (2,), {"value": value}, index=3)
        assert got == want and type(got) is float, (value, got)
    assert rewards.load("counting") is rewards.counting
    from core.config.rl import BUILTIN_REWARDS
    assert set(BUILTIN_REWARDS) == set(rewards.BUILTIN)  # what submit accepts is what the controller has
    for spec, msg in (("nope", "neither a built-in"), ("no_such_mod_xyz:f", "cannot find module"),
                      (f"{__name__}:missing", "has no function 'missing'")):
        with pytest.raises(ConfigError, match=f"reward: .*{msg}"):
            rewards.load(spec)


def test_kl_estimators_match_their_formulas() -> None:
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    d = logp - ref
    assert torch.equal(rl_loss.kl(logp, ref, "k1"), d)
    assert torch.equal(rl_loss.kl(logp, ref, "abs"), d.abs())
    assert torch.allclose(rl_loss.kl(logp, ref, "mse"), 0.5 * d * d)
    assert torch.allclose(rl_loss.kl(logp, ref, "low_var_kl"), torch.exp(-d) + d - 1)
    assert rl_loss.kl(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl").item() == 10.0  # clamped
    with pytest.raises(ValueError, match="unknown KL estimator"):
        rl_loss.kl(logp, ref, "k9")


def test_the_policy_loss_clips_low_and_high_and_dual_clips_negative_advantages() -> None:
    a = torch.tensor([1.0, 1.0, -1.0, -1.0])
    ratio = torch.tensor([1.0, 1.5, 0.5, 5.0])
    old = torch.zeros(4)
    loss, clipped = rl_loss.policy_loss(torch.log(ratio), old, a, clip_low=0.2, clip_high=0.28, clip_c=3.0)
    # per token: -1 (unclipped); -1.28 (high clip); 0.8 (low clip: max(0.5, 0.8)); 3 (dual clip of 5)
    assert torch.allclose(loss, torch.tensor([-1.0, -1.28, 0.8, 3.0]))
    assert clipped.tolist() == [0.0, 1.0, 1.0, 0.0]  # the clip bound on tokens 1 and 2 (the dual clip is not counted)


def test_the_log_ratio_is_clamped_before_exp() -> None:
    """verl's ±20: a token whose log-prob moved by 100 gives the ratio e^20, not inf."""
    logp, old = torch.tensor([100.0, -100.0, 0.5]), torch.zeros(3)
    assert rl_loss.log_ratio(logp, old).tolist() == [20.0, -20.0, 0.5]
    loss, _ = rl_loss.policy_loss(logp, old, torch.tensor([-1.0, 1.0, 1.0]), clip_low=0.2, clip_high=0.28, clip_c=1e9)
    assert torch.isfinite(loss).all() and loss[0].item() == pytest.approx(math.exp(20.0), rel=1e-6)


def test_each_aggregation_is_its_formula_over_the_whole_mini_batch() -> None:
    """verl's agg_loss over a mini-batch of three rows of 1, 3 and 2 tokens, taken as two
    micro-batches: the shares add up to the formula over the whole, written out by hand."""
    values = torch.tensor([[1.0, 9.0, 9.0], [2.0, 4.0, 6.0], [3.0, 5.0, 9.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    expected = {"token-mean": (1 + 2 + 4 + 6 + 3 + 5) / 6, "seq-mean-token-mean": (1 + 4 + 4) / 3,
                "seq-mean-token-sum-norm": (1 + 12 + 8) / (3 * 5)}
    for mode, value in expected.items():
        agg = rl_calls.LossAgg(mode=mode, tokens=6, rows=3, horizon=5)  # type: ignore[arg-type]
        parts = rl_loss.aggregate(values[:1], mask[:1], agg) + rl_loss.aggregate(values[1:], mask[1:], agg)
        assert parts.item() == pytest.approx(value), mode
    with pytest.raises(ValueError, match="at least 1"):
        rl_loss.aggregate(values, mask, rl_calls.LossAgg(tokens=0, rows=3, horizon=5))


def test_value_loss_and_entropy() -> None:
    v, old, ret = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([0.0, 1.0])
    # token 0: max((1-0)^2, (0.5-0)^2) = 1; token 1: max((0-1)^2, (0-1)^2) = 1
    loss, clipped = rl_loss.value_loss(v, old, ret, clip=0.5)
    assert loss.tolist() == [0.5, 0.5] and clipped.tolist() == [0.0, 0.0]
    # a value that overshoots the target past the clip: the clipped term (further off) is taken
    loss, clipped = rl_loss.value_loss(torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([3.0]), clip=0.5)
    assert loss.item() == pytest.approx(0.5 * 2.5 ** 2) and clipped.item() == 1.0
    assert rl_loss.entropy(torch.zeros(3, 8))[0].item() == pytest.approx(math.log(8))


def test_the_vocab_parallel_entropy_of_a_single_rank_is_the_entropy(tmp_path) -> None:
    """One rank holds the whole vocabulary: three all-reduces over a group of one give
    softmax's entropy (on two ranks: tests/integration/test_rl_temperature.py, an actor in tp 2)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
        mine, plain = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        got = rl_loss.vocab_parallel_entropy(mine, dist.group.WORLD)
        assert torch.allclose(got, rl_loss.entropy(plain), atol=1e-6)
        weights = torch.rand(3, 5, generator=torch.Generator().manual_seed(1))  # the entropy bonus's gradient
        (got * weights).sum().backward()
        (rl_loss.entropy(plain) * weights).sum().backward()
        assert torch.allclose(mine.grad, plain.grad, atol=1e-6) and mine.grad.abs().max() > 1e-3
    finally:
        dist.destroy_process_group()


def test_the_entropy_bonus_keeps_one_logits_sized_tensor_for_backward(tmp_path) -> None:
    """rl.entropy_coef's memory: of the tensors autograd keeps for the entropy's backward,
    one has the logits' size (the softmax), however large the vocabulary; the gradient
    through it is still the plain entropy's."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        logits = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(4))
        mine, plain = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        kept: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            got = rl_loss.vocab_parallel_entropy(mine, dist.group.WORLD)
        assert sum(1 for n in kept if n >= logits.numel()) == 1, kept
        got.sum().backward()
        rl_loss.entropy(plain).sum().backward()
        assert torch.allclose(mine.grad, plain.grad, atol=1e-6) and mine.grad.abs().max() > 1e-3
    finally:
        dist.destroy_process_group()


def test_an_rl_update_splits_its_rows_into_whole_micro_batches() -> None:
    """micro_batch_size auto may resolve to a size that does not divide a replica's rows: the
    update takes the largest size below it that does, so no response is left out."""
    from core.model.gpt.microbatch import micro_size

    assert [micro_size(m, 16) for m in (6, 8, 32, 1)] == [4, 8, 16, 1]
    assert micro_size(5, 7) == 1 and micro_size(3, 3) == 3


def _entropy_rank(rank: int, store: str, logits: torch.Tensor, weights: torch.Tensor, out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        half = logits.shape[-1] // 2
        mine = logits[..., rank * half:(rank + 1) * half].clone().requires_grad_()
        got = rl_loss.vocab_parallel_entropy(mine, dist.group.WORLD)
        (got * weights).sum().backward()
        out.put((rank, got.detach().numpy(), mine.grad.numpy()))  # by value: a tensor's shared storage dies with its process
    finally:
        dist.destroy_process_group()


def test_the_vocab_parallel_entropy_and_its_gradient_over_two_ranks_are_the_whole_vocabularys(tmp_path) -> None:
    """Two processes, each half the vocabulary: every rank's entropy is softmax's over the
    whole, and its gradient (the entropy bonus's, in the RL update) is that half of the
    whole vocabulary's gradient, not twice it (the sums' backward is the identity)."""
    import torch.multiprocessing as mp

    logits = torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(2))
    weights = torch.rand(3, 5, generator=torch.Generator().manual_seed(3))
    whole = logits.clone().requires_grad_()
    (rl_loss.entropy(whole) * weights).sum().backward()
    ctx = mp.get_context("spawn")  # not fork: a forked child of a process that ran torch ops can hang in OpenMP
    out = ctx.Queue()
    procs = [ctx.Process(target=_entropy_rank, args=(r, str(tmp_path / "store"), logits, weights, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {r: (torch.from_numpy(e), torch.from_numpy(g)) for r, e, g in (out.get(timeout=600) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, (got, grad) in results.items():
        assert torch.allclose(got, rl_loss.entropy(logits), atol=1e-6)
        assert torch.allclose(grad, whole.grad[..., rank * 6:(rank + 1) * 6], atol=1e-6), rank
