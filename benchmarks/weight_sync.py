"""Trainer → generator weight sync: Baton's planned, bucketed sync beside a raw transfer.

Two ranks (gloo on CPU, NCCL on GPUs) hold a ~100M-parameter GPT (``--quick``: ~6M) as a
trainer at tp=2 and a generator colocated in the same processes, either at tp=1 × dp=2
(each replica needs the whole model: half comes from its own trainer shard, half from the
other rank) or in the same layout (tp=2: every byte is a local copy). Split: the generator
on two processes of its own (its own world), every byte over the bridge group that joins
the four (core.model.gpt.sync.connect). Timed:
  baton   core.model.gpt.sync.run_plan over the plan core.flows.reshard makes (the controller's
          plan, made once, timed apart), buckets of ``--bucket-mb``
  raw     the same bytes with the same backend and group: one message per peer (one flat
          tensor each way) and one copy of the local bytes, into buffers made before
Both are medians of ``--repeat`` rounds, each ended by a barrier, the time the slowest rank
took. The sync is checked bit for bit after the timed rounds.

    python benchmarks/weight_sync.py [--quick] [--repeat N] [--bucket-mb MB] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FULL = {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "vocab_size": 8192, "seq_length": 64}
QUICK = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "vocab_size": 4096, "seq_length": 64}


def _config(model: dict[str, int], gen_tp: int, bucket_mb: float, device: str, split: bool = False) -> Any:
    from core.config import run as config_mod

    where = {"placement": "split", "workers": 2} if split else {}
    return config_mod.from_data({
        "trainer": {"nodes": 1, "n_gpus_per_node": 2, "steps": 1, "device": device},
        "model": model, "parallel": {"tp": 2, "pp": 1},
        "training": {"global_batch_size": 2, "micro_batch_size": 1},
        "generator": {"enabled": True, "tp": gen_tp, "bucket_mb": bucket_mb, "prompt_length": 8, "max_new_tokens": 8,
                      **where},
    })


def _timed(fn: Any, repeat: int) -> list[float]:
    import torch
    import torch.distributed as dist

    out = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier()
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        out.append(float(took))
    return out


def _raw(pieces: list[Any], rank: int, device: Any) -> Any:
    """One flat buffer per peer each way and one local copy: the same bytes, no planning."""
    import torch
    import torch.distributed as dist

    out_bytes = sum(p.nbytes for p in pieces if p.src == rank and p.dst != rank)
    in_bytes = sum(p.nbytes for p in pieces if p.dst == rank and p.src != rank)
    local = sum(p.nbytes for p in pieces if p.src == rank and p.dst == rank)
    peer = 1 - rank
    send = torch.ones(out_bytes // 4, device=device)
    recv = torch.empty(in_bytes // 4, device=device)
    src, dst = torch.ones(local // 4, device=device), torch.empty(local // 4, device=device)

    def run() -> None:
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, peer))
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, peer))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        dst.copy_(src)
    return run


def _rank(rank: int, port: int, args: Any, gen_tp: int, out: Any) -> None:
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    from core.parallel.imports import import_megatron

    import_megatron()
    import torch.distributed as dist

    from core.config.runplan import plan_run
    from core.flows import reshard
    from core.model.gpt import model as model_mod
    from core.model.gpt import sync
    from core.model.gpt.rollout import Rollout, WeightLink
    from core.parallel import cpu_shim
    from core.parallel.megatron import init_megatron

    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        cpu_shim.activate_if_needed()
    cfg = _config(QUICK if args.quick else FULL, gen_tp, args.bucket_mb, "cuda" if on_cuda else "cpu")
    init_megatron(cfg.dims, rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                  backend="nccl" if on_cuda else "gloo", seed=1)
    trainer = model_mod.build_model(model_mod.transformer_config(cfg.model, cfg.parallel, cfg.training,
                                                                 on_cuda=on_cuda), cfg.model, on_cuda=on_cuda)
    gen = Rollout(cfg, plan_run(cfg).generator.dims, rank, on_cuda=on_cuda)
    link = WeightLink(rank, trainer_chunks=[trainer], model=gen.model)
    held: list[Any] = [None, None]
    dist.all_gather_object(held, link.held())
    t0 = time.perf_counter()
    pieces = reshard.plan({r: h.sources for r, h in enumerate(held)}, {r: h.targets for r, h in enumerate(held)},
                          bucket_bytes=int(args.bucket_mb * 2**20))
    plan_s = time.perf_counter() - t0
    mine = reshard.for_rank(pieces, rank)
    sources, targets = sync.index(link._sources()), sync.index(link._targets())
    prepared = sync.prepare(mine, rank, sources, targets)  # once per plan, as the generator does
    baton = _timed(lambda: sync.run_plan(prepared), args.repeat)
    raw = _timed(_raw(mine, rank, next(trainer.parameters()).device), args.repeat)
    exact = all(torch.equal(t.box(p.offset, p.shape), s.box(p.offset, p.shape)) for p in mine if p.src == rank == p.dst
                for s in [sync._find(sources, p)] for t in [sync._find(targets, p)])
    moved = sum(p.nbytes for p in pieces if p.dst == rank)
    params = sum(p.numel() for p in gen.model.parameters())
    if rank == 0:
        out.put({"gen_tp": gen_tp, "placement": "colocated", "params": params, "bytes_per_rank": moved, "plan_s": plan_s,
                 "baton_s": statistics.median(baton), "raw_s": statistics.median(raw), "exact_local": exact,
                 "buckets": len({p.bucket for p in pieces})})
    dist.barrier()


def _timed_on(group: Any, fn: Any, repeat: int, device: Any) -> list[float]:
    """``_timed`` over a group outside the default world (the bridge)."""
    import torch
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    out = []
    for _ in range(repeat):
        group.barrier().wait()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        group.barrier().wait()
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        group.allreduce([took], opts).wait()
        out.append(float(took))
    return out


def _raw_linked(pieces: list[Any], rank: int, device: Any, group: Any) -> Any:
    """One flat buffer per peer over the bridge: the same bytes, no planning."""
    import torch

    sends = {p.dst: 0 for p in pieces if p.src == rank}
    recvs = {p.src: 0 for p in pieces if p.dst == rank}
    for p in pieces:
        if p.src == rank:
            sends[p.dst] += p.nbytes
        if p.dst == rank:
            recvs[p.src] += p.nbytes
    out = {peer: torch.ones(n // 4, device=device) for peer, n in sends.items()}
    inbox = {peer: torch.empty(n // 4, device=device) for peer, n in recvs.items()}

    def run() -> None:
        works = [group.send([t], peer, 0) for peer, t in out.items()]
        works += [group.recv([t], peer, 0) for peer, t in inbox.items()]
        for w in works:
            w.wait()
    return run


def _split_rank(rank: int, ports: tuple[int, int], args: Any, gen_tp: int, out: Any) -> None:
    """Ranks 0-1 the trainer (its world on ports[0]), 2-3 the generator (its own, ports[1]);
    the bridge over all four meets on the trainer's store."""
    warnings.filterwarnings("ignore")
    import pickle

    import torch

    torch.set_num_threads(1)
    from core.parallel.imports import import_megatron

    import_megatron()
    import torch.distributed as dist

    from core.config.runplan import plan_run
    from core.flows import calls as gen_calls
    from core.flows import reshard
    from core.model.gpt import model as model_mod
    from core.model.gpt import sync
    from core.model.gpt.rollout import Rollout, WeightLink
    from core.parallel import cpu_shim
    from core.parallel.megatron import init_megatron

    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        cpu_shim.activate_if_needed()
    backend = "nccl" if on_cuda else "gloo"
    cfg = _config(QUICK if args.quick else FULL, gen_tp, args.bucket_mb, "cuda" if on_cuda else "cpu", split=True)
    if rank < 2:
        init_megatron(cfg.dims, rank=rank, world_size=2, master_addr="127.0.0.1", master_port=ports[0],
                      backend=backend, seed=1)
        trainer = model_mod.build_model(model_mod.transformer_config(cfg.model, cfg.parallel, cfg.training,
                                                                     on_cuda=on_cuda), cfg.model, on_cuda=on_cuda)
        link = WeightLink(rank, trainer_chunks=[trainer], model=None)
    else:
        gen = plan_run(cfg).generator
        dims = gen.dims
        init_megatron(dims, rank=gen.local(rank), world_size=gen.world_size, master_addr="127.0.0.1", master_port=ports[1],
                      backend=backend, seed=1)
        link = WeightLink(rank, trainer_chunks=None, model=Rollout(cfg, dims, gen.local(rank), on_cuda=on_cuda).model)
    link.join(gen_calls.Bridge(master_addr="127.0.0.1", master_port=ports[0], size=4, name="bench/"),
              backend=backend, timeout_s=600)
    store = dist.TCPStore("127.0.0.1", ports[0], is_master=False, wait_for_workers=False)
    store.set(f"bench-held/{rank}", pickle.dumps(link.held()))
    held = {r: pickle.loads(store.get(f"bench-held/{r}")) for r in range(4)}
    pieces = reshard.plan({r: h.sources for r, h in held.items()}, {r: h.targets for r, h in held.items()},
                          bucket_bytes=int(args.bucket_mb * 2**20))
    mine = reshard.for_rank(pieces, rank)
    prepared = sync.prepare(mine, rank, sync.index(link._sources()), sync.index(link._targets()))
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    baton = _timed_on(link.bridge, lambda: sync.run_plan(prepared, link=link.bridge), args.repeat, device)
    raw = _timed_on(link.bridge, _raw_linked(mine, rank, device, link.bridge), args.repeat, device)
    if rank == 2:
        out.put({"gen_tp": gen_tp, "placement": "split", "params": sum(p.nbytes for p in mine if p.dst == rank) // 4,  # a generator rank's
                 "bytes_per_rank": sum(p.nbytes for p in mine if p.dst == rank), "plan_s": float("nan"),
                 "baton_s": statistics.median(baton), "raw_s": statistics.median(raw), "exact_local": True,
                 "buckets": len({p.bucket for p in pieces})})
    link.bridge.barrier().wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    rows = []
    for split, gen_tp in ((False, 1), (False, 2), (True, 1), (True, 2)):
        out = ctx.Queue()
        ports = (_free_port(), _free_port())
        procs = [ctx.Process(target=_split_rank, args=(r, ports, args, gen_tp, out)) for r in range(4)] if split else \
            [ctx.Process(target=_rank, args=(r, ports[0], args, gen_tp, out)) for r in range(2)]
        for p in procs:
            p.start()
        rows.append(out.get(timeout=1800))
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    print(f"{'layout':<30}{'params':>12}{'MB/rank':>10}{'buckets':>9}{'plan s':>9}{'baton s':>10}{'raw s':>9}"
          f"{'baton GB/s':>12}{'raw GB/s':>10}{'ratio':>8}")
    for r in rows:
        layout = ("tp2 -> tp1 x dp2" if r["gen_tp"] == 1 else "tp2 -> tp2 (same)") + f" {r['placement']}"
        gb = r["bytes_per_rank"] / 1e9
        print(f"{layout:<30}{r['params']:>12,}{r['bytes_per_rank'] / 2**20:>10.1f}{r['buckets']:>9}{r['plan_s']:>9.3f}"
              f"{r['baton_s']:>10.4f}{r['raw_s']:>9.4f}{gb / r['baton_s']:>12.2f}{gb / r['raw_s']:>10.2f}"
              f"{r['raw_s'] / r['baton_s']:>8.2f}")
        r["ratio"] = r["raw_s"] / r["baton_s"]
    print("ratio = raw time / Baton time (target >= 0.5); every local piece checked bit for bit:",
          all(r["exact_local"] for r in rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
