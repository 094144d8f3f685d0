"""Sampling on the device (core.model.gpt.sampling), one rank holding the whole vocabulary.

The draws are checked against the distribution they should follow, computed here in plain
torch from the definitions (softmax of logits / T; top-k: the k largest; top-p: the smallest
set of the most likely whose mass reaches p), by a chi-square over 40,000 rows on a 16-token
vocabulary; the same counts against a truncation one token off fail the bound, so the check
can fail. The noise is keyed by (row seed, step, token id): a row draws the same in any batch.
The tensor-parallel split of the same choice is tests/integration/test_rollout_decode.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from core.model.gpt import sampling  # noqa: E402
from tests.helpers import REPO, refused_at_submit  # noqa: E402

V, ROWS = 16, 40_000
CHI2_BOUND = 40.0  # p < 1e-4 for the at most 15 degrees of freedom here; a wrong set gives thousands


def _lowbias32(x: int) -> int:
    """The hash in plain Python integers (Wellons' lowbias32)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _expected(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The sampling distribution by its definition, one token at a time in sorted order."""
    scaled = (logits / temperature).double()
    order = torch.argsort(scaled, descending=True).tolist()
    kept = order[:top_k] if top_k else order
    probs = torch.softmax(scaled[kept], dim=0).tolist()
    mass, nucleus = 0.0, []
    for tok, p in zip(kept, probs, strict=True):
        if mass >= top_p:
            break
        nucleus.append(tok)
        mass += p
    out = torch.zeros(V, dtype=torch.float64)
    out[nucleus] = torch.softmax(scaled[nucleus], dim=0)
    return out


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    if bool((counts[probs == 0] > 0).any()):
        return float("inf")  # a token outside the set was drawn
    exp = probs[probs > 0] * counts.sum()
    return float(((counts[probs > 0] - exp) ** 2 / exp).sum())


def _draw(logits: torch.Tensor, how: sampling.Sampling, seeds: range, step: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    keys = sampling.row_keys(list(seeds), torch.device("cpu"))
    return sampling.choose(logits.expand(len(seeds), V).contiguous(), how, keys=keys, step=step, lo=0, group=None)


def test_the_hash_is_lowbias32() -> None:
    xs = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xDEADBEEF]
    assert sampling.hash32(torch.tensor(xs, dtype=torch.int64)).tolist() == [_lowbias32(x) for x in xs]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0),
                                                             (1.0, 0, 0.8), (0.7, 6, 0.8), (1.0, 0, 0.97)])
def test_draws_follow_the_truncated_softmax(temperature: float, top_k: int, top_p: float) -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(7)) * 1.5
    how = sampling.Sampling(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    chosen, logp = _draw(logits, how, range(ROWS))
    counts = torch.bincount(chosen, minlength=V).double()
    assert _chi2(counts, _expected(logits, temperature, top_k, top_p)) < CHI2_BOUND
    truncated = top_k or top_p < 1
    if truncated:  # one token more than the right set: refused
        wrong = _expected(logits, temperature, (top_k + 1) if top_k else 0, top_p if top_k else min(1.0, top_p + 0.1))
        assert _chi2(counts, wrong) > 10 * CHI2_BOUND
    else:  # another temperature: refused
        assert _chi2(counts, _expected(logits, temperature * 1.2, 0, 1.0)) > 10 * CHI2_BOUND
    # the log-prob: of logits / T, before any truncation
    assert torch.allclose(logp, torch.log_softmax(logits / temperature, dim=0)[chosen], atol=1e-6)


def test_a_row_draws_the_same_in_any_batch_and_position() -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3))
    how = sampling.Sampling(max_new_tokens=1, temperature=1.0)
    batch, _ = _draw(logits, how, range(100, 164))
    for i in (0, 17, 63):
        alone, _ = _draw(logits, how, range(100 + i, 101 + i))
        assert alone.item() == batch[i].item()
    draws = [_draw(logits, how, range(100, 164), step=s)[0] for s in (3, 4)]
    assert not torch.equal(draws[0], draws[1])  # another step, other draws
    assert len(set(batch.tolist())) > 4  # rows differ from one another


def test_greedy_is_the_argmax_and_the_lowest_id_on_ties() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -3.0, -0.5, -2.0]])
    keys = sampling.row_keys([0, 1, 2], torch.device("cpu"))
    chosen, logp = sampling.choose(logits, sampling.Sampling(max_new_tokens=1), keys=keys, step=0, lo=0, group=None)
    assert chosen.tolist() == [1, 0, 2]
    assert torch.allclose(logp, torch.log_softmax(logits, dim=-1)[torch.arange(3), chosen])


def test_the_gumbel_noise_is_standard() -> None:
    keys = sampling.row_keys(range(64), torch.device("cpu"))
    g = sampling.gumbel(keys, 5, sampling.vocab_keys(0, 4096, torch.device("cpu")))
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.std().item() - 1.2825) < 0.01  # Euler's γ, π/√6


def test_the_gumbel_noise_is_finite_for_every_hash() -> None:
    """Every value of the top bits (the extremes included) gives finite noise: an infinite one
    would win whatever its token's probability, and beside a truncated -inf make a NaN."""
    g = sampling.noise_of(torch.arange(0, 2**32, 2**9, dtype=torch.int64))  # each 23-bit value once
    assert bool(torch.isfinite(g).all()) and g.min().item() > -3.0 and g.max().item() < 17.0


def test_a_batch_token_budget_below_one_row_is_refused_at_submit(tmp_path: Path) -> None:
    line = refused_at_submit(tmp_path, REPO / "experiments" / "grpo_tiny.yaml", "generator.max_batch_tokens=3")
    assert line.startswith("generator.max_batch_tokens: 3 holds no row of rl.prompt_length + rl.max_response_length")
    assert "raise it to at least" in line, line
