"""Read a token dataset written by ``core.data.build``: ``tokens`` as a read-only memory map.

The HDF5 file is opened only to read the metadata and the byte offset of the contiguous
``tokens`` dataset, then closed: the tokens are read through ``np.memmap``, so many
processes (data loader workers, several ranks on a node) share the page cache and none
holds an HDF5 handle across ``fork``.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from core.errors import UserError

logger = logging.getLogger(__name__)

SUPPORTED_FORMAT_VERSIONS = (1,)
REBUILD_HINT = "rebuild it with `baton data build`"


class DatasetError(UserError):
    """A token dataset file is missing, of another format, or not memory-mappable."""


class TokenDataset:
    """A token file: ``tokens`` (np.memmap), ``doc_offsets``, ``vocab_size``, ``eos_id``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise DatasetError(f"{self.path}: no such token dataset; check data.path or {REBUILD_HINT}")
        try:
            f = h5py.File(self.path, "r")
        except OSError:
            raise DatasetError(f"{self.path}: not an HDF5 file; {REBUILD_HINT}") from None
        with f:
            attrs = dict(f.attrs)
            version = attrs.get("format_version")
            if version not in SUPPORTED_FORMAT_VERSIONS:
                raise DatasetError(f"{self.path}: format_version {version!r}, this Baton reads "
                                   f"{', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}; {REBUILD_HINT}")
            for name in ("tokens", "doc_offsets"):
                if not isinstance(f.get(name), h5py.Dataset):
                    raise DatasetError(f"{self.path}: no {name!r} dataset; {REBUILD_HINT}")
            dset = f["tokens"]
            offset = dset.id.get_offset()
            if dset.ndim != 1 or dset.chunks is not None or dset.compression is not None or offset is None:
                raise DatasetError(f"{self.path}: 'tokens' is not a contiguous 1-D dataset and cannot be "
                                   f"memory-mapped; {REBUILD_HINT}")
            dtype, shape = dset.dtype, dset.shape
            self.doc_offsets: np.ndarray[Any, np.dtype[np.int64]] = f["doc_offsets"][()].astype(np.int64)
        self.vocab_size = int(attrs["vocab_size"])
        self.eos_id = int(attrs["eos_id"])
        self.tokenizer = str(attrs.get("tokenizer", ""))
        self.tokens: np.memmap[Any, Any] = np.memmap(self.path, dtype=dtype, mode="r", offset=offset, shape=shape)
        logger.debug("opened %s: %d tokens, %d documents", self.path, len(self), self.num_documents)

    def __len__(self) -> int:
        """The number of tokens."""
        return int(self.tokens.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.doc_offsets.shape[0])

    def window(self, start: int, length: int) -> np.ndarray[Any, Any]:
        """``length`` tokens from ``start`` (a view of the memory map, no copy)."""
        if start < 0 or length < 0 or start + length > len(self):
            raise IndexError(f"window [{start}, {start + length}) outside {len(self)} tokens of {self.path}")
        return self.tokens[start:start + length]

    def document(self, index: int) -> np.ndarray[Any, Any]:
        """The ids of document ``index``, its trailing EOS included."""
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} outside {self.num_documents} documents of {self.path}")
        end = int(self.doc_offsets[index + 1]) if index + 1 < self.num_documents else len(self)
        return self.tokens[int(self.doc_offsets[index]):end]

    def __repr__(self) -> str:
        return f"TokenDataset({str(self.path)!r}, tokens={len(self)}, documents={self.num_documents})"
