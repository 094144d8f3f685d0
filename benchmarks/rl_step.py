"""What the controller and the worker groups cost per GRPO step at real lengths: ``program:
grpo`` under Baton beside the same algorithm as one plain process (benchmarks/plain_grpo_loop.py:
no controller, no groups, no reward processes, the actor generates itself), same model,
prompts and seeds, in the same run; and what the rollout saves by stopping at end of text.

    python benchmarks/rl_step.py [--quick] [--steps N] [--rounds K] [--json PATH] [key=value ...]

Both run experiments/grpo_varlen_tiny.yaml (``count_to``: a response ends at its first
end-of-text token, the vocabulary's last id) on one worker process, with a small-hidden GPT
(hidden 64, 2 layers) at real lengths: prompts of 512 tokens, responses of up to 2,048, 4
prompts × n 4 = 16 rows per step, one replica, one PPO epoch, no warm start (``--quick``: 128
and 512 tokens). A random model draws the end-of-text id about once per ``vocab_size``
tokens, so the vocabulary (544; quick 136) sets where responses end: at varied points, a
mean of about a third of the limit, the longest of 16 often under it (a static batch decodes
until its last row ends).

Baton's figures are the controller's per-phase wall times from metrics.jsonl (``phase_s``);
the plain loop's are the same phases timed in-process. The overhead is Baton's step less its
``sync`` phase (the weight sync into the generator's own model and its check: the plain loop
generates with the actor and has no need of it) over the plain step of the same RL step (the
same responses: the steps' lengths vary more than the overhead), the median over the RL
steps after the first (which saves the reference policy's checkpoint); with ``--rounds K``
the two runs alternate K times (this machine's load drifts between runs by more than the
goal's margin) and the overhead is the median of the rounds'. The goal is < 5 %:
the script exits 1 when it is missed (or when the two runs' responses differ: then they did
not do the same work), after printing the table and writing --json.

The rollout with early stop: before each of its RL steps (outside the step's time), the
plain loop runs the step's rollout with the stop token ignored (every row the full response
length; same prompts, seeds and weights); the fraction is the stopping rollout's time over
that one, summed over the steps.
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
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXP = REPO / "experiments" / "grpo_varlen_tiny.yaml"
PHASES = ("sync", "generate", "reward", "old", "ref", "update")
GOAL_PCT = 5.0
SKIP = 1  # the first RL step saves the reference policy's checkpoint (Baton) and warms the caches (both)


def sizes(prompt: int, response: int, vocab: int) -> list[str]:
    """The model and the GRPO batch at these lengths (``vocab``: a random model ends a
    response after about that many tokens)."""
    return [f"model.seq_length={prompt + response}", f"model.vocab_size={vocab}", "model.hidden_size=64",
            "model.num_layers=2", "model.num_attention_heads=4", f"rl.prompt_length={prompt}",
            f"rl.max_response_length={response}", "rl.prompts_per_step=4", "rl.n=4", "rl.ppo_epochs=1",
            "training.global_batch_size=16", "training.micro_batch_size=4"]


FULL = sizes(512, 2048, 544)
QUICK = sizes(128, 512, 136)


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")


def baton_run(overrides: list[str], root: Path) -> list[dict[str, Any]]:
    """Each RL step's record of a Baton run (metrics.jsonl)."""
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "submit", str(EXP), f"runs_root={root}",
                          "checkpoint.at_end=false", "checkpoint.interval_steps=0", *overrides, "--backend", "local"],
                         capture_output=True, text=True, env=_env(), cwd=REPO, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"rl_step: the Baton run failed (exit {out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    run_dir = Path(next(line for line in out.stdout.splitlines() if line.startswith("run folder: ")).split(": ", 1)[1])
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "phase_s" in r]


def plain_run(overrides: list[str], root: Path) -> list[dict[str, Any]]:
    """Each RL step's record of the plain loop, with the step's rollout stops ignored."""
    out = root / "plain.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={port}",
                           str(REPO / "benchmarks" / "plain_grpo_loop.py"), str(EXP), *overrides, "--out", str(out),
                           "--no-eos-rollout"], env=_env(), cwd=REPO, timeout=3600, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"rl_step: the plain loop failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def _medians(steps: list[dict[str, Any]]) -> dict[str, float]:
    out = {p: statistics.median(s["phase_s"].get(p, 0.0) for s in steps) for p in PHASES}
    out["step"] = statistics.median(s["step_time_s"] for s in steps)
    out["step_less_sync"] = statistics.median(s["step_time_s"] - s["phase_s"].get("sync", 0.0) for s in steps)
    return out


def _overhead(baton: list[dict[str, Any]], plain: list[dict[str, Any]]) -> float:
    """Baton's step less its sync over the plain step, in %: the median over the steps of each
    step's ratio (a step does the same work in both runs: the same responses)."""
    return statistics.median(((b["step_time_s"] - b["phase_s"].get("sync", 0.0)) / p["step_time_s"] - 1) * 100
                             for b, p in zip(baton, plain, strict=True))


def _rollout(plain: list[dict[str, Any]]) -> dict[str, Any]:
    """The stopping rollout beside the one that ignores the stop token (the plain loop's)."""
    eos = statistics.median(s["phase_s"]["generate"] for s in plain)
    full = statistics.median(s["generate_no_eos_s"] for s in plain)
    fraction = sum(s["phase_s"]["generate"] for s in plain) / sum(s["generate_no_eos_s"] for s in plain)
    longest = [max(s["lengths"]) for s in plain]
    return dict(generate_eos_s=eos, generate_no_eos_s=full, fraction=fraction, longest_response=longest,
                mean_response=statistics.fmean(statistics.fmean(s["lengths"]) for s in plain),
                draws_agree=all(s["no_eos_agrees"] for s in plain))


def _kept(record: dict[str, Any]) -> dict[str, Any]:
    """What --json keeps of a step's record."""
    return {k: v for k, v in record.items() if k in ("step", "step_time_s", "phase_s", "response_length",
                                                    "response_length_max", "lengths", "generate_no_eos_s")}


def report(b: dict[str, float], p: dict[str, float], roll: dict[str, Any], overhead: float, n: int, title: str) -> None:
    print(f"\nGRPO step, medians over {n} RL steps after the first of each run ({title}; one worker process)")
    print(f"{'phase':<16}{'plain (s)':>11}{'baton (s)':>11}")
    for phase in (*PHASES, "step", "step_less_sync"):
        print(f"{phase:<16}{p[phase]:>11.3f}{b[phase]:>11.3f}")
    compute = sum(b[k] for k in PHASES if k != "sync")
    print(f"controller and groups: {overhead:+.1f}% of the plain step (goal < {GOAL_PCT:g}%; each step's Baton time "
          f"less its sync, which the plain loop has no need of and which adds {b['sync'] / p['step'] * 100:.1f}%); "
          f"dispatch and bookkeeping outside the phases {(b['step'] - compute - b['sync']) / p['step'] * 100:.1f}%")
    print(f"rollout: stops at end of text {roll['generate_eos_s']:.2f} s, stop ignored (every row "
          f"{roll['max_new_tokens']} tokens) {roll['generate_no_eos_s']:.2f} s: {roll['fraction']:.2f} of the time "
          f"(responses: mean {roll['mean_response']:.0f} tokens, longest per step {roll['longest_response']})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="prompts of 128 tokens, responses up to 512, 5 steps")
    ap.add_argument("--steps", type=int, help="RL steps measured after the first (default 4; --quick 5)")
    ap.add_argument("--rounds", type=int, default=1, help="Baton and the plain loop alternate this many times")
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*", help="config overrides for both runs")
    args = ap.parse_args()
    measured = args.steps or (5 if args.quick else 4)
    steps = SKIP + measured
    overrides = ["trainer.n_gpus_per_node=1", "rl.warmup_steps=0", "rl.val_every=0", f"trainer.steps={steps}",
                 f"generator.sync_interval_steps={steps}", *(QUICK if args.quick else FULL), *args.overrides]
    baton: list[dict[str, Any]] = []
    plain: list[dict[str, Any]] = []
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):  # alternate the order: the machine drifts
            runs = {}
            for name in (("baton", "plain") if i % 2 == 0 else ("plain", "baton")):
                root = Path(tmp) / f"{name}-{i}"
                root.mkdir()
                runs[name] = (baton_run if name == "baton" else plain_run)(overrides, root)[SKIP:]
            rounds.append(_overhead(runs["baton"], runs["plain"]))
            baton += runs["baton"]
            plain += runs["plain"]
    b, p, roll = _medians(baton), _medians(plain), _rollout(plain)
    roll["max_new_tokens"] = int(next(o for o in overrides[::-1] if o.startswith("rl.max_response_length="))
                                 .split("=")[1])
    overhead = statistics.median(rounds)
    same = [r["response_length"] for r in baton] == [statistics.fmean(s["lengths"]) for s in plain]
    report(b, p, roll, overhead, len(baton), "quick" if args.quick else "full")
    if len(rounds) > 1:
        print("rounds (Baton's step less sync over the plain step): " + ", ".join(f"{r:+.1f}%" for r in rounds))
    passed = overhead < GOAL_PCT and same
    if not same:
        print("the two runs' responses differ (mean lengths per step): they did not do the same work")
    print(f"{'PASS' if passed else 'FAIL'}: overhead {overhead:+.1f}% (goal < {GOAL_PCT:g}%)")
    if args.json:
        args.json.write_text(json.dumps({"mode": "quick" if args.quick else "full", "overrides": overrides,
                                         "baton": b, "plain": p, "overhead_pct": overhead, "rounds_pct": rounds,
                                         "goal_pct": GOAL_PCT,
                                         "excluded": ["sync"], "same_responses": same, "rollout": roll,
                                         "passed": passed, "steps": {"baton": [_kept(r) for r in baton],
                                                                         "plain": [_kept(r) for r in plain]}},
                                        indent=1))
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
