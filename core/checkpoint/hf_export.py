"""``python -m core.checkpoint.hf_export STEP_DIR --hf OUT``: one committed checkpoint as a Hugging Face folder.

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
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.checkpoint import hf_source as source
from core.checkpoint.hdf5 import CheckpointReader
from core.checkpoint.manifest import TensorEntry
from core.config import run as config_mod
from core.config.modelcfg import ModelConfig
from core.errors import CheckpointError, ConfigError, ExitCode, UserError
from core.hf import families, layout, shards

log = logging.getLogger(__name__)
FAMILIES_NEED = "Llama/Qwen2/Qwen3 need"
_BLOCK_BYTES = 16 << 20  # fp32 read per block of a one-to-one tensor: the conversion's working memory


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
    qk_norm, qkv_bias = model.qk_norm, bool(model.qkv_bias)
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


@dataclass(frozen=True)
class Unit:
    """One read of the export: a Megatron global tensor (one layer of it, for a stacked one)
    and the HF tensors it holds (``layout.to_hf``: q, k, v of ``linear_qkv``; gate, up of fc1)."""

    name: str
    layer: int | None
    box: tuple[tuple[int, ...], tuple[int, ...]]  # offset, shape in the global tensor
    outputs: tuple[shards.Planned, ...]


def _hf_names(name: str, layer: int | None, array: np.ndarray, dims: layout.Dims) -> dict[str, np.ndarray]:
    """``layout.to_hf`` of one box: a layer box is given as layer 0 and named as ``layer``."""
    out = layout.to_hf(name, array, dims)
    if layer is None:
        return out
    pre = "model.layers.0."
    return {f"model.layers.{layer}.{k[len(pre):]}": v for k, v in out.items()}


def plan_units(tensors: dict[str, TensorEntry], dims: layout.Dims) -> list[Unit]:
    """The reads of an export, in Hugging Face's order (the embedding, layer by layer, the final
    norm, the output layer); what each gives is found from the mapping on unfilled arrays."""
    model = {n: t for n, t in tensors.items() if not n.startswith("optim.")}
    stacked = sorted(n for n in model if n.startswith(layout.P))
    units = []
    firsts = [n for n in model if n not in stacked and n != "decoder.final_layernorm.weight"
              and n != "output_layer.weight"]
    for name in sorted(firsts):
        units.append(_unit(name, None, model[name].global_shape, dims))
    for layer in range(dims.layers):
        units += [_unit(name, layer, model[name].global_shape, dims) for name in stacked]
    units += [_unit(n, None, model[n].global_shape, dims) for n in ("decoder.final_layernorm.weight",
                                                                       "output_layer.weight") if n in model]
    got = {p.name for u in units for p in u.outputs}
    missing = sorted(set(layout.hf_shapes(dims)) - got)
    if missing:
        raise CheckpointError(f"export: the checkpoint holds no tensor for {', '.join(missing[:3])}"
                              f"{' ...' if len(missing) > 3 else ''}; it was not saved with this run's model section")
    return units


def _unit(name: str, layer: int | None, shape: tuple[int, ...], dims: layout.Dims) -> Unit:
    offset = (layer, *(0,) * (len(shape) - 1)) if layer is not None else (0,) * len(shape)
    box = (1, *shape[1:]) if layer is not None else tuple(shape)
    try:
        shapes = _hf_names(name, layer, np.empty(box, np.float32), dims)  # never touched: no memory used
    except KeyError as exc:
        raise CheckpointError(f"export: {exc.args[0]}; this checkpoint holds a tensor no family has") from None
    outputs = tuple(shards.Planned(n, tuple(a.shape)) for n, a in shapes.items())
    return Unit(name, layer, (offset, box), outputs)


def _read(reader: CheckpointReader, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    """fp32 box of a global tensor: the optimizer's fp32 main weights where the run kept them apart
    (what a resume loads), else the model's."""
    main = f"optim.main_param.{name}"
    return reader.read(main if main in reader.manifest.tensors else name, offset, shape)


def _blocks_by_rows(reader: CheckpointReader, unit: Unit, dtype: str) -> Iterator[np.ndarray]:
    """A one-to-one tensor read and rounded in row blocks: at most ``_BLOCK_BYTES`` of fp32 at once."""
    offset, box = unit.box
    axis = 1 if unit.layer is not None else 0
    rows = box[axis] if len(box) > axis else 1
    step = max(1, _BLOCK_BYTES // max(4 * math.prod(box) // max(rows, 1), 1))
    for r in range(0, rows, step):
        n = min(step, rows - r)
        at = tuple(o + r if a == axis else o for a, o in enumerate(offset))
        shape = tuple(n if a == axis else s for a, s in enumerate(box))
        yield shards.to_dtype(_read(reader, unit.name, at, shape), dtype)


class Producer:
    """HF tensors in order, as blocks, each unit read once; a unit's other outputs wait for their turn."""

    def __init__(self, reader: CheckpointReader, units: list[Unit], dims: layout.Dims, dtype: str) -> None:
        self.reader, self.dims, self.dtype = reader, dims, dtype
        self.unit_of = {p.name: u for u in units for p in u.outputs}
        self.pending: dict[str, np.ndarray] = {}

    def __call__(self, planned: shards.Planned) -> Iterator[np.ndarray]:
        if planned.name in self.pending:
            return iter([self.pending.pop(planned.name)])
        unit = self.unit_of[planned.name]
        if len(unit.outputs) == 1 and math.prod(unit.outputs[0].shape) == math.prod(unit.box[1]):
            return _blocks_by_rows(self.reader, unit, self.dtype)
        whole = _read(self.reader, unit.name, *unit.box)
        parts = {n: shards.to_dtype(a, self.dtype) for n, a in _hf_names(unit.name, unit.layer, whole, self.dims).items()}
        del whole
        mine = parts.pop(planned.name)
        self.pending.update(parts)
        return iter([mine])


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
        dims = layout.dims_of(cfg.model)
        units = plan_units(reader.manifest.tensors, dims)
        tensors = [p for u in units for p in u.outputs]
        plan = shards.plan_shards(tensors, dtype, max_shard_bytes)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            index = shards.write_shards(tmp, plan, dtype, Producer(reader, units, dims, dtype))
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            (tmp / "generation_config.json").write_text(
                json.dumps(source.generation_config(src, config), indent=2) + "\n")
            copied = source.copy_tokenizer(src, tmp)
            publish_modes(tmp)
            shards.fsync_tree(tmp)
            if out.exists():
                out.rmdir()  # the login node checked it is empty
            tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return {"out": str(out), "family": family, "dtype": dtype, "tensors": len(tensors), "shards": len(plan),
            "bytes": index["metadata"]["total_size"], "tokenizer": copied, "source": str(src) if src else None}


def publish_modes(folder: Path) -> None:
    """The modes a new folder and files get under the umask (mkdtemp and safetensors make them private)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for p in folder.iterdir():
        os.chmod(p, 0o666 & ~umask)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m core.checkpoint.hf_export", description="Export a checkpoint as a HF folder.")
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
