"""A generator replica served by vLLM (``generator.engine: vllm``).

Each replica of the generator's layout (``generator.tp`` ranks) is one vLLM engine with
``tensor_parallel_size = generator.tp``, started and stopped by the replica's first rank (its
*leader*; the replica's other ranks hold nothing and answer empty: the engine's own workers
use their devices). Colocated, the leaders are trainer processes; split, the generator's own.

Weight syncs reuse Baton's plan (core.flows.reshard, run by core.model.gpt.rollout.WeightLink):
a leader holds every global tensor of the policy whole, in the trainer's dtype (``stage``:
its targets, sized from the trainer's slices; on its GPU when it has one, as NCCL receives into
GPU memory only, else in host memory), which the plan fills bucket by bucket; then
``synced`` renames them to the model family's Hugging Face tensors (core.hf.layout.to_hf, the
exporter's mapping), writes them as one safetensors file in shared memory and has the engine
reload it (core.model.gpt.vllm_engine). The first sync starts the engine on that folder: an
engine never runs weights that are not a synced policy's. The version is the sync's.

Sampling: one vLLM request per response, its seed the one Baton's Megatron engine gives the
same row ((seed, step, row) through ``Generate.seed`` and the row's index), left pads removed
(vLLM takes prompts of any length). Responses come back padded to ``max_new_tokens`` as the
Megatron engine's do (after a stop id: ``eos[0]``, log-prob 0). The probe (SCORE) is vLLM's
prompt log-probs of the probe batch. A lost engine ends the worker (``EngineLost``: the
run recovers it as a lost worker and syncs the new engine). A leader removes its weights
folder when it closes; the folder of a worker killed outright is removed by the next leader
started on the node (``_sweep_orphans``: only folders whose worker's pid runs no process).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from core.checkpoint.spec import TensorSlice
from core.config import tokvocab
from core.config.dims import ParallelDims
from core.config.run import RunConfig
from core.flows import calls as gen_calls
from core.hf import families, files, layout
from core.model.gpt import sync
from core.model.gpt import vllm_engine as engine_mod
from core.wire.ragged import FLOATS, TOKENS, Ragged
from core.worker.task import ON_HARD_EXIT

log = logging.getLogger(__name__)
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
EXIT_ENGINE_LOST = 75  # the worker's exit code when its engine died (a lost worker)
SHM_PREFIX = "baton-vllm-"  # a leader's weights folder: baton-vllm-PID-XXXX, PID the worker's


def family(cfg: RunConfig) -> str:
    """The Hugging Face family the engine loads the policy as: the imported folder's, else the
    model's shape's (qk_norm: qwen3, qkv_bias: qwen2, else llama)."""
    folder = tokvocab.hf_init_folder(cfg.init_from)
    if folder is not None:
        return families.family_of(families.read_config(folder))
    m = cfg.model
    return "qwen3" if m.qk_norm else "qwen2" if m.qkv_has_bias else "llama"


def _numpy(t: torch.Tensor) -> Any:
    """A bit-exact numpy view (bf16 as int16: the mapping only reshapes and splits)."""
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _torch(a: Any, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(a.copy() if not a.flags.c_contiguous else a)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


class VLLMRollout:
    """This rank's part of a vLLM generator replica (rank ``rank`` of a world laid out as ``dims``)."""

    def __init__(self, cfg: RunConfig, dims: ParallelDims, rank: int, *, on_cuda: bool) -> None:
        self.cfg, self.dims, self.coords, self.on_cuda = cfg, dims, dims.coords(rank), on_cuda
        self.leader = self.coords.tp == 0
        self.staged: list[tuple[TensorSlice, torch.Tensor]] = []
        self.engine: engine_mod.Engine | None = None
        self.folder: Path | None = None
        self.link: Any = None  # the WeightLink whose syncs fill ``staged`` (set by the role)
        self.model = None  # no Megatron model (SETUP reports none: the engine starts at the first sync)

    @property
    def dtype(self) -> str:
        """The engine's compute dtype (numpy's name); "" on a rank without an engine."""
        return DTYPES[self.cfg.training.mixed_precision.resolved(on_cuda=self.on_cuda)[0]] if self.leader else ""

    @property
    def version(self) -> int:
        return -1 if self.link is None else self.link.version

    # --- weight syncs ----------------------------------------------------------------------------
    def stage(self, req: gen_calls.Stage) -> gen_calls.HeldSlices:
        """A leader's targets: every tensor of ``req`` whole (allocated once per engine)."""
        if not self.leader:
            return gen_calls.HeldSlices()
        if [s for s, _ in self.staged] != list(req.tensors):
            # on GPUs syncs run over NCCL (the default group, or the bridge), which receives into GPU memory only
            device = torch.device("cuda", torch.cuda.current_device()) if self.on_cuda else torch.device("cpu")
            self.staged = [(s, torch.empty(s.global_shape, dtype=sync.DTYPES[s.dtype], device=device))
                           for s in req.tensors]
        return gen_calls.HeldSlices(targets=tuple(s for s, _ in self.staged))

    def targets(self) -> list[tuple[TensorSlice, torch.Tensor]]:
        return self.staged

    def synced(self, version: int) -> None:
        """After a sync filled ``staged``: the engine runs these weights (started on the first)."""
        if not self.leader:
            return
        t0 = time.perf_counter()
        d = layout.dims_of(self.cfg.model)
        tensors: dict[str, torch.Tensor] = {}
        for s, t in self.staged:
            for name, a in layout.to_hf(s.name, _numpy(t.cpu()), d).items():
                tensors[name] = _torch(a, t.dtype)
        if self.folder is None:
            _sweep_orphans(_shm())
            self.folder = Path(tempfile.mkdtemp(prefix=f"{SHM_PREFIX}{os.getpid()}-", dir=_shm()))
        files.save_tensors(tensors, self.folder / files.SINGLE)
        if self.engine is None:
            self._start()
        else:
            self._call(self.engine.reload)
        self._call(self._engine().sleep)
        log.debug("vLLM engine at version %d in %.3f s", version, time.perf_counter() - t0)

    def _start(self) -> None:
        assert self.folder is not None
        cfg, g = self.cfg, self.cfg.generator
        dtype = self.dtype
        # one position past seq_length: scoring a whole sequence (the probe) asks vLLM for one more token
        longest = cfg.model.seq_length + 1
        hf = {**families.hf_config(cfg.model, family(cfg), dtype=dtype), "max_position_embeddings": longest}
        (self.folder / "config.json").write_text(json.dumps(hf))
        spec = engine_mod.EngineSpec(
            folder=str(self.folder), dtype=dtype, tp=g.tp, max_model_len=longest, seed=cfg.seed,
            on_cuda=self.on_cuda, gpu_memory_utilization=g.gpu_memory_utilization,
            kv_cache_bytes=None if g.kv_cache_mb is None and self.on_cuda else int((g.kv_cache_mb or 256) * 2**20),
            max_num_seqs=g.max_num_seqs, tied=cfg.model.tie_embeddings,
            devices=tuple(range(torch.cuda.current_device(), torch.cuda.current_device() + g.tp)) if self.on_cuda
            else (), sleeps=self.on_cuda and not g.split)
        if not self.on_cuda and not g.split:
            log.info("vLLM colocated on a CPU: no sleep mode there, the engine keeps its memory during updates")
        t0 = time.perf_counter()
        if engine_mod.kill_all not in ON_HARD_EXIT:
            ON_HARD_EXIT.append(engine_mod.kill_all)
        self.engine = engine_mod.Engine(spec)
        log.info("vLLM engine of replica %d started in %.1f s (%s, tp %d)", self.coords.dp, time.perf_counter() - t0,
                 dtype, g.tp)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """An engine call; a lost engine ends this worker (the run recovers it as a lost worker)."""
        try:
            return fn(*args, **kwargs)
        except engine_mod.EngineLost as exc:
            log.error("rank %d: %s; this worker exits (code %d) and the run recovers it as a lost worker",
                      self.coords.rank, exc, EXIT_ENGINE_LOST)
            self.close()
            logging.shutdown()
            os._exit(EXIT_ENGINE_LOST)

    def _engine(self) -> engine_mod.Engine:
        if self.engine is None:
            raise RuntimeError(f"rank {self.coords.rank}: the vLLM engine starts at the first weight sync")
        return self.engine

    # --- calls -----------------------------------------------------------------------------------
    def score(self, req: gen_calls.LogProbs) -> gen_calls.LogProbs:
        """The probe: log-probs of each row's own next tokens (``Probe.next_token``: s - 1 per row)."""
        if not req.tokens or not self.leader:
            return gen_calls.LogProbs()
        logp = self._call(self._engine().prompt_logprobs, req.tokens)
        self._call(self._engine().sleep)
        return gen_calls.LogProbs(logprobs=tuple(tuple(row) for row in logp))

    def generate(self, req: gen_calls.Generate) -> gen_calls.Generated:
        if not self.leader:
            return gen_calls.Generated()
        if not req.prompts:  # more replicas than prompts
            return gen_calls.Generated(replica=self.coords.dp, version=self.version)
        indices = req.indices or tuple(range(len(req.prompts)))
        pads = req.pads or (0,) * len(req.prompts)
        # the seed Baton's Megatron engine gives this row's generator (core.model.gpt.rollout)
        requests = [engine_mod.Request(prompt=tuple(p[pad:]), seed=(req.seed * 1_000_003 + i) % 2**63)
                    for p, pad, i in zip(req.prompts.tolist(), pads, indices, strict=True)]
        n = req.max_new_tokens
        out = self._call(self._engine().generate, requests, max_new_tokens=n, temperature=req.temperature,
                         top_k=req.top_k, top_p=req.top_p, stop=req.eos)
        self._call(self._engine().sleep)  # colocated on a GPU: the update that follows has the GPU
        fill = req.eos[0] if req.eos else 0
        tokens = [tuple(t) + (fill,) * (n - len(t)) for t, _ in out]
        logps = [tuple(lp) + (0.0,) * (n - len(lp)) for _, lp in out]
        return gen_calls.Generated(replica=self.coords.dp, version=self.version, tokens=Ragged.of(tokens, TOKENS),
                                   logprobs=Ragged.of(logps, FLOATS))  # vLLM's sampler computes in float32

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def _sweep_orphans(where: str | None) -> None:
    """Remove the weights folders of workers that are gone: a worker killed outright (SIGKILL,
    out of memory) cannot remove its own, and each holds a whole policy in shared memory.
    Only folders whose PID runs no process are touched."""
    root = Path(where if where is not None else tempfile.gettempdir())
    for folder in root.glob(f"{SHM_PREFIX}*-*"):
        pid = folder.name[len(SHM_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            log.info("removing %s and the shared memory its engine left: its worker (pid %s) is gone", folder, pid)
            engine_mod.remove_listed(folder)
            shutil.rmtree(folder, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _shm() -> str | None:
    """Shared memory where the host has it (the engine reads the weights from there)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
