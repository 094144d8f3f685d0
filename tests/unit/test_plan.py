from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from core.config import run as config
from core.config.plan import (
    GIB,
    RankPlan,
    count_params,
    make_plan,
    memory_per_sample,
    resolve_micro_batch,
    static_bytes,
)
from core.config.planview import format_plan
from core.errors import ConfigError
from launcher import cmd_plan

REPO = Path(__file__).resolve().parents[2]


def _cfg(*overrides: str) -> config.RunConfig:
    return config.from_data(config.apply_overrides({}, list(overrides)))


TP2PP2 = ("trainer.n_gpus_per_node=4", "parallel.tp=2", "parallel.pp=2")
TP2PP2DP2 = ("trainer.n_gpus_per_node=8", "parallel.tp=2", "parallel.pp=2")
BIG = ("model.num_layers=24", "model.hidden_size=2048", "model.num_attention_heads=16",
       "model.vocab_size=50304", "model.seq_length=2048")


def _row(r: RankPlan) -> tuple:
    return (r.rank, r.node, r.local_rank, r.tp, r.pp, r.dp, r.layers, r.embeddings, r.output_layer, r.loss_owner)


def test_tp2pp2_layout_on_four_workers() -> None:
    plan = make_plan(_cfg(*TP2PP2))
    assert [_row(r) for r in plan.ranks] == [
        (0, 0, 0, 0, 0, 0, (0, 1), True, False, False),
        (1, 0, 1, 1, 0, 0, (0, 1), True, False, False),
        (2, 0, 2, 0, 1, 0, (2, 3), False, True, True),
        (3, 0, 3, 1, 1, 0, (2, 3), False, True, False),
    ]
    assert plan.num_micro_batches == 16 // (4 * 1)


def test_tp2pp2dp2_layout_on_eight_workers_over_two_nodes() -> None:
    plan = make_plan(_cfg("trainer.nodes=2", "trainer.n_gpus_per_node=4", "parallel.tp=2", "parallel.pp=2"))
    assert [_row(r) for r in plan.ranks] == [
        (0, 0, 0, 0, 0, 0, (0, 1), True, False, False),
        (1, 0, 1, 1, 0, 0, (0, 1), True, False, False),
        (2, 0, 2, 0, 0, 1, (0, 1), True, False, False),
        (3, 0, 3, 1, 0, 1, (0, 1), True, False, False),
        (4, 1, 0, 0, 1, 0, (2, 3), False, True, True),
        (5, 1, 1, 1, 1, 0, (2, 3), False, True, False),
        (6, 1, 2, 0, 1, 1, (2, 3), False, True, True),
        (7, 1, 3, 1, 1, 1, (2, 3), False, True, False),
    ]
    assert [r.rank for r in plan.ranks if r.loss_owner] == plan.dims.loss_owners()
    assert plan.num_micro_batches == 16 // (4 * 2)


def test_tiny_gpt_param_count_matches_hand_computation() -> None:
    h, f, v, s, layers = 64, 256, 128, 32, 4
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + 4 * h + (2 * h * f + f + h)
    assert per_layer == 12 * h * h + 13 * h == 49_984
    p = count_params(_cfg())
    assert p.per_layer == per_layer
    # core.model.gpt.model builds the output layer untied: its own vocab × hidden weight
    assert p.total == v * h + s * h + layers * per_layer + 2 * h + v * h == 218_496
    assert not p.tied and p.output_layer == v * h and p.tied_copy == 0


def test_per_rank_params_split_matmuls_over_tp() -> None:
    h, f, v, s = 64, 256, 128, 32
    plan = make_plan(_cfg(*TP2PP2))
    sharded = (3 * h * h + 3 * h + h * h + 2 * h * f + f) // 2
    layer = sharded + h + 4 * h + h  # row-parallel biases and LayerNorms are replicated
    assert plan.ranks[0].params == 2 * layer + v * h // 2 + s * h
    assert plan.ranks[2].params == 2 * layer + 2 * h + v * h // 2
    replicated = 4 * 6 * h + s * h + 2 * h  # held by both tp ranks of a stage
    assert sum(r.params for r in plan.ranks) - replicated == plan.params.total


def test_tied_output_layer_is_counted_once_plus_the_last_stage_copy() -> None:
    h, v = 64, 128
    single = make_plan(_cfg("model.tie_embeddings=true"))
    assert single.params.total == 210_304 and single.params.tied_copy == 0
    assert single.ranks[0].params == single.params.total  # one stage: embedding and output share
    staged = make_plan(_cfg("trainer.n_gpus_per_node=2", "parallel.pp=2", "model.tie_embeddings=true"))
    assert staged.params.tied_copy == v * h
    assert sum(r.params for r in staged.ranks) == staged.params.total + v * h


@pytest.mark.megatron
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
def test_param_counts_match_a_real_megatron_gpt_model() -> None:
    code = textwrap.dedent("""
        import json, os, warnings
        warnings.filterwarnings("ignore")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getpid() % 20000))
        import torch, torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        out = {}
        for name, layers, pre, post in [("full", 4, True, True), ("first", 2, True, False), ("last", 2, False, True)]:
            cfg = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4,
                                    use_cpu_initialization=True)
            m = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                         max_sequence_length=32, pre_process=pre, post_process=post,
                         share_embeddings_and_output_weights=False)  # as core.model.gpt.model
            out[name] = sum(p.numel() for p in m.parameters())
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    real = json.loads(proc.stdout.strip().splitlines()[-1])
    assert real["full"] == count_params(_cfg()).total
    stages = make_plan(_cfg("trainer.n_gpus_per_node=2", "parallel.pp=2")).ranks
    assert (real["first"], real["last"]) == (stages[0].params, stages[1].params)


def _variant(plan, *, dist: bool, recompute: str):
    return next(v for v in plan.variants if v.distributed_optimizer == dist and v.recompute == recompute)


def test_memory_orders_distributed_optimizer_and_recompute_modes() -> None:
    plan = make_plan(_cfg(*TP2PP2DP2), gpu_mem_gb=80)
    for rc in ("none", "selective", "full"):
        assert _variant(plan, dist=True, recompute=rc).total_bytes < _variant(plan, dist=False, recompute=rc).total_bytes
    for dist in (False, True):
        full, sel, none = (_variant(plan, dist=dist, recompute=rc).activations_bytes
                           for rc in ("full", "selective", "none"))
        assert full < sel < none
    assert plan.memory == _variant(plan, dist=False, recompute="none")


def test_memory_breakdown_of_the_configured_variant() -> None:
    cfg = _cfg("trainer.n_gpus_per_node=2", "parallel.distributed_optimizer=true", "training.recompute=selective")
    plan = make_plan(cfg)
    m, n = plan.memory, plan.ranks[0].params
    # bf16 weights + fp32 master (sharded), bf16 grads (reduce_dtype bf16), Adam moments (sharded)
    assert (m.weights_bytes, m.grads_bytes, m.optimizer_bytes) == (2 * n + 4 * n // 2, 2 * n, 8 * n // 2)
    assert make_plan(_cfg("training.mixed_precision.reduce_dtype=fp32")).memory.grads_bytes == 4 * n
    fp32 = make_plan(_cfg("training.mixed_precision.enabled=false")).memory
    assert (fp32.weights_bytes, fp32.grads_bytes, fp32.optimizer_bytes) == (4 * n, 4 * n, 8 * n)
    s, b, h = 32, 4, 64
    # the layers' 34 s b h (bf16), and the head: fp32 logits, the final norm's and output layer's bf16 inputs
    assert m.activations_bytes == 4 * s * b * h * 34 and m.logits_bytes == s * b * (128 * 4 + 2 * h * 2)
    assert m.total_bytes == sum((m.weights_bytes, m.grads_bytes, m.optimizer_bytes, m.activations_bytes,
                                 m.logits_bytes))
    assert m.fits is None and plan.fits is None


def test_a_model_too_big_for_the_gpu_warns_and_suggests_a_fix() -> None:
    plan = make_plan(_cfg(*BIG), gpu_mem_gb=1)
    assert plan.fits is False and plan.memory.total_bytes > GIB
    assert any(w.startswith("does not fit: rank 0 needs about") for w in plan.warnings)
    assert make_plan(_cfg(*BIG), gpu_mem_gb=80).fits is True


def test_the_fit_hint_names_only_the_settings_to_change() -> None:
    big = _cfg(*TP2PP2DP2, "model.num_layers=48", "model.hidden_size=4096", "model.num_attention_heads=32",
               "model.vocab_size=50304", "model.seq_length=2048", "training.global_batch_size=32")
    plan = make_plan(big, gpu_mem_gb=80)
    assert plan.fits is False
    assert plan.warnings[-1].endswith("GiB of 80 GiB; would fit with training.recompute=selective")


def test_format_plan_lists_every_rank_row_and_the_warnings() -> None:
    plan = make_plan(_cfg(*TP2PP2, *BIG[:-1]), gpu_mem_gb=1)
    text = format_plan(plan)
    rows = [ln.split() for ln in text.splitlines() if re.match(r"\s+\d+\s+n\d+/g\d+", ln)]
    assert [r[:7] for r in rows] == [["0", "n0/g0", "0", "0", "0", "0-11", f"{plan.ranks[0].params:,}"],
                                     ["1", "n0/g1", "1", "0", "0", "0-11", f"{plan.ranks[1].params:,}"],
                                     ["2", "n0/g2", "0", "1", "0", "12-23", f"{plan.ranks[2].params:,}"],
                                     ["3", "n0/g3", "1", "1", "0", "12-23", f"{plan.ranks[3].params:,}"]]
    assert "DOES NOT FIT" in text and "warnings:" in text and plan.warnings[0] in text
    assert "<- configured" in text


def test_plan_json_round_trips_through_json() -> None:
    plan = make_plan(_cfg(*TP2PP2DP2), gpu_mem_gb=80)
    data = json.loads(plan.to_json())
    assert data["dims"] == {"tp": 2, "pp": 2, "dp": 2}
    assert len(data["ranks"]) == 8 and data["ranks"][4]["layers"] == [2, 3]
    assert data["memory"]["total_bytes"] == plan.memory.total_bytes


def test_auto_micro_batch_takes_the_largest_divisor_that_fits() -> None:
    cfg = _cfg(*TP2PP2DP2, "training.micro_batch_size=auto")  # 16 / dp 2 = 8 samples per replica
    per_sample = memory_per_sample(cfg)
    assert resolve_micro_batch(cfg, 0) == 1
    assert resolve_micro_batch(cfg, 3.5 * per_sample / 0.9) == 2  # floor 3 → largest divisor of 8 ≤ 3
    assert resolve_micro_batch(cfg, 5 * per_sample / 0.9) == 4
    assert resolve_micro_batch(cfg, 1e15) == 8
    plan = make_plan(cfg, gpu_mem_gb=80)
    assert plan.micro_batch_auto and plan.micro_batch_size == 8 and plan.num_micro_batches == 1
    tight = (static_bytes(cfg) + 2.5 * per_sample / 0.9) / GIB
    assert make_plan(cfg, gpu_mem_gb=tight).micro_batch_size == 2


def test_auto_micro_batch_without_gpu_memory_is_one_with_a_warning() -> None:
    plan = make_plan(_cfg("training.micro_batch_size=auto"))
    assert plan.micro_batch_size == 1 and plan.num_micro_batches == 16
    assert any("auto resolved to 1" in w for w in plan.warnings)


def test_layout_warnings_name_the_config_key() -> None:
    plan = make_plan(_cfg(*TP2PP2, "model.vocab_size=257"))
    assert any(w.startswith("model.vocab_size: 257 is not divisible by parallel.tp = 2") for w in plan.warnings)
    plan = make_plan(_cfg(*TP2PP2, "training.micro_batch_size=16"))
    assert any("only 1 micro-batch(es) for 2 pipeline stages" in w for w in plan.warnings)


def test_toy_model_has_no_plan() -> None:
    with pytest.raises(ConfigError, match="model.kind: 'toy'"):
        make_plan(_cfg("model.kind=toy"))


def _plan_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cmd_plan.register(parser.add_subparsers())
    return parser.parse_args(["plan", *argv])


def test_plan_command_prints_the_table_or_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text("trainer:\n  n_gpus_per_node: 4\nparallel:\n  tp: 2\n")
    assert cmd_plan.run(_plan_args(str(path), "parallel.pp=2")) == 0
    assert "layout: tp2pp2dp1 on 4 workers" in capsys.readouterr().out
    assert cmd_plan.run(_plan_args(str(path), "--json")) == 0
    assert json.loads(capsys.readouterr().out)["dims"] == {"tp": 2, "pp": 1, "dp": 2}
    big = [f"{o}" for o in BIG]
    assert cmd_plan.run(_plan_args(str(path), *big, "--gpu-mem-gb", "1")) == 1


def test_plan_command_leaves_user_errors_to_the_cli(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        cmd_plan.run(_plan_args(str(tmp_path / "missing.yaml")))
    path = tmp_path / "exp.yaml"
    path.write_text("parallel:\n  tp: 3\n")
    with pytest.raises(ConfigError, match="parallel.tp: 3 does not divide"):
        cmd_plan.run(_plan_args(str(path)))


def test_the_generator_plan_counts_its_weights_kv_cache_and_logits_per_rank() -> None:
    from core.config import run as config_mod
    from core.config.genplan import plan_generator
    from core.config.plan import count_params, make_plan

    cfg = config_mod.load(Path(__file__).resolve().parents[2] / "experiments" / "tiny_gpt_generate.yaml",
                          ["generator.placement=split", "generator.workers=2"])
    trainer = make_plan(cfg, gpu_mem_gb=80)
    g = plan_generator(cfg, trainer)
    assert g is not None and (g.placement, g.first_rank, g.dims.describe()) == ("split", 4, "tp1pp1dp2")
    assert g.weights_bytes == 2 * count_params(cfg).total  # tp1: the whole model, bf16 on a GPU
    assert g.kv_cache_bytes == 2 * 4 * 2 * (8 + 8) * 64 * 2  # k and v, 4 layers, 2 prompts per replica, hidden 64
    assert g.logits_bytes == 2 * 128 * 4  # each row's last prompt position, fp32, the rank's vocabulary
    assert g.prefill_bytes == 2 * 2 * 4 * 8 * 8 * 2  # scores and softmax, 2 rows, 4 heads, 8 x 8 positions, bf16
    assert g.with_trainer_bytes == g.total_bytes and g.fits
    colocated = plan_generator(config_mod.load(Path(__file__).resolve().parents[2] / "experiments" /
                                               "tiny_gpt_generate.yaml", ["generator.num_prompts=100000"]), trainer)
    assert colocated is not None and colocated.with_trainer_bytes == colocated.total_bytes + trainer.memory.total_bytes
    # 25,000 rows per replica in chunks of 4,096 (generator.max_batch_tokens 65,536 / 16 tokens): 64 MiB of KV
    # cache, over 0.05 GiB beside the trainer's 1.7 MiB, which fits alone
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "plan", "experiments/tiny_gpt_generate.yaml",
                          "generator.num_prompts=100000", "--gpu-mem-gb", "0.05"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 1 and "generator: tp1pp1dp4, colocated" in out.stdout, out.stdout
    assert "of 0.05 GiB: fits" in out.stdout and "4096 of 25000 rows at once" in out.stdout
    assert "DOES NOT FIT: lower generator.max_batch_tokens" in out.stdout


def test_an_rl_program_plans_memory_for_its_reference_and_its_critic() -> None:
    """grpo with a KL term holds the reference's weights beside the actor; ppo a critic with
    its gradients and optimizer state, as large as the actor's."""
    base = REPO / "experiments" / "grpo_tiny.yaml"
    grpo, ppo = (config.load(base, [f"program={p}"]) for p in ("grpo", "ppo"))
    pretrain, no_kl = config.load(base, ["program=pretrain"]), config.load(base, ["rl.kl.coef=0"])
    actor = static_bytes(pretrain)
    assert static_bytes(no_kl) == actor
    reference = static_bytes(grpo) - actor
    assert reference > 0 and static_bytes(ppo) == 2 * actor + reference


MODERN = ("model.normalization=rmsnorm", "model.activation=swiglu", "model.position_embedding=rope",
          "model.num_query_groups=2", "model.bias=false", "model.tie_embeddings=true", "model.head_dim=24",
          "model.qk_norm=true", "model.qkv_bias=true")


@pytest.mark.megatron
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
def test_param_counts_of_modern_shapes_match_the_models_baton_builds() -> None:
    """rmsnorm, swiglu, rope, grouped-query attention, bias-free linears, a head size that is
    not hidden/heads, q/k norms and q/k/v-only biases, each alone and together: the plan's count equals the parameters of the GPT core.model.gpt.model builds."""
    variants = [MODERN, *((o,) for o in MODERN)]
    code = textwrap.dedent("""
        import json, os, sys, warnings
        warnings.filterwarnings("ignore")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getpid() % 20000))
        import torch, torch.distributed as dist
        from core.parallel.imports import import_megatron
        import_megatron()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from core.model.gpt import model as M
        from core.parallel import cpu_shim
        from core.config import run as C
        cpu_shim.activate_if_needed()
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(1)
        out = []
        for overrides in json.loads(sys.argv[1]):
            cfg = C.from_data(C.apply_overrides({}, overrides))
            gpt = M.build_model(M.transformer_config(cfg.model, cfg.parallel, cfg.training, on_cuda=False),
                                cfg.model, on_cuda=False)
            out.append(sum(p.numel() for p in gpt.parameters()))
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", code, json.dumps([list(v) for v in variants])], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    real = json.loads(proc.stdout.strip().splitlines()[-1])
    assert real == [count_params(_cfg(*v)).total for v in variants]


def test_int8_activation_storage_halves_the_planned_activations() -> None:
    """The plan's activation formula counts 16-bit activations; int8 storage keeps one byte."""
    plain, int8 = (make_plan(_cfg(*BIG, "trainer.n_gpus_per_node=4", f"training.activation_storage={s}"),
                             gpu_mem_gb=80).memory for s in ("plain", "int8"))
    assert plain.activations_bytes > 0 and int8.activations_bytes * 2 == plain.activations_bytes
    assert int8.weights_bytes == plain.weights_bytes and int8.logits_bytes < plain.logits_bytes


def test_zero3_plans_every_static_byte_split_over_data_parallelism() -> None:
    """parallel.sharding params: the fp32 parameters, gradients and Adam moments of each rank
    are 1/dp of the model's (16 bytes a parameter in all)."""
    cfg = _cfg(*BIG, "trainer.n_gpus_per_node=4", "parallel.sharding=params")
    total = count_params(cfg).total
    assert static_bytes(cfg) == 2 * -(-4 * total // 4) + -(-8 * total // 4) == 16 * total // 4
    assert static_bytes(cfg) < static_bytes(_cfg(*BIG, "trainer.n_gpus_per_node=4", "parallel.sharding=optimizer"))


@pytest.mark.parametrize(("experiment", "params"), [("qwen3_1p7b.yaml", 1_720_567_808), ("gpt_13b.yaml", 13_015_864_320)])
def test_real_model_shapes_plan_on_8_x_80_gb(experiment: str, params: int) -> None:
    """A Qwen3-1.7B shape (tied embeddings) on one node and a 13B Llama-2 shape on two,
    8 x 80 GB each: the plan's parameters and that they fit."""
    plan = make_plan(config.load(REPO / "experiments" / experiment, []), gpu_mem_gb=80)
    assert plan.params.total == params and plan.fits is True
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "plan", f"experiments/{experiment}"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0 and f"params: {params:,} total" in out.stdout, out.stdout + out.stderr


def test_an_rl_runs_generator_plan_holds_a_whole_rollout_of_prompt_and_response_tokens() -> None:
    """Under grpo the generator continues every response of a step at once (prompts_per_step ×
    n over its replicas), each prompt_length + max_response_length long, not generator.num_prompts;
    with grouped-query attention its KV cache holds the key/value heads only."""
    from core.config.genplan import format_generator, plan_generator
    from core.config.plan import make_plan

    base = REPO / "experiments" / "grpo_tiny.yaml"
    cfg = config.load(base, ["rl.prompts_per_step=16", "rl.n=8", "rl.prompt_length=4", "rl.max_response_length=12",
                             "model.seq_length=16", "generator.num_prompts=2"])
    g = plan_generator(cfg, make_plan(cfg, gpu_mem_gb=80))
    assert g is not None
    rows = -(-16 * 8 // g.dims.dp)  # this replica's share of the step's 128 responses
    m = cfg.model
    assert g.kv_cache_bytes == 2 * m.num_layers * rows * (4 + 12) * m.hidden_size // g.dims.tp * 2  # bf16
    assert g.chunk_rows == rows and g.logits_bytes == rows * m.vocab_size * 4  # 64 rows of 16 tokens: one chunk
    gqa = config.load(base, ["rl.prompts_per_step=16", "rl.n=8", "rl.prompt_length=4", "rl.max_response_length=12",
                             "model.seq_length=16", "model.num_query_groups=1"])
    g1 = plan_generator(gqa, make_plan(gqa, gpu_mem_gb=80))
    assert g1 is not None and g1.kv_cache_bytes * m.num_attention_heads == g.kv_cache_bytes  # one kv head of 4
    small = plan_generator(cfg, make_plan(cfg, gpu_mem_gb=1e-4))
    assert small is not None and "DOES NOT FIT: lower rl.prompts_per_step × rl.n" in format_generator(small)
