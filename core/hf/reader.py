"""Read boxes of Baton's global tensors straight from a Hugging Face checkpoint folder.

An HF folder is one more checkpoint source for the loader that reshards Baton's own
(core.model.gpt.state.load_model_slices, the actor's ``load_weights``). ``HFReader.read_into``
copies a box into a tensor the caller owns (the loader passes the parameter itself): each run
of rows of the box (a q, k or v run of ``linear_qkv``, a gate or up run of ``fc1``) goes from
safetensors' memory map straight into its place, cast to the parameter's dtype on the way:
one pass over the bytes, no intermediate tensor. ``HFReader.read`` is the plain
``read(name, offset, shape) -> np.ndarray`` (fp32) of every checkpoint source. Each call reads
only the rows the box covers, so a rank reads what it owns and no process holds the whole
model. torch is the framework the slices come in (numpy has no bfloat16); workers have it
loaded already.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from core.hf import files, layout


class HFReader:
    """A checkpoint folder as a ``ReadFn`` for a model of ``dims`` (with ``read_into``)."""

    def __init__(self, folder: str | Path, dims: layout.Dims) -> None:
        self.folder, self.dims = Path(folder), dims
        self.files = {name: str(path) for name, path in files.weight_files(folder).items()}
        self._handles: dict[str, Any] = {}
        self._whole: dict[str, torch.Tensor] = {}  # each HF tensor a view of its file's memory map

    def view(self, name: str, start: int, stop: int, rest: tuple[slice, ...]) -> torch.Tensor:
        """Rows [start, stop) of the HF tensor ``name`` (the other axes cut by ``rest``) in the
        file's dtype: a view of the memory-mapped file, nothing read yet."""
        whole = self._whole.get(name)
        if whole is None:
            path = self.files[name]
            if path not in self._handles:
                self._handles[path] = safe_open(path, framework="pt")
            whole = self._whole[name] = self._handles[path].get_slice(name)[:]  # a view: nothing read
        return whole[(slice(start, stop), *rest)]

    def rows(self, name: str, start: int, stop: int, rest: tuple[slice, ...]) -> np.ndarray:
        """The same rows as a new fp32 array."""
        return self.view(name, start, stop, rest).to(torch.float32).numpy()

    def put(self, name: str, start: int, stop: int, rest: tuple[slice, ...], dest: torch.Tensor) -> None:
        """The same rows copied into ``dest`` (a tensor of their shape, any dtype or device)."""
        dest.copy_(self.view(name, start, stop, rest))

    def read_into(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...], out: torch.Tensor) -> None:
        """The box of Baton's global tensor ``name`` at ``offset`` of ``shape`` into ``out`` (of
        that shape; cast once, from the file's dtype to ``out``'s)."""
        with torch.no_grad():
            layout.read_global_into(self.put, name, tuple(offset), tuple(shape), self.dims, out)

    def read(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
        """The box of Baton's global tensor ``name`` at ``offset`` of ``shape``, as fp32."""
        out = torch.empty(tuple(shape), dtype=torch.float32)
        self.read_into(name, offset, shape, out)
        return out.numpy()

    def __call__(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
        return self.read(name, offset, shape)

    def close(self) -> None:
        self._whole.clear()
        self._handles.clear()
