"""A Hugging Face checkpoint folder's weight files, checked before a run starts from it.

One ``model.safetensors``, or shards named by ``model.safetensors.index.json``'s
``weight_map``. ``check_folder`` (login node, no torch) opens every file's header with
safetensors (which refuses a truncated or corrupt file: its header must cover the file) and
compares every tensor the model needs (core.hf.layout.hf_shapes) with the file's: a missing
file, a missing tensor or a shape that disagrees with config.json is one line naming it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from core.errors import ConfigError
from core.hf import layout

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
FLOATS = ("F32", "F16", "BF16")


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Each tensor name → the safetensors file that holds it (from the index, or the single file's header)."""
    root = Path(folder).expanduser()
    index = root / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {str(name): root / str(file) for name, file in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"init_from: {index}: not a safetensors index with a weight_map ({exc!r})") from None
    if (root / SINGLE).is_file():
        return {name: root / SINGLE for name in _open(root / SINGLE).keys()}  # noqa: SIM118 - safe_open has no __iter__
    raise ConfigError(f"init_from: hf:{folder}: no weights ({SINGLE} or {INDEX}); save the model with "
                      "save_pretrained(safe_serialization=True)")


def _open(path: Path):  # noqa: ANN202 - safetensors' handle
    if not path.is_file():
        raise ConfigError(f"init_from: {path}: missing (named by {INDEX}); copy the whole checkpoint folder")
    try:
        return safe_open(str(path), framework="np")
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"init_from: {path}: not a readable safetensors file ({exc}); it may be truncated or "
                          "corrupt: copy it again") from None


def check_folder(folder: str | Path, dims: layout.Dims) -> None:
    """Every tensor ``dims``' model needs is in ``folder``'s files, a float of the shape config.json gives."""
    files = weight_files(folder)
    opened = {path: _open(path) for path in sorted(set(files.values()))}
    for name, want in layout.hf_shapes(dims).items():
        if name not in files:
            raise ConfigError(f"init_from: hf:{folder}: tensor {name} is missing; the checkpoint does not match "
                              "its config.json")
        handle = opened[files[name]]
        if name not in handle.keys():  # noqa: SIM118
            raise ConfigError(f"init_from: {files[name]}: tensor {name} is missing (the index names this file)")
        part = handle.get_slice(name)
        shape, dtype = tuple(part.get_shape()), part.get_dtype()
        if shape != want:
            raise ConfigError(f"init_from: {files[name]}: tensor {name} has shape {list(shape)}, config.json gives "
                              f"{list(want)}; the weights and config.json disagree")
        if dtype not in FLOATS:
            raise ConfigError(f"init_from: {files[name]}: tensor {name} is {dtype}; supported: {', '.join(FLOATS)}")


def save_tensors(tensors: dict[str, Any], path: Path) -> None:
    """``tensors`` (torch tensors, any dtype) as one safetensors file at ``path``, written
    beside it and renamed over it: a reader sees the old file or the new, never a torn one."""
    from safetensors.torch import save_file  # torch: only on workers (launcher imports this module)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)
