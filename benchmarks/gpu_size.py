"""A real-size GPT through the controller on one GPU: tokens/s, model FLOPs utilisation and
peak CUDA memory beside ``baton plan``'s estimate (``baton plan --check``), for a
125M-parameter modern shape (RMSNorm, SwiGLU, rotary positions, grouped-query attention;
Transformer Engine's layers where importable) in bf16, plain and with int8 activation
storage.

    python benchmarks/gpu_size.py [--steps N] [--peak-tflops F] [--json PATH] [key=value ...]

MFU = (6 N + 12 L h s) tokens/s / peak, N the parameters, L layers, h hidden, s sequence
(the attention's matmuls); ``--peak-tflops`` is the GPU's dense bf16 peak (989 for an
H100 or H200 SXM). The step time is the median after the first 10 steps. On a machine
without a GPU, ``--cpu`` runs a small shape on the CPU to check the script itself.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.local_run import submit_local  # noqa: E402
from core.config import run as config  # noqa: E402
from core.config.plan import count_params  # noqa: E402
from launcher.plan_check import estimate  # noqa: E402

SHAPE = ["model.num_layers=12", "model.hidden_size=768", "model.num_attention_heads=12", "model.num_query_groups=4",
         "model.ffn_hidden_size=2048", "model.vocab_size=32768", "model.seq_length=1024",
         "model.normalization=rmsnorm", "model.activation=swiglu", "model.position_embedding=rope", "model.bias=false"]
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
         "model.ffn_hidden_size=128", "model.vocab_size=256", "model.seq_length=64", "model.normalization=rmsnorm",
         "model.activation=swiglu", "model.position_embedding=rope", "model.bias=false"]
BASE = ["parallel.tp=1", "parallel.pp=1", "trainer.n_gpus_per_node=1", "training.global_batch_size=16",
        "training.micro_batch_size=8", "checkpoint.interval_steps=0", "checkpoint.at_end=false",
        "optimizer.warmup_steps=10"]
VARIANTS = {"bf16": [], "bf16+int8": ["training.activation_storage=int8"]}


def measure(run_dir: Path, peak_tflops: float) -> dict[str, float]:
    cfg = config.load(run_dir / "config.yaml")
    m = cfg.model
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tps = statistics.median(r["tokens_per_s"] for r in recs[10:] or recs)
    flops_per_token = 6 * count_params(cfg).total + 12 * m.num_layers * m.hidden_size * m.seq_length
    est, got, _ = estimate(run_dir)
    peak_mb = max(max(r.get("cuda_peak_mb") or [0.0]) for r in recs)
    return {"params_m": count_params(cfg).total / 1e6, "tokens_per_s": tps,
            "mfu": flops_per_token * tps / (peak_tflops * 1e12), "cuda_peak_mib": peak_mb,
            "plan_mib": sum(est.values()) / 2**20, "measured_mib": sum(got.values()) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--cpu", action="store_true", help="a small shape on the CPU: checks the script")
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args()
    shape = SMALL if args.cpu else SHAPE
    device = ["trainer.device=cpu", "training.mixed_precision.param_dtype=bf16"] if args.cpu else [
        "trainer.device=cuda", "training.mixed_precision.param_dtype=bf16"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in VARIANTS.items():
            run_dir = submit_local(REPO / "experiments" / "tiny_gpt.yaml",
                                   [*BASE, *shape, *device, f"trainer.steps={args.steps}", *extra, *args.overrides],
                                   Path(tmp) / name, timeout_s=3000)
            results[name] = measure(run_dir, args.peak_tflops)
    print(f"{'variant':<12}{'params M':>10}{'tokens/s':>12}{'MFU':>8}{'CUDA peak MiB':>15}{'held MiB':>10}"
          f"{'plan MiB':>10}")
    for name, r in results.items():
        print(f"{name:<12}{r['params_m']:>10.1f}{r['tokens_per_s']:>12.0f}{r['mfu']:>8.1%}{r['cuda_peak_mib']:>15.0f}"
              f"{r['measured_mib']:>10.0f}{r['plan_mib']:>10.0f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
