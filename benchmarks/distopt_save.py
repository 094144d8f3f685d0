"""A distributed optimizer's checkpoint save: Baton's own-range write beside the full-copy approach.

Two data-parallel ranks (gloo, one process each) of a GPT with Megatron's distributed optimizer
(fp32, ~25M parameters; ``--quick``: ~6M) take one step, then save their shard of a checkpoint
synchronously, both ways, alternating, in the same run:
  own ranges  Baton's (core.model.gpt.optimizer_state): each rank writes the flat ranges of main
              weights and moments it owns, as boxes of the global tensors, straight from its
              shard buffers
  full copy   the approach it replaced: each rank fills its range into zero tensors of every local
              parameter's full shape, the DP group sums them (one all-reduce), and DP rank 0 writes
              the whole local state
Per rank and way: the save's wall time (export + write + fsync), its bytes, and the peak extra
resident memory during it (VmHWM after a reset through /proc/self/clear_refs, minus the resident
set before), beside the rank's own optimizer shard.

    python benchmarks/distopt_save.py [--quick] [--repeat N] [--dir PATH]
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.multiprocessing as tmp  # noqa: E402

WAYS = ("own ranges", "full copy")


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))  # type: ignore[union-attr]


def _full_copy_items(task: Any, step: int) -> tuple[list[Any], dict[str, Any]]:
    """The replaced export: full local-shaped zeros per state kind, summed over DP; rank 0 writes."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from core.model.gpt.optimizer_state import MOMENTS, OptimizerState, _slice
    from core.model.gpt.state import LiveTensor, export_state, is_writer, sharded_params

    ctx = task._ready()
    items, blobs = export_state(ctx.model_chunks, ctx.optimizer, step, ctx.coords, ctx.dims)
    items = [(s, a) for s, a in items if not s.name.startswith("optim.")]  # model weights as before
    opt, params = OptimizerState(ctx.optimizer), list(sharded_params(ctx.model_chunks))
    states = []
    for _, param in params:
        full = {k: torch.zeros(param.shape, dtype=torch.float32) for k in MOMENTS}
        held = opt._tensors(param)
        if held is not None:
            tensors, r = held
            for k in MOMENTS:
                full[k].view(-1)[r.start:r.end] = tensors[k]
        states.append(full)
    flat = torch.cat([s[k].reshape(-1) for s in states for k in MOMENTS])
    dist.all_reduce(flat, group=parallel_state.get_data_parallel_group())
    i = 0
    for s in states:
        for k in MOMENTS:
            s[k].view(-1).copy_(flat[i:i + s[k].numel()])
            i += s[k].numel()
    del flat
    for (sh, _), state in zip(params, states, strict=True):
        if is_writer(sh):
            for k in MOMENTS:
                piece = _slice(sh, f"optim.{k}.{sh.key}")
                items.append((piece, LiveTensor(state[k], piece.shape)))
    return items, blobs


def _save(task: Any, folder: Path, way: str) -> tuple[float, int, int]:
    """(seconds, bytes written, peak extra bytes) of one synchronous save of this rank's shard."""
    from core.checkpoint.hdf5 import write_shard
    from core.checkpoint.spec import current
    from core.model.gpt.state import export_state

    ctx = task._ready()
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _kib("VmRSS")
    t0 = time.perf_counter()
    if way == "own ranges":
        items, blobs = export_state(ctx.model_chunks, ctx.optimizer, 1, ctx.coords, ctx.dims)
    else:
        items, blobs = _full_copy_items(task, 1)
    ack = write_shard(folder / f"rank_{task.ctx.rank:05d}.h5", [(s, current(a)) for s, a in items], blobs,
                      {"step": 1, "rank": task.ctx.rank})
    seconds = time.perf_counter() - t0
    extra = (_kib("VmHWM") - before) * 1024
    del items
    return seconds, ack.size_bytes, extra


def _rank(rank: int, port: int, quick: bool, repeat: int, base: str, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    from core.config import run as config_mod
    from core.config.runplan import plan_run
    from core.model.gpt.optimizer_state import MOMENTS
    from core.model.gpt.task import GPTTask
    from core.wire import calls
    from core.worker.task import WorkerContext

    hidden = 256 if quick else 512
    cfg = config_mod.from_data({
        "trainer": {"n_gpus_per_node": 2, "device": "cpu"}, "parallel": {"distributed_optimizer": True},
        "model": {"num_layers": 8, "hidden_size": hidden, "num_attention_heads": 8, "vocab_size": 128, "seq_length": 32},
        "training": {"global_batch_size": 4, "micro_batch_size": 2, "mixed_precision": {"param_dtype": "fp32"}}})
    task = GPTTask(WorkerContext(rank=rank, world_size=2, epoch=0, run_dir=Path(base), host="localhost",
                                 log=logging.getLogger("bench"), config=cfg,
                                 roles=plan_run(cfg).roles_at(rank)))
    task.setup(calls.Setup(master_addr="127.0.0.1", master_port=port))
    task.role("actor").train_step(calls.Step(step=0))
    inner = task._ready().optimizer.optimizer
    shard = sum(t.nbytes for state in inner.state.values() for k, t in state.items() if k in MOMENTS)
    results: dict[str, list[tuple[float, int, int]]] = {w: [] for w in WAYS}
    for r in range(repeat + 1):  # the first round warms up, untimed
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            folder = Path(base) / f"{way.replace(' ', '_')}_{r}"
            folder.mkdir(exist_ok=True)
            got = _save(task, folder, way)
            if r:
                results[way].append(got)
    out.put((rank, shard, results))
    task.close()


def run(quick: bool, repeat: int, folder: Path | None) -> dict[str, Any]:
    """Both ways on two ranks; per rank and way the medians of seconds, bytes and peak extra bytes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = tempfile.mkdtemp(prefix="baton-bench-distopt-", dir=folder)
    ctx = tmp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, quick, repeat, base, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    rows: dict[str, Any] = {}
    for rank, shard, results in sorted(got):
        for way, rs in results.items():
            rows[f"rank {rank} {way}"] = {"shard_bytes": shard, "seconds": statistics.median(x[0] for x in rs),
                                          "bytes": statistics.median(x[1] for x in rs),
                                          "peak_extra_bytes": statistics.median(x[2] for x in rs)}
    return rows


def report(rows: dict[str, Any]) -> bool:
    """Print the table; True when every own-range save stays within 1.2x of its shard."""
    print(f"{'rank / way':<22} {'save s':>7} {'MB written':>10} {'GB/s':>6} {'peak extra MiB':>14} {'shard MiB':>9} "
          f"{'extra/shard':>11}")
    for name, r in rows.items():
        print(f"{name:<22} {r['seconds']:>7.2f} {r['bytes'] / 1e6:>10.1f} {r['bytes'] / r['seconds'] / 1e9:>6.2f} "
              f"{r['peak_extra_bytes'] / 2**20:>14.1f} {r['shard_bytes'] / 2**20:>9.1f} "
              f"{r['peak_extra_bytes'] / r['shard_bytes']:>11.2f}")
    return all(r["peak_extra_bytes"] <= 1.2 * r["shard_bytes"] for n, r in rows.items() if n.endswith("own ranges"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    met = report(run(args.quick, args.repeat, args.dir))
    print(f"target: own-range peak extra memory <= 1.2x the rank's optimizer shard: {'met' if met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
