"""``baton plan --check RUN_DIR``: the plan's memory estimate beside what the run's ranks
measured they held (memory.json, written at the first step of its last allocation).

The estimate is made for what ran: the precision resolved for the ranks' device (a CPU run
computes in fp32 where a GPU plan assumes bf16) and the micro-batch it trained with. It is
compared on the rank the plan finds worst, category by category: weights, gradients,
optimizer state, activations (the layers' and the head's: what one rank's forward saves
for backward, times the micro-batches in flight). Exit code 1 when one is off by more than
``TOLERANCE``.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from core.config import run as config
from core.config.plan import make_plan
from core.errors import ExitCode, RunFolderError, UserError
from core.record.memory import MemoryReport
from core.record.runfolder import RunFolder

TOLERANCE = 0.15
CATEGORIES = (("weights", "weights_bytes"), ("gradients", "grads_bytes"), ("optimizer", "optimizer_bytes"),
              ("activations", "activations_bytes"))


def estimate(run_dir: Path) -> tuple[dict[str, float], dict[str, float], int]:
    """(estimated, measured) bytes per category on the plan's worst rank, and that rank."""
    run = RunFolder(run_dir)
    if not run.config.is_file():
        raise UserError(f"{run_dir}: not a Baton run folder (no config.yaml); pass the folder `baton submit` printed")
    measured = MemoryReport.read(run.memory)
    if measured.micro_batch_size is None:
        raise RunFolderError(f"{run.memory}: no micro_batch_size recorded; resume the run for a step to write it again")
    cfg = config.load(run.config)
    mp = cfg.training.mixed_precision
    param, reduce = mp.resolved(on_cuda=measured.device == "cuda")
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(
        cfg.training, micro_batch_size=measured.micro_batch_size,
        mixed_precision=dataclasses.replace(mp, param_dtype=param, reduce_dtype=reduce)))
    mem = make_plan(cfg).memory
    est = {"weights": mem.weights_bytes, "gradients": mem.grads_bytes, "optimizer": mem.optimizer_bytes,
           "activations": mem.activations_bytes + mem.logits_bytes}
    rank = measured.ranks[mem.rank] if mem.rank < len(measured.ranks) else None
    got = {name: getattr(rank, key, None) for name, key in CATEGORIES}
    if None in got.values():
        raise RunFolderError(f"{run.memory}: rank {mem.rank} measured no {', '.join(n for n, v in got.items() if v is None)}"
                             "; resume the run for a step to write it again")
    return est, {name: float(v) for name, v in got.items() if v is not None}, mem.rank


def run_check(run_dir: Path) -> int:
    est, got, rank = estimate(run_dir)
    print(f"memory of rank {rank}: the plan's estimate beside what it measured (tolerance ±{TOLERANCE:.0%})")
    print(f"  {'':<12} {'estimate':>12} {'measured':>12} {'ratio':>7}")
    off = []
    for name, _ in CATEGORIES:
        ratio = est[name] / got[name] if got[name] else float("inf")
        ok = abs(ratio - 1) <= TOLERANCE
        off += [] if ok else [name]
        print(f"  {name:<12} {est[name] / 2**20:>10.2f}Mi {got[name] / 2**20:>10.2f}Mi {ratio:>7.3f}{'' if ok else '  OFF'}")
    if off:
        print(f"off by more than {TOLERANCE:.0%}: {', '.join(off)}")
        return ExitCode.FAILED
    return ExitCode.OK
