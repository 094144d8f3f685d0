"""``baton plan --check RUN_DIR``: the plan's memory estimate beside what the run's ranks
measured they held (memory.json, written at the first step of its last allocation).

The estimate is made for what ran: the precision resolved for the ranks' device (a CPU run
computes in fp32 where a GPU plan assumes bf16) and the micro-batch it trained with. It is
compared on the rank the plan finds worst, category by category: weights, gradients,
optimizer state, activations (the layers' and the head's: what one rank's forward saves
for backward, times the micro-batches in flight). Exit code 1 when one is off by more than
``TOLERANCE``.

With a generator, the largest KV cache a replica measured it allocated (``gen_kv_cache_mb``,
the most over metrics.jsonl's steps) beside the generator plan's (core.config.genplan, in the
dtype of the ranks' device), within the same tolerance. A run with that measurement and no
memory.json (an RL run without a warm start trains no plain step) is checked on it alone.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from core.config import run as config
from core.config.genplan import plan_generator
from core.config.plan import make_plan
from core.config.run import RunConfig
from core.errors import ExitCode, RunFolderError, UserError
from core.record import steps as step_records
from core.record.memory import MemoryReport
from core.record.runfolder import RunFolder
from core.record.state import RunRecord

TOLERANCE = 0.15
CATEGORIES = (("weights", "weights_bytes"), ("gradients", "grads_bytes"), ("optimizer", "optimizer_bytes"),
              ("activations", "activations_bytes"))


def _run_folder(run_dir: Path) -> RunFolder:
    run = RunFolder(run_dir)
    if not run.config.is_file():
        raise UserError(f"{run_dir}: not a Baton run folder (no config.yaml); pass the folder `baton submit` printed")
    return run


def _as_ran(cfg: RunConfig, device: str, micro_batch_size: int | None = None) -> RunConfig:
    """``cfg`` at the precision its ranks resolved on ``device`` (and the micro-batch they used)."""
    mp = cfg.training.mixed_precision
    param, reduce = mp.resolved(on_cuda=device == "cuda")
    return dataclasses.replace(cfg, training=dataclasses.replace(
        cfg.training, micro_batch_size=micro_batch_size or cfg.training.micro_batch_size,
        mixed_precision=dataclasses.replace(mp, param_dtype=param, reduce_dtype=reduce)))


def estimate(run_dir: Path) -> tuple[dict[str, float], dict[str, float], int]:
    """(estimated, measured) bytes per category on the plan's worst rank, and that rank."""
    run = _run_folder(run_dir)
    measured = MemoryReport.read(run.memory)
    if measured.micro_batch_size is None:
        raise RunFolderError(f"{run.memory}: no micro_batch_size recorded; resume the run for a step to write it again")
    cfg = _as_ran(config.load(run.config), measured.device, measured.micro_batch_size)
    mem = make_plan(cfg).memory
    est = {"weights": mem.weights_bytes, "gradients": mem.grads_bytes, "optimizer": mem.optimizer_bytes,
           "activations": mem.activations_bytes + mem.logits_bytes}
    rank = measured.ranks[mem.rank] if mem.rank < len(measured.ranks) else None
    got = {name: getattr(rank, key, None) for name, key in CATEGORIES}
    if None in got.values():
        raise RunFolderError(f"{run.memory}: rank {mem.rank} measured no {', '.join(n for n, v in got.items() if v is None)}"
                             "; resume the run for a step to write it again")
    return est, {name: float(v) for name, v in got.items() if v is not None}, mem.rank


def generator_kv(run_dir: Path) -> tuple[float, float] | None:
    """(planned, measured) bytes of a generator replica's largest KV cache; None when no step
    recorded one (no generator, or a vLLM engine, which sizes its own)."""
    run = _run_folder(run_dir)
    recorded = [r.gen_kv_cache_mb for r in step_records.read(run.metrics) if r.gen_kv_cache_mb] \
        if run.metrics.is_file() else []
    if not recorded:
        return None
    try:
        device = MemoryReport.read(run.memory).device
    except RunFolderError:  # no memory.json: the device the ranks set up on
        record = RunRecord(run)
        devices = {r.device for r in record.read().ranks if r.device} if record.exists() else set()
        device = "cuda" if devices == {"cuda"} else "cpu"
    cfg = _as_ran(config.load(run.config), device)
    gen = plan_generator(cfg, make_plan(cfg))
    if gen is None:
        return None
    return float(gen.kv_cache_bytes), max(recorded) * 2**20


def _line(name: str, est: float, got: float) -> bool:
    ratio = est / got if got else float("inf")
    ok = abs(ratio - 1) <= TOLERANCE
    print(f"  {name:<12} {est / 2**20:>10.2f}Mi {got / 2**20:>10.2f}Mi {ratio:>7.3f}{'' if ok else '  OFF'}")
    return ok


def run_check(run_dir: Path) -> int:
    kv = generator_kv(run_dir)
    off = []
    if kv is None or _run_folder(run_dir).memory.is_file():
        est, got, rank = estimate(run_dir)
        print(f"memory of rank {rank}: the plan's estimate beside what it measured (tolerance ±{TOLERANCE:.0%})")
        print(f"  {'':<12} {'estimate':>12} {'measured':>12} {'ratio':>7}")
        off += [name for name, _ in CATEGORIES if not _line(name, est[name], got[name])]
    if kv is not None:
        print(f"generator: the plan's KV cache beside the largest a replica allocated (tolerance ±{TOLERANCE:.0%})")
        print(f"  {'':<12} {'estimate':>12} {'measured':>12} {'ratio':>7}")
        off += [] if _line("KV cache", *kv) else ["generator KV cache"]
    if off:
        print(f"off by more than {TOLERANCE:.0%}: {', '.join(off)}")
        return ExitCode.FAILED
    return ExitCode.OK
