"""Host memory of a synchronous save: the shard streamed through bounded buffers beside the whole copy.

Two data-parallel ranks (gloo, one process each) of a bf16 GPT with Megatron's distributed
optimizer (~100M parameters; ``--quick``: ~25M) take one step, then save their shard of a
checkpoint synchronously, three ways, alternating, in the same run:
  whole copy         what a save did before core.checkpoint.stream: every item turned into a host
                     array first (``spec.current``: the bf16 weights cast to fp32 copies; the fp32
                     main weights and moments of the shard are views on a CPU), then written
  whole copy (GPU)   the same as it is on a GPU, where ``current`` copies every item to host
                     (emulated: every item copied into a private fp32 array first)
  streamed           Baton's: ``write_shard`` reads each item while it writes it; what is not
                     already host fp32 (here the bf16 weights) goes through two 32 MiB buckets
  streamed (GPU)     Baton's as on a GPU, where nothing is host memory: every item through the
                     two buckets (``copy_all``, as an async snapshot does)
Per rank and way: the save's wall time, the bytes written, and the peak extra resident memory
during it (VmHWM after a reset through /proc/self/clear_refs, minus the resident set before;
glibc's mmap threshold is fixed at 64 KiB, so freed blocks go back to the system and each
save's growth is its own).
The goal: a streamed save's extra memory is at most its buckets (64 MiB) plus 16 MiB of slack
(HDF5's metadata, the blobs), whatever the state's size.

    python benchmarks/stream_save.py [--quick] [--repeat N] [--dir PATH] [--json PATH]
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.multiprocessing as tmp  # noqa: E402

WAYS = ("whole copy", "whole copy (GPU)", "streamed", "streamed (GPU)")
SLACK = 16 << 20


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))  # type: ignore[union-attr]


def _save(task: Any, path: Path, way: str) -> tuple[float, int, int]:
    """(seconds, bytes written, peak extra bytes) of one synchronous save of this rank's shard."""
    import numpy as np

    from core.checkpoint import stream
    from core.checkpoint.hdf5 import write_shard
    from core.checkpoint.spec import current

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from here
    before = _kib("VmRSS")
    t0 = time.perf_counter()
    items, blobs = task.checkpoint_state()
    attrs = {"step": 1, "rank": task.ctx.rank}
    if way == "whole copy":
        ack = write_shard(path, [(s, current(a)) for s, a in items], blobs, attrs)
    elif way == "whole copy (GPU)":
        ack = write_shard(path, [(s, np.array(current(a), dtype=np.float32)) for s, a in items], blobs, attrs)
    else:
        ack = write_shard(path, items, blobs, attrs, slots=stream.Slots(), copy_all=way == "streamed (GPU)")
    seconds = time.perf_counter() - t0
    extra = (_kib("VmHWM") - before) * 1024
    del items
    return seconds, ack.size_bytes, extra


def _rank(rank: int, port: int, quick: bool, repeat: int, base: str, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import logging
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from core.config import run as config_mod
    from core.config.runplan import plan_run
    from core.model.gpt.task import GPTTask
    from core.wire import calls
    from core.worker.task import WorkerContext

    hidden = 512 if quick else 1024
    cfg = config_mod.from_data({
        "trainer": {"n_gpus_per_node": 2, "device": "cpu"}, "parallel": {"distributed_optimizer": True},
        "model": {"num_layers": 8, "hidden_size": hidden, "num_attention_heads": 8, "vocab_size": 128, "seq_length": 32},
        "training": {"global_batch_size": 4, "micro_batch_size": 2, "mixed_precision": {"param_dtype": "bf16"}}})
    task = GPTTask(WorkerContext(rank=rank, world_size=2, epoch=0, run_dir=Path(base), host="localhost",
                                 log=logging.getLogger("bench"), config=cfg, roles=plan_run(cfg).roles_at(rank)))
    task.setup(calls.Setup(master_addr="127.0.0.1", master_port=port))
    task.role("actor").train_step(calls.Step(step=0))
    items, _ = task.checkpoint_state()
    largest = max(4 * math.prod(s.shape) for s, _ in items)
    del items
    results: dict[str, list[tuple[float, int, int]]] = {w: [] for w in WAYS}
    for r in range(repeat + 1):  # the first round warms up, untimed
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            folder = Path(base) / f"r{rank}_{way.replace(' ', '_').strip('()')}_{r}"
            folder.mkdir()
            got = _save(task, folder / f"rank_{rank:05d}.h5", way)
            shutil.rmtree(folder)
            if r:
                results[way].append(got)
    out.put((rank, largest, results))
    task.close()


def run(quick: bool, repeat: int, folder: Path | None) -> dict[str, Any]:
    """Every way on two ranks; per rank and way the medians of seconds, bytes and peak extra bytes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = tempfile.mkdtemp(prefix="baton-bench-stream-", dir=folder)
    # glibc raises its mmap threshold as big blocks are freed and then keeps such blocks in
    # its heap: a later save would reuse an earlier one's memory and show no growth. A fixed
    # threshold mmaps every block of 64 KiB or more and returns it on free, so each save's
    # growth is its own (the ranks are spawned: a fresh interpreter reads this at start).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 << 10)
    ctx = tmp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, quick, repeat, base, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = [out.get(timeout=1800) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
        shutil.rmtree(base, ignore_errors=True)
    rows: dict[str, Any] = {}
    for rank, largest, results in sorted(got):
        for way, rs in results.items():
            rows[f"rank {rank} {way}"] = {"largest_tensor_bytes": largest, "seconds": statistics.median(x[0] for x in rs),
                                          "bytes": statistics.median(x[1] for x in rs),
                                          "peak_extra_bytes": statistics.median(x[2] for x in rs)}
    return rows


def report(rows: dict[str, Any]) -> dict[str, bool]:
    """Print the table; per rank whether its streamed saves stayed within the buckets plus slack."""
    from core.checkpoint.stream import Slots

    bound = Slots().nbytes + SLACK
    print(f"{'rank / way':<26} {'save s':>7} {'MB written':>10} {'peak extra MiB':>14} {'vs streamed':>11}")
    met = {}
    for name, r in rows.items():
        rank, way = name.split(" ", 2)[1], name.split(" ", 2)[2]
        gpu = way.endswith("(GPU)")
        streamed = rows[f"rank {rank} {'streamed (GPU)' if gpu else 'streamed'}"]["peak_extra_bytes"]
        print(f"{name:<26} {r['seconds']:>7.2f} {r['bytes'] / 1e6:>10.1f} {r['peak_extra_bytes'] / 2**20:>14.1f} "
              f"{r['peak_extra_bytes'] / max(streamed, 1):>11.1f}")
        if way.startswith("streamed"):
            met[name] = r["peak_extra_bytes"] <= bound
    print(f"bound for a streamed save: two buckets + slack = {bound / 2**20:.0f} MiB; largest tensor "
          f"{max(r['largest_tensor_bytes'] for r in rows.values()) / 2**20:.1f} MiB (fp32)")
    return met


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~25M parameters instead of ~100M")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds (after one warm-up round)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: the system temp folder)")
    ap.add_argument("--json", type=Path, help="write the numbers here")
    args = ap.parse_args()
    rows = run(args.quick, args.repeat, args.dir)
    met = report(rows)
    print("target: streamed peak extra memory <= two buckets + 16 MiB: " + ", ".join(
        f"{k}: {'met' if v else 'MISSED'}" for k, v in met.items()))
    if args.json:
        args.json.write_text(json.dumps({"quick": args.quick, "repeat": args.repeat, "rows": rows,
                                         "targets_met": met}, indent=1))
    return 0 if all(met.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
