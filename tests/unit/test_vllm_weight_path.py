"""The vLLM rollout's weight path without a run: a tiny random Qwen3 model (head dim 32, tied
embeddings) saved with transformers, read as Baton's global tensors (core.hf.layout.read_global),
turned back into Hugging Face tensors the way VLLMRollout.synced does (core.hf.layout.to_hf,
one safetensors file), served by core.model.gpt.vllm_engine.Engine (its own engine
processes), then another model's weights written over the file and ``reload()``ed. Before and
after the reload, vLLM's greedy tokens equal transformers' greedy ``generate`` on the same
weights, and vLLM's log-probs of its tokens and of teacher-forced prompts equal transformers'
within 1e-4 (fp32). The second model changes the embedding too, so a tied head left stale
by the reload (the CPU backend's packed copy) shows as wrong tokens. Last, an engine whose
process dies while a call waits on it fails the call with EngineLost (core.model.gpt.vllm_engine)."""
from __future__ import annotations

import json
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402 - after the skip: vllm pins the torch these tests need
import transformers  # noqa: E402 - tests only: the independent reference
from safetensors.numpy import load_file  # noqa: E402

from core.hf import files, layout  # noqa: E402
from core.model.gpt import vllm_engine  # noqa: E402
from tests.helpers import HF_SHAPE, save_hf_model, wait_for  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
D = layout.Dims(layers=HF_SHAPE["num_hidden_layers"], hidden=HF_SHAPE["hidden_size"],
                heads=HF_SHAPE["num_attention_heads"], groups=HF_SHAPE["num_key_value_heads"], head_dim=32,
                ffn=HF_SHAPE["intermediate_size"], vocab=HF_SHAPE["vocab_size"], qk_norm=True, tied=True)
PROMPTS = [(3, 17, 42, 5), (90, 1, 1, 64, 7, 33), (11,)]
NEW = 12


def _baton_globals(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Baton's whole global tensors of a tied Qwen3 model, read from its HF tensors."""
    d, n = D, D.layers
    qkv_rows = (d.heads + 2 * d.groups) * d.head_dim
    shapes = {"embedding.word_embeddings.weight": (d.vocab, d.hidden), "decoder.final_layernorm.weight": (d.hidden,),
              "decoder.layers.self_attention.linear_qkv.weight": (n, qkv_rows, d.hidden),
              "decoder.layers.self_attention.linear_proj.weight": (n, d.hidden, d.heads * d.head_dim),
              "decoder.layers.self_attention.q_layernorm.weight": (n, d.head_dim),
              "decoder.layers.self_attention.k_layernorm.weight": (n, d.head_dim),
              "decoder.layers.input_layernorm.weight": (n, d.hidden),
              "decoder.layers.pre_mlp_layernorm.weight": (n, d.hidden),
              "decoder.layers.mlp.linear_fc1.weight": (n, 2 * d.ffn, d.hidden),
              "decoder.layers.mlp.linear_fc2.weight": (n, d.hidden, d.ffn)}

    def rows(name: str, a: int, b: int, rest: tuple[slice, ...]) -> np.ndarray:
        return hf[name][(slice(a, b), *rest)]

    return {name: layout.read_global(rows, name, (0,) * len(s), s, d) for name, s in shapes.items()}


def _sync(hf_folder: Path, engine_folder: Path) -> None:
    """What VLLMRollout.synced writes: every global tensor through to_hf, as one safetensors file."""
    tensors: dict[str, torch.Tensor] = {}
    for name, array in _baton_globals(load_file(str(hf_folder / files.SINGLE))).items():
        tensors.update({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in layout.to_hf(name, array, D).items()})
    assert "lm_head.weight" not in tensors  # tied: the engine's head is its embedding
    files.save_tensors(tensors, engine_folder / files.SINGLE)


def _reference(hf_folder: Path) -> list[tuple[list[int], list[float], list[float]]]:
    """transformers (fp32): per prompt, its greedy new tokens, their log-probs, and the prompt's
    teacher-forced log-probs (of tokens 1..)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            seq = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0]
            logp = torch.log_softmax(model(seq[None]).logits[0].double(), dim=-1)
            picked = logp[torch.arange(len(seq) - 1), seq[1:]].tolist()
            out.append((seq[len(p):].tolist(), picked[len(p) - 1:], picked[:len(p) - 1]))
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-weights")
    out = {"a": save_hf_model("qwen3", root / "a", seed=0), "b": save_hf_model("qwen3", root / "b", seed=1),
           "engine": root / "engine"}
    out["engine"].mkdir()
    config = json.loads((out["a"] / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["head_dim"] == 32
    shutil.copy(out["a"] / "config.json", out["engine"] / "config.json")
    return out


@pytest.fixture(scope="module")
def engine(folders: dict[str, Path]) -> Iterator[vllm_engine.Engine]:
    _sync(folders["a"], folders["engine"])
    spec = vllm_engine.EngineSpec(folder=str(folders["engine"]), dtype="float32", tp=1,
                                  max_model_len=HF_SHAPE["max_position_embeddings"], seed=0, on_cuda=False,
                                  gpu_memory_utilization=0.5, kv_cache_bytes=32 * 2**20, max_num_seqs=8, tied=True)
    e = vllm_engine.Engine(spec)
    try:
        yield e
    finally:
        e.shutdown()
    assert not any(p.is_running() for p in e.children)


def _check_engine_equals_transformers(e: vllm_engine.Engine, hf_folder: Path) -> list[list[int]]:
    want = _reference(hf_folder)
    got = e.generate([vllm_engine.Request(prompt=p, seed=7) for p in PROMPTS], max_new_tokens=NEW, temperature=0.0,
                     top_k=0, top_p=1.0, stop=())
    prompt_logp = e.prompt_logprobs(PROMPTS)
    for (tokens, logps), prompt_lp, (w_tokens, w_logps, w_prompt) in zip(got, prompt_logp, want, strict=True):
        assert list(tokens) == w_tokens
        np.testing.assert_allclose(logps, w_logps, atol=1e-4, rtol=0)
        np.testing.assert_allclose(prompt_lp, w_prompt, atol=1e-4, rtol=0)
    return [list(t) for t, _ in got]


def test_vllm_serves_the_synced_weights_and_a_reload_replaces_them_tied_head_included(
        engine: vllm_engine.Engine, folders: dict[str, Path]) -> None:
    before = _check_engine_equals_transformers(engine, folders["a"])
    _sync(folders["b"], folders["engine"])
    engine.reload()
    after = _check_engine_equals_transformers(engine, folders["b"])
    assert before != after  # the second model's continuations differ: the reload is seen


def test_an_engine_that_dies_mid_call_fails_the_call_with_engine_lost(engine: vllm_engine.Engine) -> None:
    """The engine core is stopped, a generate call sent to it, and the core SIGKILLed while the
    call waits for its answer: the call ends with EngineLost (vLLM's own client would wait
    forever). The module's last test: it ends the engine."""
    (core,) = [p for p in engine.children if "EngineCore" in " ".join(p.cmdline())]
    outcome: dict[str, BaseException] = {}

    def call() -> None:
        try:
            engine.generate([vllm_engine.Request(prompt=PROMPTS[0], seed=1)], max_new_tokens=NEW, temperature=0.0,
                            top_k=0, top_p=1.0, stop=())
        except BaseException as exc:  # noqa: BLE001 - what the call raised is the test's subject
            outcome["raised"] = exc

    core.send_signal(signal.SIGSTOP)  # it cannot answer: the request stays in flight
    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    wait_for(lambda: engine.llm.llm_engine.get_num_unfinished_requests() > 0, 60, "the request in flight")
    core.send_signal(signal.SIGKILL)
    caller.join(timeout=60)
    assert not caller.is_alive(), "the call still waits on an engine that is gone"
    assert isinstance(outcome.get("raised"), vllm_engine.EngineLost), outcome
