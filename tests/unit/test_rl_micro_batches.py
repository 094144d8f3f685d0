"""The RL passes' micro-batches and their log-probs at real lengths: rows grouped by a token
budget (core.model.gpt.microbatch), and log-probs and entropy taken in chunks of positions
(core.model.gpt.logprobs), checked against plain torch over the whole vocabulary."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from core.model.gpt import logprobs, microbatch

LENGTHS = [4, 10, 6, 15, 5, 23, 8, 12]


def test_a_token_budget_groups_rows_longest_first_within_rows_times_the_longest() -> None:
    groups = microbatch.by_tokens(LENGTHS, 24)
    assert sorted(i for g in groups for i in g) == list(range(len(LENGTHS)))  # every row once
    assert groups == [[5], [3], [1, 7], [2, 4, 6], [0]]  # 23 | 15 | 12 10 | 8 6 5 | 4
    for g in groups:
        assert len(g) * max(LENGTHS[i] for i in g) <= 24 or len(g) == 1
    assert microbatch.by_tokens([30, 2, 2], 24) == [[0], [1, 2]]  # a row over the budget goes alone
    assert microbatch.by_tokens(LENGTHS, 10**6) == [list(range(len(LENGTHS)))]


def test_without_a_budget_micro_batches_are_consecutive_rows_of_micro_batch_size() -> None:
    assert microbatch.groups(LENGTHS, micro_batch_size=4, max_tokens=0) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert microbatch.groups(LENGTHS[:6], micro_batch_size=4, max_tokens=0) == [[0, 1, 2], [3, 4, 5]]
    assert [microbatch.micro_size(m, 16) for m in (6, 8, 32, 1)] == [4, 8, 16, 1]


def test_scoring_groups_each_mini_batch_as_its_update_does() -> None:
    """Scoring a replica's rows of two mini-batches: each mini-batch's rows grouped alone, as
    the update of that mini-batch groups them (the first epoch's ratio is exactly 1)."""
    for budget, micro in ((24, 2), (0, 2)):
        scored = microbatch.scoring_groups(LENGTHS, mini_batch=4, micro_batch_size=micro, max_tokens=budget)
        first = microbatch.groups(LENGTHS[:4], micro_batch_size=micro, max_tokens=budget)
        second = microbatch.groups(LENGTHS[4:], micro_batch_size=micro, max_tokens=budget)
        assert scored == first + [[4 + i for i in g] for g in second]


@pytest.fixture
def world(tmp_path: Any) -> Any:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _plain(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_and_entropy_are_plain_torchs_and_the_same_at_every_chunk(
        world: Any, dtype: torch.dtype, temperature: float) -> None:
    """Per position: the values and gradients do not depend on the chunk (bit for bit: the
    kernels are row-wise on CPU), and equal log_softmax / its entropy in float64."""
    gen = torch.Generator().manual_seed(5)
    base = (3 * torch.randn(3, 7, 40, generator=gen)).to(dtype)
    labels = torch.randint(0, 40, (3, 7), generator=gen)
    w_logp, w_ent = torch.randn(3, 7, generator=gen), torch.randn(3, 7, generator=gen)
    seen = []
    for chunk in (1, 4, 21, 1024):
        leaf = base.clone().requires_grad_()
        logp, ent = logprobs.vocab_parallel_logprobs(leaf * 1, labels, temperature, entropy=True, group=world,
                                                     chunk=chunk)  # leaf * 1: a model's output, spent
        ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
        seen.append((logp.detach(), ent.detach(), leaf.grad))
    for other in seen[1:]:
        assert all(torch.equal(a, b) for a, b in zip(seen[0], other, strict=True))
    plain = base.double().requires_grad_()
    ref, ref_ent = _plain(plain, labels, temperature)
    ((ref * w_logp).sum() + (ref_ent * w_ent).sum()).backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    logp, ent, grad = seen[0]
    assert (logp - ref).abs().max() <= tol and (ent - ref_ent).abs().max() <= tol
    assert (grad.double() - plain.grad).abs().max() <= tol and plain.grad.abs().max() > 1e-2
    alone, none = logprobs.vocab_parallel_logprobs(base.clone(), labels, temperature, entropy=False, group=world)
    assert none is None and torch.equal(alone, seen[0][0])  # without the entropy: the same log-probs


class _Allocations(TorchDispatchMode):
    """The largest new storage any op makes (views and writes into given tensors excluded)."""

    def __init__(self, given: list[torch.Tensor]) -> None:
        super().__init__()
        self.given = {t.untyped_storage().data_ptr() for t in given}
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.given:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_fp32_tensor_the_size_of_the_logits_is_made_in_forward_or_backward(world: Any, dtype: torch.dtype) -> None:
    """At 64 positions in chunks of 8, every tensor the log-probs, the entropy and their
    gradient make is at most a chunk's fp32 logits: the gradient is written into the logits."""
    positions, vocab, chunk = 64, 256, 8
    logits = torch.randn(4, positions // 4, vocab, dtype=dtype).requires_grad_()
    out = logits * 1  # the model's output
    labels = torch.randint(0, vocab, (4, positions // 4))
    with _Allocations([out, logits]) as seen:
        logp, ent = logprobs.vocab_parallel_logprobs(out, labels, 0.7, entropy=True, group=world, chunk=chunk)
        (grad,) = torch.autograd.grad(logp.sum() + ent.sum(), out)
    assert seen.largest <= chunk * vocab * 4, (seen.largest, chunk * vocab * 4)
    assert grad.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert seen.largest < positions * vocab * 2  # the check can fail: less than even a bf16 copy of the logits


def _tp_rank(rank: int, store: str, logits: torch.Tensor, labels: torch.Tensor, weights: Any, out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        half = logits.shape[-1] // 2
        mine = logits[..., rank * half:(rank + 1) * half].clone().requires_grad_()
        logp, ent = logprobs.vocab_parallel_logprobs(mine * 1, labels, 0.7, entropy=True, group=dist.group.WORLD,
                                                     chunk=3)
        ((logp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
        out.put((rank, logp.detach().numpy(), ent.detach().numpy(), mine.grad.numpy()))  # by value (see test_rl_math)
    finally:
        dist.destroy_process_group()


def test_over_two_tensor_parallel_ranks_each_has_the_whole_vocabularys_numbers_and_its_half_of_the_gradient(
        tmp_path: Any) -> None:
    import torch.multiprocessing as mp

    gen = torch.Generator().manual_seed(8)
    logits = 3 * torch.randn(2, 5, 12, generator=gen)
    labels = torch.randint(0, 12, (2, 5), generator=gen)  # labels on both ranks' halves
    weights = (torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen))
    plain = logits.double().requires_grad_()
    ref, ref_ent = _plain(plain, labels, 0.7)
    ((ref * weights[0]).sum() + (ref_ent * weights[1]).sum()).backward()
    ctx = mp.get_context("spawn")  # not fork: a forked child of a process that ran torch ops can hang in OpenMP
    out = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, str(tmp_path / "store"), logits, labels, weights, out))
             for r in (0, 1)]
    for p in procs:
        p.start()
    results = [(r, *map(torch.from_numpy, arrays)) for r, *arrays in (out.get(timeout=600) for _ in procs)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, logp, ent, grad in results:
        assert (logp - ref).abs().max() <= 1e-5 and (ent - ref_ent).abs().max() <= 1e-5
        assert (grad.double() - plain.grad[..., rank * 6:(rank + 1) * 6]).abs().max() <= 1e-6, rank
