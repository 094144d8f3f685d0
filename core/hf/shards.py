"""Sharded safetensors out: the shard plan, the files, the index (``model.safetensors.index.json``).

A Hugging Face folder holds its weights as ``model-00001-of-0000N.safetensors`` files of at
most ``max_shard_bytes`` each (transformers' rule: a tensor starts a new shard when it would
push the current one past the limit; a tensor larger than the limit is a shard of its own)
and an index naming each tensor's file. The plan is made from the tensors' shapes before any
data is read, so the file names (which carry N) are known up front; then each shard is
filled one tensor at a time and written by safetensors itself (``serialize_file`` over the
arrays' own buffers: no copy), so a process holds one shard at most, never the model.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import TensorSpec, serialize_file

INDEX_NAME = "model.safetensors.index.json"
# The dtypes an export writes; bfloat16 travels as its raw 16-bit words (numpy has none).
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Planned:
    """One tensor of the export: its Hugging Face name and shape."""

    name: str
    shape: tuple[int, ...]


def shard_file_name(index: int, count: int) -> str:
    """``model-00002-of-00005.safetensors`` (1-based, as transformers names them)."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def plan_shards(tensors: Sequence[Planned], dtype: str, max_shard_bytes: int) -> list[list[Planned]]:
    """The tensors, in order, cut into shards of at most ``max_shard_bytes`` (bar an oversize tensor)."""
    shards: list[list[Planned]] = []
    size = 0
    for t in tensors:
        nbytes = math.prod(t.shape) * ITEMSIZE[dtype]
        if not shards or (shards[-1] and size + nbytes > max_shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def to_dtype(array: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 ``array`` in ``dtype``, rounded to nearest even (bfloat16: as uint16 words, as torch rounds)."""
    if dtype == "float32":
        return np.ascontiguousarray(array, dtype=np.float32)
    if dtype == "float16":
        return np.ascontiguousarray(array, dtype=np.float16)
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    word = np.right_shift(bits, 16)  # in place from here on: one temporary beside the result
    np.bitwise_and(word, 1, out=word)
    np.add(word, 0x7FFF, out=word)
    np.add(word, bits, out=word)
    np.right_shift(word, 16, out=word)
    rounded = word.astype(np.uint16)
    del word
    nan = np.isnan(array)
    if nan.any():  # a NaN stays a (quiet) NaN; the rounding above could carry it into the sign bit
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def write_shards(out: Path, shards: list[list[Planned]], dtype: str,
                 produce: Callable[[Planned], np.ndarray]) -> dict[str, object]:
    """Write every shard into ``out`` (``produce`` gives a tensor's array in ``dtype``'s
    storage) and the index; returns the index."""
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        name = shard_file_name(i, len(shards))
        arrays: dict[str, np.ndarray] = {}
        for t in shard:
            array = np.ascontiguousarray(produce(t))
            if tuple(array.shape) != t.shape or array.dtype.itemsize != ITEMSIZE[dtype]:
                raise AssertionError(f"{t.name}: produced {array.shape} {array.dtype}, planned {t.shape} {dtype}")
            arrays[t.name] = array
            weight_map[t.name] = name
            total += array.nbytes
        specs = {n: TensorSpec(dtype=dtype, shape=list(a.shape), data_ptr=a.ctypes.data,
                               data_len=a.nbytes) for n, a in arrays.items()}
        serialize_file(specs, str(out / name), metadata={"format": "pt"})  # arrays alive until it returns
        del arrays, specs
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return index


def fsync_tree(folder: Path) -> None:
    """fsync every file in ``folder`` and the folder itself (before the rename that publishes it)."""
    for p in folder.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
