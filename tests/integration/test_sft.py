"""``program: sft`` on a real Megatron-core GPT (CPU, gloo): the loss counts the assistant's
tokens only, is the mean over the whole global batch's assistant tokens, does not change with
the layout, and a local SFT run that is interrupted and resumed ends on the uninterrupted
run's numbers bit for bit.

The data is experiments/data/chat_count.jsonl through the byte chat format (conversations of
40 to 115 tokens right-padded to 128: every micro-batch counts a different number of tokens,
so a per-micro-batch mean would give other numbers than the global one, see below).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import REPO, Submitted, checkpoint_weights, losses, numbers, submit_local
from tests.integration.gpt_harness import RankGroup, gpt_config

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]

STEPS = 3
LAYOUT_TOL = 2e-5  # relative: float32 sums in another order (see test_the_loss_does_not_change_with_the_layout)


def sft_config(*, tp: int = 1, pp: int = 1, world_size: int = 1, micro: int = 2) -> dict[str, Any]:
    cfg = gpt_config(tp=tp, pp=pp, world_size=world_size, steps=STEPS, training={"micro_batch_size": micro})
    cfg["model"].update(vocab_size=264, seq_length=128)
    cfg["program"] = "sft"
    cfg["sft"] = {"data": str(REPO / "experiments" / "data" / "chat_count.jsonl"), "tokenizer": "byte"}
    return cfg


# --- run on the rank (apply): the step's gradients and a plain-torch reference ------------------
def _grads(ctx: Any, batches: list[Any]) -> tuple[float, list[Any]]:
    from core.model.gpt import step

    for chunk in ctx.model_chunks:
        chunk.zero_grad_buffer()
    ctx.optimizer.zero_grad()  # after an optimizer step param.grad is main_grad itself: drop it, as train_step does
    loss = step._run_schedule(ctx, batches, forward_only=False)
    return float(loss), [p.main_grad.detach().clone() for p in ctx.model_chunks[0].parameters()]


def _reference(ctx: Any, batches: list[Any]) -> tuple[float, list[Any]]:
    """Cross entropy over the assistant labels of the whole global batch, in one forward pass
    of all its rows, written out in plain torch from the model's logits."""
    import torch
    import torch.nn.functional as F

    tokens = torch.from_numpy(np.concatenate([mb.tokens for mb in batches]))
    labels = torch.from_numpy(np.concatenate([mb.labels for mb in batches]))
    mask = torch.from_numpy(np.concatenate([mb.loss_mask for mb in batches]))
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    model = ctx.model_chunks[0]
    model.zero_grad_buffer()
    ctx.optimizer.zero_grad()
    logits = model(tokens, positions, None)  # no labels: [b, s, vocab]
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    loss = ce[mask.flatten()].sum() / mask.sum()
    loss.backward()
    return float(loss), [p.main_grad.detach().clone() for p in model.parameters()]


def probe_on_rank(task: Any, step: int) -> dict[str, Any]:
    ctx = task.rank.ready()
    batches = ctx.source.micro_batches(step)
    loss, grads = _grads(ctx, batches)
    # Other labels where the mask is 0 (the prompt's and the pads' positions): nothing may change.
    vocab = ctx.cfg.model.vocab_size
    moved = [replace(mb, labels=np.where(mb.loss_mask, mb.labels, (mb.labels + 1 + np.arange(mb.labels.size).reshape(
        mb.labels.shape)) % vocab)) for mb in batches]
    moved_loss, moved_grads = _grads(ctx, moved)
    ref_loss, ref_grads = _reference(ctx, batches)
    # The mean of the micro-batches' own means: what a per-micro-batch normalisation would report.
    per_micro = [float(_grads(ctx, [replace(mb, loss_tokens=int(mb.loss_mask.sum()))])[0]) for mb in batches]
    return {
        "loss": loss, "moved_loss": moved_loss, "ref_loss": ref_loss, "per_micro_mean": float(np.mean(per_micro)),
        "moved_labels": int(sum((a.labels != b.labels).sum() for a, b in zip(batches, moved, strict=True))),
        "same_grads": all(bool((a == b).all()) for a, b in zip(grads, moved_grads, strict=True)),
        "grad_norm": float(sum(float((g * g).sum()) for g in grads)) ** 0.5,
        "max_grad_diff": max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads, strict=True)),
        "max_grad": max(float(g.abs().max()) for g in ref_grads),
    }


# --- the tests -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sft")


@pytest.fixture(scope="module")
def tp1(workdir: Path) -> dict[str, Any]:
    """One rank: the initial weights, STEPS training steps' losses, then the probe of the next
    step (trained weights: the tokens' losses differ more than at the start)."""
    with RankGroup(sft_config(), world_size=1, run_dir=workdir) as g:
        g.setup()
        weights = workdir / "initial.npz"
        g.call("save_global_weights", path=str(weights))
        curve = [g.loss(g.call("train_step", step=s)) for s in range(STEPS)]
        (probe,) = g.apply(probe_on_rank, step=STEPS)
    return {"probe": probe, "losses": curve, "weights": weights}


def test_only_assistant_tokens_count_and_the_loss_is_the_global_batch_mean(tp1: dict[str, Any]) -> None:
    p = tp1["probe"]
    print({k: v for k, v in p.items() if k != "same_grads"})  # shown with -rP
    assert p["moved_labels"] > 1000  # prompts and pads are most of the labels
    assert p["moved_loss"] == p["loss"] and p["same_grads"]  # masked labels: no loss, no gradient
    assert p["grad_norm"] > 0
    assert abs(p["loss"] - p["ref_loss"]) <= 1e-6 * p["ref_loss"]
    assert p["max_grad_diff"] <= 1e-5 * p["max_grad"], (p["max_grad_diff"], p["max_grad"])
    # The check can fail: normalising each micro-batch by its own count gives another number.
    assert abs(p["per_micro_mean"] - p["ref_loss"]) > 1e-4 * p["ref_loss"], p


@pytest.mark.parametrize(("tp", "pp", "micro"), [(1, 1, 4), (2, 1, 2), (1, 2, 1)],
                         ids=["dp2-micro4", "tp2-micro2", "pp2-micro1"])
def test_the_loss_does_not_change_with_the_layout(tp1: dict[str, Any], workdir: Path, tp: int, pp: int,
                                                  micro: int) -> None:
    """dp2 (another micro batch too), tp2 and pp2 against one rank. Not bit for bit: each layout
    sums the same float32 terms in another order (the micro-batches' sums, the data-parallel
    all-reduce of gradients and losses, tp's vocab-parallel softmax and row-parallel
    all-reduces), so the losses agree to float32 reduction noise, which Adam carries into
    the next steps' weights."""
    with RankGroup(sft_config(tp=tp, pp=pp, world_size=2, micro=micro), world_size=2, run_dir=workdir) as g:
        g.setup()
        g.call("load_global_weights", path=str(tp1["weights"]))
        curve = [g.loss(g.call("train_step", step=s)) for s in range(STEPS)]
    ref = tp1["losses"]
    print(f"max relative |loss - tp1| tp{tp} pp{pp} micro{micro}: "  # shown with -rP
          f"{max(abs(a - b) / b for a, b in zip(curve, ref, strict=True)):.3g}")
    assert curve[0] != pytest.approx(curve[-1], rel=1e-2)  # it trains
    for got, want in zip(curve, ref, strict=True):
        assert abs(got - want) <= LAYOUT_TOL * want, (curve, ref)


def test_an_interrupted_sft_run_resumes_on_the_uninterrupted_numbers(tmp_path: Path) -> None:
    """SIGUSR2 at the controller mid-run (a preemption): it checkpoints at the step boundary,
    requeues and resumes; every step's loss and grad norm and the final weights are the
    uninterrupted run's (the data position is the step, restored with the checkpoint). The
    data file is rewritten (its records reversed) before the preemption: the resumed workers
    train on the conversations submit read (the run folder's sft_data.npz), not on the file."""
    common = ("model.num_layers=2", "model.hidden_size=64", "trainer.steps=16", "checkpoint.interval_steps=0")
    full = submit_local("experiments/sft_chat.yaml", f"runs_root={tmp_path}/a", *common)
    data = tmp_path / "chat.jsonl"
    lines = (REPO / "experiments" / "data" / "chat_count.jsonl").read_text().splitlines(keepends=True)
    data.write_text("".join(lines))
    r = Submitted(tmp_path / "b", [f"sft.data={data}"], {"BATON_FAULTS": "data_delay_ms=150"},
                  experiment="experiments/sft_chat.yaml", common=common)  # the delay: the signal lands mid-run
    assert r.preempt_at(4, before=lambda: data.write_text("".join(reversed(lines))))["step"] < 16
    keys = ("step", "loss", "grad_norm", "lr", "tokens")
    assert numbers(r.run_dir, keys) == numbers(full, keys)  # bit for bit
    mine, theirs = checkpoint_weights(r.run_dir, 16), checkpoint_weights(full, 16)
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)
    assert losses(full)[-1] < losses(full)[0] - 1.0  # it learns
