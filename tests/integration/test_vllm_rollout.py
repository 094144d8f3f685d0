"""vLLM as the rollout engine (``generator.engine: vllm``), with real vLLM engines on the CPU,
real processes and the local backend: experiments/grpo_vllm_tiny.yaml learns to count with
the engine colocated in the trainer's worker and on a worker of its own; after each sync the
engine's greedy continuations are transformers' on the exported checkpoint of that step; a
killed engine process is recovered as a lost worker; a killed worker takes its engine with it.

One colocated and one split GRPO run serve the whole module (module fixtures). Both validate
(``rl.val_every=50``: after RL steps 50 and 100, steps 80 and 130), which writes the engine's
greedy responses to samples.jsonl and changes no training number, and both checkpoint the
same steps (80, and 130 at the end), so ``baton export RUN:STEP`` gives transformers the
weights the engine was synced to. The colocated run also takes the faults (its engine core
killed at its first RL step, then the worker holding the new engine): each loss resumes from
the reference's checkpoint (step 30), and vLLM's seeded sampling makes the redone steps the
same, so the run still learns and still samples what the split run samples. Every engine
start costs tens of seconds on a CPU: one run with three starts instead of two runs."""
from __future__ import annotations

import os
import signal
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import psutil  # noqa: E402 - after the skip: a test without vllm imports nothing more

from core.model.gpt import vllm_engine  # noqa: E402
from tests.helpers import Submitted, baton, history, json_lines, metrics, wait_for  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
EXPERIMENT = "experiments/grpo_vllm_tiny.yaml"
VALIDATED = ("rl.val_every=50", "checkpoint.interval_steps=80")  # greedy samples and checkpoints at 80 and 130
SYNCED_STEPS = (80, 130)
FAST = ("recovery.backoff_s=0.2", "timeouts.heartbeat_interval_s=0.1", "timeouts.heartbeat_timeout_s=3",
        "timeouts.controller_lost_s=6")
ENGINE_NAMES = ("VLLM::EngineCore", "VLLM::Worker")


@pytest.fixture(scope="module")
def colocated(faulted: dict[str, Any]) -> Path:
    """The colocated run (its faults recovered: see ``faulted``)."""
    assert faulted["rc"] == 0, faulted["output"][-3000:]
    return faulted["run"].run_dir


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vllm-split")
    res = baton("submit", EXPERIMENT, f"runs_root={root}", *VALIDATED, "generator.placement=split",
                "generator.workers=1", "--backend", "local", timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return next((root / "grpo-vllm-tiny").glob("*"))


def _rl(run: Path) -> list[dict[str, Any]]:
    return [r for r in metrics(run) if "reward_mean" in r]


@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_grpo_with_the_vllm_rollout_learns_to_count_and_its_log_probs_are_the_actors(
        placement: str, request: pytest.FixtureRequest) -> None:
    run = request.getfixturevalue(placement)
    rl = _rl(run)
    assert [r["step"] for r in rl] == list(range(30, 130)) and all(r["policy_version"] == r["step"] for r in rl)
    first, last = (statistics.fmean(r["reward_mean"] for r in part) for part in (rl[:10], rl[-10:]))
    assert last >= 0.85 and first < last, (first, last)
    # every step: vLLM's log-probs of its samples (at the temperature) against the actor's recomputed ones, fp32
    gaps = [r["sync_logprob_maxdiff"] for r in rl]
    assert all(0 <= g <= 1e-4 for g in gaps), max(gaps)
    if placement == "split":
        status = baton("status", str(run)).stdout
        assert "generator: 1 on 1 node: local (rank 1)" in status, status


def test_colocated_and_split_vllm_rollouts_sample_the_same_responses(colocated: Path, split: Path) -> None:
    """Samples are keyed by (seed, step, row), not by where the engine runs: every step's
    rewards, and the validation's greedy and sampled responses, are the same."""
    assert [r["reward_mean"] for r in _rl(colocated)] == [r["reward_mean"] for r in _rl(split)]
    val = [[(s["step"], s["kind"], s["tokens"]) for s in json_lines(run / "samples.jsonl")] for run in (colocated, split)]
    assert val[0] == val[1] and val[0]


def _transformers_greedy(folder: Path, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation (fp32) and each new token's log-prob."""
    import torch  # tests only: the independent reference
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        seq = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0]
        logp = torch.log_softmax(model(seq[None]).logits[0].double(), dim=-1)
    at = torch.arange(len(prompt) - 1, len(seq) - 1)
    return seq[len(prompt):].tolist(), logp[at, seq[at + 1]].tolist()


@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_after_each_sync_the_engines_greedy_continuations_are_the_trainers(
        placement: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """samples.jsonl's greedy rows at steps 80 and 130 (the engine synced to that step's policy)
    equal transformers' greedy generate on the checkpoint of the same step, exported to HF,
    token for token, and their log-probs are transformers' within 1e-4 (fp32)."""
    run = request.getfixturevalue(placement)
    rows = [s for s in json_lines(run / "samples.jsonl") if s["kind"] == "greedy"]
    assert sorted({s["step"] for s in rows}) == list(SYNCED_STEPS)
    for step in SYNCED_STEPS:
        out = tmp_path / f"hf-{step}"
        res = baton("export", f"{run}:{step}", "--hf", str(out), timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        mine = [s for s in rows if s["step"] == step]
        assert mine and all(s["version"] == step and len(s["tokens"]) == 8 for s in mine)
        for s in mine:
            tokens, logps = _transformers_greedy(out, s["prompt"], len(s["tokens"]))
            assert s["tokens"] == tokens, (step, s, tokens)
            assert max(abs(a - b) for a, b in zip(s["logprobs"], logps, strict=True)) <= 1e-4, (step, s, logps)


# --- faults ---------------------------------------------------------------------------------------
def _engine_procs(pid: int) -> list[psutil.Process]:
    """The vLLM engine processes under the process ``pid`` (its descendants named VLLM::...)."""
    try:
        return [p for p in psutil.Process(pid).children(recursive=True) if _is_engine(p)]
    except psutil.NoSuchProcess:
        return []


def _is_engine(p: psutil.Process) -> bool:
    try:
        return any(" ".join(p.cmdline()).startswith(n) or p.name().startswith(n[:15]) for n in ENGINE_NAMES)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _engine_parent(p: psutil.Process) -> int | None:
    """The Baton worker that started this engine process (its BATON_VLLM_PARENT)."""
    try:
        value = p.environ().get(vllm_engine.PARENT_ENV)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return int(value) if value else None


def _worker_with_engine(r: Submitted, generation: int) -> tuple[int, list[psutil.Process]]:
    """Rank 0 of ``generation`` once its engine runs, and the engine's processes."""
    def ready() -> int | None:
        gens = [e.get("generation") for e in r.events("workers_ready")]
        return int(r.state()["ranks"][0]["pid"]) if generation in gens and gens[-1] == generation else None

    pid = wait_for(ready, 300, f"the workers of generation {generation}", interval_s=0.2)
    procs = wait_for(lambda: _engine_procs(pid), 120, f"the vLLM engine of worker {pid}", interval_s=0.2)
    return pid, procs


def _rl_steps(run: Path) -> int:
    return sum(1 for r in metrics(run) if "reward_mean" in r)


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _all_dead(procs: list[psutil.Process]) -> bool:
    return all(_gone(p) for p in procs)


@pytest.fixture(scope="module")
def faulted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The colocated run: once an RL step is recorded, its engine core is SIGKILLed; once the
    recovered workers have recorded another RL step, the worker holding the new engine is
    SIGKILLed; the run goes on to its end. What was seen along the way."""
    r = Submitted(tmp_path_factory.mktemp("vllm-colocated"), list(VALIDATED), experiment=EXPERIMENT, common=FAST)
    seen: dict[str, Any] = {"workers": set(), "segments_before": set(Path("/dev/shm").glob("psm_*"))}
    try:
        wait_for(lambda: _rl_steps(r.run_dir) >= 1, 300, "a first RL step", interval_s=0.2)
        pid, procs = _worker_with_engine(r, 0)
        core = [p for p in procs if "EngineCore" in " ".join(p.cmdline())]
        assert core, [p.cmdline() for p in procs]
        seen["workers"].add(pid)
        core[0].send_signal(signal.SIGKILL)
        seen["engine_killed"] = core[0].pid
        wait_for(lambda: r.events("worker_lost"), 120, "the lost worker", interval_s=0.2)
        before = _rl_steps(r.run_dir)
        pid, procs = _worker_with_engine(r, 1)
        seen["workers"].add(pid)
        wait_for(lambda: _rl_steps(r.run_dir) > before, 300, "an RL step of the recovered run", interval_s=0.2)
        procs = _engine_procs(pid)
        seen["worker_killed"], seen["its_engine"] = pid, [p.pid for p in procs]
        os.kill(pid, signal.SIGKILL)
        seen["engine_gone"] = bool(procs) and _poll(lambda: _all_dead(procs), 30)
        seen["rc"] = r.finish(timeout=900)
        seen["workers"] |= {int(x["pid"]) for x in r.state().get("ranks", [])}
        seen["output"] = r.output
        yield {**seen, "run": r}
    finally:
        r.cleanup()


def _poll(predicate: Any, timeout_s: float) -> bool:
    try:
        wait_for(predicate, timeout_s, "the condition", interval_s=0.1)
        return True
    except AssertionError:
        return False


def test_a_killed_engine_is_recovered_as_a_lost_worker_and_the_run_completes(faulted: dict[str, Any]) -> None:
    r: Submitted = faulted["run"]
    assert faulted["rc"] == 0, faulted["output"][-3000:]
    assert r.state()["status"] == "completed"
    lost = history(r.run_dir, "worker_lost")
    assert len(lost) >= 2, lost  # the killed engine's worker (exit 75), then the killed worker
    assert [e["generation"] for e in history(r.run_dir, "restarting_workers")][:2] == [1, 2]
    log = (r.run_dir / "logs" / "worker_r00000.log").read_text()
    assert "is gone; this worker exits (code 75)" in log  # the killed engine ended its worker: EngineLost
    # the killed worker could not remove its weights folder: the next leader did
    assert f"removing /dev/shm/baton-vllm-{faulted['worker_killed']}-" in log
    rl = _rl(r.run_dir)
    assert [x["step"] for x in rl] == list(range(30, 130))
    assert all(x["sync_logprob_maxdiff"] <= 1e-4 for x in rl)
    # nothing of this run's engines is left: no engine process started by any of its workers
    # (found by the parent each engine records in its environment), no shared-memory folder
    workers = faulted["workers"]
    left = [p.pid for p in psutil.process_iter() if _is_engine(p) and _engine_parent(p) in workers]
    assert left == [], left
    shm = [p for w in workers for p in Path("/dev/shm").glob(f"baton-vllm-{w}-*")]
    assert shm == [], shm
    # nor the shared memory the killed engines' processes mapped (vLLM's queues, Python's psm_*)
    segments = set(Path("/dev/shm").glob("psm_*")) - faulted["segments_before"]
    assert not [s for s in segments if not _mapped(s)], segments


def _mapped(path: Path) -> bool:
    """Whether a live process maps ``path`` (another run's engine may be using it)."""
    for p in psutil.process_iter():
        try:
            if any(m.path == str(path) for m in p.memory_maps()):
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return False


def test_a_killed_worker_takes_its_engine_processes_with_it(faulted: dict[str, Any]) -> None:
    assert faulted["its_engine"], "the worker held no engine process when it was killed"
    assert faulted["engine_gone"], f"engine processes {faulted['its_engine']} outlived worker {faulted['worker_killed']}"
