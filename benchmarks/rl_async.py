"""Asynchronous RL (``rl.max_staleness: 1``) beside the synchronous loop (``0``): GRPO step time
and what each learns, the same run otherwise, measured in the same invocation.

    python benchmarks/rl_async.py [--quick] [--steps N] [--rounds K] [--delay-ms N] [--json PATH] [key=value ...]

Both run experiments/grpo_tiny.yaml (the counting demo: a 30-step supervised warm start, then
GRPO) with one trainer rank (``trainer.n_gpus_per_node=1``: a core of its own) and the
generator on a worker process of its own (``generator.placement=split generator.workers=1``),
16 prompts × n 8 = 128 rows per RL step (``rl.prompts_per_step=16``: the demo's 4 give the
trainer ~0.25 s of work a step, beside which the fixed per-step costs of any loop (the sync,
the reward, the records: ~0.05-0.09 s) would bound the gain near 1.7x; with 16 it is ~1 s,
and the reward rises more smoothly), no checkpoints, for ``--steps`` RL steps (default 30;
``--quick`` 20).

The generator's time: on this machine the generator would share the trainer's CPU cores, so
an overlap could only move work around. Here the generator stands for an accelerator that
does not compete for them: each rollout's GENERATE sleeps N ms on the generator's rank
(``BATON_FAULTS=generate_delay_ms=N``) before its real, small sampling; the trainer's phases
(old, ref, update) run for real. N is picked so that the generate phase is about the trainer's
old + ref + update: a first short synchronous run without the delay (8 RL steps) gives the
median of each, and N = (old + ref + update) - generate (``--delay-ms`` sets N instead). Both
runs use the same N.

The figure is each run's median ``step_time_s`` (metrics.jsonl) over its RL steps after the
first ``SKIP`` (the first saves the reference policy and, at staleness 1, generates its own
rollout before the trainer can start). The goal, asserted (exit 1 after printing the table
and writing --json): the synchronous step over the asynchronous one ≥ 1.6x. The two runs
alternate ``--rounds`` times (default 2, ``--quick`` 1), the order swapped each round, and the
goal is on the median of the rounds' ratios: the machine's other load drifts between runs.
Learning: each run's mean reward over its first ``HEAD`` RL steps and over its last ``TAIL``
(the first round's), side by side; asserted that each run ends above its own start, and that
every step's ``staleness`` is its run's (0; at staleness 1, 1 for every step after the first).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXP = REPO / "experiments" / "grpo_tiny.yaml"
WARM = 30  # the demo's supervised warm start (rl.warmup_steps)
PHASES = ("wait", "sync", "generate", "reward", "old", "ref", "update")
TRAIN = ("old", "ref", "update")
GOAL = 1.6
SKIP = 2  # RL steps left out of the step-time median at each run's start
HEAD, TAIL = 5, 10  # RL steps whose mean reward is the run's start and its end
CALIBRATE = 8  # RL steps of the synchronous run that picks N
MACHINE = (f"{os.cpu_count()}-core CPU, fp32, shared with other work; the generator's time per rollout is its real "
           "sampling plus generate_delay_ms (BATON_FAULTS), standing for an accelerator that does not compete for "
           "these cores; the trainer's old, ref and update run for real")


def _env(delay_ms: int) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    env.pop("BATON_FAULTS", None)
    if delay_ms:
        env["BATON_FAULTS"] = f"generate_delay_ms={delay_ms}"
    return env


def baton_run(overrides: list[str], root: Path, delay_ms: int) -> list[dict[str, Any]]:
    """Each RL step's record of a Baton run (metrics.jsonl), in step order."""
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "submit", str(EXP), f"runs_root={root}", *overrides,
                          "--backend", "local"], capture_output=True, text=True, env=_env(delay_ms), cwd=REPO,
                         timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"rl_async: the Baton run failed (exit {out.returncode}):\n"
                         f"{out.stdout[-2000:]}{out.stderr[-2000:]}")
    run_dir = Path(next(line for line in out.stdout.splitlines() if line.startswith("run folder: ")).split(": ", 1)[1])
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sorted((r for r in recs if "phase_s" in r), key=lambda r: r["step"])


def common(steps: int, extra: list[str]) -> list[str]:
    """The overrides both runs share (and the calibration run, with its own step count)."""
    return ["trainer.n_gpus_per_node=1", "generator.placement=split", "generator.workers=1", "rl.prompts_per_step=16",
            f"trainer.steps={WARM + steps}", f"rl.warmup_steps={WARM}", "rl.val_every=0",
            f"generator.sync_interval_steps={WARM + steps}", "checkpoint.interval_steps=0",
            "checkpoint.at_end=false", *extra]


def medians(steps: list[dict[str, Any]]) -> dict[str, float]:
    out = {p: statistics.median(s["phase_s"].get(p, 0.0) for s in steps) for p in PHASES}
    out["train"] = statistics.median(sum(s["phase_s"].get(p, 0.0) for p in TRAIN) for s in steps)
    out["step"] = statistics.median(s["step_time_s"] for s in steps)
    return out


def calibrate(extra: list[str], root: Path) -> tuple[int, dict[str, float]]:
    """N (ms) from a short synchronous run without delay: the trainer's old + ref + update
    less the generator's real sampling, medians over its RL steps after the first SKIP."""
    m = medians(baton_run(common(CALIBRATE, extra) + ["rl.max_staleness=0"], root, 0)[SKIP:])
    return max(0, round((m["train"] - m["generate"]) * 1000)), m


def learning(recs: list[dict[str, Any]]) -> dict[str, Any]:
    rewards = [r["reward_mean"] for r in recs]
    return dict(first=statistics.fmean(rewards[:HEAD]), last=statistics.fmean(rewards[-TAIL:]), per_step=rewards)


def staleness_ok(recs: list[dict[str, Any]], k: int) -> bool:
    """Every step's rollout is its run's staleness old: 0, or at 1 one version for every step
    after the first (which generates its own)."""
    return all(r["staleness"] == (0 if i == 0 else k) and r["policy_version"] == r["step"] - r["staleness"]
               for i, r in enumerate(recs))


def report(m: dict[int, dict[str, float]], learn: dict[int, dict[str, Any]], ratio: float, n: int, delay_ms: int,
           title: str) -> None:
    print(f"\nGRPO step at staleness 0 and 1, medians over {n} RL steps after the first {SKIP} of each run ({title}; "
          f"split placement, generate_delay_ms={delay_ms})")
    print(f"{'phase':<10}{'staleness 0 (s)':>17}{'staleness 1 (s)':>17}")
    for phase in (*PHASES, "train", "step"):
        print(f"{phase:<10}{m[0][phase]:>17.3f}{m[1][phase]:>17.3f}")
    print(f"generate / (old + ref + update) at staleness 0: {m[0]['generate'] / m[0]['train']:.2f}")
    print(f"step time: staleness 0 {m[0]['step']:.3f} s, staleness 1 {m[1]['step']:.3f} s: {ratio:.2f}x faster "
          f"(goal >= {GOAL:g}x)")
    print(f"mean reward, first {HEAD} RL steps -> last {TAIL}: staleness 0 {learn[0]['first']:.3f} -> "
          f"{learn[0]['last']:.3f}, staleness 1 {learn[1]['first']:.3f} -> {learn[1]['last']:.3f}")
    print(f"machine: {MACHINE}")


def _kept(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k in ("step", "step_time_s", "phase_s", "reward_mean", "policy_version",
                                                "staleness")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20 RL steps per run, one round")
    ap.add_argument("--steps", type=int, help="RL steps per run (default 30; --quick 20)")
    ap.add_argument("--rounds", type=int, help="the two runs alternate this many times (default 2; --quick 1)")
    ap.add_argument("--delay-ms", type=int, help="generate_delay_ms (default: picked by a synchronous run)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = ap.parse_args()
    steps = args.steps or (20 if args.quick else 30)
    args.rounds = args.rounds or (1 if args.quick else 2)
    if steps < SKIP + HEAD or steps < TAIL + HEAD:
        ap.error(f"--steps: at least {max(SKIP, TAIL) + HEAD}")
    runs: dict[int, list[list[dict[str, Any]]]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory() as tmp:
        cal = None
        delay = args.delay_ms
        if delay is None:
            delay, cal = calibrate(args.overrides, Path(tmp) / "calibrate")
            print(f"calibration (staleness 0, no delay, {CALIBRATE} RL steps): generate {cal['generate']:.3f} s, "
                  f"old + ref + update {cal['train']:.3f} s: generate_delay_ms={delay}")
        for i in range(args.rounds):
            for k in ((0, 1) if i % 2 == 0 else (1, 0)):  # the machine drifts: swap the order each round
                recs = baton_run(common(steps, args.overrides) + [f"rl.max_staleness={k}"],
                                 Path(tmp) / f"k{k}-{i}", delay)
                runs[k].append(recs)
    rounds = [statistics.median(r0["step_time_s"] for r0 in a[SKIP:]) /
              statistics.median(r1["step_time_s"] for r1 in b[SKIP:]) for a, b in zip(runs[0], runs[1], strict=True)]
    ratio = statistics.median(rounds)
    m = {k: medians([r for run in runs[k] for r in run[SKIP:]]) for k in (0, 1)}
    learn = {k: learning(runs[k][0]) for k in (0, 1)}
    fresh = {k: all(staleness_ok(run, k) for run in runs[k]) for k in (0, 1)}
    learned = {k: all(learning(run)["last"] > learning(run)["first"] for run in runs[k]) for k in (0, 1)}
    report(m, learn, ratio, (steps - SKIP) * args.rounds, delay, "quick" if args.quick else "full")
    if args.rounds > 1:
        print("rounds (staleness 0 step / staleness 1 step): " + ", ".join(f"{r:.2f}x" for r in rounds))
    for k in (0, 1):
        if not fresh[k]:
            print(f"staleness {k}: a step's rollout is not the policy version it should be")
        if not learned[k]:
            print(f"staleness {k}: a run's mean reward over its last {TAIL} RL steps is not above its first {HEAD}")
    passed = ratio >= GOAL and all(fresh.values()) and all(learned.values())
    print(f"{'PASS' if passed else 'FAIL'}: {ratio:.2f}x (goal >= {GOAL:g}x)")
    if args.json:
        args.json.write_text(json.dumps({
            "mode": "quick" if args.quick else "full", "machine": MACHINE, "experiment": str(EXP.relative_to(REPO)),
            "overrides": common(steps, args.overrides), "generate_delay_ms": delay, "calibration": cal,
            "rl_steps": steps, "skip": SKIP, "rounds": args.rounds, "medians": {str(k): m[k] for k in (0, 1)},
            "ratio": ratio, "rounds_ratio": rounds, "goal": GOAL,
            "reward": {str(k): {"first": learn[k]["first"], "last": learn[k]["last"], "head": HEAD, "tail": TAIL}
                       for k in (0, 1)},
            "staleness_ok": {str(k): fresh[k] for k in (0, 1)}, "passed": passed,
            "steps": {str(k): [[_kept(r) for r in run] for run in runs[k]] for k in (0, 1)}}, indent=1))
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
