"""Import then export: a bfloat16 Hugging Face model started from (``init_from: hf:PATH``) and
exported again (``baton export``) gives every tensor back bit for bit, in each family and
in a tensor/pipeline-parallel layout, with the source's dtype, token ids and tokenizer
files; transformers loads the export and computes the original's logits exactly.

Each run takes one step at a learning rate of 1e-30 (Adam moves a weight by about 1e-30,
far below float32's spacing at the weights' sizes), so its checkpoint holds the imported
weights: bfloat16 -> float32 -> bfloat16 is exact.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, baton, submit_local

LAYOUTS = {"llama": (1, 2), "qwen2": (2, 1), "qwen3": (2, 2)}  # (tp, pp) each family's run uses
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]


def _bf16_source(fp32: Path, folder: Path) -> Path:
    """The family's random model in bfloat16, with a tokenizer and a chat template beside it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16)
    model.config.bos_token_id, model.config.eos_token_id = 1, 2
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(96)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", unk_token="t0")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def roundtrips(hf_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("roundtrip")
    out = {}
    for family, (tp, pp) in LAYOUTS.items():
        source = _bf16_source(hf_models[family], root / f"{family}_bf16")
        exp = yaml.safe_load((REPO / "experiments" / "tiny_gpt.yaml").read_text())
        exp["model"] = {"seq_length": 32}  # the shape is config.json's
        exp["init_from"] = f"hf:{source}"
        exp["trainer"].update(steps=1, n_gpus_per_node=tp * pp)
        exp["parallel"] = {"tp": tp, "pp": pp}
        exp["optimizer"].update(lr=1e-30, min_lr=0.0, warmup_steps=0)
        (root / f"{family}.yaml").write_text(yaml.safe_dump(exp))
        run = submit_local(str(root / f"{family}.yaml"), f"runs_root={root / 'runs' / family}")
        res = baton("export", str(run), "--hf", str(root / f"{family}_out"), "--max-shard-size", "20KB")
        assert res.returncode == 0, res.stdout + res.stderr
        out[family] = (source, root / f"{family}_out")
    return out


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_an_imported_model_exports_bit_for_bit(family: str, roundtrips: dict) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, out = roundtrips[family]
    want = {}
    for f in source.glob("*.safetensors"):
        want.update(load_file(f))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for f in sorted(set(index["weight_map"].values())):
        got.update(load_file(out / f))
    assert len(set(index["weight_map"].values())) > 1 and sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype == torch.bfloat16, name
        assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), name
    config, original = (json.loads((p / "config.json").read_text()) for p in (out, source))
    assert config["dtype"] == "bfloat16" and config["architectures"] == original["architectures"]
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    for name in (*TOKENIZER, "generation_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(p).eval()(tokens).logits for p in (source, out)]
    assert torch.equal(logits[0], logits[1])
    chat = AutoTokenizer.from_pretrained(out).apply_chat_template([{"role": "user", "content": "t5 t6"}], tokenize=False)
    assert chat == "t5 t6 "
