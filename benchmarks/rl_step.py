"""What the controller and the worker groups cost per GRPO step: ``program: grpo`` under
Baton beside the same algorithm as one plain process (benchmarks/plain_grpo_loop.py: no
controller, no groups, the actor generates itself), same model, prompts and seeds, same run.

    python benchmarks/rl_step.py [--quick] [--json PATH] [key=value ...]

Both run experiments/grpo_tiny.yaml on one worker process (trainer.n_gpus_per_node=1),
widened (--quick: as shipped) so that compute, not the tiny demo's milliseconds, fills a
step. Baton's figures are the controller's per-phase wall times from metrics.jsonl
(``phase_s``; sync is the weight sync into the rollout model and its check, which the
plain loop has no need of); the plain loop's are the same phases timed in-process. Medians
over the RL steps after the first 3.
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
EXP = REPO / "experiments" / "grpo_tiny.yaml"
PHASES = ("sync", "generate", "reward", "old", "ref", "update")
WIDE = ["model.hidden_size=512", "model.num_layers=4", "model.num_attention_heads=8"]


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")


def baton_run(overrides: list[str], root: Path) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "submit", str(EXP), f"runs_root={root}",
                          "checkpoint.at_end=false", "checkpoint.interval_steps=0", *overrides, "--backend", "local"],
                         capture_output=True, text=True, env=_env(), cwd=REPO, timeout=3600, check=True)
    run_dir = Path(next(line for line in out.stdout.splitlines() if line.startswith("run folder: ")).split(": ", 1)[1])
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step_time_s": r["step_time_s"], "phase_s": r["phase_s"]} for r in recs if "phase_s" in r]


def plain_run(overrides: list[str], root: Path) -> list[dict]:
    out = root / f"plain-{len(list(root.iterdir()))}.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={port}",
                    str(REPO / "benchmarks" / "plain_grpo_loop.py"), str(EXP), *overrides, "--out", str(out)],
                   env=_env(), cwd=REPO, timeout=3600, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def _medians(steps: list[dict]) -> dict[str, float]:
    out = {p: statistics.median(s["phase_s"].get(p, 0.0) for s in steps) for p in PHASES}
    out["step"] = statistics.median(s["step_time_s"] for s in steps)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the demo's size, 20 RL steps, one repetition")
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*", help="config overrides for both runs")
    args = ap.parse_args()
    rl_steps, reps = (20, 1) if args.quick else (30, 2)
    overrides = ["trainer.n_gpus_per_node=1", "rl.warmup_steps=5", f"trainer.steps={5 + rl_steps}",
                 f"generator.sync_interval_steps={5 + rl_steps}", *([] if args.quick else WIDE), *args.overrides]
    baton_s: list[dict] = []
    plain_s: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i in range(reps):  # alternate the order: the machine drifts
            for name in (("baton", "plain") if i % 2 == 0 else ("plain", "baton")):
                if name == "baton":
                    baton_s += baton_run(overrides, root)[3:]
                else:
                    plain_s += plain_run(overrides, root)[3:]
    b, p = _medians(baton_s), _medians(plain_s)
    print(f"\nGRPO step, medians over {len(baton_s)} RL steps ({' '.join(overrides)}; one worker process)")
    print(f"{'phase':<10}{'plain (ms)':>12}{'baton (ms)':>12}")
    for phase in (*PHASES, "step"):
        print(f"{phase:<10}{p[phase] * 1e3:>12.2f}{b[phase] * 1e3:>12.2f}")
    overhead = (b["step"] - p["step"]) / p["step"] * 100
    compute = sum(b[k] for k in PHASES if k != "sync")
    print(f"controller and groups: {overhead:+.1f}% of the plain step (target < 5%); "
          f"of that, the rollout's weight sync {b['sync'] / p['step'] * 100:.1f}%, "
          f"dispatch and bookkeeping {(b['step'] - compute - b['sync']) / p['step'] * 100:.1f}%")
    if args.json:
        args.json.write_text(json.dumps({"baton": b, "plain": p, "overhead_pct": overhead}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
