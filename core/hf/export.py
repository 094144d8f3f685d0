"""``python -m core.hf.export STEP_DIR --hf OUT``: one committed checkpoint as a Hugging Face folder.

What ``baton export`` runs in a subprocess (launcher/cmd_export.py has checked the run folder,
the step and OUT). Here: the model's shape against the families (one line naming every
option that is off, before anything is written), then the tensors one at a time, each read
from the checkpoint in whatever layout it was saved (``CheckpointReader.read`` of the boxes
``core.hf.layout`` names: one layer of one Megatron tensor, or rows of it), rounded once to
the export dtype and gathered into shards of at most ``--max-shard-size``. Everything is
written into a temporary folder beside OUT, renamed to OUT at the end: a failed export
leaves nothing behind.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.checkpoint.hdf5 import CheckpointReader
from core.config import run as config_mod
from core.config.modelcfg import ModelConfig
from core.errors import ConfigError, ExitCode, UserError
from core.hf import families, layout, shards, source

log = logging.getLogger(__name__)
FAMILIES_NEED = "Llama/Qwen2/Qwen3 need"
_BLOCK_BYTES = 64 << 20  # fp32 read per piece: conversion holds at most this beside the tensor


def supported_family(model: ModelConfig, source_family: str | None) -> str:
    """The family the run's model is exported as, or a ConfigError naming every option that is off."""
    if model.kind != "gpt":
        raise ConfigError(f"export: model.kind is {model.kind!r}; only a GPT has Hugging Face weights")
    want = {"normalization": "rmsnorm", "activation": "swiglu", "position_embedding": "rope", "bias": False}
    off = [f"model.{k} {v if not isinstance(v, bool) else str(v).lower()} (this run: "
           f"{str(getattr(model, k)).lower() if isinstance(getattr(model, k), bool) else getattr(model, k)})"
           for k, v in want.items() if getattr(model, k) != v]
    if off:
        raise ConfigError(f"export: {FAMILIES_NEED} {', '.join(off)}; this run's model has no Hugging Face "
                          "family to export to")
    if source_family is not None:
        return source_family
    qk_norm, qkv_bias = bool(getattr(model, "qk_norm", False)), bool(getattr(model, "qkv_bias", False))
    if qk_norm and qkv_bias:
        raise ConfigError("export: model.qk_norm true with model.qkv_bias true is no family's shape (Qwen3: qk_norm, "
                          "Qwen2: qkv_bias); this run cannot be exported")
    return "qwen3" if qk_norm else "qwen2" if qkv_bias else "llama"


def hf_config(model: ModelConfig, family: str, dtype: str, source_cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json: the family's mapping of the model section; from an imported run's source
    also its token ids and its longest sequence (the run may have trained on shorter ones)."""
    out = families.hf_config(model, family, dtype=dtype)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"):
        if source_cfg.get(key) is not None:
            out[key] = source_cfg[key]
    return out


def _read_block(reader: CheckpointReader, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    """fp32 box of a global tensor: the optimizer's fp32 main weights where the run kept them apart
    (what a resume loads), else the model's."""
    main = f"optim.main_param.{name}"
    return reader.read(main if main in reader.manifest.tensors else name, offset, shape)


def produce(reader: CheckpointReader, tensor: layout.HFTensor, dtype: str) -> np.ndarray:
    """One HF tensor in ``dtype``'s storage, filled from its boxes in row blocks."""
    out = np.empty(tensor.shape, dtype=np.uint16 if dtype == "bfloat16" else np.dtype(dtype))
    flat = out.reshape(-1)
    pos = 0
    for box in tensor.boxes:
        rows = box.shape[box.row_axis]
        row_elems = math.prod(box.shape) // max(rows, 1)
        step = max(1, _BLOCK_BYTES // max(4 * row_elems, 1))
        for r in range(0, rows, step):
            n = min(step, rows - r)
            offset = tuple(o + (r if a == box.row_axis else 0) for a, o in enumerate(box.offset))
            shape = tuple(n if a == box.row_axis else s for a, s in enumerate(box.shape))
            block = shards.to_dtype(_read_block(reader, box.name, offset, shape), dtype).reshape(-1)
            flat[pos:pos + block.size] = block
            pos += block.size
    if pos != flat.size:
        raise AssertionError(f"{tensor.name}: boxes filled {pos} of {flat.size} elements")
    return out


def export(step_dir: Path, out: Path, max_shard_bytes: int) -> dict[str, Any]:
    """Write ``out`` from the checkpoint ``step_dir`` (checks first); a summary."""
    run_dir = step_dir.parent.parent
    cfg = config_mod.load(run_dir / "config.yaml")
    src = source.hf_source(cfg, run_dir)
    src_cfg = source.source_config(src)
    family = supported_family(cfg.model, families.family_of(src_cfg, str(src)) if src_cfg else None)
    dtype = source.export_dtype(src_cfg)
    config = hf_config(cfg.model, family, dtype, src_cfg)
    with CheckpointReader(step_dir) as reader:
        tensors = layout.hf_tensors(cfg.model, reader.manifest.tensors)
        plan = shards.plan_shards([shards.Planned(t.name, t.shape) for t in tensors], dtype, max_shard_bytes)
        by_name = {t.name: t for t in tensors}
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            index = shards.write_shards(tmp, plan, dtype, lambda p: produce(reader, by_name[p.name], dtype))
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            (tmp / "generation_config.json").write_text(
                json.dumps(source.generation_config(src, config), indent=2) + "\n")
            copied = source.copy_tokenizer(src, tmp)
            shards.fsync_tree(tmp)
            if out.exists():
                out.rmdir()  # the login node checked it is empty
            tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return {"out": str(out), "family": family, "dtype": dtype, "tensors": len(tensors), "shards": len(plan),
            "bytes": index["metadata"]["total_size"], "tokenizer": copied, "source": str(src) if src else None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m core.hf.export", description="Export a checkpoint as a HF folder.")
    p.add_argument("step_dir", type=Path, help="a committed checkpoint folder (RUN_DIR/checkpoints/step_N)")
    p.add_argument("--hf", required=True, type=Path, help="the folder to write (new or empty)")
    p.add_argument("--max-shard-size", type=int, default=5 * 10**9, help="bytes per safetensors file at most")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, export, print what was written. Bad input: one line on stderr, exit code 2."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        s = export(args.step_dir, args.hf, args.max_shard_size)
    except UserError as exc:
        print(f"baton: error: {exc}", file=sys.stderr)
        return ExitCode.USER_ERROR
    print(f"wrote {s['out']}: {s['family']} ({s['dtype']}), {s['tensors']} tensors, {s['bytes'] / 2**20:.1f} MiB "
          f"in {s['shards']} shard(s)" + (f"; tokenizer from {s['source']}: {', '.join(s['tokenizer'])}"
                                         if s["tokenizer"] else ""))
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
