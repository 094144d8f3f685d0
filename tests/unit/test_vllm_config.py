"""``generator.engine: vllm`` on the login node: ``baton plan``'s numbers for the engine
(checked against a hand count: weights = parameters × bytes of the engine's dtype; KV per
token = 2 × layers × key/value heads × head dim × bytes) and the bad values of its keys, each
refused by ``baton submit`` in one line naming the key, the value and the fix, exit 2, before
any run folder is written."""
from __future__ import annotations

from pathlib import Path

import pytest

from core.config import run as config
from core.config.genplan import format_generator, plan_generator
from core.config.plan import GIB, make_plan
from tests.helpers import REPO, baton, refused_at_submit

VLLM_TINY = REPO / "experiments" / "grpo_vllm_tiny.yaml"
GRPO_TINY = REPO / "experiments" / "grpo_tiny.yaml"
# the tiny Qwen3 of grpo_vllm_tiny.yaml by hand: tied embeddings 32 × 64; per layer q 64 × 64,
# k and v 64 × 32 each, o 64 × 64, gate and up 64 × 128 each, down 128 × 64, two norms of 64,
# q and k norms of 32; the final norm 64
PARAMS = 32 * 64 + 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 64 * 128 + 128 * 64 + 2 * 64 + 2 * 32) + 64
KV_TOKEN_BF16 = 2 * 2 * 1 * 32 * 2  # a key and a value × 2 layers × 1 key/value head × head dim 32 × 2 bytes


def _plan(*overrides: str, gpu_gb: float | None = 80):
    cfg = config.load(VLLM_TINY, list(overrides))
    trainer = make_plan(cfg, gpu_mem_gb=gpu_gb)
    g = plan_generator(cfg, trainer)
    assert g is not None and g.engine == "vllm"
    return g, trainer


def test_the_engine_takes_its_share_of_the_gpu_and_its_kv_cache_is_what_the_weights_leave() -> None:
    g, trainer = _plan("generator.kv_cache_mb=null", "generator.gpu_memory_utilization=0.3")
    assert g.weights_bytes == PARAMS * 2  # bf16 on a GPU, the whole model at tp 1
    assert g.kv_bytes_per_token == KV_TOKEN_BF16
    assert g.total_bytes == int(0.3 * 80 * GIB) + PARAMS * 2  # and the staged copy the syncs fill
    assert g.kv_cache_bytes == int(0.3 * 80 * GIB) - PARAMS * 2
    assert g.kv_tokens == g.kv_cache_bytes // KV_TOKEN_BF16
    assert g.rollout_tokens == 4 * 8 * (4 + 8)  # prompts_per_step × n rows of prompt + response tokens
    assert g.with_trainer_bytes == g.total_bytes + trainer.memory.total_bytes and g.fits
    line = format_generator(g)
    assert "vLLM engine" in line and "both are resident" in line and line.endswith("; fits")


def test_kv_cache_mb_sizes_the_kv_cache_beside_the_weights_in_the_engines_dtype() -> None:
    g, trainer = _plan("generator.kv_cache_mb=64", "training.mixed_precision.enabled=false")
    assert g.weights_bytes == PARAMS * 4  # fp32
    assert g.kv_bytes_per_token == 2 * KV_TOKEN_BF16
    assert g.kv_cache_bytes == 64 * 2**20 and g.kv_tokens == 64 * 2**20 // (2 * KV_TOKEN_BF16)
    assert g.total_bytes == PARAMS * 4 + 64 * 2**20 + PARAMS * 4  # weights, KV cache, the staged copy
    assert g.with_trainer_bytes == g.total_bytes + trainer.memory.total_bytes


def test_tensor_parallelism_splits_the_key_value_heads() -> None:
    wide, _ = _plan("model.num_query_groups=2")
    split, _ = _plan("model.num_query_groups=2", "generator.placement=split", "generator.tp=2")
    assert wide.kv_bytes_per_token == 2 * KV_TOKEN_BF16  # two key/value heads on one rank
    assert split.kv_bytes_per_token == KV_TOKEN_BF16  # one on each of two
    assert split.with_trainer_bytes == split.total_bytes  # split: its workers hold the engine alone


def test_a_colocated_engine_whose_share_and_the_trainer_exceed_the_gpu_does_not_fit() -> None:
    gpu_gb = 0.05
    g, trainer = _plan("generator.kv_cache_mb=null", "generator.gpu_memory_utilization=0.99", gpu_gb=gpu_gb)
    gpu = int(gpu_gb * GIB)
    staged = PARAMS * 2
    assert g.with_trainer_bytes == int(0.99 * gpu) + staged + trainer.memory.total_bytes > gpu and g.fits is False
    most = (gpu - trainer.memory.total_bytes - staged) / gpu
    assert g.fix.startswith(f"lower generator.gpu_memory_utilization to at most {most:.2f}")
    split, _ = _plan("generator.kv_cache_mb=null", "generator.gpu_memory_utilization=1",
                     "generator.placement=split", gpu_gb=gpu_gb)  # its own GPU, but the staged copy needs room
    assert split.total_bytes == gpu + staged and split.fits is False
    assert split.fix.startswith(f"lower generator.gpu_memory_utilization to at most {(gpu - staged) / gpu:.2f}")
    assert "placement=split" not in split.fix
    out = baton("plan", str(VLLM_TINY), "generator.kv_cache_mb=null", "generator.gpu_memory_utilization=0.99",
                "--gpu-mem-gb", str(gpu_gb), timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "generator: vLLM engine" in out.stdout and "DOES NOT FIT: lower generator.gpu_memory_utilization" in out.stdout


def test_a_kv_cache_smaller_than_one_sequence_does_not_fit() -> None:
    g, _ = _plan("generator.kv_cache_mb=null", "generator.gpu_memory_utilization=0.01", gpu_gb=1e-3)
    assert g.kv_tokens < 16 + 1 and g.fits is False
    assert "less than one sequence of model.seq_length + 1 = 17" in g.fix


_refused = refused_at_submit


FAMILY = ("model.normalization=rmsnorm", "model.activation=swiglu", "model.position_embedding=rope",
          "model.bias=false")
BAD = [  # (experiment, overrides, what the line starts with, what else it says)
    (GRPO_TINY, ("generator.engine=sglang",), "generator.engine: 'sglang' is not", "'vllm'"),
    (GRPO_TINY, ("generator.engine=vllm",), "generator.engine: vllm runs the policy as a Hugging Face",
     "model.normalization: rmsnorm (now layernorm), model.activation: swiglu (now gelu), "
     "model.position_embedding: rope (now learned)"),
    (GRPO_TINY, ("generator.engine=vllm", *FAMILY), "generator.engine: vllm needs a head dim of at least 32",
     "model.num_attention_heads 4 = 16); use fewer, wider heads"),
    (VLLM_TINY, ("generator.gpu_memory_utilization=1.5",), "generator.gpu_memory_utilization: 1.5 must be ≤ 1", ""),
    (VLLM_TINY, ("generator.kv_cache_mb=0",), "generator.kv_cache_mb: 0", "must be > 0"),
    (VLLM_TINY, ("generator.kv_cache_mb=0.001",), "generator.kv_cache_mb: 0.001 holds fewer than one sequence",
     "raise it to at least"),
    (VLLM_TINY, ("generator.kv_cache_mb=null", "generator.gpu_memory_utilization=1"),
     "generator.gpu_memory_utilization: 1 gives a colocated vLLM engine the whole GPU",
     "or use generator.placement=split"),
]


@pytest.mark.parametrize(("experiment", "overrides", "starts", "says"), BAD, ids=[" ".join(b[1]) for b in BAD])
def test_a_bad_vllm_key_is_refused_at_submit_in_one_line_naming_key_value_and_fix(
        tmp_path: Path, experiment: Path, overrides: tuple[str, ...], starts: str, says: str) -> None:
    line = _refused(tmp_path, experiment, *overrides)
    assert line.startswith(starts) and says in line, line
