"""Memory per rank and step time for each way of holding a model: no sharding, ZeRO-1
(``parallel.sharding=optimizer``), ZeRO-3 (``params``), each plain, with int8 activation
storage and with full recompute; the ranks' measured bytes (memory.json) beside
``baton plan``'s estimate for the same run (``baton plan --check``), same run.

    python benchmarks/memory.py [--quick] [--json PATH] [key=value ...]

Every variant is experiments/tiny_gpt.yaml at tp1 pp1 on two data-parallel workers (CPU,
gloo), widened (--quick: as shipped) so that a step is more than start-up noise. Step time
is the median over the steps after the first two (the first measures).
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
from launcher.plan_check import estimate  # noqa: E402

EXP = REPO / "experiments" / "tiny_gpt.yaml"
BASE = ["parallel.tp=1", "parallel.pp=1", "trainer.n_gpus_per_node=2", "checkpoint.interval_steps=0",
        "checkpoint.at_end=false"]
WIDE = ["model.hidden_size=256", "model.num_attention_heads=8", "model.seq_length=128", "model.num_layers=4"]
SHARDING = ("none", "optimizer", "params")
STORAGE = {"plain": [], "int8": ["training.activation_storage=int8"], "recompute": ["training.recompute=full"]}


def run(overrides: list[str], root: Path) -> dict:
    run_dir = submit_local(EXP, [*BASE, *overrides], root)
    est, got, rank = estimate(run_dir)
    steps = [json.loads(line)["step_time_s"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"rank": rank, "estimate": est, "measured": got, "step_s": statistics.median(steps[2:] or steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the shipped tiny model, 6 steps")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args()
    size = [] if args.quick else WIDE
    steps = ["trainer.steps=6" if args.quick else "trainer.steps=12"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for sharding in SHARDING:
            for name, extra in STORAGE.items():
                key = f"{sharding}/{name}"
                results[key] = run([*size, *steps, f"parallel.sharding={sharding}", *extra, *args.overrides],
                                   Path(tmp) / key.replace("/", "-"))
    cats = ("weights", "gradients", "optimizer", "activations")
    print(f"{'variant':<22}" + "".join(f"{c + ' MiB':>24}" for c in cats) + f"{'step s':>9}")
    print(f"{'':<22}" + "".join(f"{'measured / plan':>24}" for _ in cats))
    for key, r in results.items():
        cells = "".join(f"{r['measured'][c] / 2**20:>15.2f} / {r['estimate'][c] / 2**20:<6.2f}" for c in cats)
        print(f"{key:<22}{cells}{r['step_s']:>9.3f}")
    base = results["none/plain"]
    total = {k: sum(r["measured"].values()) for k, r in results.items()}
    print("\nper-rank total measured, relative to no sharding with plain storage (same run):")
    for key in results:
        print(f"  {key:<22} {total[key] / 2**20:8.2f} MiB  {total[key] / total['none/plain']:.2f}x  "
              f"step {results[key]['step_s'] / base['step_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
