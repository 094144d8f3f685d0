"""Sharded safetensors out: the shard plan, the files, the index (``model.safetensors.index.json``).

A Hugging Face folder holds its weights as ``model-00001-of-0000N.safetensors`` files of at
most ``max_shard_bytes`` each (transformers' rule: a tensor starts a new shard when it would
push the current one past the limit; a tensor larger than the limit is a shard of its own)
and an index naming each tensor's file. The plan is made from the tensors' shapes before any
data is read, so the file names (which carry N) are known up front; then each shard is
streamed to its file block by block (``write_file``), so a process holds one tensor's
read at most, never a shard or the model.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INDEX_NAME = "model.safetensors.index.json"
# The dtypes an export writes (safetensors' codes); bfloat16 travels as its raw 16-bit words
# (numpy has none).
ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
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
                 produce: Callable[[Planned], Iterator[np.ndarray]]) -> dict[str, object]:
    """Write every shard into ``out`` and the index; returns the index. ``produce`` gives a
    tensor's data in ``dtype``'s storage as blocks, in order, each written as it comes."""
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        name = shard_file_name(i, len(shards))
        total += write_file(out / name, shard, dtype, produce)
        weight_map.update((t.name, name) for t in shard)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return index


def write_file(path: Path, tensors: list[Planned], dtype: str, produce: Callable[[Planned], Iterator[np.ndarray]]) -> int:
    """One safetensors file, streamed: the header (from the planned shapes), then each tensor's
    blocks as ``produce`` makes them; the data bytes written.

    Why not ``safetensors.serialize_file``: it needs every tensor of the file in memory at
    once (a 5 GB shard), and writes slower than plain writes here; the format is the
    header's length (u64, little-endian), the JSON header (padded with spaces to 8 bytes,
    as safetensors pads it) and the tensors' bytes back to back. Tests read it with
    safetensors and transformers.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for t in tensors:
        n = math.prod(t.shape) * ITEMSIZE[dtype]
        header[t.name] = {"dtype": ST_DTYPES[dtype], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for t in tensors:
            start, want = f.tell(), header[t.name]["data_offsets"]  # type: ignore[index]
            for block in produce(t):
                f.write(memoryview(np.ascontiguousarray(block)).cast("B"))
            if f.tell() - start != want[1] - want[0]:
                raise AssertionError(f"{t.name}: wrote {f.tell() - start} bytes, planned {want[1] - want[0]}")
    return pos


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
