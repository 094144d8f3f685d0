"""``init_from: hf:PATH`` refuses bad model folders through the real CLI, on the login node:
exit code 2, one line on stderr naming the folder or file (and the tensor), nothing written.
A good folder fills the model section from its config.json (the user writes no shape keys).
The folders are small transformers models (tests.helpers.save_hf_model), broken on purpose."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from core.config import run as config_mod
from core.errors import ConfigError
from tests.helpers import baton

EXP = "name: hfbad\ntrainer:\n  steps: 2\nmodel:\n  seq_length: 32\n"


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _refused(tmp_path: Path, folder: Path | str, named: list[str], *overrides: str) -> str:
    (tmp_path / "exp.yaml").write_text(EXP)
    before = _snapshot(tmp_path)
    res = baton("submit", "exp.yaml", "--backend", "local", "runs_root=runs", f"init_from=hf:{folder}", *overrides,
                cwd=tmp_path, timeout=120)
    line = res.stderr.strip()
    assert res.returncode == 2, f"exit {res.returncode}; stderr: {res.stderr!r}"
    assert line and "\n" not in line and "Traceback" not in line, res.stderr
    for word in named:
        assert word in line, f"{word!r} not named in {line!r}"
    assert _snapshot(tmp_path) == before and not (tmp_path / "runs").exists()
    return line


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_the_model_section_is_config_jsons_and_a_disagreeing_key_is_refused(hf_models: dict[str, Path]) -> None:
    cfg = config_mod.from_data({"init_from": f"hf:{hf_models['qwen3']}", "model": {"seq_length": 48}})
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim, m.vocab_size) == \
        (2, 64, 4, 2, 32, 96)
    assert (m.qk_norm, m.tie_embeddings, m.bias, m.norm_eps, m.seq_length) == (True, True, False, 1e-6, 48)
    assert config_mod.from_data({"init_from": f"hf:{hf_models['llama']}"}).model.rope_scaling_factor == 8.0
    with pytest.raises(ConfigError, match=r"model.hidden_size: 32 disagrees with .*config.json, which gives 64"):
        config_mod.from_data({"init_from": f"hf:{hf_models['qwen2']}", "model": {"hidden_size": 32}})
    with pytest.raises(ConfigError, match=r"model.seq_length: 65 exceeds .*max_position_embeddings = 64"):
        config_mod.from_data({"init_from": f"hf:{hf_models['qwen2']}", "model": {"seq_length": 65}})


def test_bad_folders_are_refused_on_the_login_node(tmp_path: Path, hf_models: dict[str, Path]) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    _refused(tmp_path, bad / "nowhere", ["init_from:", "nowhere", "no such folder"])
    (bad / "empty").mkdir()
    _refused(tmp_path, bad / "empty", ["init_from:", "empty", "no config.json"])
    nofiles = _copy(hf_models["llama"], bad / "nofiles")
    (nofiles / "model.safetensors").unlink()
    _refused(tmp_path, nofiles, ["init_from:", "nofiles", "no weights"])
    truncated = _copy(hf_models["llama"], bad / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-100])
    _refused(tmp_path, truncated, ["truncated/model.safetensors", "truncated or corrupt"])
    corrupt = _copy(hf_models["llama"], bad / "corrupt")
    (corrupt / "model.safetensors").write_bytes(data[:8] + b"{not json" + data[17:])
    _refused(tmp_path, corrupt, ["corrupt/model.safetensors", "truncated or corrupt"])
    shard = _copy(hf_models["qwen2"], bad / "shard")
    next(shard.glob("model-00002-*.safetensors")).unlink()
    _refused(tmp_path, shard, ["model-00002-of-00003.safetensors", "missing"])
    shape = _copy(hf_models["qwen3"], bad / "shape")
    _edit_config(shape, intermediate_size=128)
    _refused(tmp_path, shape, ["model.layers.0.mlp.gate_proj.weight", "[96, 64]", "[128, 64]"])
    moe = _copy(hf_models["qwen3"], bad / "moe")
    _edit_config(moe, architectures=["Qwen3MoeForCausalLM"])
    _refused(tmp_path, moe, ["'Qwen3MoeForCausalLM' is not supported", "Qwen3ForCausalLM"])
    window = _copy(hf_models["qwen2"], bad / "window")
    _edit_config(window, use_sliding_window=True, sliding_window=16)
    _refused(tmp_path, window, ["sliding-window"])
    odd = _copy(hf_models["qwen3"], bad / "odd")
    _edit_config(odd, vocab_size=95)
    _refused(tmp_path, odd, ["parallel.tp: 2 does not divide", "vocab_size = 95"], "parallel.tp=2",
             "trainer.n_gpus_per_node=2")
    _refused(tmp_path, hf_models["qwen3"], ["model.num_layers: 3 disagrees", "gives 2"], "model.num_layers=3")


def test_the_reader_gives_fp32_boxes_of_a_bf16_checkpoint(tmp_path: Path, hf_models: dict[str, Path]) -> None:
    """Real checkpoints are bf16 (numpy has none): a rank's box of linear_qkv and of the
    embedding are the bf16 values widened to fp32, whatever rows the box covers."""
    import torch
    from safetensors.torch import load_file, save_file

    from core.hf import layout
    from core.hf.reader import HFReader

    folder = _copy(hf_models["llama"], tmp_path / "bf16")
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(folder / "model.safetensors")).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    dims = layout.Dims(layers=2, hidden=64, heads=4, groups=2, head_dim=16, ffn=96, vocab=96)
    reader = HFReader(folder, dims)
    wide = {k: v.float().numpy() for k, v in tensors.items()}
    q, k, v = (wide[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
    whole = np.concatenate([q[:32], k[:16], v[:16], q[32:], k[16:], v[16:]])  # group 0, then group 1
    box = reader.read("decoder.layers.self_attention.linear_qkv.weight", (1, 40, 8), (1, 40, 24))
    assert box.dtype == np.float32
    np.testing.assert_array_equal(box[0], whole[40:80, 8:32])
    np.testing.assert_array_equal(reader.read("embedding.word_embeddings.weight", (48, 0), (48, 64)),
                                  wide["model.embed_tokens.weight"][48:])


def test_read_into_copies_each_run_into_its_place_cast_once_to_the_destinations_dtype(
        tmp_path: Path, hf_models: dict[str, Path]) -> None:
    """What the loader uses (core.model.gpt.state.copy_box): a bf16 checkpoint's qkv box lands
    in a bf16 parameter bit for bit and in an fp32 one widened exactly; a box of the wrong size
    is refused naming the tensor."""
    import torch
    from safetensors.torch import load_file, save_file

    from core.checkpoint.spec import TensorSlice
    from core.errors import CheckpointError
    from core.hf import layout
    from core.hf.reader import HFReader
    from core.model.gpt.state import copy_box

    folder = _copy(hf_models["llama"], tmp_path / "bf16")
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(folder / "model.safetensors")).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    dims = layout.Dims(layers=2, hidden=64, heads=4, groups=2, head_dim=16, ffn=96, vocab=96)
    q, k, v = (tensors[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    whole = torch.cat([q[:32], k[:16], v[:16], q[32:], k[16:], v[16:]])  # group 0, then group 1
    s = TensorSlice(name="decoder.layers.self_attention.linear_qkv.weight", global_shape=(2, 128, 64),
                    offset=(0, 24, 0), shape=(1, 80, 64), dtype="float32")
    reader = HFReader(folder, dims)
    for dtype in (torch.bfloat16, torch.float32):
        param = torch.full((80, 64), float("nan"), dtype=dtype, requires_grad=True)
        copy_box(reader, s, param)
        assert torch.equal(param.detach(), whole[24:104].to(dtype))
    with pytest.raises(CheckpointError, match="linear_qkv.weight: a box of shape"):
        copy_box(reader, s, torch.empty(79, 64))


def test_a_run_folders_config_loads_once_the_hf_folder_has_gone(tmp_path: Path, hf_models: dict[str, Path]) -> None:
    """config.yaml holds the whole model section: a resume (from the run's own checkpoints)
    does not need the folder; a config that leaves the shape to config.json does."""
    folder = _copy(hf_models["qwen2"], tmp_path / "gone")
    cfg = config_mod.from_data({"init_from": f"hf:{folder}", "model": {"seq_length": 32}})
    written = config_mod.dump(cfg)
    shutil.rmtree(folder)
    (tmp_path / "config.yaml").write_text(written)
    assert config_mod.load(tmp_path / "config.yaml") == cfg
    with pytest.raises(ConfigError, match="no such folder"):
        config_mod.from_data({"init_from": f"hf:{folder}", "model": {"seq_length": 32}})


def test_plan_names_the_family_and_folder_and_counts_config_jsons_model(tmp_path: Path,
                                                                       hf_models: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM  # the independent count: transformers' own model

    (tmp_path / "exp.yaml").write_text(EXP)
    res = baton("plan", "exp.yaml", f"init_from=hf:{hf_models['qwen2']}", "--json", cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    counted = json.loads(res.stdout)["params"]["total"]
    hf = AutoModelForCausalLM.from_pretrained(hf_models["qwen2"])
    assert counted == sum(p.numel() for p in hf.parameters())
    text = baton("plan", "exp.yaml", f"init_from=hf:{hf_models['qwen2']}", cwd=tmp_path, timeout=120).stdout
    assert text.splitlines()[0].startswith(f"model: qwen2 from {hf_models['qwen2']}")
