"""What an export takes from a run besides its weights: the Hugging Face folder it came from,
followed through a run started from a run, that folder's dtype and its tokenizer files."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from core.checkpoint import hf_source
from core.config import run as config_mod
from tests.helpers import REPO, save_hf_model


def _run(folder: Path, init_from: str, *, hf: bool) -> config_mod.RunConfig:
    data = yaml.safe_load((REPO / "experiments" / "tiny_gpt.yaml").read_text())
    data.update(init_from=init_from, parallel={"tp": 1, "pp": 1})
    data["trainer"]["n_gpus_per_node"] = 1
    if hf:
        data["model"] = {"seq_length": 32}  # the shape is config.json's
    cfg = config_mod.from_data(data)
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "config.yaml").write_text(config_mod.dump(cfg))
    return cfg


def test_the_source_of_a_run_started_from_an_imported_run_is_the_hugging_face_folder(tmp_path: Path) -> None:
    source = save_hf_model("qwen3", tmp_path / "qwen3")
    _run(tmp_path / "first", f"hf:{source}", hf=True)
    second = _run(tmp_path / "second", str(tmp_path / "first"), hf=False)
    assert hf_source.hf_source(second, tmp_path / "second") == source
    scratch = _run(tmp_path / "scratch", str(tmp_path / "first" / "missing"), hf=False)
    assert hf_source.hf_source(scratch, tmp_path / "scratch") is None  # the run it started from is gone


def test_the_export_dtype_is_the_sources_else_float32(tmp_path: Path) -> None:
    assert hf_source.export_dtype({"dtype": "bfloat16"}) == "bfloat16"
    assert hf_source.export_dtype({"torch_dtype": "float16"}) == "float16"
    assert hf_source.export_dtype({}) == "float32"


def test_only_the_tokenizer_files_the_source_has_are_copied(tmp_path: Path) -> None:
    source, out = tmp_path / "src", tmp_path / "out"
    source.mkdir()
    out.mkdir()
    (source / "tokenizer.json").write_text(json.dumps({"model": {}}))
    (source / "merges.txt").write_text("a b\n")
    (source / "model.safetensors").write_bytes(b"not copied")
    assert hf_source.copy_tokenizer(source, out) == ["tokenizer.json", "merges.txt"]
    assert sorted(p.name for p in out.iterdir()) == ["merges.txt", "tokenizer.json"]
    assert (out / "merges.txt").read_bytes() == (source / "merges.txt").read_bytes()
