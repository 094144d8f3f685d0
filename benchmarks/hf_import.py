"""Hugging Face checkpoints in and out: Baton's reader and ``baton export`` beside raw file I/O.

A random model of Qwen3-0.6B's shape (hidden 1024, 28 layers, 16 heads, 8 key/value heads,
head_dim 128, ffn 3072, vocab 151936, tied, q/k norms), saved by transformers in bfloat16.

Import, at tp1 and tp2: each tensor-parallel rank reads the boxes a Megatron rank of that
layout owns (one layer of one global tensor at a time; tp splits qkv and fc1 rows per
group/half, proj and fc2 columns, the embedding's rows; norms whole) the way a worker does on
CKPT_LOAD hf:PATH: a fresh core.hf.reader.HFReader per round, and for each box
core.model.gpt.state.copy_box (what load_model_slices calls per parameter) into preallocated
parameters of fp32 and, in a second process, of bf16. Beside it, in a process of its own:
  raw   os.preadv of exactly the safetensors rows those boxes touch (core.hf.layout.pieces:
        the same bytes, whole rows), into one reused buffer: the ceiling of any reader.
Each is timed page cache warm (after an untimed round) and cold (the model's files evicted
with fsync + posix_fadvise DONTNEED before each round: this machine's page cache, not the
disk's or a host's); medians of --repeat rounds. Memory: the rank's peak anonymous resident
memory in one more round, untimed (sampled every 2 ms on a thread, less what it held before its
parameters were made) beside its
shard (its parameters) and its largest box; the goal is at most shard + largest + 20 %.
The fp32 ranks then write their parameters as a Baton checkpoint shard, committed as a
checkpoint of that layout.

Export, of each of those checkpoints: ``python -m core.checkpoint.hf_export`` (bfloat16: the source's
dtype) beside raw: reading the checkpoint's files (preadv) and writing the same number of
bytes the export writes (write + fsync). Its peak resident memory (the process's VmHWM) beside its largest output shard + largest tensor + 20 %. Every exported tensor is
checked bit for bit against the original file.

    python benchmarks/hf_import.py [--layers N] [--repeat N] [--dir PATH] [--json PATH]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


REPO = Path(__file__).resolve().parent.parent
SHAPE = {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
         "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True}
TIME_GOAL, MEM_GOAL = 0.5, 1.2


# --- the model -------------------------------------------------------------------------------------
def make_model(folder: Path, layers: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**{**SHAPE, "num_hidden_layers": layers}, max_position_embeddings=4096, dtype="bfloat16")
    torch.set_default_dtype(torch.bfloat16)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(folder)


def run_config(folder: Path, run_dir: Path, layers: int) -> None:
    """A run folder's config.yaml for a run imported from ``folder`` (what `baton export` reads)."""
    import yaml

    from core.config import run as config_mod

    data = yaml.safe_load((REPO / "experiments" / "tiny_gpt.yaml").read_text())
    data.update(runs_root=str(run_dir.parent), init_from=f"hf:{folder}", parallel={"tp": 1, "pp": 1},
                model={"seq_length": 32})  # the shape is config.json's
    data["trainer"]["n_gpus_per_node"] = 1
    cfg = config_mod.from_data(data)
    assert cfg.model.num_layers == layers
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_mod.dump(cfg))


# --- one tensor-parallel rank's boxes -------------------------------------------------------------
def rank_boxes(d, tp: int, rank: int) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:  # noqa: ANN001
    """(global name, offset, shape) of every box a Megatron rank of ``tp`` owns, one layer each."""
    q, kv, h = d.heads * d.head_dim, d.groups * d.head_dim, d.hidden
    p = "decoder.layers."
    layer: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    rows = (q + 2 * kv) // tp
    layer.append((p + "self_attention.linear_qkv.weight", (rank * rows, 0), (rows, h)))
    layer.append((p + "self_attention.linear_proj.weight", (0, rank * q // tp), (h, q // tp)))
    f = d.ffn // tp
    layer += [(p + "mlp.linear_fc1.weight", (rank * f, 0), (f, h)), (p + "mlp.linear_fc1.weight", (d.ffn + rank * f, 0), (f, h))]
    layer.append((p + "mlp.linear_fc2.weight", (0, rank * f), (h, f)))
    if rank == 0:  # replicated: the first rank's copy is the one a checkpoint holds
        layer += [(p + "self_attention.linear_qkv.layer_norm_weight", (0,), (h,)),
                  (p + "mlp.linear_fc1.layer_norm_weight", (0,), (h,)),
                  (p + "self_attention.q_layernorm.weight", (0,), (d.head_dim,)),
                  (p + "self_attention.k_layernorm.weight", (0,), (d.head_dim,))]
    v = d.vocab // tp
    out = [("embedding.word_embeddings.weight", (rank * v, 0), (v, h))]
    out += [(n, (i, *o), (1, *s)) for i in range(d.layers) for n, o, s in layer]
    if rank == 0:
        out.append(("decoder.final_layernorm.weight", (0,), (h,)))
    return out


def global_shapes(d) -> dict[str, tuple[int, ...]]:  # noqa: ANN001
    q, kv, h, p = d.heads * d.head_dim, d.groups * d.head_dim, d.hidden, "decoder.layers."
    return {"embedding.word_embeddings.weight": (d.vocab, h), "decoder.final_layernorm.weight": (h,),
            p + "self_attention.linear_qkv.weight": (d.layers, q + 2 * kv, h),
            p + "self_attention.linear_proj.weight": (d.layers, h, q),
            p + "mlp.linear_fc1.weight": (d.layers, 2 * d.ffn, h), p + "mlp.linear_fc2.weight": (d.layers, h, d.ffn),
            p + "self_attention.linear_qkv.layer_norm_weight": (d.layers, h),
            p + "mlp.linear_fc1.layer_norm_weight": (d.layers, h),
            p + "self_attention.q_layernorm.weight": (d.layers, d.head_dim),
            p + "self_attention.k_layernorm.weight": (d.layers, d.head_dim)}


class Sampler:
    """Peak RssAnon of this process, sampled every 2 ms on a thread."""

    def __init__(self) -> None:
        self.peak, self._stop = anon(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, anon())

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return max(self.peak, anon())


def anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def raw_spans(folder: Path, d, boxes: list) -> list[tuple[Path, int, int]]:  # noqa: ANN001
    """(file, byte offset, byte count) of the full rows of every HF run the boxes cover
    (core.hf.layout.pieces: exactly the rows the reader copies from)."""
    from core.hf import files, layout

    spans, headers = [], {}
    weight_files = files.weight_files(folder)
    for box, off, shape in boxes:
        for name, start, stop, _, _ in layout.pieces(box, off, shape, d):
            path = weight_files[name]
            if path not in headers:
                with open(path, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    headers[path] = (8 + n, json.loads(f.read(n)))
            base, header = headers[path]
            t = header[name]
            row = math.prod(t["shape"][1:]) * 2
            spans.append((path, base + t["data_offsets"][0] + start * row, (stop - start) * row))
    return spans


def drop_cache(folder: Path) -> None:
    """Evict the folder's weight files from this machine's page cache (fsync, then
    posix_fadvise DONTNEED: only these files, no privileges needed; dirty or mapped pages
    would stay)."""
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def rounds(once, folder: Path, repeat: int) -> dict[str, float]:  # noqa: ANN001
    """Median seconds of ``once()``: page cache warm (after an untimed round), then cold."""
    once()
    warm = [once() for _ in range(repeat)]
    cold = []
    for _ in range(repeat):
        drop_cache(folder)
        cold.append(once())
    return {"warm_s": statistics.median(warm), "cold_s": statistics.median(cold)}


def raw_rank(folder: Path, tp: int, rank: int, repeat: int) -> dict:
    """One rank's baseline: os.preadv of exactly the safetensors rows its boxes touch, into one
    reused buffer (the ceiling of any reader); no torch in this process."""
    from core.hf import layout

    d = layout.dims_of(_model_config(folder))
    spans = raw_spans(folder, d, rank_boxes(d, tp, rank))
    buf = bytearray(max(n for _, _, n in spans))

    def once() -> float:
        t0 = time.perf_counter()
        fds = {p: os.open(p, os.O_RDONLY) for p in {s[0] for s in spans}}
        for path, off, n in spans:
            os.preadv(fds[path], [memoryview(buf)[:n]], off)
        for fd in fds.values():
            os.close(fd)
        return time.perf_counter() - t0

    return {"tp": tp, "rank": rank, "bytes": sum(n for _, _, n in spans), **rounds(once, folder, repeat)}


def import_rank(folder: Path, tp: int, rank: int, dtype: str, repeat: int, step_dir: Path | None) -> dict:
    """One rank's import, as a worker's: a fresh core.hf.reader.HFReader (as CKPT_LOAD makes
    one) and core.model.gpt.state.copy_box (what load_model_slices does for each parameter)
    into preallocated parameters of ``dtype``; then (fp32) its shard written."""
    import torch

    from core.checkpoint.hdf5 import write_shard
    from core.checkpoint.spec import TensorSlice
    from core.hf import layout, reader
    from core.model.gpt.state import copy_box

    torch.set_num_threads(1)
    d = layout.dims_of(_model_config(folder))
    shapes = global_shapes(d)
    slices = [TensorSlice(name=n, global_shape=shapes[n], offset=o, shape=s, dtype="float32")
              for n, o, s in rank_boxes(d, tp, rank)]
    before = anon()
    params = [torch.ones(s.shape, dtype=getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype]))
              for s in slices]  # touched: the rank's model, as Megatron holds it
    shard = sum(p.numel() * p.element_size() for p in params)

    def once() -> float:
        t0 = time.perf_counter()
        r = reader.HFReader(folder, d)
        for s, p in zip(slices, params, strict=True):
            copy_box(r, s, p)
        r.close()
        return time.perf_counter() - t0

    times = rounds(once, folder, repeat)
    sampler = Sampler()  # the memory round, untimed (the sampling thread would slow the import)
    once()
    peak = sampler.stop() - before
    out = {"tp": tp, "rank": rank, "dtype": dtype, **times, "peak": peak, "shard": shard,
           "largest": max(p.numel() * p.element_size() for p in params)}
    if step_dir is not None:
        items = [(s, p.numpy()) for s, p in zip(slices, params, strict=True)]
        ack = write_shard(step_dir / f"rank_{rank:05d}.h5", items, {}, {"rank": rank, "step": 0, "layout": f"tp{tp}"})
        out["ack"] = dataclasses.asdict(ack)
    return out


def _model_config(folder: Path):  # noqa: ANN202
    from core.config.modelcfg import ModelConfig
    from core.hf import families

    keys = families.model_section(folder).model
    return ModelConfig(**{**keys, "seq_length": 4096})


# --- export ----------------------------------------------------------------------------------------
def raw_export(step_dir: Path, out_bytes: int, scratch: Path) -> float:
    """Read the checkpoint's files and write as many bytes as the export wrote, durably."""
    buf = bytearray(64 << 20)
    t0 = time.perf_counter()
    for f in sorted(step_dir.glob("rank_*.h5")):
        fd = os.open(f, os.O_RDONLY)
        while os.readv(fd, [buf]):
            pass
        os.close(fd)
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = out_bytes
    while left > 0:
        left -= os.write(fd, memoryview(buf)[:min(left, len(buf))])
    os.fsync(fd)
    os.close(fd)
    took = time.perf_counter() - t0
    scratch.unlink()
    return took


# The export's own peak: VmHWM of its process, read as it ends (the resource usage of a
# child counts the parent's memory it was forked with, before exec).
_PEAK_WRAPPER = """import atexit, runpy, sys
path = sys.argv[1]
atexit.register(lambda: open(path, 'w').write([l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]))
sys.argv = ['hf_export', *sys.argv[2:]]
runpy.run_module('core.checkpoint.hf_export', run_name='__main__')
"""


def export_once(step_dir: Path, out: Path) -> tuple[float, int]:
    """One `python -m core.checkpoint.hf_export` run: (seconds, peak resident bytes of its process)."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    peak_file = out.parent / "peak.txt"
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", _PEAK_WRAPPER, str(peak_file), str(step_dir), "--hf", str(out)],
                         env=env, stdout=subprocess.DEVNULL, check=False)
    took = time.perf_counter() - t0
    assert res.returncode == 0, f"export of {step_dir} failed ({res.returncode})"
    return took, int(peak_file.read_text()) * 1024


def check_bits(original: Path, out: Path) -> int:
    """Every tensor of the export equals the original file's, bit for bit; how many."""
    import torch
    from safetensors import safe_open

    index = json.loads((out / "model.safetensors.index.json").read_text())
    with safe_open(str(original / "model.safetensors"), "pt") as src:
        assert sorted(src.keys()) == sorted(index["weight_map"]), "the export's tensor names differ from the original's"
        for name, file in index["weight_map"].items():
            with safe_open(str(out / file), "pt") as f:
                a, b = src.get_tensor(name), f.get_tensor(name)
            assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16)), name
    return len(index["weight_map"])


def run_export(work: Path, folder: Path, tp: int, repeat: int) -> dict:
    step_dir = work / f"run_tp{tp}" / "checkpoints" / "step_00000000"
    out = work / f"hf_tp{tp}"
    runs = [export_once(step_dir, out) for _ in range(repeat)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard = max((out / f).stat().st_size for f in set(index["weight_map"].values()))
    largest = max(math.prod(v) * 2 for v in _hf_shapes(folder).values())
    raws = [raw_export(step_dir, index["metadata"]["total_size"], work / "raw.bin") for _ in range(repeat)]
    return {"tp": tp, "export_s": statistics.median(t for t, _ in runs), "raw_s": statistics.median(raws),
            "peak": max(p for _, p in runs), "shard": shard, "largest": largest,
            "bytes": index["metadata"]["total_size"], "tensors": check_bits(folder, out)}


def _hf_shapes(folder: Path) -> dict:
    from core.hf import layout

    return layout.hf_shapes(layout.dims_of(_model_config(folder)))


# --- the table -------------------------------------------------------------------------------------
def import_layout(work: Path, folder: Path, tp: int, repeat: int, layers: int) -> list[dict]:
    """Every rank of ``tp``, the raw baseline and the import into fp32 and into bf16 parameters
    each in a process of its own, one after another; the fp32 ranks' shards committed."""
    from core.checkpoint.commit import commit, tmp_step_dir
    from core.checkpoint.spec import ShardAck, SliceAck

    run_dir = work / f"run_tp{tp}"
    run_config(folder, run_dir, layers)
    tmp = tmp_step_dir(run_dir / "checkpoints", 0)
    results, acks = [], []
    for rank in range(tp):
        raw = _child("--raw-of", str(tp), str(rank), str(folder), "--repeat", str(repeat))
        for dtype in ("fp32", "bf16"):
            r = _child("--rank-of", str(tp), str(rank), dtype, str(folder), str(tmp) if dtype == "fp32" else "-",
                       "--repeat", str(repeat))
            if "ack" in r:
                a = r.pop("ack")
                acks.append(ShardAck(**{**a, "slices": tuple(SliceAck(**{k: tuple(v) if isinstance(v, list) else v
                                                                         for k, v in s.items()}) for s in a["slices"])}))
            results.append({**r, "bytes": raw["bytes"], "raw_warm_s": raw["warm_s"], "raw_cold_s": raw["cold_s"]})
    commit(run_dir / "checkpoints", 0, tmp, acks, {"layout": f"tp{tp}"}, keep_last=1)
    return results


def _child(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=28, help="transformer layers (28: Qwen3-0.6B; fewer: a quick check)")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: the system temp folder)")
    ap.add_argument("--json", type=Path, help="write the numbers here")
    ap.add_argument("--keep", action="store_true", help="keep the model, checkpoints and exports (printed)")
    ap.add_argument("--rank-of", nargs=5, metavar=("TP", "RANK", "DTYPE", "FOLDER", "STEP_DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--raw-of", nargs=3, metavar=("TP", "RANK", "FOLDER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_of:
        tp, rank, dtype, folder, step_dir = args.rank_of
        print(json.dumps(import_rank(Path(folder), int(tp), int(rank), dtype, args.repeat,
                                     None if step_dir == "-" else Path(step_dir))))
        return 0
    if args.raw_of:
        tp, rank, folder = args.raw_of
        print(json.dumps(raw_rank(Path(folder), int(tp), int(rank), args.repeat)))
        return 0
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="baton-hf-bench-", dir=args.dir))
    try:
        folder = work / "qwen3"
        make_model(folder, args.layers)
        size = (folder / "model.safetensors").stat().st_size
        print(f"Qwen3-0.6B shape, {args.layers} layers, bfloat16: {size / 2**20:.0f} MiB; medians of {args.repeat}")
        imports = [r for tp in (1, 2) for r in import_layout(work, folder, tp, args.repeat, args.layers)]
        exports = [run_export(work, folder, tp, args.repeat) for tp in (1, 2)]
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return report(imports, exports, args)


def report(imports: list[dict], exports: list[dict], args: argparse.Namespace) -> int:
    mib = 2**20
    print(f"{'':<23}{'warm: Baton s':>14}{'raw s':>7}{'speed':>7}{'cold: Baton s':>15}{'raw s':>7}{'speed':>7}"
          f"  {'peak MiB':>9}{'shard':>7}{'largest':>8}{'mem':>6}")
    missed: list[str] = []
    rows = []
    for r in imports:
        warm, cold = r["raw_warm_s"] / r["warm_s"], r["raw_cold_s"] / r["cold_s"]
        mem = r["peak"] / (r["shard"] + r["largest"])
        what = f"import tp{r['tp']} rank {r['rank']} {r['dtype']}"
        missed += _missed(what + " warm", warm, mem) + _missed(what + " cold", cold, 0.0)
        rows.append({**r, "speed_warm": warm, "speed_cold": cold, "mem": mem, "what": "import"})
        print(f"{what:<23}{r['warm_s']:>14.2f}{r['raw_warm_s']:>7.2f}{warm:>6.2f}x{r['cold_s']:>15.2f}"
              f"{r['raw_cold_s']:>7.2f}{cold:>6.2f}x  {r['peak'] / mib:>9.0f}{r['shard'] / mib:>7.0f}"
              f"{r['largest'] / mib:>8.0f}{mem:>6.2f}")
    for r in exports:
        speed, mem = r["raw_s"] / r["export_s"], r["peak"] / (r["shard"] + r["largest"])
        missed += _missed(f"export from tp{r['tp']}", speed, mem)
        rows.append({**r, "speed": speed, "mem": mem, "what": "export"})
        print(f"{'export from tp' + str(r['tp']):<23}{r['export_s']:>14.2f}{r['raw_s']:>7.2f}{speed:>6.2f}x"
              f"{'':>29}  {r['peak'] / mib:>9.0f}{r['shard'] / mib:>7.0f}{r['largest'] / mib:>8.0f}{mem:>6.2f}")
    print(f"goals: speed >= {TIME_GOAL}x of raw, peak <= {MEM_GOAL:.1f} x (shard + largest); "
          f"exports bit for bit: {', '.join(str(r['tensors']) + ' tensors' for r in exports)}")
    if args.json:
        args.json.write_text(json.dumps({"layers": args.layers, "repeat": args.repeat, "rows": rows}, indent=1))
    assert not missed, "goals missed: " + "; ".join(missed)
    return 0


def _missed(what: str, speed: float, mem: float) -> list[str]:
    return ([f"{what} speed {speed:.2f}x < {TIME_GOAL}x"] if speed < TIME_GOAL else []) + \
           ([f"{what} memory {mem:.2f} > {MEM_GOAL}"] if mem > MEM_GOAL else [])


if __name__ == "__main__":
    raise SystemExit(main())
