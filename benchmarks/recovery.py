"""Recovery times on the local backend, from the run's own event history.

Three scenarios, each a real ``baton submit --backend local`` of the toy model (4 workers)
with the default timeouts and recovery settings unless said otherwise:

- preemption: SIGTERM to the controller mid-run → checkpoint at the step boundary →
  requeue (exit 85; the local supervisor relaunches the next epoch) → first resumed step.
  Broken down: signal → checkpoint committed, → requeued, → controller running (the
  relaunch), → first step done. Lost steps: steps finished before the signal that were
  not in the resumed checkpoint (must be 0).
- worker kill -9: detection (kill → worker_lost), restart (worker_lost → new generation
  registered, with ``recovery.backoff_s`` shown apart), → first step after the resume.
- worker SIGSTOP (hung): the same path, detection by heartbeat silence.

Baseline, measured in the same run: a cold start (submit → first step of a fresh run).

``--slurm`` adds the same on the local Slurm cluster (tests/cluster/): a run whose workers
are on partition ``low`` preempted by a job on ``high`` (signal → checkpoint → scontrol
requeue → the job running again → first resumed step), and a worker kill -9 restarted
inside the allocation. The toy's steps are slowed there (BATON_TOY_STEP_S=0.01) so that
the preemption lands mid-run.

    python benchmarks/recovery.py [--quick] [--slurm] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from core.record import events as ev  # noqa: E402
from core.record.runfolder import RunFolder  # noqa: E402
from core.record.state import RunRecord  # noqa: E402

TARGETS = {"preemption_to_resumed_step_s": 20.0, "worker_loss_detected_s": 3.0, "restart_to_training_s": 15.0}


class Run:
    """One ``baton submit --backend local`` in the background; its pids are ours to end."""

    def __init__(self, root: Path, overrides: list[str], *, backend: str = "local",
                 env: dict[str, str] | None = None) -> None:
        self.root = root
        self.t_submit = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", "submit", "experiments/toy.yaml", f"runs_root={root}",
             *overrides, "--backend", backend],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def poll(self, pred: Any, timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = pred()
            if value:
                return value
            time.sleep(0.01)  # polling files written by another process
        raise TimeoutError(f"{what}: not within {timeout_s} s")

    @property
    def folder(self) -> Path:
        return self.poll(lambda: next(iter((self.root / "toy").glob("*/state.json")), None), 30, "run folder").parent

    def state(self) -> dict[str, Any]:
        try:
            return json.loads((self.folder / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [ev.to_data(e) for e in RunRecord(RunFolder(self.folder)).events() if ev.kind_of(e) == kind]

    def metrics(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in (self.folder / "metrics.jsonl").read_text().splitlines() if x.strip()]

    def wait_step(self, step: int) -> None:
        self.poll(lambda: self.state().get("step", 0) >= step, 60, f"step {step}")

    def finish(self) -> None:
        out, _ = self.proc.communicate(timeout=300)
        if self.proc.returncode != 0:
            raise RuntimeError(f"run failed ({self.proc.returncode}): {out.decode()[-2000:]}")
        self.output = out.decode()

    def finish_slurm(self) -> str:
        """Submission returns at once on Slurm: wait for the run's own final status; the job id."""
        self.finish()
        job = self.output.split("submitted job ", 1)[1].split()[0]
        try:
            status = self.poll(lambda: self.state().get("status") in ("completed", "failed", "stopped")
                               and self.state()["status"], 300, f"job {job}")
        except TimeoutError:
            subprocess.run(["scancel", job], check=False)
            raise
        if status != "completed":
            raise RuntimeError(f"job {job}: {status}: {self.state().get('reason')}")
        return job


def first_step_time(run: Run, step: int) -> float:
    """When the step ``step`` finished (the record is written right after it)."""
    return next(m["time"] for m in run.metrics() if m["step"] == step)


def cold_start(root: Path, overrides: list[str]) -> float:
    run = Run(root, overrides)
    run.finish()
    return first_step_time(run, 0) - run.t_submit


def preemption(root: Path, overrides: list[str], at_step: int) -> dict[str, float]:
    run = Run(root, [*overrides, "checkpoint.interval_steps=0"])
    run.wait_step(at_step)
    pid = json.loads((run.folder / "controller.json").read_text())["pid"]
    t0 = time.time()
    os.kill(pid, signal.SIGTERM)
    run.finish()
    return preemption_times(run, t0)


HIGH_JOB = """#!/bin/bash
#SBATCH --job-name=baton-bench-high
#SBATCH --partition=high
#SBATCH --nodes=1
#SBATCH --ntasks=16
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=5
#SBATCH --output=/dev/null
sleep 1
"""


def slurm_preemption(root: Path, overrides: list[str], at_step: int) -> dict[str, float]:
    run = Run(root, [*overrides, "checkpoint.interval_steps=0", "slurm.controller.partition=cpu", "--partition", "low"],
              backend="slurm", env={"BATON_TOY_STEP_S": "0.01"})
    run.finish()
    run.wait_step(at_step)
    script = root / "high.sbatch"
    script.write_text(HIGH_JOB)
    high = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True).stdout
    run.finish_slurm()
    subprocess.run(["scancel", high.strip().split(";")[0]], check=False)
    (pre, *_) = run.events("preempted")
    return preemption_times(run, float(pre["signal_at"]))


def preemption_times(run: Run, t0: float) -> dict[str, float]:
    (pre, *_) = run.events("preempted")
    committed = next(e["time"] for e in run.events("checkpoint_committed") if e["step"] == pre["step"])
    requeued = run.events("requeued")[0]["time"]
    started = run.events("controller_started")[1]["time"]
    resumed = run.events("resumed")[0]
    first = first_step_time(run, resumed["step"])
    return {"signal_to_committed_s": committed - t0, "committed_to_requeued_s": requeued - committed,
            "requeued_to_running_s": started - requeued, "running_to_first_step_s": first - started,
            "preemption_to_resumed_step_s": first - t0, "lost_steps": pre["step"] - resumed["step"]}


def worker_loss(root: Path, overrides: list[str], at_step: int, sig: int, *, slurm: bool = False) -> dict[str, float]:
    if slurm:
        run = Run(root, [*overrides, "checkpoint.interval_steps=100", "slurm.controller.partition=cpu",
                         "--partition", "gpu"], backend="slurm", env={"BATON_TOY_STEP_S": "0.002"})
        run.finish()
    else:
        run = Run(root, [*overrides, "checkpoint.interval_steps=100"])
    run.wait_step(at_step)
    pid = run.state()["ranks"][2]["pid"]  # node2 of the local cluster is this host too
    t0 = time.time()
    os.kill(pid, sig)
    if slurm:
        run.finish_slurm()
    else:
        run.finish()
    lost = run.events("worker_lost")[0]
    restarting = run.events("restarting_workers")[0]
    ready = next(e for e in run.events("workers_ready") if e.get("generation") == 1)
    resumed = run.events("resumed")[-1]
    first = first_step_time(run, resumed["step"])
    return {"worker_loss_detected_s": lost["time"] - t0, "backoff_s": restarting["backoff_s"],
            "lost_to_registered_s": ready["time"] - lost["time"], "registered_to_first_step_s": first - ready["time"],
            "restart_to_training_s": first - lost["time"], "kill_to_training_s": first - t0,
            "redone_steps": lost["step"] - resumed["step"]}


def median(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one repetition per scenario instead of three")
    ap.add_argument("--slurm", action="store_true", help="also on the local Slurm cluster (tests/cluster/)")
    ap.add_argument("--json", type=Path, help="write the numbers here")
    args = ap.parse_args()
    repeat = 1 if args.quick else 3
    base = ["trainer.steps=3000", "optimizer.lr=0.002", "trainer.log_interval_steps=20"]
    tuned = [*base, "recovery.backoff_s=0"]
    results: dict[str, Any] = {"repeat": repeat}
    with tempfile.TemporaryDirectory(prefix="baton-recovery-bench-") as tmp:
        root = Path(tmp)
        n = iter(range(1000))
        results["cold_start_s"] = statistics.median(cold_start(root / f"c{next(n)}", [*base, "trainer.steps=50"])
                                                    for _ in range(repeat))
        results["preemption"] = median([preemption(root / f"p{next(n)}", base, 300) for _ in range(repeat)])
        results["kill9_default"] = median([worker_loss(root / f"k{next(n)}", base, 300, signal.SIGKILL)
                                           for _ in range(repeat)])
        results["kill9_no_backoff"] = median([worker_loss(root / f"k{next(n)}", tuned, 300, signal.SIGKILL)
                                              for _ in range(repeat)])
        results["sigstop_default"] = median([worker_loss(root / f"s{next(n)}", base, 300, signal.SIGSTOP)
                                             for _ in range(repeat)])
        if args.slurm:  # once each: the cluster is shared and a preemption costs ~30 s
            slurm_base = ["model.kind=toy", "trainer.n_gpus_per_node=4", "trainer.steps=2000", "optimizer.lr=0.002",
                          "trainer.log_interval_steps=20"]
            os.chmod(root, 0o755)  # the jobs (root, either node) write into run folders under here
            results["slurm_preemption"] = slurm_preemption(root / "sp", slurm_base, 300)
            results["slurm_kill9_default"] = worker_loss(root / "sk", slurm_base, 300, signal.SIGKILL, slurm=True)
    p = results["preemption"]
    print(f"local backend, toy model, 4 workers; median of {repeat}; baseline cold start (submit → first step) "
          f"{results['cold_start_s']:.2f} s")
    sp = results.get("slurm_preemption")
    print(f"{'preemption':<42} {'local SIGTERM':>14} {'Slurm low/high':>15}")
    for key in ("signal_to_committed_s", "committed_to_requeued_s", "requeued_to_running_s", "running_to_first_step_s",
                "preemption_to_resumed_step_s", "lost_steps"):
        print(f"  {key:<40} {p[key]:>14.2f} " + (f"{sp[key]:>15.2f}" if sp else f"{'-':>15}"))
    scenarios = ["kill9_default", "kill9_no_backoff", "sigstop_default"]
    if "slurm_kill9_default" in results:
        scenarios.append("slurm_kill9_default")
    print(f"{'worker loss':<30} {'kill -9':>9} {'kill -9, backoff 0':>19} {'SIGSTOP':>9}"
          + (f" {'Slurm kill -9':>14}" if len(scenarios) == 4 else ""))
    for key in ("worker_loss_detected_s", "backoff_s", "lost_to_registered_s", "registered_to_first_step_s",
                "restart_to_training_s", "kill_to_training_s", "redone_steps"):
        row = [results[s][key] for s in scenarios]
        print(f"  {key:<28} {row[0]:>9.2f} {row[1]:>19.2f} {row[2]:>9.2f}" + (f" {row[3]:>14.2f}" if len(row) == 4 else ""))
    met = {
        "preemption_to_resumed_step_s": p["preemption_to_resumed_step_s"] <= TARGETS["preemption_to_resumed_step_s"]
        and p["lost_steps"] == 0,
        "worker_loss_detected_s": max(results[s]["worker_loss_detected_s"] for s in ("kill9_default", "sigstop_default"))
        <= TARGETS["worker_loss_detected_s"],
        "restart_to_training_s": results["kill9_default"]["restart_to_training_s"] <= TARGETS["restart_to_training_s"],
    }
    results["targets_met"] = met
    print("targets: " + ", ".join(f"{k} ≤ {TARGETS[k]:.0f} s: {'met' if v else 'MISSED'}" for k, v in met.items()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
