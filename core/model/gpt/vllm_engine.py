"""One vLLM engine (``generator.engine: vllm``): the home of Baton's ``vllm`` imports.

``Engine`` starts ``vllm.LLM`` on a Hugging Face folder Baton writes (config.json and the
policy's weights as safetensors, in shared memory: core.model.gpt.vllm_rollout), with vLLM's
own engine process (V1 multiprocessing: the engine core and its workers are processes of
their own, started with spawn, never sharing this process's torch.distributed world), prompts
as token ids (no tokenizer: Baton tokenizes), ``logprobs_mode=processed_logprobs`` (each
sampled token's log-prob of the distribution after temperature: Baton's rollout log-prob; with
top-k / top-p, after the truncation too) and ``BatonWorker`` as the worker extension.

Weight updates go through vLLM's supported path on this version: the worker's
``reload_weights`` from the folder (``BatonWorker.baton_reload``: every rank of the engine
reads the new safetensors file; with a tied output layer on the CPU backend, the head's
packed copy is refreshed, which ``reload_weights`` leaves stale), then the prefix cache is
reset. Sampling is per request: ``seed`` keys each response's stream. On a GPU the engine runs
on the CUDA devices it is given (``CUDA_VISIBLE_DEVICES`` of its processes: the replica's ``tp``
devices from its leader's on), and colocated it sleeps between calls (``sleep``: weights to host
memory, KV cache freed, so the trainer's update has the GPU; woken by the next call).

An engine whose process died (killed, out of memory) fails its next call, or the call
waiting on it, with ``EngineLost`` (calls run on a thread of their own while the engine's
processes are watched: vLLM's synchronous client would wait forever); the worker exits on
it (core.model.gpt.vllm_rollout), so the run recovers it as a lost worker. ``shutdown`` ends
the engine and any of its processes left behind (they hold shared memory), by pid: only
processes this one started; ``kill_all`` (the worker's hard exit) kills them at once. A killed
engine cannot remove the shared memory its processes made (the message queues between its
core and its workers, Python's ``psm_*`` segments, and their ``sem.mp-*`` semaphores: a few
hundred MB that outlive the job): ``kill`` notes which of them the processes map and removes
those once the processes are gone. This is what happens when Slurm requeues a job:
``scontrol requeue`` ends the job's steps while the worker shuts its engine down. A worker
that dies outright takes its engine with it: ``plugin``, vLLM's
general plugin (setup.cfg's ``vllm.general_plugins`` entry point), has every process of an
engine Baton started ask the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)
EXTENSION = "core.model.gpt.vllm_engine.BatonWorker"
PARENT_ENV = "BATON_VLLM_PARENT"  # the Baton worker that started the engine (its processes die with theirs)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
SHUTDOWN_S = 5.0  # vLLM's own shutdown gets this long; then its processes are killed
WATCH_S = 0.5  # while a call waits on the engine, its processes are checked this often
SHM_LIST = "shared_memory.txt"  # in the engine's folder: the shared memory its processes map
_SHM_PREFIXES = ("psm_", "sem.mp-")  # Python's shared memory and semaphore names (multiprocessing)
_ENGINES: list[Engine] = []  # this process's running engines (kill_all)


def plugin() -> None:
    """vLLM's general plugin: an engine process (or its worker) that Baton started dies with
    its parent, even when the Baton worker was killed outright."""
    if os.environ.get(PARENT_ENV) in (None, str(os.getpid())):
        return
    import ctypes  # the C library's prctl: only in an engine's processes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d)", ctypes.get_errno())
    if os.getppid() == 1:  # the parent died before the request
        os._exit(1)
    # Slurm's warning before preemption is the Baton worker's to act on (it checkpoints, then ends
    # the engine); by default SIGUSR2 would end an engine process at once
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def kill_all() -> None:
    """Kill every engine process of this process now (its hard exit: no time for vLLM's shutdown)."""
    for engine in list(_ENGINES):
        engine.kill()
        shutil.rmtree(engine.spec.folder, ignore_errors=True)  # the weights: a whole policy in shared memory


class EngineLost(RuntimeError):
    """The engine's process is gone: the worker is lost with it."""


class BatonWorker:
    """vLLM's worker extension (``worker_extension_cls``): methods the engine runs on every
    worker rank through ``collective_rpc``."""

    def baton_reload(self, path: str, tied: bool) -> bool:
        runner: Any = self.model_runner  # type: ignore[attr-defined]  # the vLLM worker this extends
        runner.reload_weights(weights_path=path, is_checkpoint_format=True)
        model = runner.get_model()
        if tied and str(getattr(self, "device", "cpu")).startswith("cpu"):
            # the CPU backend packs linear weights for its GEMM; reload_weights refreshes the
            # embedding but not the tied head's packed copy
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # CPU backend only
            dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)
        return True


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """What an engine is started with (core.model.gpt.vllm_rollout fills it from the run's config)."""

    folder: str
    dtype: str  # float32 | bfloat16 | float16
    tp: int
    max_model_len: int
    seed: int
    on_cuda: bool
    gpu_memory_utilization: float
    kv_cache_bytes: int | None
    max_num_seqs: int
    tied: bool
    devices: tuple[int, ...] = ()  # on a GPU: the CUDA devices (this process's numbering) the engine runs on
    sleeps: bool = False  # colocated on a GPU: asleep (weights offloaded, KV cache freed) between calls


@dataclass(frozen=True, kw_only=True)
class Request:
    prompt: tuple[int, ...]
    seed: int


class Engine:
    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # share the CPUs the worker was given
        from vllm import LLM  # vllm loads only where an engine starts (an optional extra)
        kwargs: dict[str, Any] = dict(
            model=spec.folder, skip_tokenizer_init=True, dtype=spec.dtype, tensor_parallel_size=spec.tp,
            max_model_len=spec.max_model_len, seed=spec.seed, logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION, max_num_seqs=spec.max_num_seqs, enable_prefix_caching=True,
            enforce_eager=not spec.on_cuda, gpu_memory_utilization=spec.gpu_memory_utilization, load_format="safetensors")
        if spec.kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = spec.kv_cache_bytes
        if spec.sleeps:
            kwargs["enable_sleep_mode"] = True
        os.environ[PARENT_ENV] = str(os.getpid())
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            with _visible(spec.devices):
                self.llm: Any = LLM(**kwargs)
        except BaseException:  # what it started before failing ends here, with its shared memory
            end_processes([p for p in psutil.Process().children(recursive=True) if p.pid not in before])
            raise
        self.children = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        # the engine's own processes (their titles), not helpers such as multiprocessing's resource tracker
        self.watched = [p for p in self.children if _title(p).startswith("VLLM")] or self.children
        self.shm = shared_memory(self.children)  # what they map: removed after them, even once they died
        (Path(spec.folder) / SHM_LIST).write_text("".join(f"{name}\n" for name in sorted(self.shm)))
        self.asleep = False
        _ENGINES.append(self)

    # --- calls ---------------------------------------------------------------------------------
    def _alive(self) -> None:
        for p in self.watched:
            try:
                gone = not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                raise EngineLost(f"vLLM engine process {p.pid} is gone")

    def _guarded(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn`` on a thread of its own, its engine's processes watched meanwhile: vLLM's
        synchronous client waits forever for an answer from an engine that died mid-call (its
        monitor shuts the client down without waking the waiting call)."""
        self._alive()
        call = _on_thread(fn, *args, **kwargs)
        while not futures.wait([call], timeout=WATCH_S).done:
            self._alive()  # the waiting thread is left behind: the worker exits on EngineLost
        try:
            return call.result()
        except Exception as exc:
            from vllm.v1.engine.exceptions import EngineDeadError  # as LLM above: only with an engine
            if isinstance(exc, EngineDeadError) or any(not p.is_running() for p in self.children):
                raise EngineLost(f"vLLM engine died: {exc}") from exc
            raise

    def sleep(self) -> None:
        """Colocated on a GPU: give the GPU back to the trainer (level 1: weights to host
        memory, KV cache freed); a no-op otherwise."""
        if self.spec.sleeps and not self.asleep:
            self._guarded(self.llm.sleep, level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self._guarded(self.llm.wake_up)
            self.asleep = False

    def reload(self) -> None:
        """The folder's weights into every worker of the engine; the prefix cache reset."""
        self.wake()
        self._guarded(self.llm.collective_rpc, "baton_reload",
                      kwargs={"path": self.spec.folder, "tied": self.spec.tied})
        self._guarded(self.llm.reset_prefix_cache)

    def generate(self, requests: Sequence[Request], *, max_new_tokens: int, temperature: float, top_k: int,
                 top_p: float, stop: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
        """Each request's new tokens (up to and including its first stop id) and their log-probs."""
        from vllm import SamplingParams  # as LLM above: only with an engine
        self.wake()
        params = [SamplingParams(n=1, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_new_tokens,
                                 seed=r.seed, logprobs=0, stop_token_ids=list(stop), ignore_eos=True,
                                 detokenize=False) for r in requests]
        outs = self._guarded(self.llm.generate, [{"prompt_token_ids": list(r.prompt)} for r in requests], params,
                             use_tqdm=False)
        result = []
        for out in outs:
            c = out.outputs[0]
            result.append((tuple(c.token_ids), tuple(float(lp[t].logprob) for lp, t in zip(c.logprobs, c.token_ids,
                                                                                              strict=True))))
        return result

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """log p(seq[i] | seq[:i]) for i ≥ 1 of each sequence (teacher forced, temperature 1)."""
        from vllm import SamplingParams  # as LLM above: only with an engine
        self.wake()
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = self._guarded(self.llm.generate, [{"prompt_token_ids": list(s)} for s in sequences], params,
                             use_tqdm=False)
        return [[float(lp[t].logprob) for lp, t in zip(o.prompt_logprobs[1:], s[1:], strict=True)]
                for o, s in zip(outs, sequences, strict=True)]

    def shutdown(self) -> None:
        """End the engine (vLLM's shutdown, for at most ``SHUTDOWN_S``); then kill any of its
        processes still running (by pid: this process's own), and remove the shared memory they
        mapped when it began (Slurm may end them meanwhile, before they remove it)."""
        left = shared_memory(self.children) | self.shm
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None:
            done = threading.Thread(target=_quietly, args=(core.shutdown,), daemon=True, name="vllm-shutdown")
            done.start()
            done.join(SHUTDOWN_S)
        self.kill(left)

    def kill(self, left: set[str] | None = None) -> None:
        """Kill the engine's processes and remove the shared memory they left (``left``: what
        they mapped earlier, besides what they map now)."""
        removed = end_processes(self.children, (left or set()) | self.shm)
        if removed:
            log.info("removed %d shared-memory file(s) the vLLM engine left: %s", len(removed), ", ".join(removed))
        if self in _ENGINES:
            _ENGINES.remove(self)


@contextlib.contextmanager
def _visible(devices: Sequence[int]) -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES`` for the processes the engine starts: ``devices`` (this process's
    numbering, through its own ``CUDA_VISIBLE_DEVICES`` if set); unchanged without devices."""
    if not devices:
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    mine = old.split(",") if old else [str(i) for i in range(max(devices) + 1)]
    if max(devices) >= len(mine):
        raise RuntimeError(f"generator.tp: a vLLM replica runs on {len(devices)} GPUs from its first rank's "
                           f"(device {devices[0]}), but that process sees {len(mine)} (CUDA_VISIBLE_DEVICES "
                           f"{old!r}); give each generator node at least generator.tp GPUs, all visible to its tasks")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine[d] for d in devices)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def _on_thread(fn: Any, *args: Any, **kwargs: Any) -> futures.Future[Any]:
    """``fn(*args, **kwargs)`` on a new daemon thread; its result or exception in the future."""
    call: futures.Future[Any] = futures.Future()

    def run() -> None:
        try:
            call.set_result(fn(*args, **kwargs))
        except Exception as exc:  # handed to the caller through the future
            call.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="vllm-call").start()
    return call


def end_processes(procs: Sequence[psutil.Process], left: set[str] | None = None) -> list[str]:
    """Kill ``procs``; once they are gone, remove the multiprocessing shared memory they map
    now and ``left`` (what they mapped earlier). The names removed (those still there)."""
    left = shared_memory(procs) | (left or set())
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=SHUTDOWN_S)
    return [] if alive else _remove(left)  # a live process may still open them by name


def shared_memory(procs: Sequence[psutil.Process]) -> set[str]:
    """The multiprocessing shared-memory files in /dev/shm that ``procs`` map now."""
    found = set()
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/maps") as maps:
                lines = maps.read().splitlines()
        except OSError:  # gone already, or not Linux
            continue
        for line in lines:  # address perms offset device inode [path]
            parts = line.split(maxsplit=5)
            path = parts[5].removesuffix(" (deleted)") if len(parts) == 6 else ""
            if path.startswith("/dev/shm/") and os.path.basename(path).startswith(_SHM_PREFIXES):
                found.add(path)
    return found


def _remove(paths: set[str]) -> list[str]:
    """Unlink ``paths``; the names of those that were still there."""
    removed = []
    for path in sorted(paths):
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except FileNotFoundError:  # the engine's own shutdown removed it
            pass
    return removed


def remove_listed(folder: str | os.PathLike[str]) -> list[str]:
    """A dead worker's engine: remove the shared memory its folder lists (``SHM_LIST``) that no
    live process maps; the names removed."""
    try:
        names = set((Path(folder) / SHM_LIST).read_text().split())
    except OSError:
        return []
    return _remove(names - shared_memory(psutil.process_iter()))


def _title(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return ""


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception as exc:  # a dead engine cannot shut down cleanly: its processes are killed after
        log.warning("vLLM engine shutdown: %s", exc)
