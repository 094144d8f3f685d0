"""What the controller costs per step: a Baton-driven run beside the same Megatron loop
under plain torchrun (no controller, no ZeroMQ), same model, layout and data, same run.

    python benchmarks/step_overhead.py [--quick] [--json PATH] [key=value ...]

Baton's step time is the controller's wall time per train_step call (dispatch, compute on
every rank, collect); the plain loop's is the gap between consecutive train_step returns on the last rank.
Means over the same steps (the first 5 are warm-up).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXP = REPO / "experiments" / "tiny_gpt.yaml"


def _pythonpath() -> str:
    """The repo first, then what the caller had (packages installed outside site-packages)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)


def baton_run(overrides: list[str], root: Path) -> tuple[list[float], int]:
    env = dict(os.environ, PYTHONPATH=_pythonpath())
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "submit", str(EXP), f"runs_root={root}",
                          "checkpoint.at_end=false", "checkpoint.interval_steps=0", *overrides, "--backend", "local"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=1200, check=True)
    run_dir = Path(out.stdout.strip().splitlines()[-1].split(": ", 1)[1])
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in recs], recs[-1]["tokens"]


def plain_run(overrides: list[str], root: Path, nproc: int) -> tuple[list[float], int]:
    out = root / f"plain-{len(list(root.iterdir()))}.json"
    env = dict(os.environ, PYTHONPATH=_pythonpath(), OMP_NUM_THREADS="1")
    with socket.socket() as s:  # torchrun's --master_port=0 hangs the gloo rendezvous: pick one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
                    str(REPO / "benchmarks" / "plain_megatron_loop.py"), str(EXP), "checkpoint.at_end=false",
                    *overrides, "--out", str(out)], env=env, cwd=REPO, timeout=1200, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    data = json.loads(out.read_text())
    return data["step_time_s"], data["tokens"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps, one repetition")
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*", help="config overrides for both runs")
    args = ap.parse_args()
    steps = 25 if args.quick else 60
    reps = 1 if args.quick else 2
    warm = 5
    overrides = [f"trainer.steps={steps}", *args.overrides]
    sys.path.insert(0, str(REPO))
    from core.config import run as config_mod

    nproc = config_mod.load(EXP, overrides).trainer.world_size
    baton_t: list[float] = []
    plain_t: list[float] = []
    tokens = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i in range(reps):  # alternate the order: the machine drifts
            order = [("baton", baton_run), ("plain", None)] if i % 2 == 0 else [("plain", None), ("baton", baton_run)]
            for name, _ in order:
                if name == "baton":
                    t, tokens = baton_run(overrides, root)
                    baton_t += t[warm:]
                else:
                    t, tokens = plain_run(overrides, root, nproc)
                    plain_t += t[warm:]
    b, p = statistics.fmean(baton_t), statistics.fmean(plain_t)
    rows = {"steps_timed": len(baton_t), "tokens_per_step": tokens,
            "baton_step_s": b, "plain_step_s": p, "baton_tokens_per_s": tokens / b, "plain_tokens_per_s": tokens / p,
            "overhead_pct": (b - p) / p * 100}
    print(f"\nstep time, means over {len(baton_t)} steps (tiny GPT {' '.join(overrides)}, {nproc} processes)")
    print(f"{'':<22}{'step':>10}{'tokens/s':>12}")
    print(f"{'plain torchrun loop':<22}{p * 1e3:>8.1f}ms{tokens / p:>12.0f}")
    print(f"{'baton (controller)':<22}{b * 1e3:>8.1f}ms{tokens / b:>12.0f}")
    print(f"controller overhead: {rows['overhead_pct']:+.2f}% of step time (target < 2%)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
