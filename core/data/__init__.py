"""Token datasets: build an HDF5 token file from text, read it back memory-mapped.

- ``core.data.tokenizer``: the built-in byte tokenizer, or a local Hugging Face one.
- ``core.data.build``: ``build_dataset`` and ``python -m core.data.build`` (``baton data build``).
- ``core.data.dataset``: ``TokenDataset``, a read-only memory map of the ``tokens`` array.

This package imports neither h5py nor numpy on its own: import the module you need.
"""
