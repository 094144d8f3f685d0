"""Trainer → generator weight sync: Baton's planned, bucketed sync beside a raw transfer.

Colocated (the generator in the trainer's processes, gloo on CPU, NCCL on GPUs), a ~100M-
parameter GPT (``--quick``: ~6M):
  2 ranks  trainer tp2 → generator tp1 × dp2 (each replica needs the whole model: half comes
           from its own trainer shard, half from the other rank) or tp2 (every byte local)
  4 ranks  trainer tp1dp4, tp2dp2 (ZeRO-1 layout: its replicas hold whole model shards) and
           tp2pp2 → generator tp1dp4: every trainer replica is a source, so tp1dp4 moves
           nothing over the network and no rank sends more than the model over the trainer's
           replicas and one bucket (asserted)
Split: the generator on two processes of its own (its own world), every byte over the bridge
group that joins the four (core.model.gpt.sync.connect). Timed:
  baton   core.model.gpt.sync.run_plan over the plan core.flows.reshard makes (the controller's
          plan, made once, timed apart), buckets of ``--bucket-mb``
  raw     the same bytes with the same backend and group: one message per pair of ranks (one
          flat tensor each way, all posted at once) and one copy of the local bytes, into
          buffers made before
  bcast   (4 ranks) one gloo/NCCL broadcast of the whole model from rank 0: what a sync from
          one source replica sends
All are medians of ``--repeat`` rounds, each ended by a barrier, the time the slowest rank
took. After the timed rounds every piece is checked bit for bit (a digest of its bytes on the
sending and the receiving rank). Goal: raw time / Baton time ≥ 0.5 (asserted without --quick).

    python benchmarks/weight_sync.py [--quick] [--repeat N] [--bucket-mb MB] [--ranks 2|4] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import math
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


def _config(model: dict[str, int], gen_tp: int, bucket_mb: float, device: str, split: bool = False, *,
            world: int = 2, tp: int = 2, pp: int = 1) -> Any:
    from core.config import run as config_mod

    where = {"placement": "split", "workers": 2} if split else {}
    return config_mod.from_data({
        "trainer": {"nodes": 1, "n_gpus_per_node": world, "steps": 1, "device": device},
        "model": model, "parallel": {"tp": tp, "pp": pp},
        "training": {"global_batch_size": 2 * world, "micro_batch_size": 1},
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
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64,
                            device="cuda" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        out.append(float(took))
    return out


def _raw(pieces: list[Any], rank: int, device: Any) -> Any:
    """One flat buffer per peer each way and one local copy: the same bytes, no planning."""
    import torch
    import torch.distributed as dist

    sends: dict[int, int] = {}
    recvs: dict[int, int] = {}
    for p in pieces:
        if p.src != p.dst:
            mine, peer = (sends, p.dst) if p.src == rank else (recvs, p.src)
            mine[peer] = mine.get(peer, 0) + p.nbytes
    out = {peer: torch.ones(n // 4, device=device) for peer, n in sends.items()}
    inbox = {peer: torch.empty(n // 4, device=device) for peer, n in recvs.items()}
    local = sum(p.nbytes for p in pieces if p.src == rank == p.dst)
    src, dst = torch.ones(local // 4, device=device), torch.empty(local // 4, device=device)

    def run() -> None:
        ops = [dist.P2POp(dist.isend, t, peer) for peer, t in out.items()]
        ops += [dist.P2POp(dist.irecv, t, peer) for peer, t in inbox.items()]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        dst.copy_(src)
    return run


def _model_bytes(targets: Any) -> int:
    """The bytes of every global tensor the generator holds (one model)."""
    from core.flows import reshard

    whole = {s.name: reshard.ITEMSIZE[s.dtype] * math.prod(s.global_shape) for ts in targets for s in ts}
    return sum(whole.values())


def _bcast(nbytes: int, device: Any) -> Any:
    """The whole model broadcast from rank 0: one source replica's traffic."""
    import torch
    import torch.distributed as dist

    buf = torch.ones(nbytes // 4, device=device)
    return lambda: dist.broadcast(buf, 0)


def _digests(pieces: list[Any], rank: int, sources: Any, targets: Any) -> dict[tuple[int, str], str]:
    """(piece index, end) → a digest of the piece's bytes on this rank's end of it (the source
    cast to the target's dtype, as it travels)."""
    import hashlib

    import torch

    from core.model.gpt import sync

    out = {}
    for i, p in enumerate(pieces):
        for end, held in (("src", sources), ("dst", targets)):
            if getattr(p, end) == rank:
                box = sync._find(held, p).box(p.offset, p.shape).to(sync.DTYPES[p.dtype]).contiguous()
                out[i, end] = hashlib.blake2b(box.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
    return out


def _rank(rank: int, port: int, args: Any, layout: tuple[int, int, int, int], out: Any) -> None:
    """One rank of a colocated sync: trainer tp × pp over ``world`` ranks, generator tp ``gen_tp``."""
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

    world, tp, pp, gen_tp = layout
    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        cpu_shim.activate_if_needed()
    cfg = _config(QUICK if args.quick else FULL, gen_tp, args.bucket_mb, "cuda" if on_cuda else "cpu", world=world,
                  tp=tp, pp=pp)
    init_megatron(cfg.dims, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                  backend="nccl" if on_cuda else "gloo", seed=1)
    trainer = model_mod.build_model(model_mod.transformer_config(cfg.model, cfg.parallel, cfg.training,
                                                                 on_cuda=on_cuda), cfg.model, on_cuda=on_cuda)
    gen = Rollout(cfg, plan_run(cfg).generator.dims, rank, on_cuda=on_cuda)
    link = WeightLink(rank, trainer_chunks=[trainer], model=gen.model)
    held: list[Any] = [None] * world
    dist.all_gather_object(held, link.held())
    t0 = time.perf_counter()
    pieces = reshard.plan({r: h.sources for r, h in enumerate(held)}, {r: h.targets for r, h in enumerate(held)},
                          bucket_bytes=int(args.bucket_mb * 2**20))
    plan_s = time.perf_counter() - t0
    mine = reshard.for_rank(pieces, rank)
    sources, targets = sync.index(link._sources()), sync.index(link._targets())
    prepared = sync.prepare(mine, rank, sources, targets)  # once per plan, as the generator does
    device = next(trainer.parameters()).device
    model_bytes = _model_bytes(h.targets for h in held)
    baton = _timed(lambda: sync.run_plan(prepared), args.repeat)
    raw = _timed(_raw(mine, rank, device), args.repeat)
    bcast = _timed(_bcast(model_bytes, device), args.repeat) if world > 2 else [float("nan")]
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, _digests(pieces, rank, sources, targets))
    if rank == 0:
        ends = {k: v for d in digests for k, v in d.items()}
        exact = all(ends[i, "src"] == ends[i, "dst"] for i in range(len(pieces)))
        sent = reshard.sent_by(pieces)
        received = {r: sum(p.nbytes for p in pieces if p.dst == r != p.src) for r in range(world)}
        out.put({"layout": f"tp{tp}{'pp2' if pp > 1 else ''}dp{world // tp // pp} -> tp{gen_tp}dp{world // gen_tp}",
                 "ranks": world, "placement": "colocated", "params": model_bytes // 4, "model_bytes": model_bytes,
                 "trainer_replicas": world // tp // pp, "sent_per_rank": [sent.get(r, 0) for r in range(world)],
                 "received_per_rank": [received[r] for r in range(world)],
                 "bytes_per_rank": max(received.values()), "plan_s": plan_s, "baton_s": statistics.median(baton),
                 "raw_s": statistics.median(raw), "bcast_s": statistics.median(bcast), "exact": exact,
                 "buckets": len({p.bucket for p in pieces}), "bucket_bytes": int(args.bucket_mb * 2**20)})
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
    sources, targets = sync.index(link._sources()), sync.index(link._targets())
    prepared = sync.prepare(mine, rank, sources, targets)
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    baton = _timed_on(link.bridge, lambda: sync.run_plan(prepared, link=link.bridge), args.repeat, device)
    raw = _timed_on(link.bridge, _raw_linked(mine, rank, device, link.bridge), args.repeat, device)
    store.set(f"bench-digests/{rank}", pickle.dumps(_digests(pieces, rank, sources, targets)))
    if rank == 2:
        ends = {k: v for r in range(4) for k, v in pickle.loads(store.get(f"bench-digests/{r}")).items()}
        sent = reshard.sent_by(pieces)
        received = [sum(p.nbytes for p in pieces if p.dst == r) for r in range(4)]
        out.put({"layout": f"tp2 -> tp{gen_tp}dp{2 // gen_tp}", "ranks": 4, "placement": "split",
                 "params": _model_bytes(h.targets for h in held.values()) // 4,
                 "model_bytes": _model_bytes(h.targets for h in held.values()), "trainer_replicas": 1,
                 "sent_per_rank": [sent.get(r, 0) for r in range(4)], "received_per_rank": received,
                 "bytes_per_rank": max(received), "plan_s": float("nan"), "baton_s": statistics.median(baton),
                 "raw_s": statistics.median(raw), "bcast_s": float("nan"),
                 "exact": all(ends[i, "src"] == ends[i, "dst"] for i in range(len(pieces))),
                 "buckets": len({p.bucket for p in pieces}), "bucket_bytes": int(args.bucket_mb * 2**20)})
    link.bridge.barrier().wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


COLOCATED = {2: ((2, 2, 1, 1), (2, 2, 1, 2)),  # (world, trainer tp, trainer pp, generator tp)
             4: ((4, 1, 1, 1), (4, 2, 1, 1), (4, 2, 2, 1))}


def _run(ctx: Any, target: Any, n: int, args: tuple[Any, ...]) -> dict[str, Any]:
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, out)) for r in range(n)]
    for p in procs:
        p.start()
    row = out.get(timeout=1800)
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    return row


def _report(rows: list[dict[str, Any]], *, quick: bool) -> list[str]:
    """The table, and what misses a goal (the byte bound and exactness always; time without --quick)."""
    print(f"{'layout':<28}{'params':>12}{'max MB sent':>12}{'max MB in':>10}{'buckets':>8}{'plan s':>8}"
          f"{'baton s':>9}{'raw s':>9}{'bcast s':>9}{'ratio':>7}{'exact':>7}")
    missed = []
    for r in rows:
        r["ratio"] = r["raw_s"] / r["baton_s"]
        r["sent_bound"] = r["model_bytes"] // r["trainer_replicas"] + r["bucket_bytes"]
        name = f"{r['layout']} {r['placement']}"
        print(f"{name:<28}{r['params']:>12,}{max(r['sent_per_rank']) / 2**20:>12.2f}"
              f"{r['bytes_per_rank'] / 2**20:>10.2f}{r['buckets']:>8}{r['plan_s']:>8.3f}{r['baton_s']:>9.4f}"
              f"{r['raw_s']:>9.4f}{r['bcast_s']:>9.4f}{r['ratio']:>7.2f}{str(r['exact']):>7}")
        if r["placement"] == "colocated" and max(r["sent_per_rank"]) > r["sent_bound"]:
            missed.append(f"{name}: a rank sends {max(r['sent_per_rank'])} bytes > {r['sent_bound']} (the model over "
                          "the trainer's replicas and one bucket)")
        if not r["exact"]:
            missed.append(f"{name}: a piece arrived with other bytes than it left with")
        if not quick and r["ratio"] < 0.5:
            missed.append(f"{name}: raw / Baton time {r['ratio']:.2f} < 0.5")
    print("ratio = raw time / Baton time (goal >= 0.5); sent: bytes to other ranks (local copies excluded); "
          "bcast: the model broadcast from rank 0 (one source replica)")
    return missed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, help="default: 64 (--quick: 4, so that a sync needs several)")
    ap.add_argument("--ranks", type=int, choices=(2, 4), help="only the colocated layouts of this many ranks "
                    "(default: all, and the split ones)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.bucket_mb = args.bucket_mb or (4.0 if args.quick else 64.0)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    rows = []
    for world in (2, 4) if args.ranks is None else (args.ranks,):
        for layout in COLOCATED[world]:
            rows.append(_run(ctx, _rank, world, (_free_port(), args, layout)))
    for gen_tp in (1, 2) if args.ranks is None else ():
        rows.append(_run(ctx, _split_rank, 4, ((_free_port(), _free_port()), args, gen_tp)))
    missed = _report(rows, quick=args.quick)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if missed:
        sys.exit("goal missed: " + "; ".join(missed))


if __name__ == "__main__":
    main()
