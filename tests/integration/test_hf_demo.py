"""`make hf-demo` (experiments/hf_roundtrip.py) end to end: pretrain a tiny Qwen3-shaped GPT,
export it, transformers continues its prompts with the run's own tokens and log-probs, GRPO
starts from the exported folder, and a LayerNorm/GELU run's export is refused in one line.
The script checks itself; here the numbers it prints are asserted, and the GRPO run's step-0
checkpoint is compared with the export's safetensors independently of `baton export` (the
checkpoint's global arrays mapped by core.hf.layout, as the import test does)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import REPO, checkpoint_weights

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("hf-demo")
    res = subprocess.run([sys.executable, "experiments/hf_roundtrip.py", "--work", str(work), "--json",
                          str(work / "result.json")], capture_output=True, text=True, cwd=REPO, timeout=280)
    print(res.stdout)  # shown with -rP
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1] == "all checks hold"
    return {"stdout": res.stdout, **json.loads((work / "result.json").read_text())}


def test_transformers_continues_the_exported_run_with_its_tokens_and_log_probs(demo: dict) -> None:
    assert demo["same_tokens"] is True
    assert demo["logprob_gap"] < 1e-5  # samples.jsonl keeps 6 decimals: the gap is at least their rounding
    assert f"largest log-prob gap: {demo['logprob_gap']:.2e}" in demo["stdout"]
    config = json.loads((Path(demo["export"]) / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 32
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is True


def test_grpo_from_the_export_has_the_exported_tensors_as_its_step_0_checkpoint(demo: dict) -> None:
    from safetensors.numpy import load_file

    from core.hf import layout

    export = Path(demo["export"])
    want = {k: v for f in sorted(export.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    dims = layout.Dims(layers=2, hidden=64, heads=4, groups=2, head_dim=32, ffn=128, vocab=32, qk_norm=True, tied=True)
    got: dict[str, np.ndarray] = {}
    for name, array in checkpoint_weights(Path(demo["grpo_run"]), 0).items():
        got.update(layout.to_hf(name, array, dims))
    assert got.keys() == want.keys() and len(want) == 2 + 2 * 11
    for name, array in want.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)
    assert demo["step0_equals_export"] is True and len(demo["grpo_rewards"]) == 2


def test_the_export_of_a_layernorm_gelu_run_is_refused_in_one_line(demo: dict) -> None:
    assert demo["refusal_exit"] == 2 and "\n" not in demo["refusal"]
    for words in ("model.normalization rmsnorm (this run: layernorm)", "model.activation swiglu (this run: gelu)",
                  "model.position_embedding rope (this run: learned)"):
        assert words in demo["refusal"], demo["refusal"]
