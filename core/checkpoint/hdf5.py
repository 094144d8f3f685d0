"""Rank shards in HDF5: the only module that imports h5py.

One file per writing rank. Each slice a rank owns is its own contiguous dataset
(``tensor_00000``, ...; no chunks, no filters) with attributes ``name``,
``global_shape`` and ``offset``; the file carries ``baton_format_version``,
``baton_attrs`` (the caller's attrs as JSON) and, for h5dump readers, ``step``,
``rank``, ``config_hash`` and ``layout``; ``blobs`` is a uint8 dataset holding the
rank's loop/RNG/optimizer scalars as JSON.

The data does not go through h5py: h5py lays out the file (datasets allocated early, never
filled) and writes all metadata at close; core.checkpoint.pipeline then writes each
dataset's bytes at its file offset with ``pwrite`` and checksums the file from the same
buffers (the raw-write fast path; the file is never read back).

Why h5py lays the file out in memory (``SparseImage``, through its file-object driver) and
never touches the disk: HDF5 writes its metadata when it flushes or closes, and a full disk
there gives a RuntimeError, an OSError or a segfault in its close path, depending on which
write fails (reproduced on a small tmpfs). In memory nothing can fail; the image's
metadata (kilobytes: the data regions stay holes) then reaches the disk by plain
``pwrite``, so a full disk, EIO or ESTALE is an ``OSError`` with its errno, at any point.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from core.checkpoint import pipeline, stream
from core.checkpoint.image import SparseImage
from core.checkpoint.manifest import (
    FORMAT_VERSION,
    Manifest,
    fsync_dir,
    read_manifest,
)
from core.checkpoint.spec import ShardAck, SliceAck, TensorSlice
from core.errors import CheckpointError, TransientIOError, is_transient

logger = logging.getLogger(__name__)

_BLOBS = "blobs"
_RANK_RE = re.compile(r"^rank_(\d+)\.h5$")
_READ_BLOCK = 256 << 20  # below Linux's 2 GiB per-call limit


def _dataset_name(index: int) -> str:
    return f"tensor_{index:05d}"


def _simple(value: Any) -> bool:
    return isinstance(value, str | int | float | bool)


def write_shard(path: Path, items: list[tuple[TensorSlice, Any]], blobs: dict[str, Any],
                attrs: dict[str, Any], *, slots: stream.Slots | None = None, copy_all: bool = False,
                on_copied: Callable[[], None] | None = None) -> ShardAck:
    """Write one rank's HDF5 file at ``path`` (which must not exist), durably; return its ack.

    An item's data is an array or a ``LiveArray``, read while it is written
    (core.checkpoint.stream): what is not already host memory of the slice's dtype (or
    everything, with ``copy_all``) is copied a bucket at a time into ``slots`` (default: two
    buckets), so the save holds at most ``slots.nbytes`` more host memory than the state.
    ``on_copied`` runs once every item has been read (the state may change from then on).

    ``attrs`` should hold ``step``, ``rank``, ``layout`` and ``config_hash``; without
    ``rank`` it is taken from the file name ``rank_NNNNN.h5``. ``blobs`` must be
    JSON-able. The file and its folder are fsynced before this returns. The ack says what
    the file holds and where: what ``manifest.commit`` takes.
    """
    path = Path(path)
    rank = attrs.get("rank")
    if rank is None and (m := _RANK_RE.match(path.name)):
        rank = int(m.group(1))
    if not isinstance(rank, int):
        raise CheckpointError(f"{path}: no rank in attrs and none in the file name (rank_00000.h5)")
    for item, data in items:
        stream.check(item, data)
    blob_bytes = json.dumps(blobs, sort_keys=True, allow_nan=True).encode()
    if path.exists():
        raise CheckpointError(f"{path}: exists already; each save writes into a fresh folder from tmp_step_dir()")
    image = SparseImage()
    regions = _lay_out(image, items, blob_bytes, attrs)  # in memory: no storage fault can reach HDF5
    try:
        image.create_file(path)
        size, checksum = pipeline.write_regions(path, regions, slots or stream.Slots(), copy_all, on_copied)
        fsync_dir(path.parent)
    except BaseException as exc:
        try:
            path.unlink(missing_ok=True)  # a partial shard must not look like one that could be acked
        except OSError as cleanup:
            logger.warning("could not remove the partial shard %s: %s", path, cleanup)
        if is_transient(exc):
            raise TransientIOError(f"{path}: cannot write the shard ({exc}); a storage fault: retried within "
                                   "recovery.max_retries") from exc
        if isinstance(exc, OSError):
            raise CheckpointError(f"{path}: cannot write the shard ({exc}); check that the folder exists, "
                                  "is writable and has space") from exc
        raise
    logger.info("wrote shard %s: %d slices, %d bytes", path, len(items), size)
    return ShardAck(file=path.name, rank=rank, size_bytes=size, checksum=checksum, slices=tuple(
        SliceAck(name=item.name, dtype=np.dtype(item.dtype).name, global_shape=tuple(item.global_shape),
                 offset=tuple(item.offset), shape=tuple(item.shape), dataset=_dataset_name(i))
        for i, (item, _) in enumerate(items)))


def _lay_out(image: SparseImage, items: Sequence[tuple[TensorSlice, Any]], blob_bytes: bytes,
             attrs: dict[str, Any]) -> list[pipeline.Region]:
    """Lay the file out in ``image`` with every dataset allocated but unwritten; return its
    regions by offset.

    Datasets and their attributes are made with h5py's low-level API: half the time of
    the high-level one, which matters for ranks holding thousands of tensors.
    """
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dcpl.set_obj_track_times(False)  # no timestamps: an async save is byte-identical to a sync one
    regions = []
    with h5py.File(image, "w", locking=False) as f:
        f.attrs["baton_format_version"] = FORMAT_VERSION
        f.attrs["baton_attrs"] = json.dumps(attrs, sort_keys=True)
        for key in ("step", "rank", "config_hash", "layout"):
            if key in attrs and attrs[key] is not None:
                f.attrs[key] = attrs[key] if _simple(attrs[key]) else json.dumps(attrs[key], sort_keys=True)
        for i, (item, data) in enumerate(items):
            dtype = stream.dtype_of(item)
            nbytes = dtype.itemsize * math.prod(item.shape)
            space = h5py.h5s.create_simple(item.shape) if item.shape else h5py.h5s.create(h5py.h5s.SCALAR)
            dsid = h5py.h5d.create(f.id, _dataset_name(i).encode(), h5py.h5t.py_create(dtype), space, dcpl=dcpl)
            _str_attr(dsid, b"name", item.name)
            _int_attr(dsid, b"global_shape", item.global_shape)
            _int_attr(dsid, b"offset", item.offset)
            offset = dsid.get_offset()
            if offset is not None and nbytes:
                regions.append((offset, item, data))
            elif nbytes:  # HDF5 gives no offset for some tiny (scalar) datasets: let h5py write them
                dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, stream.whole(item, data))
        f.create_dataset(_BLOBS, data=np.frombuffer(blob_bytes, dtype=np.uint8), track_times=False)
    return sorted(regions, key=lambda r: r[0])


def _str_attr(obj: Any, key: bytes, value: str) -> None:
    """A scalar fixed-length UTF-8 string attribute (h5py reads it back as bytes)."""
    data = value.encode()
    tid = h5py.h5t.C_S1.copy()
    tid.set_size(max(1, len(data)))
    tid.set_cset(h5py.h5t.CSET_UTF8)
    h5py.h5a.create(obj, key, tid, h5py.h5s.create(h5py.h5s.SCALAR)).write(
        np.array(data, dtype=f"S{max(1, len(data))}"), mtype=tid)


def _int_attr(obj: Any, key: bytes, values: tuple[int, ...]) -> None:
    """A 1-D little-endian int64 attribute."""
    h5py.h5a.create(obj, key, h5py.h5t.STD_I64LE, h5py.h5s.create_simple((len(values),))).write(
        np.asarray(values, dtype="<i8"))


def _flat_start(shape: tuple[int, ...], box: tuple[slice, ...]) -> int | None:
    """The C-order flat index where ``box`` starts if it is one contiguous run of ``shape``, else None.

    Contiguous: every dimension before some k is selected with length 1, dimension k with
    any range, every dimension after k in full.
    """
    k = 0
    while k < len(shape) - 1 and box[k].stop - box[k].start == 1:
        k += 1
    if any(box[j].start != 0 or box[j].stop != shape[j] for j in range(k + 1, len(shape))):
        return None
    start = 0
    for j, n in enumerate(shape):
        start = start * n + box[j].start
    return start


class ShardReader:
    """One rank file, opened read-only: its slices, attrs and blobs."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None  # a plain descriptor for the preadv fast path, opened on first use
        try:
            self._file = h5py.File(self.path, "r", locking=False)
        except OSError as exc:
            if is_transient(exc):  # EIO, ESTALE, ... (h5py's errno may be only in its message): not the file's fault
                raise TransientIOError(f"{self.path}: cannot read the shard ({exc}); a storage fault: retried "
                                       "within recovery.max_retries") from exc
            raise CheckpointError(f"{self.path}: cannot open as HDF5 ({exc}); the shard is missing or corrupt: "
                                  "run `baton ckpt verify` and resume from another step") from None
        version = self._file.attrs.get("baton_format_version")
        if version is None or int(version) > FORMAT_VERSION:
            self._file.close()
            raise CheckpointError(f"{self.path}: shard format version {version}, this Baton reads ≤ {FORMAT_VERSION}; "
                                  "upgrade Baton or check that this is a Baton shard")

    @property
    def attrs(self) -> dict[str, Any]:
        """The attrs the writer was given (step, rank, layout, config hash, ...)."""
        return json.loads(self._file.attrs["baton_attrs"])

    def blobs(self) -> dict[str, Any]:
        """The rank's JSON blobs, as given to ``write_shard``."""
        return json.loads(self._file[_BLOBS][()].tobytes())

    def slices(self) -> dict[str, TensorSlice]:
        """Dataset name → the slice it holds, from the file's own attributes."""
        out = {}
        for key, ds in self._file.items():
            if key != _BLOBS:
                name = ds.attrs["name"]
                out[key] = TensorSlice(name=name.decode() if isinstance(name, bytes) else str(name), global_shape=tuple(int(x) for x in ds.attrs[
                    "global_shape"]), offset=tuple(int(x) for x in ds.attrs["offset"]), shape=ds.shape,
                    dtype=ds.dtype.name)
        return out

    def read_into(self, dataset: str, source: tuple[slice, ...], out: np.ndarray, dest: tuple[slice, ...]) -> None:
        """Copy ``dataset[source]`` into ``out[dest]`` (``out`` C-contiguous).

        When both boxes are one contiguous byte range (whole datasets, row blocks) the
        bytes are read with ``preadv`` straight into ``out``: h5py's own path costs an
        extra pass over memory. Other boxes (column blocks) go through h5py.
        """
        try:
            ds = self._file[dataset]
        except KeyError:
            raise CheckpointError(f"{self.path}: no dataset {dataset!r}; the manifest does not match this file") from None
        if out.ndim == 0:
            out[()] = ds[()]
            return
        src = _flat_start(ds.shape, source)
        dst = _flat_start(out.shape, dest)
        file_offset = ds.id.get_offset() if ds.dtype == out.dtype and ds.chunks is None else None
        if src is None or dst is None or file_offset is None:
            ds.read_direct(out, source_sel=source, dest_sel=dest)
            return
        count = math.prod(s.stop - s.start for s in source)
        view = memoryview(out.reshape(-1)[dst:dst + count].view(np.uint8))
        pos = file_offset + src * out.itemsize
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        while view:
            n = os.preadv(self._fd, [view[:_READ_BLOCK]], pos)
            if n == 0:
                raise CheckpointError(f"{self.path}: ends inside dataset {dataset!r}; the file is truncated: "
                                      "run `baton ckpt verify` and resume from another step")
            view, pos = view[n:], pos + n

    def close(self) -> None:
        """Close the file."""
        self._file.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CheckpointReader:
    """A committed checkpoint folder, readable in any layout: any global slice of any tensor.

    The manifest says which file holds which slice; ``read`` intersects the requested
    box with every stored slice and copies the overlaps, so a checkpoint saved with
    TP=2, PP=2 loads with TP=1, PP=4. Files are opened read-only, once, on first use.
    """

    def __init__(self, step_dir: Path) -> None:
        self.step_dir = Path(step_dir)
        self.manifest: Manifest = read_manifest(self.step_dir)
        self._shards: dict[str, ShardReader] = {}

    def names(self) -> list[str]:
        """Global tensor names, sorted."""
        return sorted(self.manifest.tensors)

    def _shard(self, file: str) -> ShardReader:
        if file not in self._shards:
            self._shards[file] = ShardReader(self.step_dir / file)
        return self._shards[file]

    def read(self, name: str, offset: Sequence[int] | None = None, shape: Sequence[int] | None = None, *,
             out: np.ndarray | None = None) -> np.ndarray:
        """The global slice ``[offset : offset + shape]`` of tensor ``name`` (default: all of it).

        ``out`` (C-contiguous, of that shape and dtype) is filled in place when given, so a
        worker can load straight into its preallocated buffers.
        """
        try:
            entry = self.manifest.tensors[name]
        except KeyError:
            close = [n for n in self.manifest.tensors if n.split(".")[-1] == name.split(".")[-1]][:3]
            raise CheckpointError(f"{self.step_dir}: no tensor {name!r} in this checkpoint "
                                  f"({len(self.manifest.tensors)} tensors; similar: {close})") from None
        g = entry.global_shape
        offset = tuple(offset) if offset is not None else (0,) * len(g)
        shape = tuple(shape) if shape is not None else tuple(x - o for x, o in zip(g, offset, strict=True))
        TensorSlice(name=name, global_shape=g, offset=offset, shape=shape, dtype=entry.dtype)  # validates the box
        if out is None:
            out = np.empty(shape, dtype=np.dtype(entry.dtype))
        elif out.shape != shape or out.dtype != np.dtype(entry.dtype) or not out.flags.c_contiguous:
            raise ValueError(f"{name}: out is {out.dtype}{out.shape}, needs C-contiguous {entry.dtype}{shape}")
        covered = 0
        for s in entry.slices:
            lo = [max(o, so) for o, so in zip(offset, s.offset, strict=True)]
            hi = [min(o + n, so + sn) for o, n, so, sn in zip(offset, shape, s.offset, s.shape, strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            source = tuple(slice(a - so, b - so) for a, b, so in zip(lo, hi, s.offset, strict=True))
            dest = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset, strict=True))
            self._shard(s.file).read_into(s.dataset, source, out, dest)
            covered += math.prod(b - a for a, b in zip(lo, hi, strict=True))
        if covered != math.prod(shape):  # the commit checked the tiling, so only a doctored manifest gets here
            raise CheckpointError(f"{self.step_dir}: tensor {name!r} slice {offset}+{shape} is not fully stored "
                                  f"({covered} of {math.prod(shape)} elements); the manifest is inconsistent")
        return out

    def blobs(self, rank: int) -> dict[str, Any]:
        """The JSON blobs rank ``rank`` saved (loop state, RNG, scheduler)."""
        file = next((f.name for f in self.manifest.files if f.rank == rank), None)
        if file is None:
            ranks = sorted(f.rank for f in self.manifest.files)
            raise CheckpointError(f"{self.step_dir}: no shard of rank {rank} (ranks {ranks[0]}..{ranks[-1]}); "
                                  "map new ranks to saved ones when the layout changed")
        return self._shard(file).blobs()

    def close(self) -> None:
        """Close every opened file."""
        for shard in self._shards.values():
            shard.close()
        self._shards.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
