"""experiments/grpo_qwen3_1p7b.yaml passes the login node's checks against a folder with
Qwen3-1.7B's real config.json, generation_config.json and safetensors headers (every tensor at
its real shape, bfloat16; the data is a sparse file: the headers are real, the 3.4 GB of
weights take no disk) and a small ChatML tokenizer: ``baton plan`` fits it on 8 x 80 GB GPUs,
and ``baton submit --backend slurm --dry-run`` (no sbatch needed: it prints the script and
writes nothing) checks the folder, its tokenizer and stop tokens and the built-in reward. The
prompts file itself is read by the controller when the job starts, not at submit."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from tests.helpers import REPO, baton
from tests.hf_tokenizers import chatml_folder, with_qwen_ids

EXP = "experiments/grpo_qwen3_1p7b.yaml"
QWEN3_1P7B = {  # Qwen/Qwen3-1.7B's config.json
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}


def _shapes(c: dict) -> dict[str, list[int]]:
    h, d, ffn = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = {"model.embed_tokens.weight": [c["vocab_size"], h], "model.norm.weight": [h]}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
                    p + "self_attn.q_proj.weight": [q, h], p + "self_attn.k_proj.weight": [kv, h],
                    p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, q],
                    p + "self_attn.q_norm.weight": [d], p + "self_attn.k_norm.weight": [d],
                    p + "mlp.gate_proj.weight": [ffn, h], p + "mlp.up_proj.weight": [ffn, h],
                    p + "mlp.down_proj.weight": [h, ffn]})
    return out


def _sparse_safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    """A bfloat16 safetensors file: its real header, then a hole as long as the data."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


@pytest.fixture(scope="module")
def qwen3_1p7b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-1.7B's folder as it ships (two shards and an index), weights as holes."""
    folder = tmp_path_factory.mktemp("Qwen3-1.7B")
    # a small ChatML tokenizer whose special tokens have Qwen3's ids: the real generation config names them
    with_qwen_ids(chatml_folder(folder, eos_token_id=[151645, 151643]))
    (folder / "config.json").write_text(json.dumps(QWEN3_1P7B, indent=2))
    names = list(_shapes(QWEN3_1P7B).items())
    shards = [dict(names[:len(names) // 2]), dict(names[len(names) // 2:])]
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _sparse_safetensors(folder / file, shard)
        weight_map.update(dict.fromkeys(shard, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.fixture(scope="module")
def prompts() -> Path:
    return REPO / "experiments" / "data" / "arith_chat.jsonl"


def test_the_folder_is_sparse_and_its_headers_are_what_safetensors_reads(qwen3_1p7b: Path) -> None:
    from safetensors import safe_open

    files = sorted(qwen3_1p7b.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    assert size > 3.4e9 and sum(f.stat().st_blocks * 512 for f in files) < 10e6  # 3.4 GB, no disk
    seen = {}
    for f in files:
        with safe_open(str(f), "np") as st:
            seen.update({k: st.get_slice(k).get_shape() for k in st.keys()})  # noqa: SIM118 - safe_open's API
    assert seen == _shapes(QWEN3_1P7B) and len(seen) == 2 + 28 * 11


def test_baton_plan_fits_grpo_on_qwen3_1p7b_on_one_node_of_80_gb_gpus(qwen3_1p7b: Path, prompts: Path) -> None:
    res = baton("plan", EXP, f"init_from=hf:{qwen3_1p7b}", f"rl.prompts={prompts}", "--gpu-mem-gb", "80", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    plan = json.loads(res.stdout)
    want = sum(math.prod(shape) for shape in _shapes(QWEN3_1P7B).values())  # the files' own count (tied: once)
    assert plan["params"]["total"] == want == 1_720_574_976 and plan["params"]["tied"]
    assert plan["dims"] == {"tp": 1, "pp": 1, "dp": 8} and plan["warnings"] == []
    assert plan["fits"] and plan["generator"]["fits"]
    print(f"GiB per GPU: trainer {plan['memory']['total_bytes'] / 2**30:.1f}, "  # shown with -rP
          f"with the colocated generator {plan['generator']['with_trainer_bytes'] / 2**30:.1f}")
    # room for allocator slack; the rollout is a whole step's (32 × 8 responses over 8 replicas of
    # 512 + 1024 tokens): its KV cache and, above all, the prefill's fp32 logits over the whole
    # vocabulary (32 rows × 512 × 151,936 × 4 bytes, about 10 GB) count
    assert plan["generator"]["with_trainer_bytes"] < 0.7 * 80 * 2**30


def test_submit_dry_run_reads_the_folder_prompts_and_tokenizer_and_prints_the_script(
        qwen3_1p7b: Path, prompts: Path, tmp_path: Path) -> None:
    res = baton("submit", EXP, f"init_from=hf:{qwen3_1p7b}", f"rl.prompts={prompts}", f"runs_root={tmp_path}",
                "--backend", "slurm", "--dry-run")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "#SBATCH" in res.stdout and "--gpus-per-node=8" in res.stdout, res.stdout
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


@pytest.mark.parametrize(("override", "words"), [
    ("rl.stop=[<|eot_id|>]", ("rl.stop", "<|eot_id|>")),  # the folder's tokenizer is really loaded
    ("rl.prompts=/path/to/prompts.jsonl", ("rl.prompts", "/path/to/prompts.jsonl", "does not exist")),  # unedited
], ids=["stop-token", "prompts-placeholder"])
def test_submit_dry_run_refuses_bad_input_in_one_line(qwen3_1p7b: Path, prompts: Path, tmp_path: Path,
                                                      override: str, words: tuple[str, ...]) -> None:
    res = baton("submit", EXP, f"init_from=hf:{qwen3_1p7b}", f"rl.prompts={prompts}", override,
                f"runs_root={tmp_path}", "--backend", "slurm", "--dry-run")
    assert res.returncode == 2 and "\n" not in res.stderr.strip(), res.stdout + res.stderr
    assert all(w in res.stderr for w in words), res.stderr
    assert list(tmp_path.iterdir()) == []


def test_exact_match_scores_the_stripped_response_text_against_the_records_answer() -> None:
    from core.rl import rewards

    fn = rewards.load("exact_match")
    assert fn((1,), (2, 3), {"answer": "12", "response_text": " 12\n"}) == 1.0
    assert fn((1,), (2, 3), {"answer": "12", "response_text": "12."}) == 0.0
    assert fn((1,), (2, 3), {"answer": 1024, "response_text": "1024"}) == 1.0
    with pytest.raises(Exception, match="rl.reward: core.rl.rewards:exact_match raised KeyError.*'answer'"):
        rewards.score(fn, (1,), (2,), {"response_text": "12"}, index=3)
