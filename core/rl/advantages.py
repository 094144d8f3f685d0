"""Advantages and the KL coefficient, computed on the controller from the rollout's numbers.

The formulas are the field's (verl's ``core_algos``), so that a user moving from it gets the
same training signal:

- GRPO (outcome reward, one scalar per response): within each group of ``rollout.n``
  responses to one prompt, ``(score - mean) / (std + eps)`` with the sample standard
  deviation (ddof 1); a group of one has mean 0 and std 1. ``norm_by_std=False`` keeps only
  the mean baseline (Dr. GRPO). Every response token gets its response's advantage.
- GAE (PPO, per-token rewards and values): ``delta_t = r_t + gamma V_{t+1} - V_t``,
  ``A_t = delta_t + gamma lambda A_{t+1}`` over the response mask (a padded position is
  skipped: it passes on the next token's value and advantage), returns ``A + V``; the
  advantages are then whitened over the batch's response tokens.
- Adaptive KL: ``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon``.
- ``kl.coef: auto``: ``max(1e-3, 0.02 ln(params in billions))``, a heuristic, not a law:
  it is negative below a billion parameters, hence the clamp.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

EPS = 1e-6
MIN_AUTO_KL = 1e-3


def grpo(scores: Sequence[float], groups: Sequence[int], *, norm_by_std: bool = True, eps: float = EPS) -> np.ndarray:
    """One advantage per response: its score against its group's (``groups[i]``: the prompt)."""
    s = np.asarray(scores, dtype=np.float64)
    g = np.asarray(groups)
    if s.shape != g.shape or s.ndim != 1:
        raise ValueError(f"scores {s.shape} and groups {g.shape} must be two equal 1-D sequences")
    out = np.empty_like(s)
    for key in np.unique(g):
        idx = np.flatnonzero(g == key)
        mean, std = (s[idx].mean(), s[idx].std(ddof=1)) if len(idx) > 1 else (0.0, 1.0)
        out[idx] = (s[idx] - mean) / (std + eps) if norm_by_std else s[idx] - mean
    return out


def per_token(advantages: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """A response's advantage on each of its tokens (``mask``: responses x tokens, 1 = response)."""
    return np.asarray(advantages, dtype=np.float64)[:, None] * np.asarray(mask, dtype=np.float64)


def gae(rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, *, gamma: float,
        lam: float, whiten: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(advantages, returns), each responses x tokens, zero outside the response mask."""
    r, v, m = (np.asarray(a, dtype=np.float64) for a in (rewards, values, mask))
    adv = np.zeros_like(r)
    last = np.zeros(r.shape[0])
    nxt = np.zeros(r.shape[0])  # the value of the next response token (padding skipped)
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * nxt - v[:, t]
        last = (delta + gamma * lam * last) * m[:, t] + last * (1 - m[:, t])
        nxt = v[:, t] * m[:, t] + nxt * (1 - m[:, t])
        adv[:, t] = last
    returns = (adv + v) * m
    if whiten:
        adv = masked_whiten(adv, m)
    return adv * m, returns


def masked_whiten(x: np.ndarray, mask: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """``(x - mean) / sqrt(var + eps)`` over the masked entries (unbiased variance)."""
    sel = x[mask > 0]
    if sel.size < 2:
        return x - (sel.mean() if sel.size else 0.0)
    return (x - sel.mean()) / math.sqrt(sel.var(ddof=1) + eps)


@dataclass
class AdaptiveKL:
    """The KL coefficient that follows a target KL; part of the RL state a checkpoint keeps."""

    value: float
    target: float | None = None  # None: fixed
    horizon: int = 10000

    def update(self, current_kl: float, n_samples: int) -> float:
        if self.target is not None and self.target > 0:
            error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_samples / self.horizon
        return self.value


def auto_kl_coef(num_params: int) -> float:
    """``kl.coef: auto``: max(1e-3, 0.02 ln(params in billions)) — a clamped heuristic."""
    return max(MIN_AUTO_KL, 0.02 * math.log(max(num_params, 1) / 1e9))
