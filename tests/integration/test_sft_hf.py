"""``program: sft`` from a Hugging Face model, end to end (experiments/sft_hf.yaml): a random
Qwen3 saved by transformers, with a ChatML tokenizer and chat template in the same folder,
fine-tuned on experiments/data/chat_count.jsonl through ``sft.tokenizer: hf`` on the local
backend (dp2, fp32).

References: transformers' apply_chat_template (the conversation's ids, and its assistant mask
from the template's generation block) and transformers' forward of the same folder, the loss
written out in plain torch: cross entropy over the assistant tokens of the whole global batch,
summed and divided by their count. An interrupted (SIGUSR2, a preemption) and resumed run ends
on the uninterrupted run's numbers and weights bit for bit."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers import REPO, Submitted, checkpoint_weights, json_lines, metrics, numbers, submit_local
from tests.hf_tokenizers import chatml_folder

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]

EXP = "experiments/sft_hf.yaml"
STEPS = 8
LOSS_TOL = 1e-5  # relative: transformers and Megatron sum the same float32 terms in other orders (dp2 too)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3 (vocabulary 512, 128 positions) and a ChatML tokenizer, one folder."""
    from tests.helpers import save_hf_model

    model = save_hf_model("qwen3", tmp_path_factory.mktemp("qwen3-chat"), vocab_size=512, max_position_embeddings=128)
    return chatml_folder(model)  # generation_config.json's eos: <|im_end|>


def _common(folder: Path) -> tuple[str, ...]:
    return (f"init_from=hf:{folder}", f"trainer.steps={STEPS}", "checkpoint.interval_steps=0", "optimizer.lr=1e-3",
            "optimizer.warmup_steps=0", "optimizer.schedule=constant")


@pytest.fixture(scope="module")
def full(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return submit_local(EXP, f"runs_root={tmp_path_factory.mktemp('sft-hf')}", *_common(folder))


def _reference_rows(folder: Path) -> dict[tuple[int, ...], list[int]]:
    """Every conversation of the file: its ids -> its assistant mask, both transformers'."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    out = {}
    for record in json_lines(REPO / "experiments" / "data" / "chat_count.jsonl"):
        enc = tok.apply_chat_template(record["messages"], return_dict=True, return_assistant_tokens_mask=True,
                                      enable_thinking=False)
        out[tuple(enc["input_ids"])] = list(enc["assistant_masks"])
    return out


def test_step_0_loss_is_transformers_cross_entropy_over_the_assistant_tokens(folder: Path, full: Path) -> None:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from core.config import run as config_mod
    from core.model.gpt.data import from_config

    cfg = config_mod.load(full / "config.yaml")
    assert cfg.model.qk_norm and cfg.model.head_dim == 32 and cfg.model.vocab_size == 512  # config.json's shape
    batches = from_config(cfg, dp=1, dp_rank=0, run_dir=full).micro_batches(0)  # the step's 16 rows
    tokens = np.concatenate([mb.tokens for mb in batches])
    loss_mask = np.concatenate([mb.loss_mask for mb in batches]).astype(bool)
    assert tokens.shape == (16, 96)
    reference = _reference_rows(folder)
    labels = np.zeros_like(tokens)
    mask = np.zeros_like(loss_mask)
    for r, row in enumerate(tokens):
        ids = next(k for k in reference if tuple(row[:len(k)]) == k[:96] and len(k) <= 97)  # the row's conversation
        n = len(ids)
        labels[r, :n - 1] = ids[1:]
        mask[r, :n - 1] = np.array(reference[ids][1:], dtype=bool)  # label i is token i + 1
    np.testing.assert_array_equal(loss_mask, mask)  # the assistant's tokens, as transformers marks them
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens)).logits
        ce = F.cross_entropy(logits.flatten(0, 1), torch.from_numpy(labels).flatten(), reduction="none")
        want = float(ce[torch.from_numpy(mask).flatten()].sum() / mask.sum())
    got = metrics(full)[0]["loss"]
    print(f"step-0 loss: Baton {got:.7f}, transformers {want:.7f}; {int(mask.sum())} assistant tokens")  # -rP
    assert abs(got - want) <= LOSS_TOL * want
    per_row = float(np.mean([float(ce.view(16, 96)[r][torch.from_numpy(mask[r])].mean()) for r in range(16)]))
    assert abs(per_row - want) > 1e-3 * want  # a per-conversation mean would be another number: the check can fail
    assert metrics(full)[-1]["loss"] < got - 0.5  # it learns


def test_an_interrupted_sft_run_from_hf_resumes_on_the_uninterrupted_numbers(folder: Path, full: Path,
                                                                              tmp_path: Path) -> None:
    r = Submitted(tmp_path, [], {"BATON_FAULTS": "data_delay_ms=150"}, experiment=EXP,
                  common=_common(folder))  # the delay: the signal lands mid-run
    assert r.preempt_at(3)["step"] < STEPS
    assert len(r.events("initialised_from")) == 1  # the resume reads its own checkpoint, not the folder
    keys = ("step", "loss", "grad_norm", "lr", "tokens")
    assert numbers(r.run_dir, keys) == numbers(full, keys)  # bit for bit
    mine, theirs = checkpoint_weights(r.run_dir, STEPS), checkpoint_weights(full, STEPS)
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)
