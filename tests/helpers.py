"""Shared test helpers: deadline polling, the CLI, runs whose processes the test owns by pid,
and readers of what a run folder holds. Test modules import from here (``from tests.helpers
import ...``), never from one another; the Slurm tests' own helpers are in
tests/integration/slurm_helpers.py, the GPT rank harness in tests/integration/gpt_harness.py."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from core.checkpoint.hdf5 import CheckpointReader
from core.config import run as config_mod
from core.record import steps
from core.record.runfolder import RunFolder
from launcher import local, runprep

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """Poll ``predicate`` until truthy; on timeout fail saying what was awaited."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.1f} s waiting for {what} (last value: {last!r})")


@dataclass
class LocalRun:
    """A run started from a test: controller and workers as our own child processes."""

    run: RunFolder
    cfg: config_mod.RunConfig
    controller: subprocess.Popen[bytes] | None = None
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, *, epoch: int = 0, controller: bool = True, workers: bool = True) -> LocalRun:
        if controller:
            self.controller = local._spawn(self.run, "controller", epoch=epoch, rank=None)
        if workers:
            self.workers = [local._spawn(self.run, "worker", epoch=epoch, rank=r) for r in range(self.cfg.trainer.world_size)]
        return self

    def state(self) -> dict[str, Any]:
        """state.json as plain data (through the run record), {} while it cannot be read."""
        from core.record.state import RunRecord, state_to_data

        try:
            return state_to_data(RunRecord(self.run).read())
        except Exception:  # noqa: BLE001 - mid-replace reads are retried by the poller
            return {}

    def log(self, name: str = "controller") -> str:
        path = self.run.controller_log if name == "controller" else self.run.worker_log(int(name))
        return path.read_text() if path.exists() else ""

    def procs(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in [self.controller, *self.workers] if p is not None]

    def cleanup(self) -> None:
        for p in self.procs():
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.kill()
            p.wait(timeout=10)


def make_run(tmp_path: Path, experiment: str, overrides: list[str]) -> LocalRun:
    cfg = config_mod.load(REPO / "experiments" / experiment, [f"runs_root={tmp_path}", *overrides])
    return LocalRun(run=runprep.prepare_run(cfg, backend="local"), cfg=cfg)


def history(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The run's events (events.jsonl, through the run record) as flat dicts, of ``kind`` if given."""
    from core.record import events as ev
    from core.record.state import RunRecord

    try:
        events = RunRecord(RunFolder(Path(run_dir))).events()
    except (OSError, ValueError):  # mid-write on a busy machine: the poller asks again
        return []
    return [ev.to_data(e) for e in events if kind is None or ev.kind_of(e) == kind]


def baton(*args: str, cwd: Path | None = None, timeout: float = 600,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would (``env``: variables added to this process's)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           **(env or {})}
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, env=env, timeout=timeout)


def refused_at_submit(tmp_path: Path, experiment: Path, *overrides: str) -> str:
    """``baton submit`` of ``experiment`` refused as bad input: exit 2, one line on stderr, no run
    folder written; the line without its ``baton: error:`` prefix."""
    res = baton("submit", str(experiment), "--backend", "local", f"runs_root={tmp_path / 'runs'}", *overrides,
                cwd=tmp_path, timeout=120)
    line = res.stderr.strip()
    assert res.returncode == 2 and "\n" not in line, res.stdout + res.stderr
    assert line.startswith("baton: error: "), line
    assert not (tmp_path / "runs").exists()
    return line.removeprefix("baton: error: ")


def scrape(address: str) -> dict[str, list[Any]]:
    """{sample name: [samples]} of one Prometheus scrape, parsed by prometheus_client itself."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(address, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def running_in_ci() -> bool:
    """CI=true: a missing tool or cluster is a failure there, a skip elsewhere."""
    return os.environ.get("CI", "").strip().lower() == "true"


# --- the CLI's runs ---------------------------------------------------------------------------
def run_folder(res: subprocess.CompletedProcess[str]) -> Path:
    """The run folder ``baton submit`` names on its last line (``run folder: PATH``)."""
    return Path(res.stdout.strip().splitlines()[-1].split(": ", 1)[1])


def submit_local(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> Path:
    """``baton submit ARGS --backend local`` to its end; it must exit 0. Returns the run folder."""
    res = baton("submit", *args, "--backend", "local", env=env, timeout=timeout)
    assert res.returncode == 0, res.stdout + res.stderr
    return run_folder(res)


class Submitted:
    """A ``baton submit --backend local`` run started from a test; everything it started is
    ended by pid at the end (SIGINT to the CLI first: it ends its children itself).

    ``common``: the overrides before ``overrides`` (each test module's shared ones)."""

    def __init__(self, root: Path, overrides: list[str], env: dict[str, str] | None = None, *,
                 experiment: str = "experiments/toy.yaml", common: tuple[str, ...] | list[str] = ()) -> None:
        self.root = root
        args = [sys.executable, "-m", "launcher.cli", "submit", experiment, f"runs_root={root}",
                *common, *overrides, "--backend", "local"]
        self.proc = subprocess.Popen(args, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.seen_pids: set[int] = set()
        self.output = ""

    @property
    def run_dir(self) -> Path:
        return wait_for(lambda: next((p for p in self.root.glob("*/*") if (p / "state.json").exists()), None),
                        30, "the run folder")

    def state(self) -> dict[str, Any]:
        return read_state(self.run_dir)

    def wait_step(self, step: int) -> dict[str, Any]:
        return wait_for(lambda: (s := self.state()).get("step", 0) >= step and s, 60, f"step {step}")

    def events(self, kind: str) -> list[dict[str, Any]]:
        return history(self.run_dir, kind)

    def worker_pid(self, rank: int, generation: int = 0) -> int:
        def current() -> int | None:
            ready = self.events("workers_ready")
            if not ready or ready[-1].get("generation") != generation:
                return None
            return int(self.state()["ranks"][rank]["pid"])

        pid = wait_for(current, 30, f"rank {rank} of generation {generation}")
        self.seen_pids.add(pid)
        return pid

    def controller_pid(self) -> int:
        pid = int(json.loads((self.run_dir / "controller.json").read_text())["pid"])
        self.seen_pids.add(pid)
        return pid

    def finish(self, timeout: float = 120) -> int:
        self.output, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode

    def preempt_at(self, step: int, *, timeout: float = 300, before: Callable[[], object] | None = None
                   ) -> dict[str, Any]:
        """SIGUSR2 to the controller once the run reaches ``step`` (``before`` first); the run
        finishes in the foreground (requeued locally) and exits 0. Its ``preempted`` event, at
        least ``step``, whose ``resumed`` event names the same step."""
        try:
            self.wait_step(step)
            if before is not None:
                before()
            os.kill(self.controller_pid(), signal.SIGUSR2)
            assert self.finish(timeout=timeout) == 0, self.output
        finally:
            self.cleanup()
        (pre,) = self.events("preempted")
        assert pre["step"] >= step and self.events("resumed")[0]["step"] == pre["step"], pre
        return pre

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
        state = self.state()
        pids = self.seen_pids | {int(r["pid"]) for r in state.get("ranks", [])}
        for pid in pids:  # only our own entrypoint processes, checked before the kill
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"core.entrypoint" in cmdline:
                os.kill(pid, signal.SIGKILL)



@contextlib.contextmanager
def submitted_runs(root: Path, common: list[str]) -> Iterator[Callable[..., Submitted]]:
    """A test's ``Submitted`` starter under ``root`` (``common``: the module's overrides);
    every run it started is ended at the end."""
    runs: list[Submitted] = []

    def start(*overrides: str, env: dict[str, str] | None = None) -> Submitted:
        r = Submitted(root / f"r{len(runs)}", list(overrides), env, common=common)
        runs.append(r)
        return r

    try:
        yield start
    finally:
        for r in runs:
            r.cleanup()


def toy_reference(root: Path, common: list[str]) -> list[float]:
    """The loss at every step of an uninterrupted toy run of ``common`` (the reference a
    recovered run must equal)."""
    res = baton("submit", "experiments/toy.yaml", f"runs_root={root}", *common, "--backend", "local", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return losses(next((root / "toy").glob("*")), every_step_once=True)

# --- what a run folder holds ------------------------------------------------------------------
def json_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of a JSON-lines file (metrics.jsonl, samples.jsonl), parsed."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's current step records (metrics.jsonl: the latest of each step; those a resume
    redid, marked superseded, left out) as plain dicts."""
    return [data for data, superseded in steps.entries(run_dir / "metrics.jsonl") if not superseded]


def losses(run_dir: Path, *, every_step_once: bool = False) -> list[float]:
    """The loss of each record in metrics.jsonl. ``every_step_once``: first assert that the
    records are steps 0, 1, 2, ... with none missing or repeated."""
    records = metrics(run_dir)
    if every_step_once:
        assert [r["step"] for r in records] == list(range(len(records))), "steps missing or repeated in metrics"
    return [r["loss"] for r in records]


def read_state(run_dir: Path) -> dict[str, Any]:
    """state.json as plain JSON, {} while it cannot be read (missing, or mid-replace)."""
    try:
        return json.loads((Path(run_dir) / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def checkpoint_weights(run_dir: Path, step: int) -> dict[str, np.ndarray]:
    """The model weights of a committed checkpoint (every tensor but the optimizer state)."""
    with CheckpointReader(run_dir / "checkpoints" / f"step_{step:08d}") as reader:
        return {n: reader.read(n) for n in reader.manifest.tensors if not n.startswith("optim.")}


def sweep_ledger(sweep_dir: Path) -> dict[str, Any]:
    """A sweep folder's sweep.json."""
    return json.loads((sweep_dir / "sweep.json").read_text())


# --- references the RL and generator tests share ----------------------------------------------
# experiments/tiny_gpt_generate.yaml for 30 steps, the generator synced and sampling every 10:
# the uninterrupted colocated run that the split and Slurm generator tests compare with.
GENERATOR_RUN = ("trainer.steps=30", "generator.sync_interval_steps=10", "checkpoint.interval_steps=10",
                 "recovery.backoff_s=0.2", "timeouts.heartbeat_interval_s=0.1", "timeouts.heartbeat_timeout_s=3",
                 "timeouts.controller_lost_s=6")
# The numbers of a GRPO step that a resumed or re-placed run must reproduce bit for bit: the
# training's, and the held-out validation's (rl.val_every), which must not change the training's.
GRPO_TRAINING = ("step", "loss", "grad_norm", "reward_mean", "reward_std", "clip_frac", "policy_version", "kl",
                 "kl_coef", "entropy", "ratio_max", "sync_logprob_maxdiff")
GRPO_NUMBERS = (*GRPO_TRAINING, "val_reward_mean", "val_reward_mean_sampled")
# experiments/grpo_tiny.yaml with the rollout on a worker of its own, one step ahead of the update
# (rl.max_staleness=1): the session's async_demo, and the overlap's preempted and recovered runs.
ASYNC_GRPO = ("generator.placement=split", "generator.workers=1", "rl.max_staleness=1")
GRPO_ASYNC_NUMBERS = (*GRPO_NUMBERS, "staleness")


def numbers(run_dir: Path, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each step record's ``keys`` (None where a record lacks one)."""
    return [{k: m.get(k) for k in keys} for m in metrics(run_dir)]


def same_samples(got: list[dict], want: list[dict]) -> None:
    """The same rows, tokens and all; log-probs within 1e-5 (another generator layout)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert {k: v for k, v in g.items() if k not in ("replica", "logprobs")} == \
            {k: v for k, v in w.items() if k not in ("replica", "logprobs")}
        assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"], strict=True)) <= 1e-5, (g, w)


# --- small Hugging Face models (transformers only here, in tests) -----------------------------
HF_SHAPE = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def save_hf_model(family: str, folder: Path, *, seed: int = 0, **shape: Any) -> Path:
    """A random fp32 ``family`` model saved with save_pretrained into ``folder``: ``llama`` (Llama
    3.1's scaled rotary frequencies, untied), ``qwen2`` (q/k/v biases, untied), ``qwen3`` (q/k
    norms, head_dim 32 where hidden/heads is 16, tied embeddings); all with grouped-query
    attention (4 heads over 2 key/value groups). Biases and norms are random too, so a weight
    loaded into the wrong place shows in the logits. Qwen2 is saved in shards of 100 kB
    (model.safetensors.index.json), the others as one model.safetensors. ``shape``: HF config
    keys that replace HF_SHAPE's (``vocab_size=512``)."""
    import torch  # transformers' models are torch modules (tests only)
    import transformers  # tests only: the independent reference

    torch.manual_seed(seed)
    if family == "llama":
        config = transformers.LlamaConfig(**{**HF_SHAPE, **shape}, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    elif family == "qwen2":
        config = transformers.Qwen2Config(**{**HF_SHAPE, **shape}, rope_theta=1e6, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**{**HF_SHAPE, **shape}, head_dim=32, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    model.to(torch.float32).save_pretrained(folder, max_shard_size="100KB" if family == "qwen2" else "5GB")
    return folder


# --- a real small file system that fills ------------------------------------------------------
@contextlib.contextmanager
def small_tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """A real tmpfs of ``size_bytes`` mounted at ``path`` (created if missing), unmounted after.
    Mounting needs root (CI runs as root): the test is skipped, saying so, otherwise."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root): the disk-full path is untested here")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)  # a process of the test still had it open


def fill_up(folder: Path, leave_bytes: int = 0) -> Path:
    """Fill ``folder``'s file system with a file of real (zero) bytes until ``leave_bytes`` are free."""
    st = os.statvfs(folder)
    size = max(0, st.f_bavail * st.f_frsize - leave_bytes)
    filler = folder / "filler"
    with open(filler, "wb") as f:
        f.write(bytes(size))
    return filler


# --- the RL calls' rows (core.wire.ragged) --------------------------------------------------------
def ints(rows: Any) -> Any:
    """Token rows (sequences of ints) as a request's int32 ``Ragged``."""
    from core.wire.ragged import TOKENS, Ragged

    return Ragged.of(list(rows), TOKENS)


def floats(rows: Any) -> Any:
    """Per-token numbers (sequences of floats) as a request's float32 ``Ragged``."""
    from core.wire.ragged import FLOATS, Ragged

    return Ragged.of(list(rows), FLOATS)


def as_rows(result: dict[str, Any]) -> dict[str, Any]:
    """A result as plain data (RankGroup.call's) with its rows (``Ragged``: values and lengths)
    as lists of tuples of Python numbers."""
    from core.wire.ragged import Ragged

    return {k: Ragged(**v).tolist() if isinstance(v, dict) and v.keys() == {"values", "lengths"} else v
            for k, v in result.items()}
