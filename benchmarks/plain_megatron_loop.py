"""The same Megatron training loop as a Baton worker runs, without the controller.

Launched by benchmarks/step_overhead.py through torchrun; every rank calls GPTTask's
setup and train_step directly, and the last rank times the gap between consecutive steps.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from core.config import run as config_mod  # noqa: E402
from core.config.runplan import plan_run  # noqa: E402
from core.model.gpt.task import GPTTask  # noqa: E402
from core.wire import calls  # noqa: E402
from core.worker.task import WorkerContext  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", type=Path)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    cfg = config_mod.load(args.config, args.overrides)
    ctx = WorkerContext(rank=rank, world_size=world, epoch=0, run_dir=args.out.parent, host=socket.gethostname(),
                        log=logging.getLogger("plain"), config=cfg, roles=plan_run(cfg).roles_at(rank))
    task = GPTTask(ctx)
    task.setup(calls.Setup(master_addr="", master_port=0))
    # Steps run back to back (no barrier between them, as under the controller); a step's
    # time is the gap between consecutive returns on the last rank (the last pipeline stage).
    times, tokens = [], 0
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(cfg.trainer.steps):
        out = task.role("actor").train_step(calls.Step(step=step))
        now = time.perf_counter()
        times.append(now - t0)
        t0 = now
        tokens = max(tokens, out.tokens)
    dist.all_reduce(t := torch.tensor([tokens]), op=dist.ReduceOp.MAX)
    if rank == world - 1:
        args.out.write_text(json.dumps({"step_time_s": times, "tokens": int(t.item())}))
    task.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
