"""Checkpoint save and load speed: Baton's HDF5 shard writer beside the usual ways, same run.

One process saves a multi-tensor float32 state (~1 GiB; ``--quick``: ~128 MiB) with
  raw         os.write of every tensor's bytes into one file, then fsync (the disk's ceiling)
  baton       tmp_step_dir + write_shard: one rank's durable shard (contiguous datasets, xxh3
              checksum, fsync of file and folder); the controller's commit is timed apart
  torch.save  torch.save of the tensors, flush, fsync
  dcp         torch.distributed.checkpoint.save, FileSystemWriter(thread_count=4), no_dist=True
and loads each back (raw: readv into preallocated arrays; baton: CheckpointReader.read(out=);
torch.load; dcp.load in place) after dropping the files from the page cache. A warm-up
round runs first, untimed: fresh memory on these VMs is slow to touch, and every writer
should be measured with its buffers warm.

Then the training time an async save costs, against the time of a synchronous Baton save.
A stand-in training loop runs on torch tensors that are the state (one thread, as each
worker here): "forward and backward" is a fixed amount of matmul work (``--step-ms``),
"the optimizer step" a small in-place change of every tensor, preceded by the save's
fence, as in core.model.gpt.step. From the submit until the shard is durable, the loop keeps
stepping; the time lost is that stretch's wall time less the same number of undisturbed
steps (median over the rounds, each followed by a check that the file holds the values of
the saved step, not a later one); and the time the training thread is blocked: in submit
and at the fence. Two ways of taking the snapshot:
  background  Baton's: the state is exported live (core.model.gpt.state.LiveTensor) and copied
              on the writer thread while forward and backward run; the step waits at the
              fence only for what is left of the copy
  at submit   the copy made on the training thread before submit returns

Last, a distributed optimizer's save on two data-parallel ranks: each rank's own ranges
beside the full-copy approach it replaced (benchmarks/distopt_save.py): time, bytes, and the
peak extra memory of each rank against its optimizer shard.

    python benchmarks/checkpoint.py [--quick] [--repeat N] [--step-ms MS] [--dir PATH] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import distopt_save  # noqa: E402  (beside this script)
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from core.checkpoint import manifest  # noqa: E402
from core.checkpoint.async_writer import AsyncWriter  # noqa: E402
from core.checkpoint.commit import commit, tmp_step_dir  # noqa: E402
from core.checkpoint.hdf5 import CheckpointReader, ShardReader, write_shard  # noqa: E402
from core.checkpoint.spec import TensorSlice  # noqa: E402
from core.model.gpt.state import LiveTensor  # noqa: E402

State = dict[str, np.ndarray]


def make_state(quick: bool) -> State:
    """Transformer-like: big weight matrices, smaller projections, biases (~1 GiB or ~128 MiB)."""
    d = 1448 if quick else 4096  # 1448² ≈ 4096²/8
    rng = np.random.default_rng(0)
    state: State = {}
    for i in range(14):
        state[f"layers.{i}.weight"] = rng.random((d, d), dtype=np.float32)
    for i in range(32):
        state[f"layers.{i}.proj"] = rng.random((d, d // 16), dtype=np.float32)
        state[f"layers.{i}.bias"] = rng.random((d,), dtype=np.float32)
    return state


def drop_cache(folder: Path) -> None:
    """Evict the (already fsynced, so clean) pages of every file under ``folder``."""
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


# --- the writers and readers: each save(folder) and load(folder) -------------------------
def raw_save(state: State, folder: Path) -> None:
    fd = os.open(folder / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for a in state.values():
        view = memoryview(a.reshape(-1).view(np.uint8))
        while view:
            view = view[os.write(fd, view[: 1 << 30]):]
    os.fsync(fd)
    os.close(fd)
    fsync_dir(folder)


def raw_load(state: State, targets: State, folder: Path) -> None:
    fd = os.open(folder / "raw.bin", os.O_RDONLY)
    for name in state:
        view = memoryview(targets[name].reshape(-1).view(np.uint8))
        while view:
            view = view[os.readv(fd, [view[: 1 << 30]]):]
    os.close(fd)


def items_of(state: State) -> list[tuple[TensorSlice, np.ndarray]]:
    return [(TensorSlice(name=n, global_shape=a.shape, offset=(0,) * a.ndim, shape=a.shape, dtype="float32"), a)
            for n, a in state.items()]


def baton_save(state: State, folder: Path) -> tuple[Path, dict]:
    """What a rank does: one durable shard in the step's temporary folder (the commit is timed apart)."""
    tmp = tmp_step_dir(folder, 1)
    return tmp, write_shard(tmp / manifest.rank_file_name(0), items_of(state), {"step": 1}, {"step": 1, "rank": 0})


def baton_load(state: State, targets: State, folder: Path) -> None:
    with CheckpointReader(folder / manifest.step_dir_name(1)) as reader:
        for name in state:
            reader.read(name, out=targets[name])


def torch_save(state: State, folder: Path) -> None:
    with open(folder / "state.pt", "wb") as f:
        torch.save({n: torch.from_numpy(a) for n, a in state.items()}, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(folder)


def torch_load(state: State, targets: State, folder: Path) -> None:
    loaded = torch.load(folder / "state.pt", weights_only=True)
    assert len(loaded) == len(state)


def dcp_save(state: State, folder: Path) -> None:
    writer = dcp.FileSystemWriter(folder / "dcp", thread_count=4, sync_files=True)
    dcp.save({n: torch.from_numpy(a) for n, a in state.items()}, storage_writer=writer, no_dist=True)


def dcp_load(state: State, targets: State, folder: Path) -> None:
    dcp.load({n: torch.from_numpy(a) for n, a in targets.items()}, checkpoint_id=folder / "dcp", no_dist=True)


METHODS: dict[str, tuple[Callable[[State, Path], object], Callable[[State, State, Path], None]]] = {
    "raw write": (raw_save, raw_load),
    "baton hdf5": (baton_save, baton_load),
    "torch.save": (torch_save, torch_load),
    "dcp": (dcp_save, dcp_load),
}


def settle(folder: Path) -> None:
    """Delete a method's files and flush the deletion, so its cleanup is not charged to the next method."""
    shutil.rmtree(folder)
    os.sync()


def one_round(state: State, targets: State, base: Path, times: dict[str, list[float]], rotate: int) -> None:
    """Save and load with every method once, appending seconds to ``times``.

    The order of the methods rotates from round to round: on a shared VM disk, whoever runs
    right after a large delete or another tenant's burst pays for it.
    """
    names = list(METHODS)
    for name in names[rotate % len(names):] + names[:rotate % len(names)]:
        save, load = METHODS[name]
        folder = Path(tempfile.mkdtemp(dir=base))
        t0 = time.perf_counter()
        saved = save(state, folder)
        times[f"{name} save"].append(time.perf_counter() - t0)
        if name == "baton hdf5":  # what the controller does once every rank has acked
            assert isinstance(saved, tuple)
            t0 = time.perf_counter()
            commit(folder, 1, saved[0], [saved[1]], {"layout": "bench"})
            times["baton commit"].append(time.perf_counter() - t0)
        drop_cache(folder)
        t0 = time.perf_counter()
        load(state, targets, folder)
        times[f"{name} load"].append(time.perf_counter() - t0)
        if name == "baton hdf5":
            for n, a in state.items():  # the loaded values are the saved ones, bit for bit
                assert np.array_equal(a.view(np.uint32), targets[n].view(np.uint32)), n
        settle(folder)


# --- the training time an async save costs ------------------------------------------------
class Trainer:
    """The stand-in loop on the state's tensors: fixed matmul work, the fence, a small update."""

    def __init__(self, state: State, step_ms: float) -> None:
        self.tensors = {n: torch.from_numpy(a) for n, a in state.items()}  # the state itself, no copy
        gen = torch.Generator().manual_seed(0)
        self.x, self.w = torch.randn(256, 256, generator=gen), torch.randn(256, 256, generator=gen)
        self.y = torch.empty(256, 256)
        self.reps = 20
        self.work()  # warm: the first matmuls are slower
        t0 = time.perf_counter()
        self.work()
        self.reps = max(1, round(step_ms / 1e3 / ((time.perf_counter() - t0) / self.reps)))
        self.fence_s = 0.0

    def work(self) -> None:
        """Forward and backward: compute that reads nothing the snapshot copies."""
        for _ in range(self.reps):
            torch.mm(self.x, self.w, out=self.y)

    def step(self, fence: Callable[[], object]) -> None:
        self.work()
        t0 = time.perf_counter()
        fence()  # what core.model.gpt.step.train_step calls right before optimizer.step()
        self.fence_s += time.perf_counter() - t0
        with torch.no_grad():
            for t in self.tensors.values():
                t.view(-1)[:1024].add_(1.0)

    def plain_step_s(self, n: int = 3) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.step(lambda: None)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def async_round(trainer: Trainer, writer: AsyncWriter, state: State, base: Path, mode: str) -> dict[str, float]:
    """One async save beside the stand-in loop: the training seconds it cost, and how."""
    items = [(s, LiveTensor(trainer.tensors[s.name], s.shape)) for s, _ in items_of(state)]
    plain = trainer.plain_step_s()
    expected = {n: a.copy() for n, a in state.items()}  # untimed: what the file must hold
    folder = Path(tempfile.mkdtemp(dir=base))
    path = folder / manifest.rank_file_name(0)
    trainer.fence_s = 0.0
    t0 = time.perf_counter()
    handle = writer.submit(path, items, {"step": 1}, {"step": 1, "rank": 0}, snapshot=mode)  # type: ignore[arg-type]
    submit_s = time.perf_counter() - t0
    steps = 0
    while steps == 0 or not handle.done():
        trainer.step(lambda: handle.wait_snapshot(600))
        steps += 1
    total = time.perf_counter() - t0
    handle.result(timeout=0)
    with ShardReader(path) as shard:  # the saved step's values, not those of the steps beside it
        for dataset, s in shard.slices().items():
            out = np.empty(s.shape, np.float32)
            box = tuple(slice(0, n) for n in s.shape)
            shard.read_into(dataset, box, out, box)
            assert np.array_equal(out, expected[s.name]), f"{mode}: {s.name} holds a later step's values"
    settle(folder)
    return {"blocked": submit_s + trainer.fence_s, "lost": total - steps * plain, "steps": steps,
            "submit": submit_s, "fence": trainer.fence_s, "plain_step": plain, "durable_after": total}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~128 MiB instead of ~1 GiB")
    ap.add_argument("--repeat", type=int, default=4, help="timed rounds (after one warm-up round)")
    ap.add_argument("--step-ms", type=float, default=500.0, help="the stand-in training step's compute")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: the system temp folder)")
    ap.add_argument("--json", type=Path, help="write the numbers here")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")  # dcp warns that no process group exists: that is the point of no_dist
    torch.set_num_threads(1)  # one thread per worker, as Baton's workers run here

    state = make_state(args.quick)
    nbytes = sum(a.nbytes for a in state.values())
    targets = {n: np.zeros_like(a) for n, a in state.items()}  # touched now, so warm when timed
    base = Path(tempfile.mkdtemp(prefix="baton-bench-ckpt-", dir=args.dir))
    writer = AsyncWriter()
    times: dict[str, list[float]] = {k: [] for k in [*(f"{m} {op}" for m in METHODS for op in ("save", "load")),
                                                     "baton commit"]}
    modes = {"background": "background", "at submit": "now"}
    rounds: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    try:
        one_round(state, targets, base, {k: [] for k in times}, 0)  # warm-up, untimed
        for r in range(args.repeat):
            one_round(state, targets, base, times, r)
        trainer = Trainer(state, args.step_ms)
        for mode in modes.values():  # warm-up: the snapshot buffers are touched once
            async_round(trainer, writer, state, base, mode)
        for r in range(args.repeat):
            for label in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                rounds[label].append(async_round(trainer, writer, state, base, modes[label]))
    finally:
        writer.close()
        shutil.rmtree(base, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    gbs = {k: nbytes / v / 1e9 for k, v in med.items()}
    print(f"checkpoint of {len(state)} float32 tensors, {nbytes / 2**20:.0f} MiB, median of {args.repeat} "
          f"(after 1 warm-up), loads from a dropped page cache")
    print(f"{'method':<12} {'save GB/s':>9} {'vs raw':>7} {'vs torch.save':>13} {'load GB/s':>9} {'vs raw':>7}")
    rows = {}
    for m in METHODS:
        s, ld = gbs[f"{m} save"], gbs[f"{m} load"]
        rows[m] = {"save_gbs": s, "save_vs_raw": s / gbs["raw write save"],
                   "save_vs_torch_save": s / gbs["torch.save save"], "load_gbs": ld,
                   "load_vs_raw": ld / gbs["raw write load"], "save_s": med[f"{m} save"], "load_s": med[f"{m} load"]}
        r = rows[m]
        print(f"{m:<12} {s:>9.2f} {r['save_vs_raw']:>7.2f} {r['save_vs_torch_save']:>13.2f} {ld:>9.2f} "
              f"{r['load_vs_raw']:>7.2f}")
    print(f"baton commit (controller: validate acks, manifest, rename, latest, retention): "
          f"{med['baton commit'] * 1e3:.1f} ms")
    sync = med["baton hdf5 save"]
    asy = {label: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for label, rs in rounds.items()}
    print(f"\nasync save beside a training loop of {asy['background']['plain_step'] * 1e3:.0f} ms steps; "
          f"a synchronous save blocks {sync * 1e3:.0f} ms (medians of {args.repeat})")
    print(f"{'snapshot':<11} {'blocked ms':>10} {'vs sync':>8} {'submit ms':>9} {'fence ms':>8} {'lost ms':>8} "
          f"{'vs sync':>8} {'steps':>5} {'durable ms':>10}")
    for label, a in asy.items():
        print(f"{label:<11} {a['blocked'] * 1e3:>10.1f} {a['blocked'] / sync:>8.1%} {a['submit'] * 1e3:>9.1f} "
              f"{a['fence'] * 1e3:>8.1f} {a['lost'] * 1e3:>8.0f} {a['lost'] / sync:>8.1%} {a['steps']:>5.0f} "
              f"{a['durable_after'] * 1e3:>10.0f}")
    print("blocked: the training thread waiting (submit + fence); lost: the steps' wall time until the shard is\n"
          "durable less as many undisturbed steps (blocking plus the background copy and write slowing the\n"
          "steps down; within a few % of a step it is this machine's noise)")
    lost = asy["background"]["blocked"]
    print("\na distributed optimizer's save, 2 data-parallel ranks (benchmarks/distopt_save.py): each rank's own "
          "ranges\nbeside the full-copy approach, alternating; medians per rank")
    distopt = distopt_save.run(args.quick, args.repeat, args.dir)
    targets_met = {"save >= 0.9x raw": rows["baton hdf5"]["save_vs_raw"] >= 0.9,
                   "save >= 1.5x torch.save": rows["baton hdf5"]["save_vs_torch_save"] >= 1.5,
                   "async blocks <= 10% of sync": lost / sync <= 0.10,
                   "distributed-optimizer save extra <= 1.2x shard": distopt_save.report(distopt)}
    print("targets: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in targets_met.items()))
    if args.json:
        args.json.write_text(json.dumps({"bytes": nbytes, "tensors": len(state), "repeat": args.repeat,
                                         "rows": rows, "async": asy, "async_rounds": rounds,
                                         "async_blocked_vs_sync": lost / sync, "commit_s": med["baton commit"],
                                         "targets_met": targets_met, "seconds": times, "distopt": distopt},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
