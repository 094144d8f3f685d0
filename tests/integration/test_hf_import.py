"""``init_from: hf:PATH`` on a real Megatron-core GPT (CPU, gloo, fp32): small random Llama 3.1
(scaled rotary frequencies, untied), Qwen2 (q/k/v biases) and Qwen3 (q/k norms, a head size
that is not hidden/heads, tied) models saved by transformers are loaded by ``CKPT_LOAD
hf:PATH`` in several layouts, each rank reading only its own boxes of the safetensors file.
The reference is transformers itself: the same tokens' logits (to 1e-5: the two frameworks
sum in different orders, and tensor parallelism splits the sums) and greedy generation
(``model.generate(do_sample=False)``), token for token.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integration.gpt_harness import RankGroup, gpt_config, greedy_on_rank, hf_reads_on_rank, logits_on_rank

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]

TOKENS = np.random.default_rng(7).integers(0, 96, size=(2, 24)).tolist()
PROMPTS, NEW = [row[:6] for row in TOKENS], 10
TOL = 1e-5
# family → layouts (tp, pp, dp) it is checked in; every family at tp1pp1 (with generation) and
# tp2pp2; qwen2 (sharded files) also under ZeRO-3 over two replicas (each rank reads its half)
LAYOUTS = {"llama": ((1, 1, 1), (1, 2, 1), (2, 2, 1)), "qwen2": ((1, 1, 1), (2, 2, 1), (1, 1, 2)),
           "qwen3": ((1, 1, 1), (2, 1, 1), (2, 2, 1))}


def _reference(folder: Path) -> tuple[np.ndarray, list[list[int]]]:
    """transformers' logits of TOKENS and its greedy continuation of PROMPTS."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor(TOKENS)).logits.numpy()
        out = model.generate(torch.tensor(PROMPTS), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                             eos_token_id=None, pad_token_id=0)
    return logits, out[:, len(PROMPTS[0]):].tolist()


def _elements(folder: Path) -> int:
    from safetensors.numpy import load_file

    return sum(a.size for f in folder.glob("*.safetensors") for a in load_file(str(f)).values())


def _imported(folder: Path, tp: int, pp: int, dp: int, work: Path) -> tuple[np.ndarray, list[list[int]] | None]:
    world = tp * pp * dp
    zero3 = {"parallel": {"sharding": "params"}} if dp > 1 else {}
    cfg: dict[str, Any] = gpt_config(tp=tp, pp=pp, world_size=world, training={"global_batch_size": 2,
                                                                               "micro_batch_size": 1}, **zero3)
    cfg["init_from"] = f"hf:{folder}"
    cfg["model"] = {"seq_length": 32}  # the shape comes from config.json
    with RankGroup(cfg, world_size=world, run_dir=work) as g:
        g.setup()
        assert g.call("ckpt_load", step_dir=f"hf:{folder}", into="weights") == [{"step": 0}] * world
        if tp == pp == 2:  # each rank reads about its quarter; together they read every element
            reads, total = g.apply(hf_reads_on_rank, folder=str(folder)), _elements(folder)
            assert max(reads) < total / 3 and sum(reads) >= total, (reads, total)
        logits = next(x for x in g.apply(logits_on_rank, tokens=TOKENS) if x is not None)
        tokens = g.apply(greedy_on_rank, prompts=PROMPTS, new_tokens=NEW)[0] if pp == dp == 1 else None
    return logits, tokens


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_imported_models_give_transformers_logits_and_greedy_tokens_in_every_layout(
        family: str, hf_models: dict[str, Path], tmp_path: Path) -> None:
    want_logits, want_tokens = _reference(hf_models[family])
    for tp, pp, dp in LAYOUTS[family]:
        logits, tokens = _imported(hf_models[family], tp, pp, dp, tmp_path)
        assert logits.shape == want_logits.shape
        gap = float(np.abs(logits - want_logits).max())
        assert gap < TOL, f"{family} tp{tp}pp{pp}dp{dp}: logits differ from transformers' by {gap}"
        if tokens is not None:
            assert tokens == want_tokens, f"{family} tp{tp}pp{pp}dp{dp}: greedy tokens differ"


@pytest.mark.parametrize("program", ["grpo", "ppo"])
def test_an_rl_run_starts_from_the_imported_model_and_its_reference_is_those_weights(
        program: str, hf_models: dict[str, Path], tmp_path: Path) -> None:
    """``init_from: hf:`` under ``program: grpo`` / ``ppo`` with no warm start, two steps on the
    local backend: the run records where its weights came from (the folder, absolute), and its
    step-0 checkpoint (the reference policy's) holds exactly the Hugging Face tensors."""
    import yaml
    from safetensors.numpy import load_file

    from core.hf import layout
    from tests.helpers import REPO, baton, checkpoint_weights, history, metrics, submit_local

    exp = yaml.safe_load((REPO / "experiments" / "grpo_tiny.yaml").read_text())
    exp["program"] = program
    exp["model"] = {"seq_length": 16}  # the shape is config.json's
    exp["trainer"]["steps"] = 2
    exp["rl"]["warmup_steps"] = 0
    exp["generator"]["sync_interval_steps"] = 2
    exp["init_from"] = f"hf:{hf_models['qwen3']}"
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(exp))
    run = submit_local(str(tmp_path / "exp.yaml"), f"runs_root={tmp_path / 'runs'}")
    assert [e["checkpoint"] for e in history(run, "initialised_from")] == [f"hf:{hf_models['qwen3'].resolve()}"]
    dims = layout.Dims(layers=2, hidden=64, heads=4, groups=2, head_dim=32, ffn=96, vocab=96, qk_norm=True, tied=True)
    saved: dict[str, np.ndarray] = {}
    for name, array in checkpoint_weights(run, 0).items():
        if name.startswith("critic."):  # PPO's value model: the actor's copy, then its own
            continue
        saved.update(layout.to_hf(name, array, dims))
    want = load_file(str(hf_models["qwen3"] / "model.safetensors"))
    assert saved.keys() == want.keys()
    for name, array in want.items():
        np.testing.assert_array_equal(saved[name], array, err_msg=name)
    if program == "grpo":  # a resumed run continues from its own checkpoint: it never imports again
        res = baton("submit", "--resume", str(run), "trainer.steps=3", "--backend", "local")
        assert res.returncode == 0, res.stdout + res.stderr
        assert len(history(run, "initialised_from")) == 1 and len(history(run, "resume_requested")) == 1
        assert [r["step"] for r in metrics(run)] == [0, 1, 2]
