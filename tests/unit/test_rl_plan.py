"""`baton plan` at RL lengths: the generator's KV cache from the RL batch with grouped-query
key/value heads, in chunks of ``generator.max_batch_tokens``; the RL update's logits and
log-prob temporaries; ``baton plan --check`` on a generator's recorded KV cache. Every figure
is computed by hand here from the shapes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from core.config import run as config
from core.config.generator import GeneratorConfig
from core.config.genplan import format_generator, plan_generator
from core.config.plan import make_plan, static_bytes
from core.config.rl import LOGIT_CHUNK_TOKENS
from core.config.rlplan import ENTROPY_TEMPORARIES, format_rl_update, head_bytes, head_rows, plan_rl_update
from core.record import steps as step_records
from launcher.plan_check import run_check

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "experiments" / "grpo_tiny.yaml"
# a 1k-token prompt and 4k response tokens: 32 prompts x 4 samples on one generator replica of tp 2
LONG = ("model.num_layers=2", "model.hidden_size=256", "model.num_attention_heads=8", "model.num_query_groups=2",
        "model.vocab_size=32000", "model.seq_length=5120", "rl.prompt_length=1024", "rl.max_response_length=4096",
        "rl.prompts_per_step=32", "rl.n=4", "generator.tp=2")
FP32 = "training.mixed_precision.enabled=false"


def test_the_generator_continues_a_long_rollout_in_chunks_of_max_batch_tokens_with_gqa_heads() -> None:
    cfg = config.load(GRPO, list(LONG))
    g = plan_generator(cfg, make_plan(cfg, gpu_mem_gb=80))
    assert g is not None and g.dims.describe() == "tp2pp1dp1"
    row = 1024 + 4096
    chunk = GeneratorConfig().max_batch_tokens // row  # 12 rows of 5,120 tokens in 65,536
    assert (g.rows, g.chunk_rows, g.rollout_tokens, g.kv_tokens) == (128, chunk, 128 * row, chunk * row)
    # k and v, 2 layers, 2 kv heads over tp 2 = 1, head 256 / 8 = 32 wide, bf16
    assert g.kv_bytes_per_token == 2 * 2 * 1 * 32 * 2
    assert g.kv_cache_bytes == 2 * 2 * 1 * 32 * 2 * chunk * row
    assert g.logits_bytes == chunk * (32000 // 2) * 4  # each row's last prompt position, the rank's vocabulary, fp32
    assert g.prefill_bytes == 2 * chunk * (8 // 2) * 1024 * 1024 * 2  # scores and softmax, the rank's 4 heads
    mha = plan_generator(*(lambda c: (c, make_plan(c, gpu_mem_gb=80)))(config.load(GRPO, [*LONG, "model.num_query_groups=8"])))
    assert mha is not None and mha.kv_cache_bytes == 4 * g.kv_cache_bytes  # 8 kv heads hold 4x the 2 of GQA
    line = format_generator(g)
    assert f"{chunk} of 128 rows at once, {chunk * row:,} tokens of 256 bytes" in line and "fits" in line


def test_a_short_rollout_is_one_chunk_and_its_fix_names_the_rl_batch() -> None:
    cfg = config.load(GRPO, ["rl.prompts_per_step=16", "rl.n=8"])
    tight = plan_generator(cfg, make_plan(cfg, gpu_mem_gb=1e-4))
    assert tight is not None and tight.chunk_rows == tight.rows == 64  # 128 rows of 12 tokens over dp 2
    assert "DOES NOT FIT: lower rl.prompts_per_step × rl.n or generator.max_batch_tokens" in format_generator(tight)
    long_ = config.load(GRPO, list(LONG))
    chunked = plan_generator(long_, make_plan(long_, gpu_mem_gb=1e-4))
    assert chunked is not None and "DOES NOT FIT: lower generator.max_batch_tokens" in format_generator(chunked)


def _update_cfg(*extra: str) -> config.RunConfig:
    return config.load(GRPO, ["model.vocab_size=32768", "model.seq_length=2560", "rl.prompt_length=512",
                              "rl.max_response_length=2048", "rl.kl.coef=0", *extra])


@pytest.mark.parametrize(("rows", "entropy", "fp32_tensors"), [(1, False, 1), (1, True, 1 + ENTROPY_TEMPORARIES),
                                                                (2, False, 2), (2, True, 1 + ENTROPY_TEMPORARIES)])
def test_the_rl_updates_head_counts_whole_fp32_logit_tensors_at_its_larger_peak(rows: int, entropy: bool,
                                                                               fp32_tensors: int) -> None:
    """fp32, log-probs over a micro-batch at once: the softmax the cross entropy makes of the
    logits in place, plus the entropy's three in the loss's backward, or with two rows the
    gradient's [s, b] copy in the output layer's backward, whichever is larger."""
    cfg = _update_cfg(FP32, f"rl.entropy_coef={0.01 if entropy else 0}")
    positions = rows * 2559
    assert head_bytes(cfg, rows=rows, row_tokens=2559, chunk=None) == fp32_tensors * positions * 32768 * 4


def test_the_rl_updates_head_follows_tp_bf16_and_chunks() -> None:
    s, v = 2559, 32768
    tp2 = _update_cfg(FP32, "parallel.tp=2", "rl.entropy_coef=0.01")
    assert head_bytes(tp2, rows=1, row_tokens=s, chunk=None) == 4 * s * (v // 2) * 4  # the rank's half vocabulary
    bf16 = _update_cfg()  # a GPU plan: bf16 logits
    assert head_bytes(bf16, rows=1, row_tokens=s, chunk=None) == s * v * 4 + s * v * 2  # fp32 softmax + bf16 gradient
    chunked = _update_cfg(FP32, "rl.entropy_coef=0.01")
    # the gradient whole, one chunk's fp32 softmax and the entropy's three temporaries
    assert head_bytes(chunked, rows=1, row_tokens=s, chunk=1024) == s * v * 4 + (1 + 3) * 1024 * v * 4
    two = _update_cfg(FP32)  # two rows: the output layer's reordered copy of the gradient is the larger peak
    assert head_bytes(two, rows=2, row_tokens=s, chunk=1024) == 2 * (2 * s * v * 4)
    assert head_bytes(chunked, rows=1, row_tokens=s, chunk=1024) < head_bytes(chunked, rows=1, row_tokens=s, chunk=None)


def test_the_rl_update_plan_sums_static_layers_and_head_on_the_last_stage() -> None:
    cfg = _update_cfg(FP32, "trainer.n_gpus_per_node=1", "training.global_batch_size=2", "training.micro_batch_size=2",
                      "rl.prompts_per_step=1", "rl.n=2")
    p = plan_rl_update(cfg, make_plan(cfg, gpu_mem_gb=80))
    assert p is not None and (p.row_tokens, p.micro_rows, p.chunk_tokens) == (2559, 2, LOGIT_CHUNK_TOKENS)
    assert p.static_bytes == static_bytes(cfg)
    s, b, h, f, a = 2559, 2, 64, 256, 4  # 2 layers of s·b·(10h + 8h + 4f) + the softmax 2·a·s²·b, fp32 doubles it
    assert p.activations_bytes == 2 * (s * b * (10 * h + 8 * h + 4 * f) + 2 * a * s * s * b) * 4 // 2
    assert p.logits_bytes == head_bytes(cfg, rows=2, row_tokens=s, chunk=LOGIT_CHUNK_TOKENS)
    assert p.total_bytes == p.static_bytes + p.activations_bytes + p.logits_bytes and p.fits
    assert "2 row(s) of 2,559 tokens" in format_rl_update(p) and "fits" in format_rl_update(p)
    assert plan_rl_update(config.load(GRPO, ["program=pretrain"]), make_plan(config.load(GRPO, []))) is None


def test_baton_plan_prints_the_rl_update_and_exits_1_when_it_does_not_fit() -> None:
    args = ["plan", "--gpu-mem-gb", "24", str(GRPO), "model.vocab_size=151936", "model.seq_length=5120", "rl.prompt_length=1024",
            "rl.max_response_length=4096", "rl.entropy_coef=0.01"]
    out = subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 1 and "RL update, worst rank 0:" in out.stdout and "DOES NOT FIT: lower rl." in out.stdout
    small = subprocess.run([sys.executable, "-m", "launcher.cli", "plan", str(GRPO)], capture_output=True, text=True,
                           cwd=REPO)
    assert small.returncode == 0 and "RL update, worst rank 0:" in small.stdout and "; fits" in small.stdout


def _run_folder(tmp_path: Path, kv_mb: list[float | None]) -> Path:
    cfg = config.load(GRPO, list(LONG))
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.yaml").write_text(config.dump(cfg))
    for step, mb in enumerate(kv_mb):
        step_records.append(tmp_path / "metrics.jsonl", step_records.StepRecord(step=step, loss=0.0,
                                                                                gen_kv_cache_mb=mb))
    return tmp_path


def test_plan_check_compares_the_generators_recorded_kv_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No memory.json (no plain training step): the largest recorded KV cache alone, beside
    the plan's in the CPU's fp32 (4 bytes a value): exit 0 within 15 %, 1 beyond."""
    chunk, row = GeneratorConfig().max_batch_tokens // 5120, 5120
    planned_mb = 2 * 2 * 1 * 32 * 4 * chunk * row / 2**20
    run = _run_folder(tmp_path / "ok", [planned_mb * 0.5, None, planned_mb * 1.05])
    assert run_check(run) == 0
    out = capsys.readouterr().out
    assert "generator: the plan's KV cache" in out and f"{planned_mb:.2f}Mi" in out and "0.952" in out
    off = _run_folder(tmp_path / "off", [planned_mb * 2])
    assert run_check(off) == 1 and "off by more than 15%: generator KV cache" in capsys.readouterr().out


def test_plan_check_without_any_measurement_is_still_refused_in_one_line(tmp_path: Path) -> None:
    run = _run_folder(tmp_path, [None])
    res = subprocess.run([sys.executable, "-m", "launcher.cli", "plan", "--check", str(run)], capture_output=True,
                         text=True, cwd=REPO)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "memory.json: missing" in res.stderr, res.stderr


def test_with_a_token_budget_the_head_is_sized_at_the_budgets_positions() -> None:
    """Shorter rows pack up to the budget: two rows of 4,095 fill 8,192 where one whole row of
    5,119 is all the budget holds of the longest rows."""
    cfg = _update_cfg(FP32, "rl.max_tokens_per_micro_batch=8192")
    assert head_rows(cfg, 1, 5119, 16) == (2, 4096)
    assert head_rows(cfg, 1, 5119, 1) == (1, 5119)  # one row in the replica: nothing packs beside it
    p = plan_rl_update(cfg, make_plan(cfg, gpu_mem_gb=80))
    assert p is not None and p.logits_bytes == head_bytes(cfg, rows=2, row_tokens=4096, chunk=LOGIT_CHUNK_TOKENS)
    off = _update_cfg(FP32)
    assert head_rows(off, 2, 5119, 16) == (2, 5119)
