"""Run ``GPTTask`` ranks as real processes without the ZeroMQ controller.

``RankGroup`` starts one process per rank (forked from a server that has imported torch
and Megatron-core); each builds a ``GPTTask`` and serves commands
over a pipe: ``call(name, **kw)`` runs one of the task's calls on every rank (the request
checked by its method, as the worker runtime does; the result as plain data, fields that
are None left out), ``apply(fn, **kw)`` runs a top-level function ``fn(task, **kw)`` (for
the ``core.model.gpt.state`` functions, which are no calls). Every wait has a deadline; ``close`` asks the ranks to shut down and
terminates (then kills) those it started that are still alive.

    with RankGroup(gpt_config(tp=2, pp=2, world_size=4), world_size=4) as g:
        g.setup()
        losses = [g.loss(g.call("train_step", step=s)) for s in range(10)]
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import socket
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from core.checkpoint.hdf5 import CheckpointReader
from core.checkpoint.spec import TensorSlice

Items = list[tuple[TensorSlice, np.ndarray]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gpt_config(*, tp: int = 1, pp: int = 1, world_size: int = 1, steps: int = 10, **sections: Any) -> dict[str, Any]:
    """The tiny GPT of the tests (4 layers, hidden 64, heads 4, vocab 128, seq 32, batch 16).

    ``sections`` update whole config sections by name, e.g. ``training={"recompute": "full"}``.
    """
    cfg: dict[str, Any] = {
        "seed": 1234,
        "trainer": {"nodes": 1, "n_gpus_per_node": world_size, "steps": steps, "device": "cpu"},
        "model": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128, "seq_length": 32},
        "parallel": {"tp": tp, "pp": pp},
        "training": {"global_batch_size": 16, "micro_batch_size": 2},
        "optimizer": {"lr": 3e-3, "warmup_steps": 2},
        "data": {"kind": "synthetic", "task": "increment"},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


def _call(table: dict[str, Any], name: str, kwargs: dict[str, Any]) -> Any:
    method, fn = table[name]
    value = method.encode_result(fn(method.decode_request(kwargs)))
    return {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value


def _rank_main(rank: int, world_size: int, conn: Any, run_dir: str, config: dict[str, Any]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    warnings.filterwarnings("ignore")  # Megatron's "TE/Apex missing" and deprecation noise
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    from core.checkpoint.service import CheckpointedTask
    from core.config import run as config_mod
    from core.config.runplan import plan_run
    from core.model.gpt.task import GPTTask
    from core.worker.task import WorkerContext

    cfg = config_mod.from_data(config)
    ctx = WorkerContext(rank=rank, world_size=world_size, epoch=0, run_dir=Path(run_dir), host="localhost",
                        log=logging.getLogger(f"rank{rank}"), config=cfg, roles=plan_run(cfg).roles_at(rank))
    task = GPTTask(ctx)
    served = CheckpointedTask(task, rank)  # the checkpoint calls too, as a worker serves them
    table = {m.name: (m, fn) for m, fn in served.handlers().items()}
    while True:
        kind, target, kwargs = conn.recv()
        if kind == "exit":
            break
        try:
            result = _call(table, target, kwargs) if kind == "call" else target(task, **kwargs)
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001 - sent to the test process, which raises it
            conn.send(("error", traceback.format_exc()))
    try:
        served.close()
    finally:
        conn.send(("ok", None))


PRELOAD = "tests.integration.gpt_preload"


def _context() -> Any:
    """Ranks fork from one server process that imported torch and Megatron-core once.

    A fresh interpreter per rank pays about 6 s of CPU for those imports; forked from the
    server it pays nothing. The server only imports (no torch thread pool, no process
    group), so forking it is safe; each rank still sets itself up from scratch.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])
    return ctx


class RankError(RuntimeError):
    """A rank raised; carries its traceback."""


class RankGroup:
    """``world_size`` spawned GPTTask ranks driven from the test process."""

    def __init__(self, config: dict[str, Any], *, world_size: int, run_dir: str | Path = "/tmp",
                 timeout_s: float = 240.0) -> None:
        self.config = config
        self.world_size = world_size
        self.run_dir = str(run_dir)
        self.timeout_s = timeout_s
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.setup_info: list[dict[str, Any]] = []

    def __enter__(self) -> RankGroup:
        ctx = _context()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, self.world_size, child, self.run_dir, self.config),
                               daemon=True)
            proc.start()
            self.procs.append(proc)
            self.conns.append(parent)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _collect(self, what: str, timeout_s: float | None) -> list[Any]:
        """Every rank's answer; the first error (from any rank) is raised at once."""
        budget = timeout_s or self.timeout_s
        deadline = time.monotonic() + budget
        answers: dict[int, Any] = {}
        pending = dict(enumerate(self.conns))
        while pending:
            ready = mp_connection.wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"ranks {sorted(pending)} did not answer {what} within {budget:.0f} s "
                                   f"(alive: {[self.procs[r].is_alive() for r in sorted(pending)]})")
            for rank in [r for r, c in pending.items() if c in ready]:
                try:
                    status, value = pending.pop(rank).recv()
                except (EOFError, OSError):
                    self.procs[rank].join(timeout=5)
                    raise RankError(f"rank {rank} exited during {what} (exit code "
                                    f"{self.procs[rank].exitcode}); see its stderr above") from None
                if status == "error":
                    # Other ranks may now block in a collective: stop waiting on them.
                    raise RankError(f"{what} failed on rank {rank}:\n{value}")
                answers[rank] = value
        return [answers[r] for r in range(len(self.conns))]

    def call(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Run rpc ``method`` on every rank; the results in rank order."""
        for conn in self.conns:
            conn.send(("call", method, kwargs))
        return self._collect(method, timeout_s)

    def call_each(self, method: str, per_rank: list[dict[str, Any]], timeout_s: float | None = None) -> list[Any]:
        """Run rpc ``method`` with each rank's own request; the results in rank order."""
        for conn, kwargs in zip(self.conns, per_rank, strict=True):
            conn.send(("call", method, kwargs))
        return self._collect(method, timeout_s)

    def apply(self, fn: Callable[..., Any], timeout_s: float | None = None, *,
              per_rank: list[dict[str, Any]] | None = None, **kwargs: Any) -> list[Any]:
        """Run top-level ``fn(task, **kwargs)`` on every rank (``per_rank`` adds rank-own kwargs)."""
        for rank, conn in enumerate(self.conns):
            conn.send(("apply", fn, {**kwargs, **(per_rank[rank] if per_rank else {})}))
        return self._collect(fn.__name__, timeout_s)

    def setup(self) -> list[dict[str, Any]]:
        self.setup_info = self.call("setup", master_addr="127.0.0.1", master_port=free_port())
        return self.setup_info

    def loss_owner_results(self, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in results if "loss" in r]

    def loss(self, results: list[dict[str, Any]]) -> float:
        """The step's loss; every loss owner (one per DP replica) must report the same one."""
        losses = [r["loss"] for r in self.loss_owner_results(results)]
        assert losses, "no rank reported a loss"
        assert max(losses) - min(losses) < 1e-7, f"loss owners disagree: {losses}"
        return float(losses[0])

    def train(self, steps: range) -> list[float]:
        return [self.loss(self.call("train_step", step=s)) for s in steps]

    def save(self, root: Path, step: int) -> Path:
        """A checkpoint of ``step`` through the real calls and commit (what the controller does)."""
        from core.checkpoint.calls import CKPT_SAVE
        from core.checkpoint.commit import commit, tmp_step_dir

        tmp = tmp_step_dir(root, step)
        saved = self.call("ckpt_save", step=step, tmp_dir=str(tmp),
                          attrs={"step": step, "layout": "harness", "config_hash": "harness"})
        acks = [CKPT_SAVE.decode_result(s).ack for s in saved]
        return commit(root, step, tmp, acks, {"layout": "harness"}, world_size=self.world_size)

    def load(self, step_dir: Path) -> None:
        self.call("ckpt_load", step_dir=str(step_dir))

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if proc.is_alive():
                try:
                    conn.send(("exit", None, {}))
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            proc.join(timeout=20)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()


def initial_weights(work: Path) -> Path:
    """The tiny GPT's initial global weights (a tp1pp1 rank), as ``work/init.npz``: the
    weights every layout of a comparison starts from."""
    with RankGroup(gpt_config(), world_size=1, run_dir=work) as g:
        g.setup()
        g.call("save_global_weights", path=str(work / "init.npz"))
    return work / "init.npz"


# --- rank-side functions for RankGroup.apply ------------------------------------------------
def export_on_rank(task: Any, step: int) -> tuple[Items, dict[str, Any]]:
    """The task's checkpoint state (``core.model.gpt.state.export_state``, or ZeRO-3's) of this
    rank after ``step`` steps, its live items as arrays (to send)."""
    from core.checkpoint.spec import current

    task.role("actor").next_step = step
    items, blobs = task.checkpoint_state()
    return [(s, np.array(current(a))) for s, a in items], blobs


def import_on_rank(task: Any, arrays_path: str, blobs: dict[str, Any]) -> int:
    """The task's ``restore_state`` (core.model.gpt.state.import_state, or ZeRO-3's) from an
    .npz of full global arrays; the step it restored."""
    with np.load(arrays_path) as arrays:
        def read(name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
            return arrays[name][tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]

        task.restore_state(read, blobs)
    return task.role("actor").next_step


def check_groups_against(task: Any, *, tp: int, pp: int, dp: int) -> str:
    """Rank side: the error ``check_groups`` raises for a layout Megatron was not built with."""
    from core.config.dims import ParallelDims
    from core.errors import BatonRuntimeError
    from core.parallel.megatron import check_groups

    try:
        check_groups(ParallelDims(tp=tp, pp=pp, dp=dp), task.ctx.rank)
    except BatonRuntimeError as exc:
        return str(exc)
    return "no error"


def record_reductions_on_rank(task: Any) -> None:
    """Wrap the collectives Megatron's DDP reduces gradients with: note each big one's dtype."""
    import torch
    from megatron.core.distributed import param_and_grad_buffer as buffers

    seen = task.__dict__.setdefault("_reduced", [])
    all_reduce, reduce_scatter = torch.distributed.all_reduce, buffers.dist_reduce_scatter_func

    def note(t: Any) -> None:
        if t.numel() >= 1000:  # a gradient bucket (the loss, norms and inf checks are scalars)
            seen.append(str(t.dtype).removeprefix("torch."))

    def ar(tensor: Any, *a: Any, **k: Any) -> Any:
        note(tensor)
        return all_reduce(tensor, *a, **k)

    def rs(output: Any, tensor: Any, *a: Any, **k: Any) -> Any:
        note(tensor)
        return reduce_scatter(output, tensor, *a, **k)

    torch.distributed.all_reduce, buffers.dist_reduce_scatter_func = ar, rs


def reductions_on_rank(task: Any) -> list[str]:
    """The dtypes ``record_reductions_on_rank`` noted on this rank, in order."""
    return list(task.__dict__.get("_reduced", []))


# --- test-process helpers -------------------------------------------------------------------
def assemble_exact(items: Items) -> dict[str, np.ndarray]:
    """Global arrays from every rank's slices; asserts each element was written exactly once."""
    arrays: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for s, data in items:
        assert data.shape == s.shape or data.size == int(np.prod(s.shape)), (s, data.shape)
        index = tuple(slice(o, o + n) for o, n in zip(s.offset, s.shape, strict=True))
        arrays.setdefault(s.name, np.zeros(s.global_shape, dtype=data.dtype))[index] = data.reshape(s.shape)
        counts.setdefault(s.name, np.zeros(s.global_shape, dtype=np.int32))[index] += 1
    bad = {name: (int(c.min()), int(c.max())) for name, c in counts.items() if c.min() != 1 or c.max() != 1}
    assert not bad, f"slices do not tile their global tensors exactly once: {bad}"
    return arrays


def export_group(group: RankGroup, step: int, path: Path) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """Export every rank's state, assemble the global arrays into ``path`` (.npz)."""
    parts = group.apply(export_on_rank, step=step)
    arrays = assemble_exact([item for items, _ in parts for item in items])
    np.savez(path, **arrays)
    return arrays, [blobs for _, blobs in parts]


def import_group(group: RankGroup, path: Path, blobs: list[dict[str, Any]]) -> list[int]:
    """Import into ``group``: each rank takes its own saved blobs if that rank existed, else rank 0's."""
    per_rank = [{"blobs": blobs[r] if r < len(blobs) else blobs[0]} for r in range(group.world_size)]
    return group.apply(import_on_rank, arrays_path=str(path), per_rank=per_rank)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_state_is_the_checkpoints(group: RankGroup, step_dir: Path, step: int) -> None:
    """Right after a load, every tensor this rank would save, its step counters, loss scaler and
    RNG streams equal the checkpoint's, bit for bit."""
    with CheckpointReader(step_dir) as reader:
        for rank, (items, blobs) in enumerate(group.apply(export_on_rank, step=step)):
            for s, data in items:
                saved = reader.read(s.name, s.offset, s.shape)
                assert np.array_equal(_bits(data), _bits(saved)), f"rank {rank}: {s.name} at {s.offset} differs"
            want = reader.blobs(rank)
            assert blobs["optimizer"] == want["optimizer"], (rank, blobs["optimizer"], want["optimizer"])
            assert blobs["rng"] == want["rng"], f"rank {rank}: the RNG streams are not the saved ones"


def logits_on_rank(task: Any, tokens: list[list[int]]) -> np.ndarray | None:
    """The actor's whole-vocabulary logits ``[b, s, vocab]`` of ``tokens`` (causal, forward only,
    through the pipeline schedule), on the last stage's first tensor-parallel rank; None elsewhere."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    ctx = task.role("actor").rank.ready()
    batch = torch.tensor(tokens, dtype=torch.long)
    b, s = batch.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)

    def forward(data: Any, model: Any) -> tuple[Any, Any]:
        next(data)
        out = model(batch, positions, None)
        return out, lambda logits: (logits.sum() * 0, {"logits": gather_from_tensor_model_parallel_region(logits)})

    for chunk in ctx.model_chunks:
        chunk.eval()
    with torch.no_grad():
        got = get_forward_backward_func()(forward_step_func=forward, data_iterator=iter([None]),
                                          model=ctx.model_chunks, num_microbatches=1, seq_length=s,
                                          micro_batch_size=b, forward_only=True)
    last = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    return got[0]["logits"].float().numpy() if last else None


def greedy_on_rank(task: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The actor's greedy continuation of ``prompts`` by core.model.gpt.generate (one stage)."""
    from core.model.gpt.generate import Sampling, generate
    from core.model.gpt.model import unwrap

    ctx = task.role("actor").rank.ready()
    model = unwrap(ctx.model_chunks[0])
    model.eval()
    tokens, _ = generate(model, prompts, Sampling(max_new_tokens=new_tokens), seeds=[0] * len(prompts),
                         max_length=ctx.cfg.model.seq_length)
    return tokens


def hf_reads_on_rank(task: Any, folder: str) -> int:
    """The elements this rank reads from the HF folder ``folder`` to load its weights (the task's
    ``restore_weights`` over core.hf.reader, its reads counted)."""
    from core.hf import layout
    from core.hf.reader import HFReader

    reader = HFReader(folder, layout.dims_of(task.role("actor").rank.cfg.model))
    view, count = reader.view, [0]

    def counted(name: str, start: int, stop: int, rest: tuple[slice, ...]) -> Any:
        out = view(name, start, stop, rest)
        count[0] += out.numel()
        return out

    reader.view = counted  # type: ignore[method-assign]
    task.restore_weights(reader)  # as CKPT_LOAD passes it: each box straight into its parameter
    return count[0]


def sync_generator(group: RankGroup, version: int, bucket_bytes: int = 1 << 20) -> list[Any]:
    """The trainer's weights into the colocated generator, as the controller does it: a plan
    (core.flows.reshard) from every rank's slices, each rank sent its own pieces."""
    from core.flows import calls as gen_calls
    from core.flows import reshard
    from core.wire.contract import NO_ARGS

    held = [gen_calls.GEN_SLICES.decode_result(h)
            for h in group.call("gen_slices", **gen_calls.GEN_SLICES.encode_request(NO_ARGS))]
    pieces = reshard.plan({r: h.sources for r, h in enumerate(held)}, {r: h.targets for r, h in enumerate(held)},
                          bucket_bytes=bucket_bytes)
    per_rank = [gen_calls.SYNC_WEIGHTS.encode_request(gen_calls.SyncWeights(
        pieces=tuple(reshard.for_rank(pieces, r)), version=version)) for r in range(group.world_size)]
    return group.call_each("sync_weights", per_rank)


def greedy_reference(model: Any, prompts: Any, new: int) -> list[list[int]]:
    """A reference greedy loop: the whole sequence forward again for every new token (no KV
    cache), the argmax of the gathered logits; each prompt's ``new`` tokens."""
    import torch

    seq = torch.tensor([list(p) for p in prompts])
    with torch.no_grad():
        for _ in range(new):
            n = seq.shape[1]
            positions = torch.arange(n).unsqueeze(0).expand(seq.shape[0], -1)
            causal = torch.triu(torch.ones(1, 1, n, n, dtype=torch.bool), diagonal=1)  # the keys it may not see
            nxt = model(seq, positions, causal, runtime_gather_output=True)[:, -1].argmax(-1)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
    return seq[:, len(prompts[0]):].tolist()
