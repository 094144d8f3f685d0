"""``baton export RUN_DIR[:STEP] --hf OUT`` on real runs: transformers loads the folder and
computes the run's own loss; the export of a tp2pp2 checkpoint is the tp1 one byte for byte;
every refusal is one line, exit 2, nothing written.

Run A trains a Llama-shaped GPT (RMSNorm, SwiGLU, rotary positions, 2 key/value groups for 4
heads, no biases, untied) at tp1. Run B starts from A's last checkpoint (``init_from``) at
tp2pp2 (and, as runs zero1 and zero3, at tp2 x dp2 with ZeRO-1 and at dp2 with ZeRO-3) and
takes one step at a learning rate of 1e-30: Adam moves each weight by about 1e-30,
far below the spacing of float32 near the weights' sizes, so B's checkpoint holds A's
weights exactly, in another layout, and B's first loss is Megatron's own forward of A's
weights on the step-0 batch: the reference for transformers' forward of the export.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from core.config import run as config_mod
from core.model.gpt.data import from_config
from tests.helpers import baton, checkpoint_weights, metrics, submit_local

LLAMA = {"normalization": "rmsnorm", "activation": "swiglu", "position_embedding": "rope", "num_query_groups": 2,
         "bias": "false"}
LOSS_TOL = 1e-5  # transformers' and Megatron's float32 forwards differ in reduction order only

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]


def _model(**kw: object) -> list[str]:
    return [f"model.{k}={v}" for k, v in {**LLAMA, **kw}.items()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    a = submit_local("experiments/tiny_gpt.yaml", f"runs_root={root}/a", "trainer.steps=3", "parallel.tp=1",
                     "parallel.pp=1", "trainer.n_gpus_per_node=1", *_model())
    still = (f"init_from={a}", "trainer.steps=1", "optimizer.lr=1e-30", "optimizer.min_lr=0", "optimizer.warmup_steps=0")
    b = submit_local("experiments/tiny_gpt.yaml", f"runs_root={root}/b", *still, *_model())
    zero1 = submit_local("experiments/tiny_gpt.yaml", f"runs_root={root}/zero1", *still, "parallel.pp=1",
                         "parallel.sharding=optimizer", *_model())  # tp2 x dp2
    zero3 = submit_local("experiments/tiny_gpt.yaml", f"runs_root={root}/zero3", *still, "parallel.tp=1", "parallel.pp=1",
                         "parallel.sharding=params", "trainer.n_gpus_per_node=2", *_model())
    return {"root": root, "a": a, "b": b, "zero1": zero1, "zero3": zero3}


def _export(run: str | Path, out: Path, *extra: str) -> None:
    res = baton("export", str(run), "--hf", str(out), *extra)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.fixture(scope="module")
def exported(runs: dict[str, Path]) -> dict[str, Path]:
    out = {}
    for name in ("a", "b", "zero1", "zero3"):
        out[name] = runs["root"] / f"hf_{name}"
        _export(runs[name], out[name], "--max-shard-size", "300KB")
    return out


def _hf_loss(folder: Path, run: Path) -> float:
    """transformers' mean next-token loss of the run's step-0 batch."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = config_mod.load(run / "config.yaml")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    losses = []
    with torch.no_grad():
        for mb in from_config(cfg, dp=1, dp_rank=0).micro_batches(0):
            logits = model(torch.from_numpy(mb.tokens)).logits.float()
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.from_numpy(mb.labels).flatten()))
    return float(torch.stack(losses).mean())


def test_an_exported_llama_loads_in_transformers_and_computes_megatrons_loss(runs: dict, exported: dict) -> None:
    got = _hf_loss(exported["b"], runs["b"])
    want = metrics(runs["b"])[0]["loss"]
    print(f"transformers loss {got:.7f}, Megatron's {want:.7f}")
    assert abs(got - want) < LOSS_TOL
    index = json.loads((exported["b"] / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all((exported["b"] / f).stat().st_size <= 300_000 + 2**16 for f in files)  # bar the header
    config = json.loads((exported["b"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"


def test_the_export_holds_the_checkpoints_tensors(runs: dict, exported: dict) -> None:
    """The one-to-one tensors against the checkpoint's global arrays (the split ones are
    checked through the loss above)."""
    from safetensors.numpy import load_file

    index = json.loads((exported["a"] / "model.safetensors.index.json").read_text())
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(exported["a"] / f))
    step = max(int(p.name[5:]) for p in (runs["a"] / "checkpoints").glob("step_*"))
    ckpt = checkpoint_weights(runs["a"], step)
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], ckpt["embedding.word_embeddings.weight"])
    np.testing.assert_array_equal(tensors["lm_head.weight"], ckpt["output_layer.weight"])
    np.testing.assert_array_equal(tensors["model.layers.3.mlp.down_proj.weight"], ckpt["decoder.layers.mlp.linear_fc2.weight"][3])
    assert len(tensors) == 2 + 1 + 4 * 9


@pytest.mark.parametrize("layout", ["b", "zero1", "zero3"])
def test_the_export_of_a_tp2pp2_zero1_or_zero3_checkpoint_is_the_tp1_export_byte_for_byte(exported: dict,
                                                                                           layout: str) -> None:
    """b: tp2pp2; zero1: tp2 x dp2 with the optimizer's state sharded; zero3: dp2 with the
    parameters sharded (FSDP2)."""
    names = sorted(p.name for p in exported["a"].iterdir())
    assert names == sorted(p.name for p in exported[layout].iterdir())
    assert any(n.endswith(".safetensors") for n in names)
    for name in names:
        assert (exported["a"] / name).read_bytes() == (exported[layout] / name).read_bytes(), name


# --- refusals: one line, exit 2, nothing written ------------------------------------------------
def _refused(tmp_path: Path, run: str | Path, out: Path, *words: str) -> None:
    before = sorted(p.name for p in out.parent.iterdir()) if out.parent.exists() else []
    res = baton("export", str(run), "--hf", str(out))
    assert res.returncode == 2, res.stdout + res.stderr
    line = res.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    for word in words:
        assert word in line, line
    after = sorted(p.name for p in out.parent.iterdir()) if out.parent.exists() else []
    assert after == before  # nothing written beside OUT either


def test_export_refuses_a_folder_that_is_no_run(tmp_path: Path) -> None:
    _refused(tmp_path, tmp_path, tmp_path / "out", "not a Baton run folder")


def test_export_refuses_a_run_without_a_committed_checkpoint(tmp_path: Path, runs: dict) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(runs["a"] / "config.yaml", run / "config.yaml")
    _refused(tmp_path, run, tmp_path / "out", "no committed checkpoint")


def test_export_refuses_a_step_that_is_not_committed_naming_the_committed_ones(tmp_path: Path, runs: dict) -> None:
    _refused(tmp_path, f"{runs['a']}:7", tmp_path / "out", "step 7", "committed steps: 3")


def test_export_refuses_an_out_folder_that_is_not_empty(tmp_path: Path, runs: dict) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _refused(tmp_path, runs["a"], out, str(out), "not empty")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_export_refuses_a_model_no_family_has_naming_the_options(tmp_path: Path, runs: dict) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs["a"], run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"].update(normalization="layernorm", activation="gelu", position_embedding="learned", bias=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    _refused(tmp_path, run, tmp_path / "out", "Llama/Qwen2/Qwen3 need", "model.normalization rmsnorm (this run: layernorm)",
             "model.activation swiglu", "model.position_embedding rope", "model.bias false (this run: true)")
