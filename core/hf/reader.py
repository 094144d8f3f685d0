"""Read boxes of Baton's global tensors straight from a Hugging Face checkpoint folder.

An HF folder is one more checkpoint source for the loader that reshards Baton's own
(core.model.gpt.state.load_model_slices, the actor's ``load_weights``): ``HFReader.read``
is its ``read(name, offset, shape) -> np.ndarray`` (fp32). Each call reads only the rows the
box covers, through safetensors' memory-mapped ``get_slice``, so a rank reads what it owns
and no process holds the whole model. torch is the framework the slices come in (numpy has
no bfloat16); workers have it loaded already.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from core.hf import files, layout


class HFReader:
    """A checkpoint folder as a ``ReadFn`` for a model of ``dims``."""

    def __init__(self, folder: str | Path, dims: layout.Dims) -> None:
        self.folder, self.dims = Path(folder), dims
        self.files = files.weight_files(folder)
        self._handles: dict[Path, Any] = {}

    def rows(self, name: str, start: int, stop: int, rest: tuple[slice, ...]) -> np.ndarray:
        """Rows [start, stop) of the HF tensor ``name`` (the other axes cut by ``rest``), as fp32."""
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        part = self._handles[path].get_slice(name)[(slice(start, stop), *rest)]
        return part.to(torch.float32).numpy()

    def read(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
        """The box of Baton's global tensor ``name`` at ``offset`` of ``shape``."""
        return layout.read_global(self.rows, name, tuple(offset), tuple(shape), self.dims)

    def close(self) -> None:
        self._handles.clear()
